"""The backends file's refusals name the file, the line and the key; the ledger's new columns, its migration of
an older file and its sums; the relay's SSE framing; the setup guide's tiles. In process, no server."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_core.proxy.config import BackendsError, load_backends, parse_backends
from tandem_core.proxy.relay import _event_json, _split
from tandem_core.server.ledger import Ledger, UsageRow

GOOD = """\
backends:
  - name: vllm
    url: http://127.0.0.1:8001/v1/
    models: [qwen2.5-7b, qwen2.5-coder]
    api_key_env: VLLM_KEY
    timeouts: {connect: 2, read: 60}
    prices: {input: 0.15, output: 0.6}
  - name: cloud
    url: https://api.example.com/v1
    models: ask
"""


def test_a_good_file_reads_every_field(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text(GOOD)
    bs = load_backends(f, env={"VLLM_KEY": "sk-1"})
    vllm, cloud = bs.backends
    assert (vllm.name, vllm.url, vllm.models, vllm.api_key) == ("vllm", "http://127.0.0.1:8001/v1",
                                                                ("qwen2.5-7b", "qwen2.5-coder"), "sk-1")
    assert (vllm.connect_s, vllm.read_s, vllm.price_in, vllm.price_out) == (2.0, 60.0, 0.15, 0.6)
    assert vllm.cost(1_000_000, 2_000_000) == pytest.approx(0.15 + 1.2)
    assert cloud.ask and cloud.api_key is None and cloud.read_s == 300.0 and cloud.cost(10, 10) == 0.0
    assert vllm.stream_usage and not parse_backends(GOOD + "    stream_usage: false\n", Path("b.yaml"),
                                                    {"VLLM_KEY": "k"}).backends[1].stream_usage


@pytest.mark.parametrize(("text", "env", "expected"), [
    (GOOD.replace("read: 60", "read: -1"), {"VLLM_KEY": "k"}, "b.yaml:6: backends[0].timeouts.read:"),
    (GOOD.replace("    models: ask\n", "    modles: ask\n"), {"VLLM_KEY": "k"}, "b.yaml:10: backends[1].modles: unknown key"),
    (GOOD.replace("    models: ask\n", ""), {"VLLM_KEY": "k"}, "backends[1].models: required, missing"),
    (GOOD.replace("models: ask", "models: 3"), {"VLLM_KEY": "k"}, 'b.yaml:10: backends[1].models: a list of model'),
    (GOOD.replace("https://api.example.com/v1", "api.example.com"), {"VLLM_KEY": "k"},
     "b.yaml:9: backends[1].url: 'api.example.com' is not an http"),
    (GOOD, {}, "b.yaml:5: backends[0].api_key_env: the environment variable VLLM_KEY is not set"),
    (GOOD.replace("name: cloud", "name: vllm"), {"VLLM_KEY": "k"}, "b.yaml:8: backends[1].name: 'vllm' names backends[0]"),
    (GOOD.replace("models: ask", "models: [qwen2.5-7b]"), {"VLLM_KEY": "k"},
     "b.yaml:10: backends[1].models[0]: 'qwen2.5-7b' is served by backend 'vllm' already"),
    (GOOD.replace("prices: {input: 0.15, output: 0.6}", "prices: {input: 0.15}"), {"VLLM_KEY": "k"},
     "backends[0].prices.output: required, missing"),
    ("backends: [\n", {}, "b.yaml:2: not valid YAML"),
    ("", {}, "b.yaml: backends: required, missing"),
    ("backends: []\n", {}, "b.yaml:1: backends:"),
])
def test_a_bad_file_is_refused_naming_the_line_and_the_key(text, env, expected):
    with pytest.raises(BackendsError) as err:
        parse_backends(text, Path("b.yaml"), env)
    assert expected in str(err.value), str(err.value)


def test_a_backend_may_not_claim_the_local_model():
    bs = parse_backends(GOOD, Path("b.yaml"), {"VLLM_KEY": "k"})
    with pytest.raises(BackendsError, match=r"b.yaml:4: backends\[0\].models\[1\]: 'qwen2.5-coder' is the model"):
        bs.check_local("qwen2.5-coder")
    with pytest.raises(BackendsError, match="no such file"):
        load_backends("/nonexistent/backends.yaml")


def _row(**kw) -> UsageRow:
    base = {"ts": 1_700_000_000.0, "request_id": "r", "model": "m", "endpoint": "chat", "prompt_tokens": 10,
            "completion_tokens": 5, "finish_reason": "stop", "ttft_s": 0.5, "decode_tps": 20.0, "queued_s": 0.0,
            "duration_s": 1.0, "max_tokens": 16, "capped_from": None, "stream": True}
    return UsageRow(**{**base, **kw})


def test_the_ledger_sums_by_model_and_by_day(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    led.write(_row(request_id="a", model="m1", cost=0.25, backend="vllm"))
    led.write(_row(request_id="b", model="m1", cost=0.5, backend="vllm", ttft_s=1.5, status=502, counted=True))
    led.write(_row(request_id="c", model="m2", ts=1_700_000_000.0 + 86400 * 3))
    by_model = {s.key: s for s in led.summary("model")}
    assert by_model["m1"].requests == 2 and by_model["m1"].cost == pytest.approx(0.75)
    assert by_model["m1"].errors == 1 and by_model["m1"].mean_ttft_s == pytest.approx(1.0)
    assert by_model["m2"].cost == 0.0 and by_model["m2"].prompt_tokens == 10
    assert len(led.summary("day")) == 2
    (total,) = led.summary(None)
    assert (total.requests, total.prompt_tokens, total.completion_tokens) == (3, 30, 15)
    rows = led.last(10)
    assert [r.request_id for r in rows] == ["a", "b", "c"] and rows[1].counted is True and rows[1].status == 502
    led.close()


def test_a_ledger_of_the_older_version_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE usage (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL, request_id TEXT, model TEXT, "
               "endpoint TEXT, prompt_tokens INTEGER, completion_tokens INTEGER, finish_reason TEXT, ttft_s REAL, "
               "decode_tps REAL, queued_s REAL, duration_s REAL, max_tokens INTEGER, capped_from INTEGER, "
               "stream INTEGER)")
    db.execute("INSERT INTO usage (ts, request_id, model, endpoint, prompt_tokens, completion_tokens, finish_reason,"
               " ttft_s, decode_tps, queued_s, duration_s, max_tokens, capped_from, stream) "
               "VALUES (1, 'old', 'm', 'chat', 3, 4, 'stop', NULL, NULL, 0, 1, 16, NULL, 0)")
    db.commit()
    db.close()
    led = Ledger(path)
    (old,) = led.last(5)
    assert (old.backend, old.cost, old.status, old.counted) == ("local", 0.0, 200, False)
    led.write(_row(request_id="new", backend="b", cost=1.0))
    assert led.summary(None)[0].cost == 1.0
    led.close()


def test_the_ledger_command_lists_and_sums(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    led.write(_row(request_id="a", model="m1", cost=0.25, backend="vllm"))
    led.write(_row(request_id="b", model="m2", cost=0.5, backend="cloud"))
    led.close()
    run = [sys.executable, "-m", "tandem_core.cli.main", "ledger", "--ledger", str(tmp_path / "l.sqlite")]
    listed = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0 and "vllm" in listed.stdout and "cost 0.750000" in listed.stdout
    summed = subprocess.run([*run, "--by", "model"], capture_output=True, text=True, timeout=60, check=False)
    lines = summed.stdout.splitlines()
    assert lines[1].split()[:2] == ["m1", "1"] and lines[-1].split()[0] == "total"
    assert "0.750000" in lines[-1]


def test_sse_events_are_split_whole_whatever_the_separator():
    events, rest = _split(b"data: 1\r\n\r\n: comment\n\ndata: {\"a\": 1}\n\ndata: par")
    assert events == [b"data: 1\r\n\r\n", b": comment\n\n", b"data: {\"a\": 1}\n\n"] and rest == b"data: par"
    assert _event_json(b'data: {"choices":\ndata: []}\n\n') == {"choices": []}
    assert _event_json(b"data: [DONE]\n\n") is None and _event_json(b": ping\n\n") is None


def test_the_setup_guide_has_a_tile_per_registry_entry():
    from tandem_core import catalog
    from tandem_core.proxy.dash import setup_tiles

    tiles = setup_tiles()
    assert [t["id"] for t in tiles] == sorted(catalog.entries(), key=lambda i: (not catalog.entries()[i].data.get(
        "default"), i))
    small = next(t for t in tiles if t["id"] == "smollm2-135m")
    assert small["commands"] == {"pull": "tandem pull smollm2-135m", "serve": "tandem serve --model smollm2-135m"}
    assert small["memory"]["table"][0] == {"context": 4096, "weights_gib": 0.501,
                                           "kv_gib": round(46080 * 4096 / (1 << 30), 3), "state_gib": 0.0,
                                           "total_gib": round(0.501 + round(46080 * 4096 / (1 << 30), 3), 3)}
    assert {p["name"] for p in small["profiles"]} == {"fp32-cpu", "q4_1-lean"}
    assert [m["name"] for m in small["measured"]] == ["decode-1-thread", "load", "side-lane"]
    assert all((Path(__file__).resolve().parents[1] / m["doc"]).is_file() for m in small["measured"])


def test_the_dashboards_data_needs_the_key_and_its_page_does_not(tmp_path):
    import asyncio

    import httpx

    from tandem_core.proxy.dash_cli import build_dash_app
    from tandem_core.proxy.hub import Hub

    bs = parse_backends(GOOD.replace("models: ask", "models: [big]"), Path("b.yaml"), {"VLLM_KEY": "k"})
    led = Ledger(tmp_path / "l.sqlite")
    led.write(_row(request_id="a", model="qwen2.5-7b", cost=0.5, backend="vllm"))
    hub = Hub(bs, led, api_key="s3cret")
    app = build_dash_app(hub)

    async def run() -> dict[str, httpx.Response]:
        auth = {"authorization": "Bearer s3cret"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return {
                "page": await c.get("/dash"), "script": await c.get("/dash/static/dash.js"),
                "dotted": await c.get("/dash/static/..%2Fdash.py"), "post": await c.post("/dash/api/state"),
                "state-nokey": await c.get("/dash/api/state"), "state": await c.get("/dash/api/state", headers=auth),
                "ledger": await c.get("/dash/api/ledger?by=model", headers=auth),
                "ledger-bad": await c.get("/dash/api/ledger?by=week", headers=auth),
                "models-nokey": await c.get("/v1/models"), "models": await c.get("/v1/models", headers=auth),
                "unknown": await c.post("/v1/chat/completions", headers=auth, json={"model": "nope"}),
            }

    r = asyncio.run(run())
    led.close()
    assert r["page"].status_code == 200 and "dash.js" in r["page"].text
    assert "default-src 'self'" in r["page"].headers["content-security-policy"]
    assert r["script"].status_code == 200 and r["script"].headers["content-type"].startswith("text/javascript")
    assert r["dotted"].status_code == 404 and r["post"].status_code == 405
    assert r["state-nokey"].status_code == 401 and r["state-nokey"].json()["error"]["code"] == "invalid_api_key"
    assert {b["name"] for b in r["state"].json()["backends"]} == {"vllm", "cloud"}
    ledger = r["ledger"].json()
    assert ledger["totals"]["cost"] == 0.5 and ledger["groups"][0]["key"] == "qwen2.5-7b"
    assert r["ledger-bad"].status_code == 400 and r["ledger-bad"].json()["error"]["param"] == "by"
    assert r["models-nokey"].status_code == 401
    assert {m["id"]: m["owned_by"] for m in r["models"].json()["data"]} == {"qwen2.5-7b": "vllm",
                                                                           "qwen2.5-coder": "vllm", "big": "cloud"}
    assert r["unknown"].status_code == 404 and "qwen2.5-7b" in r["unknown"].json()["error"]["message"]


def test_credentials_in_a_backend_url_are_never_shown():
    import httpx

    from tandem_core.proxy.config import Backend
    from tandem_core.proxy.hub import describe

    b = Backend(name="cloud", url="https://alice:s3cret@api.example.com/v1", models=("m",), api_key=None,
                api_key_env=None)
    assert b.shown == "https://***@api.example.com/v1"
    msg = describe(httpx.ConnectError("refused"), b)
    assert "s3cret" not in msg and "alice" not in msg and "***@api.example.com" in msg
    plain = Backend(name="local", url="http://127.0.0.1:9000/v1", models=("m",), api_key=None, api_key_env=None)
    assert plain.shown == plain.url
