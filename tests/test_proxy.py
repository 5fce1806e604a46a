"""The proxy through real processes: a ``tandem serve`` of the default model (SmolLM2-135M) with ``--backends``
naming a second ``tandem serve`` (the replay model, another loopback port), a backend in this process that
answers fixed bytes (and one that is slow), and a port where nothing listens.

- the ``openai`` client's requests land where they should (the local model stays local), ``/v1/models`` is the
  union;
- a relayed stream's bytes are the backend's bytes: exactly, for the fixed backend; for the replay backend the
  same as its own answer to the same greedy request, but for the ``id`` and ``created`` each answer draws;
- a ledger row for each request with the backend's tokens (or counted ones) and the cost from the prices;
- a client that goes away cancels the backend's generation; a slow backend is a 504, a down one a 502, naming
  it, while the local model keeps answering; a backend killed mid-answer ends the stream with an error event,
  then 502s, and the local model still answers;
- ``tandem-dash`` alone relays to both servers, with the API key rule on ``/v1`` and the dashboard's data.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from proxy_helpers import FIXED_STREAM, FIXED_WHOLE, Dash, FixedBackend, ledger_rows, wait_for, write_backends
from replay_server import ROOT, Server, free_port, write_model

pytestmark = pytest.mark.server

CACHE = ROOT / ".tandem-test-cache"
LOCAL = "smollm2-135m"
REPLAY = "replay-test"
TEXT = "Hello there! The weather in Paris is sunny today, and tomorrow it will rain."
SCRIPTS = [{"when": "[[slow]]", "random": True, "endless": True, "delay_s": 0.05}]
PRICES = {"input": 2.0, "output": 8.0}      # per million tokens


@pytest.fixture(scope="module")
def fixed():
    fb = FixedBackend(slow_s=3.0)
    yield fb
    fb.close()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay-backend")
    srv = Server(write_model(d / "model", SCRIPTS, default=TEXT), d, "--spec", "off", "--no-cache")
    try:
        yield srv.wait_ready(60)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def backends_file(tmp_path_factory, backend, fixed):
    d = tmp_path_factory.mktemp("backends")
    return write_backends(d / "backends.yaml", [
        {"name": "replay", "url": backend.url + "/v1", "models": "ask", "prices": PRICES},
        {"name": "fixed", "url": fixed.url("fixed"), "models": ["fixed-model"], "prices": {"input": 1, "output": 1}},
        {"name": "fixed-raw", "url": fixed.url("fixed"), "models": ["fixed-raw-model"], "stream_usage": False},
        {"name": "slow", "url": fixed.url("slow"), "models": ["slow-model"], "timeouts": {"read": 0.5}},
        {"name": "down", "url": f"http://127.0.0.1:{free_port()}/v1", "models": ["down-model"],
         "timeouts": {"connect": 1}},
    ])


@pytest.fixture(scope="module")
def proxy(backends_file, tmp_path_factory):
    from tandem_core import catalog
    from tandem_core.pull import pull

    path = pull(catalog.entry(LOCAL).data, home=CACHE)
    home = tmp_path_factory.mktemp("proxy-home")
    srv = Server(path, home, "--spec", "off", "--no-cache", "--backends", str(backends_file),
                 env={"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin"}, model=LOCAL)
    try:
        yield srv.wait_ready(180)
    finally:
        srv.stop()


def _client(srv, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, timeout=60, max_retries=0)


def _ask(text: str = "Say hello.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _normal(raw: bytes) -> bytes:
    """The bytes with each answer's own id and creation time blanked (everything else compared as is)."""
    raw = re.sub(rb'"id": ?"(chatcmpl|cmpl)-[^"]+"', b'"id":"-"', raw)
    return re.sub(rb'"created": ?\d+', b'"created":0', raw)


def _row(srv_ledger: Path, predicate, what: str, after: set[str] | None = None):
    """The newest row that ``predicate`` takes (among the rows not in ``after``), waited for."""
    return wait_for(lambda: next((r for r in reversed(ledger_rows(srv_ledger))
                                  if predicate(r) and r.request_id not in (after or set())), None), what=what)


def _ids(srv_ledger: Path) -> set[str]:
    return {r.request_id for r in ledger_rows(srv_ledger)}


def test_models_list_the_union(proxy):
    models = {m.id: m.owned_by for m in _client(proxy).models.list().data}
    assert models[LOCAL] == "tandem"
    assert models[REPLAY] == "replay"           # asked of its GET /v1/models
    assert models["fixed-model"] == "fixed" and models["down-model"] == "down"
    assert models["fixed-raw-model"] == "fixed-raw"


def test_requests_land_where_they_should(proxy, backend):
    c = _client(proxy)
    raw = c.chat.completions.with_raw_response.create(model=REPLAY, messages=_ask(), max_tokens=40, temperature=0)
    answer = raw.parse()
    assert raw.headers["x-tandem-backend"] == "replay"
    assert answer.choices[0].message.content == TEXT and answer.model == REPLAY
    assert _row(backend.ledger, lambda r: r.model == REPLAY, "the backend's own row")     # it ran there
    local = c.chat.completions.with_raw_response.create(model=LOCAL, messages=_ask(), max_tokens=4, temperature=0)
    assert "x-tandem-backend" not in local.headers and local.parse().model == LOCAL
    assert not [r for r in ledger_rows(backend.ledger) if r.model == LOCAL]                 # it stayed local


def test_a_relayed_stream_is_the_backends_bytes(proxy, backend, fixed):
    body = {"model": REPLAY, "messages": _ask("Weather?"), "max_tokens": 30, "temperature": 0, "seed": 7,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", backend.url + "/v1/chat/completions", json=body) as r:
            direct = b"".join(r.iter_raw())
        with h.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            via = b"".join(r.iter_raw())
    assert direct.count(b"data: ") > 5 and direct.endswith(b"data: [DONE]\n\n")
    assert _normal(via) == _normal(direct)
    # exactly the bytes, for a backend whose answer does not change: CRLF, a comment, a multi-line data field
    fbody = {"model": "fixed-model", "messages": _ask("x"), "stream": True, "stream_options": {"include_usage": True}}
    sent_body = json.dumps(fbody).encode()
    with httpx.Client(timeout=30) as h, h.stream("POST", proxy.url + "/v1/chat/completions", content=sent_body,
                                                 headers={"x-stainless-lang": "python",
                                                          "content-type": "application/json"}) as r:
        assert r.headers["x-backend-says"] == "fixed"
        assert b"".join(r.iter_raw()) == FIXED_STREAM
    path, headers, sent = fixed.seen[-1]
    assert path == "/fixed/v1/chat/completions" and sent == sent_body   # the body unchanged
    assert headers["x-stainless-lang"] == "python" and "authorization" not in headers
    # a stream without include_usage: the proxy asks for it, unless the backend says stream_usage: false
    for model, asked in (("fixed-model", True), ("fixed-raw-model", False)):
        raw = json.dumps({"model": model, "messages": _ask("y"), "stream": True}).encode()
        with httpx.Client(timeout=30) as h, h.stream("POST", proxy.url + "/v1/chat/completions", content=raw,
                                                     headers={"content-type": "application/json"}) as r:
            assert b"".join(r.iter_raw()) == FIXED_STREAM
        sent = fixed.seen[-1][2]
        assert (sent == raw) is not asked
        assert json.loads(sent).get("stream_options") == ({"include_usage": True} if asked else None)
    with httpx.Client(timeout=30) as h:
        whole = h.post(proxy.url + "/v1/chat/completions", content=b'{"model": "fixed-model", "messages": []}')
    assert whole.content == FIXED_WHOLE and fixed.seen[-1][2] == b'{"model": "fixed-model", "messages": []}'


def test_ledger_rows_have_the_tokens_and_the_cost(proxy, fixed):
    c = _client(proxy)
    seen = _ids(proxy.ledger)
    whole = c.chat.completions.create(model=REPLAY, messages=_ask("Cost?"), max_tokens=12, temperature=0)
    row = _row(proxy.ledger, lambda r: r.backend == "replay" and not r.stream, "the relayed row", seen)
    assert (row.prompt_tokens, row.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert row.cost == pytest.approx((row.prompt_tokens * 2.0 + row.completion_tokens * 8.0) / 1e6)
    assert row.status == 200 and row.finish_reason == "length" and not row.counted
    # streamed without include_usage: the proxy asks for it, the client does not get the usage chunk
    chunks = list(c.chat.completions.create(model=REPLAY, messages=_ask("Cost?"), max_tokens=12, temperature=0,
                                            stream=True))
    assert all(ch.usage is None and ch.choices for ch in chunks)
    srow = _row(proxy.ledger, lambda r: r.backend == "replay" and r.stream, "the streamed row", seen)
    assert (srow.prompt_tokens, srow.completion_tokens) == (row.prompt_tokens, row.completion_tokens)
    assert srow.ttft_s is not None and srow.ttft_s > 0 and srow.decode_tps is not None and srow.decode_tps > 0
    # a backend that sends no usage: counted (the stream above carries 2 pieces of text)
    list(c.chat.completions.create(model="fixed-model", messages=_ask("count me"), stream=True))
    frow = _row(proxy.ledger, lambda r: r.backend == "fixed" and r.stream and r.counted, "the counted row", seen)
    assert frow.completion_tokens >= 2 and frow.prompt_tokens >= 1
    assert frow.cost == pytest.approx((frow.prompt_tokens + frow.completion_tokens) / 1e6)
    # the local model's row
    local = c.chat.completions.create(model=LOCAL, messages=_ask("Local?"), max_tokens=3, temperature=0)
    lrow = _row(proxy.ledger, lambda r: r.backend == "local" and r.model == LOCAL, "the local row", seen)
    assert (lrow.prompt_tokens, lrow.completion_tokens) == (local.usage.prompt_tokens, local.usage.completion_tokens)
    assert lrow.cost == 0.0 and lrow.status == 200
    # `tandem ledger` sums them
    out = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "ledger", "--ledger", str(proxy.ledger),
                          "--by", "model", "--json"], capture_output=True, text=True, env=proxy.env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    sums = {d["key"]: d for d in map(json.loads, out.stdout.splitlines())}
    rows = ledger_rows(proxy.ledger)
    assert sums[REPLAY]["cost"] == pytest.approx(sum(r.cost for r in rows if r.model == REPLAY))
    assert sums["all"]["requests"] == len(rows)
    table = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "ledger", "--ledger", str(proxy.ledger),
                            "--by", "day"], capture_output=True, text=True, env=proxy.env, timeout=60, check=False)
    assert table.returncode == 0 and "total" in table.stdout


def test_slow_and_down_backends_fail_alone(proxy):
    c = _client(proxy)
    seen = _ids(proxy.ledger)
    with pytest.raises(openai.APIStatusError) as down:
        c.chat.completions.create(model="down-model", messages=_ask())
    assert down.value.status_code == 502 and "backend down" in down.value.message
    assert down.value.body["code"] == "backend_unavailable"
    done: dict[str, float] = {}

    def slow() -> None:
        t0 = time.perf_counter()
        try:
            c.chat.completions.create(model="slow-model", messages=_ask())
        except openai.APIStatusError as exc:
            done["status"], done["message"] = exc.status_code, exc.message
        done["s"] = time.perf_counter() - t0

    t = threading.Thread(target=slow)
    t.start()
    local = c.chat.completions.create(model=LOCAL, messages=_ask(), max_tokens=2, temperature=0)  # not blocked
    t.join(30)
    assert local.choices[0].finish_reason in ("length", "stop")
    assert done["status"] == 504 and "backend slow" in done["message"] and done["s"] < 2.5
    # each row is written once its answer has gone out: wait for it
    assert _row(proxy.ledger, lambda r: r.backend == "down", "the down backend's row", seen).status == 502
    assert _row(proxy.ledger, lambda r: r.backend == "slow", "the slow backend's row", seen).status == 504


def test_a_client_that_goes_away_cancels_the_backends_generation(proxy, backend):
    body = {"model": REPLAY, "messages": _ask("[[slow]]"), "max_tokens": 400, "stream": True}
    seen, seen_backend = _ids(proxy.ledger), _ids(backend.ledger)
    with httpx.Client(timeout=30) as h, h.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                break       # the answer is running; leave
    row = _row(backend.ledger, lambda r: r.finish_reason == "cancelled", "the backend's cancelled row", seen_backend)
    assert row.completion_tokens < 200      # stopped long before its 400 tokens (20 s at 0.05 s a token)
    prow = _row(proxy.ledger, lambda r: r.backend == "replay" and r.status == 499, "the proxy's cancelled row", seen)
    assert prow.finish_reason == "cancelled"


def test_tandem_dash_alone_relays_to_both(tmp_path, proxy, backend):
    f = write_backends(tmp_path / "dash.yaml", [
        {"name": "engine", "url": proxy.url + "/v1", "models": [LOCAL]},
        {"name": "replay", "url": backend.url + "/v1", "models": "ask", "prices": PRICES}])
    dash = Dash(f, tmp_path, "--api-key", "k3y").wait_ready(60)
    try:
        c = _client(dash, "k3y")
        assert {m.id: m.owned_by for m in c.models.list().data} == {LOCAL: "engine", REPLAY: "replay"}
        assert c.chat.completions.create(model=REPLAY, messages=_ask(), max_tokens=40,
                                         temperature=0).choices[0].message.content == TEXT
        local = c.chat.completions.create(model=LOCAL, messages=_ask(), max_tokens=3, temperature=0)
        assert local.model == LOCAL and local.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError) as missing:
            c.chat.completions.create(model="nope", messages=_ask())
        assert "'nope'" in missing.value.message and missing.value.body["param"] == "model"
        with pytest.raises(openai.AuthenticationError):
            _client(dash, "wrong").models.list()
        with httpx.Client(timeout=10) as h:
            assert h.get(dash.url + "/dash").status_code == 200            # the page holds no data
            assert h.get(dash.url + "/dash/api/state").status_code == 401
            state = h.get(dash.url + "/dash/api/state", headers={"authorization": "Bearer k3y"}).json()
            assert state["local"] is None and {b["name"] for b in state["backends"]} == {"engine", "replay"}
            assert all(b["ok"] for b in state["backends"])
        rows = ledger_rows(dash.ledger)
        assert {(r.backend, r.model) for r in rows if r.status == 200} == {("engine", LOCAL), ("replay", REPLAY)}
    finally:
        dash.stop()


def test_the_dashboards_events_carry_each_row(proxy):
    with httpx.Client(timeout=30) as h, h.stream("GET", proxy.url + "/dash/events") as ev:
        lines = ev.iter_lines()
        assert next(lines) == "event: hello"
        hello = json.loads(next(lines)[len("data: "):])
        assert hello["state"]["local"]["model"] == LOCAL and hello["state"]["local"]["memory"]
        threading.Thread(target=lambda: _client(proxy).chat.completions.create(
            model=REPLAY, messages=_ask("live"), max_tokens=5, temperature=0), daemon=True).start()
        kinds = []
        for line in lines:
            if line.startswith("event: "):
                kinds.append(line[7:])
            if kinds and kinds[-1] == "row" and line.startswith("data: "):
                row = json.loads(line[6:])
                break
    assert "start" in kinds and row["backend"] == "replay" and row["completion_tokens"] == 5
    assert "Paris" not in json.dumps(hello) and "live" not in json.dumps(row)      # counts, never text


def test_a_backend_killed_mid_answer_gives_502_while_the_local_model_answers(proxy, backend):
    c = _client(proxy)
    stream = c.chat.completions.create(model=REPLAY, messages=_ask("[[slow]]"), max_tokens=300, stream=True)
    it = iter(stream)
    next(it)
    next(it)
    backend.proc.kill()
    backend.proc.wait(10)
    with pytest.raises(openai.APIError):
        for _ in it:
            pass
    with pytest.raises(openai.APIStatusError) as gone:
        c.chat.completions.create(model=REPLAY, messages=_ask(), max_tokens=5)
    assert gone.value.status_code == 502 and "backend replay" in gone.value.message
    local = c.chat.completions.create(model=LOCAL, messages=_ask(), max_tokens=3, temperature=0)
    assert local.choices[0].message.content is not None
    assert 502 in {r.status for r in ledger_rows(proxy.ledger) if r.backend == "replay"}


def test_a_bad_backends_file_stops_serve_and_dash_before_anything_loads(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - name: a\n    url: http://127.0.0.1:1/v1\n    models: [m]\n    prices: {input: -1, output: 1}\n")
    env = {**Dash.env_for(tmp_path)}
    t0 = time.perf_counter()
    serve = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "serve", "--model", LOCAL, "--weights",
                            str(CACHE / "models" / LOCAL), "--port", str(free_port()), "--backends", str(bad)],
                           capture_output=True, text=True, env=env, timeout=60, check=False)
    assert serve.returncode == 2 and len(serve.stderr.strip().splitlines()) == 1, serve.stderr
    assert f"{bad}:5: backends[0].prices.input:" in serve.stderr and "Traceback" not in serve.stderr
    assert time.perf_counter() - t0 < 30 and "serving" not in serve.stdout
    dash = subprocess.run([sys.executable, "-m", "tandem_core.proxy.dash_cli", "--backends", str(bad), "--port",
                           str(free_port())], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert dash.returncode == 2 and f"{bad}:5: backends[0].prices.input:" in dash.stderr
    assert len(dash.stderr.strip().splitlines()) == 1
