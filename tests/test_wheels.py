"""Packaging that installs: the wheels ``make dist`` builds, installed into a fresh environment (not editable, no
source tree on the path), list the shipped registry, pull the default model and serve a chat.

The fresh environment sees the test environment's third-party packages (torch, ...) through a filtered folder
of links that leaves out every tandem distribution (as tests/test_plugins_install.py does), so everything of
TandemLLM it runs comes from the wheels. The default model comes from the suite's cache of it
(``.tandem-test-cache``, filled by the first test that pulls it): ``tandem pull`` there verifies it and is done.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from test_llama_default_model import smollm2_path  # noqa: F401  (fixture: fills the cache)
from test_plugins_install import bare_venv  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".tandem-test-cache"
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> list[Path]:
    """What ``make dist`` runs: one wheel of the core and one of each plugin."""
    out = tmp_path_factory.mktemp("dist")
    plugins = sorted(str(p.parent) for p in (ROOT / "plugins").glob("*/pyproject.toml"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(ROOT), *plugins],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    found = sorted(out.glob("*.whl"))
    assert len(found) == 1 + len(plugins), [w.name for w in found]
    return found


def test_the_core_wheel_carries_the_registry(wheels):
    core = next(w for w in wheels if w.name.startswith("tandem_core-"))
    names = set(zipfile.ZipFile(core).namelist())
    assert "tandem_core/shipped/models/smollm2-135m/model.yaml" in names
    assert "tandem_core/shipped/schema/model.schema.json" in names
    assert any(n.startswith("tandem_core/shipped/prices/") for n in names)
    assert {"tandem_core/proxy/backends.schema.json", "tandem_core/proxy/static/index.html",
            "tandem_core/proxy/static/dash.js", "tandem_core/proxy/static/dash.css"} <= names
    assert not any(n.startswith(("tests/", "plugins/", "docs/")) for n in names)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_installed_wheels_list_pull_and_serve(wheels, bare_venv, smollm2_path, tmp_path):  # noqa: F811
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(bare_venv), "install", "--quiet", "--no-deps",
                        "--disable-pip-version-check", *map(str, wheels)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tandem = bare_venv.parent / "tandem"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "PYTHON"))}
    env["TANDEM_HOME"] = str(CACHE)
    where = subprocess.run([str(bare_venv), "-c", "import tandem_core, tandem_llama; "
                            "print(tandem_core.__file__); print(tandem_llama.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(str(ROOT) not in line and "site-packages" in line for line in where.stdout.split()), where.stdout

    models = subprocess.run([str(tandem), "models"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    assert models.returncode == 0, models.stderr
    assert "smollm2-135m" in models.stdout and "qwen3.8-27b" in models.stdout
    dash = subprocess.run([str(bare_venv.parent / "tandem-dash"), "--help"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120, check=False)
    assert dash.returncode == 0 and "--backends" in dash.stdout, dash.stderr
    pulled = subprocess.run([str(tandem), "pull", "smollm2-135m"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=600)
    assert pulled.returncode == 0, pulled.stderr

    port = _free_port()
    proc = subprocess.Popen([str(tandem), "serve", "--model", "smollm2-135m", "--port", str(port),
                             "--spec", "off", "--no-cache"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while True:
            try:
                models_seen = [m.id for m in client.models.list()]
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not come up:\n{proc.stdout.read() if proc.stdout else ''}")
                time.sleep(0.5)
        assert models_seen == ["smollm2-135m"]
        got = client.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=0,
                                             messages=[{"role": "user", "content": "Say hello."}])
        assert got.choices[0].message.content and got.usage.completion_tokens > 0
        import httpx

        page = httpx.get(f"http://127.0.0.1:{port}/dash/static/dash.js", timeout=30)
        assert page.status_code == 200 and "tandemDash" in page.text      # the dashboard ships in the wheel
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
