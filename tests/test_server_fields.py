"""The field policy: the docs' table equals the code's, and every row behaves as it says on a real server."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import ROOT, Server, build_tokenizer, write_model  # noqa: E402

from tandem_core.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, HONOURED, IGNORED, REFUSED, Field  # noqa: E402

DOC = ROOT / "docs" / "server.md"
TABLES = {"chat": ("## Chat completions fields", CHAT_FIELDS, "/v1/chat/completions"),
          "completions": ("## Completions fields", COMPLETION_FIELDS, "/v1/completions")}

pytestmark = pytest.mark.server  # starts processes


def doc_rows(heading: str) -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]*) \|$", line)
        if m:
            rows.append((m.group(1), m.group(2).strip(), m.group(3).strip()))
    return rows


@pytest.mark.parametrize("endpoint", sorted(TABLES))
def test_the_docs_table_is_the_code_table(endpoint):
    heading, fields, _ = TABLES[endpoint]
    assert doc_rows(heading) == [(f.name, f.policy, f.note) for f in fields]


def test_every_openai_chat_field_has_a_row():
    openai_fields = {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
        "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options"}
    names = {f.name for f in CHAT_FIELDS}
    assert openai_fields <= names
    assert {f.policy for f in CHAT_FIELDS} == {HONOURED, IGNORED, REFUSED}
    assert len(names) == len(CHAT_FIELDS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    srv = Server(write_model(root / "model", [{"when": "[[random]]", "random": True}]), root / "home")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


BASE = {"chat": {"model": "replay-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "completions": {"model": "replay-test", "prompt": "hi", "max_tokens": 4}}


def with_field(endpoint: str, f: Field, value) -> dict:
    body = {k: v for k, v in BASE[endpoint].items() if k != f.name}
    body.update(f.requires or {})
    if "." in f.name:
        outer, inner = f.name.split(".", 1)
        body[outer] = {**body.get(outer, {}), inner: value}
    else:
        body[f.name] = "replay-test" if f.name == "model" and value is None else value
    return body


def post(server, endpoint: str, body: dict) -> httpx.Response:
    r = httpx.post(server.url + TABLES[endpoint][2], json=body, timeout=30)
    return r


def rows(policies):
    return [pytest.param(e, f, id=f"{e}:{f.name}") for e in sorted(TABLES) for f in TABLES[e][1]
            if f.policy in policies]


@pytest.mark.parametrize("endpoint,f", rows({HONOURED, IGNORED}))
def test_a_taken_field_is_answered(server, endpoint, f):
    body = with_field(endpoint, f, f.example)
    r = post(server, endpoint, body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def refusal_cases():
    out = []
    for e in sorted(TABLES):
        for f in TABLES[e][1]:
            if f.policy == REFUSED:
                out.append(pytest.param(e, f, {"x": 1}, id=f"{e}:{f.name}:refused"))
            elif f.has_refused_example:
                out.append(pytest.param(e, f, f.refused, id=f"{e}:{f.name}:{f.refused!r}"[:80]))
    return out


@pytest.mark.parametrize("endpoint,f,value", refusal_cases())
def test_a_refused_field_or_value_is_a_400_naming_it(server, endpoint, f, value):
    r = post(server, endpoint, with_field(endpoint, f, value))
    err = r.json()["error"]
    assert r.status_code == (404 if f.name == "model" else 400), r.text
    assert err["param"] == f.name
    assert f.name in err["message"]


@pytest.mark.parametrize("endpoint", sorted(TABLES))
@pytest.mark.parametrize("name", ["frobnicate", "stream_options.bogus"])
def test_an_unknown_field_is_a_400_naming_it(server, endpoint, name):
    body = dict(BASE[endpoint], stream=True)
    if "." in name:
        body["stream_options"] = {"bogus": True}
    else:
        body[name] = 1
    r = post(server, endpoint, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == name
    assert name in r.json()["error"]["message"] and "unknown" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "response_format"),
])
def test_nested_refusals_name_the_path(server, body, param):
    r = post(server, "chat", {**BASE["chat"], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def ask(server, **kw) -> str:
    r = post(server, "chat", {**BASE["chat"], "messages": [{"role": "user", "content": "[[random]]"}],
                              "max_tokens": 16, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_sampling_fields_change_the_draw(server):
    greedy = ask(server, temperature=0)
    assert ask(server, temperature=1.0, seed=3, top_k=1) == greedy
    assert ask(server, temperature=1.0, seed=3, min_p=1.0) == greedy
    assert ask(server, temperature=1.0, seed=3, top_p=0.0) == greedy
    assert ask(server, temperature=1.0, seed=3) != greedy
    tok = build_tokenizer()
    first = tok.encode(greedy).ids[0]
    assert tok.encode(ask(server, temperature=0, logit_bias={str(first): -100})).ids[0] != first
    boosted = tok.encode(ask(server, temperature=0, max_tokens=6, logit_bias={str(first): 9})).ids
    penalised = tok.encode(ask(server, temperature=0, max_tokens=6, logit_bias={str(first): 9},
                               frequency_penalty=2.0, presence_penalty=2.0)).ids
    assert boosted.count(first) >= 4 and penalised.count(first) < boosted.count(first)


@pytest.mark.parametrize("endpoint", sorted(TABLES))
def test_an_integral_number_is_an_integer_as_the_document_says(server, endpoint):
    # JSON Schema's "integer" (what /openapi.json says) takes 2.0; the server does too, and uses it as 2
    body = dict(BASE[endpoint], max_tokens=2.0, seed=7.0, top_k=-1.0, temperature=0.5)
    r = post(server, endpoint, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    twin = post(server, endpoint, dict(BASE[endpoint], max_tokens=2, seed=7, top_k=-1, temperature=0.5))
    assert twin.json()["choices"][0] == r.json()["choices"][0]
    r = post(server, endpoint, dict(BASE[endpoint], max_tokens=2.5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
