"""Generated and hostile requests through a real ``tandem serve``: never a 5xx.

The volume runs on the replay model (a real server, an engine that costs nothing: ~15 ms a request
that runs): for each endpoint 2,000 hypothesis-generated bodies (``fuzzing.bodies``) and schemathesis
cases (positive and negative) generated from the server's own ``/openapi.json``, more than 2,000
generated requests an endpoint in all. The tiny Qwen3.8 checkpoint (a real engine and its chat
template, which concatenates ``message['content']``) gets issue 10's fixed reproductions and a
smaller generated run; the default model the same in ``test_server_default_model.py``. Every answer
passes ``fuzzing.check`` (no status >= 500, every error OpenAI-shaped and naming a ``param`` where a
field is at fault), and each server answers a fixed greedy request with the same text before and after.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from conftest_qwen38 import PLUGIN_SRC, qwen38_ckpts  # noqa: E402,F401  (fixture)
from fuzzing import ENDPOINTS, HOSTILE, bodies, check  # noqa: E402
from replay_server import ROOT, Server, write_model  # noqa: E402

pytestmark = pytest.mark.server

GENERATED = 1700    # hypothesis bodies per endpoint (replay model); with SCHEMATHESIS, >= 2,000 an endpoint
ON_QWEN = 200       # hypothesis bodies per endpoint on the tiny Qwen3.8 (a request that runs costs ~100 ms there)
# schemathesis cases per endpoint: its generator takes ~190 ms a chat case (the messages schema) and ~40 ms a
# completions case on this 2-core machine, so the suite runs fewer than the hypothesis bodies; with them each
# endpoint gets at least 2,000 generated requests (a longer run: raise these)
SCHEMATHESIS = {"chat": 300, "completions": 500}
GREEDY = {"messages": [{"role": "user", "content": "w1 w2 w3 w4 [[random]]"}], "max_tokens": 8, "temperature": 0,
          "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-replay")
    srv = Server(write_model(root / "model", [{"when": "[[random]]", "random": True}]), root / "home")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def qwen(qwen38_ckpts, tmp_path_factory):  # noqa: F811
    home = tmp_path_factory.mktemp("fuzz-home")
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin",
           "PYTHONPATH": os.pathsep.join([str(PLUGIN_SRC), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    srv = Server(qwen38_ckpts.text.path, home, "--spec", "off", "--max-context", "512", env=env, model="tiny")
    try:
        yield srv.wait_ready(120)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(replay):
    with httpx.Client(base_url=replay.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def qwen_client(qwen):
    with httpx.Client(base_url=qwen.url, timeout=60) as c:
        yield c


def greedy(client: httpx.Client) -> str:
    r = client.post("/v1/chat/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def post(client: httpx.Client, endpoint: str, body: bytes) -> httpx.Response:
    return client.post(ENDPOINTS[endpoint], content=body, headers={"content-type": "application/json"})


RUN = settings(max_examples=100, deadline=None, database=None, derandomize=True,
               suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink))


def _hostile_then_generated(c: httpx.Client, endpoint: str, n: int) -> dict[int, int]:
    before = greedy(c)
    for body in HOSTILE[endpoint]:
        r = post(c, endpoint, body)
        check(r.status_code, r.headers, r.content)
        assert r.status_code == 400, (body[:80], r.text)
    statuses: dict[int, int] = {}

    @settings(RUN, max_examples=n)
    @given(body=bodies(endpoint))
    def run(body: bytes) -> None:
        r = post(c, endpoint, body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check(r.status_code, r.headers, r.content)

    run()
    assert sum(statuses.values()) >= n and max(statuses) < 500, statuses
    assert greedy(c) == before
    return statuses


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_hostile_and_generated_bodies_never_get_a_server_error(client, endpoint):
    statuses = _hostile_then_generated(client, endpoint, GENERATED)
    assert statuses.get(200, 0) >= 50 and statuses.get(400, 0) >= 500, statuses  # both kinds were exercised


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_the_tiny_qwen38_takes_them_too(qwen_client, endpoint):
    r = qwen_client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "w1"}, {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "w2"}]}]})
    assert r.status_code == 200, r.text    # its template concatenates content: null and parts normalised
    _hostile_then_generated(qwen_client, endpoint, ON_QWEN)


@pytest.fixture(scope="module")
def api(client):
    """The server's own OpenAPI document, max_tokens narrowed to 1-4 and required (a valid case runs briefly)."""
    import schemathesis

    doc = client.get("/openapi.json").json()
    doc = copy.deepcopy(doc)
    for path in ENDPOINTS.values():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body["properties"]:
                body["properties"][name] = {"type": "integer", "minimum": 1, "maximum": 4}
        body["required"] = [*body["required"], "max_tokens"]
    return schemathesis.openapi.from_dict(doc)


def test_the_openapi_document_is_the_field_table(client):
    from tandem_core.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED

    doc = client.get("/openapi.json").json()
    for path, fields in (("/v1/chat/completions", CHAT_FIELDS), ("/v1/completions", COMPLETION_FIELDS)):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["additionalProperties"] is False
        top = {f.name: f for f in fields if "." not in f.name}
        assert set(body["properties"]) == set(top)
        for name, f in top.items():
            prop = body["properties"][name]
            assert prop["description"] == f"{f.policy}: {f.note}"
            assert ("not" in prop) == (f.policy == REFUSED)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_schemathesis_cases_from_the_servers_own_document_never_get_a_server_error(api, client, replay, endpoint):
    from schemathesis.generation import GenerationMode

    op = api[ENDPOINTS[endpoint]]["POST"]
    n = SCHEMATHESIS[endpoint]
    cases = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                      op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    before = greedy(client)
    statuses: dict[int, int] = {}

    @settings(RUN, max_examples=n)
    @given(case=cases)
    def run(case) -> None:
        kw = case.as_transport_kwargs(base_url=replay.url)
        r = client.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"),
                           content=_content(kw))
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check(r.status_code, r.headers, r.content)

    run()
    assert sum(statuses.values()) >= n and max(statuses) < 500, statuses
    # the document is looser than the server's message checks (content per role, tool_calls on assistants
    # only), so how many positive cases run to a 200 depends on the draw: only the refusals are counted
    assert statuses.get(400, 0) >= n // 4, statuses
    assert greedy(client) == before


def _content(kw: dict) -> bytes | None:
    import json

    if "json" in kw:
        return json.dumps(kw["json"]).encode()
    data = kw.get("data")
    return data.encode() if isinstance(data, str) else data
