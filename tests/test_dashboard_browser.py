"""The dashboard in a real browser: Debian's headless Chromium, driven through selenium and chromium-driver.

A ``tandem serve`` of the default model, with ``--backends`` naming a replay ``tandem serve`` (slow answers, so a
request stays in flight for a while), a backend in this process that answers fixed bytes, and a port where nothing
listens. The page at ``/dash`` connects live; a relayed request appears in flight and then as a completed row,
a local one too; both plots draw their points; the backends' health shows up and down; the ledger page sums the
rows; the setup guide shows one tile per registry entry the server reads; the page's JavaScript logs no error.
The screenshot is kept in ``.artefacts/dashboard.png``.

Chromium comes from ``make test`` (``tools/provision_browser.sh``); without it the test skips, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from proxy_helpers import FixedBackend, write_backends
from replay_server import ROOT, Server, free_port, write_model

pytestmark = pytest.mark.server

CACHE = ROOT / ".tandem-test-cache"
ARTEFACTS = ROOT / ".artefacts"
LOCAL = "smollm2-135m"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SCRIPTS = [{"when": "[[slow]]", "text": "A slow answer, one token at a time, " * 3, "delay_s": 0.08}]

if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
    pytest.skip(f"no Chromium here ({CHROMIUM} and {DRIVER}); `make test` installs Debian's chromium and "
                "chromium-driver when it runs as root (tools/provision_browser.sh)", allow_module_level=True)

selenium = pytest.importorskip("selenium", reason="selenium is in the core's test extra: pip install -e '.[test]'")
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tandem_core import catalog
    from tandem_core.pull import pull

    d = tmp_path_factory.mktemp("dash-browser")
    fixed = FixedBackend()
    replay = Server(write_model(d / "replay", SCRIPTS), d / "replay-home", "--spec", "off", "--no-cache")
    local = None
    try:
        replay.wait_ready(60)
        f = write_backends(d / "backends.yaml", [
            {"name": "replay", "url": replay.url + "/v1", "models": "ask", "prices": {"input": 3, "output": 15}},
            {"name": "fixed", "url": fixed.url("fixed"), "models": ["fixed-model"]},
            {"name": "offline", "url": f"http://127.0.0.1:{free_port()}/v1", "models": ["offline-model"]}])
        local = Server(pull(catalog.entry(LOCAL).data, home=CACHE), d / "home", "--spec", "off", "--backends", str(f),
                       env={"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin"}, model=LOCAL)
        yield local.wait_ready(180), replay
    finally:
        if local is not None:
            local.stop()
        replay.stop()
        fixed.close()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1900",
              "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, check, what: str, timeout: float = 30.0):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: check(d), message=what)


def _rows(driver, table: str) -> list[list[str]]:
    """A table's cells, read in one script (the page redraws its tables each second)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr'))"
        ".map(tr => Array.from(tr.querySelectorAll('td')).map(td => td.textContent));", table)


def _text(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent;", element_id)


_INK = """
const c = document.getElementById(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) if (d[i] === arguments[1] && d[i+1] === arguments[2] && d[i+2] === arguments[3]) n++;
return n;
"""


def test_the_dashboard_live_in_chromium(servers, browser):
    srv, _replay = servers
    browser.get(srv.url + "/dash")
    _wait(browser, lambda d: _text(d, "conn") == "live", "the live connection")
    health = _wait(browser, lambda d: len(_rows(d, "backends")) == 3 and _rows(d, "backends"), "the backends' health")
    states = {r[0]: r[1] for r in health}
    assert states == {"replay": "up", "fixed": "up", "offline": "down"}
    assert "smollm2-135m" in _text(browser, "local")

    answers: dict[str, int] = {}

    def slow() -> None:
        with httpx.Client(timeout=60) as h:
            r = h.post(srv.url + "/v1/chat/completions", json={
                "model": "replay-test", "messages": [{"role": "user", "content": "[[slow]]"}], "max_tokens": 40,
                "stream": True})
            answers["replay"] = r.status_code

    t = threading.Thread(target=slow)
    t.start()
    flying = _wait(browser, lambda d: [r for r in _rows(d, "flights") if "replay-test" in r], "the request in flight")
    assert flying[0][2] == "replay" and flying[0][4] == "yes"
    t.join(60)
    assert answers["replay"] == 200
    done = _wait(browser, lambda d: [r for r in _rows(d, "rows") if r[1] == "replay-test"], "its completed row")
    assert done[0][2] == "replay" and done[0][3] == "200" and done[0][6] == "40"
    assert not [r for r in _rows(browser, "flights") if "replay-test" in r]
    with httpx.Client(timeout=60) as h:
        for i in range(2):
            assert h.post(srv.url + "/v1/chat/completions", json={
                "model": LOCAL, "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 12,
                "temperature": 0, "stream": True}).status_code == 200
    _wait(browser, lambda d: len([r for r in _rows(d, "rows") if r[1] == LOCAL]) == 2, "the local rows")
    for canvas, rgb in (("plot-tps", (47, 95, 208)), ("plot-ttft", (208, 122, 47))):
        points = int(browser.find_element(By.ID, canvas).get_attribute("data-points"))
        assert points == 3, canvas
        assert browser.execute_script(_INK, canvas, *rgb) > 50, f"{canvas} drew no line"
    assert "weights" in _text(browser, "memory")
    ARTEFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTEFACTS / "dashboard.png"))

    browser.get(srv.url + "/dash#/ledger")
    _wait(browser, lambda d: "requests" in _text(d, "totals"), "the ledger's totals")
    groups = _wait(browser, lambda d: len(_rows(d, "groups")) >= 2 and _rows(d, "groups"), "the sums by model")
    by = {g[0]: g for g in groups}
    assert by["replay-test"][1] == "1" and by[LOCAL][1] == "2"
    ARTEFACTS.joinpath("dashboard-ledger.png").write_bytes(browser.get_screenshot_as_png())

    browser.get(srv.url + "/dash#/setup")
    _wait(browser, lambda d: d.find_element(By.ID, "tiles").get_attribute("data-loaded"), "the setup guide")
    tiles = [t.get_attribute("data-model") for t in browser.find_elements(By.CSS_SELECTOR, "#tiles .tile")]
    script = "from tandem_core import catalog; import json; print(json.dumps(sorted(catalog.entries())))"
    ids = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=srv.env, timeout=60, check=True)
    assert sorted(tiles) == json.loads(ids.stdout) and LOCAL in tiles
    tile = browser.find_element(By.CSS_SELECTOR, f'#tiles .tile[data-model="{LOCAL}"]')
    assert "tandem pull smollm2-135m" in tile.text and "tandem serve --model smollm2-135m" in tile.text
    assert "fp32-cpu" in tile.text and "q4_1-lean" in tile.text and "13.3 tokens/s" in tile.text
    ARTEFACTS.joinpath("dashboard-setup.png").write_bytes(browser.get_screenshot_as_png())

    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    page = browser.page_source
    assert "[[slow]]" not in page and "Count to" not in page        # no prompt text on the page
