"""Hostile and generated requests for the server's fuzz tests, and the check every answer must pass.

``bodies(endpoint)`` is a hypothesis strategy of request bodies as bytes: mostly bodies an OpenAI
client could send with one or a few fields wrong (a table row's refused example, a value of another
type, an unknown field, lone surrogates, deep nesting, malformed messages and tool calls), some
valid ones (``max_tokens`` 1-4, so a generated request that passes runs briefly), and some bytes
that are not JSON at all. ``HOSTILE`` is the fixed set of issue 10's reproductions.

``check(status, headers, content)`` asserts what every answer must be: never >= 500; an error is
``{"error": {"message", "type", "param", "code"}}`` with a ``param`` when a 400 blames a field; a
200 is a completion (whole), or server-sent events ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tandem_core.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED, Field

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TABLE = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}

_TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["hi", "", "hi \ud800", "\udfff", "<tool_call>", "</think>", "<|im_end|>", "{\"a\": 1}"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False)
                     | _TEXT, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_TEXT, kids, max_size=3),
                     max_leaves=5)
_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])},
                              optional={"text": _TEXT | _JSON}) | _JSON
_CONTENT = st.none() | _TEXT | st.lists(_PART, max_size=3) | _JSON
_ARGS = st.sampled_from(['{"city": "Paris"}', "{}", "", "not json", "[1]", "{\"a\": " * 80 + "1" + "}" * 80,
                         '{"city": "\\ud800"}']) | _JSON
_CALL = st.fixed_dictionaries({}, optional={
    "id": _TEXT | _JSON, "type": st.sampled_from(["function", "code"]),
    "function": st.fixed_dictionaries({}, optional={"name": _TEXT | _JSON, "arguments": _ARGS}) | _JSON}) | _JSON
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])},
    optional={"content": _CONTENT, "tool_calls": st.lists(_CALL, max_size=2) | _JSON,
              "tool_call_id": _TEXT | _JSON, "name": _TEXT | _JSON}) | _JSON
_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "code"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f"]) | _TEXT},
    optional={"parameters": st.sampled_from([
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"type": "object"}, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
        {"type": "strange"}, {"$ref": "#/nowhere"}]) | _JSON})}) | _JSON
_SPECIAL = {
    "messages": st.lists(_MESSAGE, min_size=0, max_size=4),
    "tools": st.lists(_TOOL, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "nope"}}]) | _JSON,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}]) | _JSON,
    "max_tokens": st.integers(1, 4) | _JSON,
    "max_completion_tokens": st.integers(1, 4) | _JSON,
    "prompt": _TEXT | st.lists(st.integers(-3, 10**6), max_size=4) | _JSON,
    "stop": st.sampled_from(["\n", [""], ["a", "b"], [], ""]) | _JSON,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "x", "-1", "99999999", "1e3"]), st.floats(-200, 200), max_size=2),
}


def _value(f: Field) -> st.SearchStrategy[Any]:
    """A value for a table row: mostly what it refuses (its refused example, a field-specific hostile value,
    any JSON), sometimes its example."""
    opts = [_JSON, _JSON]
    if f.has_refused_example:
        opts += [st.just(f.refused)] * 2
    if f.name in _SPECIAL:
        opts += [_SPECIAL[f.name]] * 4
    return st.one_of([*opts, st.just(f.example)])


def _valid(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """A body that passes the field table: the few honoured fields that keep a run short."""
    if endpoint == "chat":
        head: dict[str, Any] = {"messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}), min_size=1, max_size=2)}
    else:
        head = {"prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 200), min_size=1, max_size=8)}
    return st.fixed_dictionaries({**head, "max_tokens": st.integers(1, 4)}, optional={
        "temperature": st.floats(0, 2), "seed": st.integers(0, 2**31), "stream": st.booleans(),
        "top_p": st.floats(0, 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "logprobs": st.booleans() if endpoint == "chat" else st.integers(0, 3)})


def _mutated(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one field set to a value its row refuses, some others to what ``_value`` draws (which
    may pass), and now and then an unknown field: nearly always a fast 400."""
    rows = [f for f in TABLE[endpoint] if "." not in f.name]
    refusable = [f for f in rows if f.has_refused_example or f.policy == REFUSED]

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        body = dict(draw(_valid(endpoint)))
        bad = draw(st.sampled_from(refusable))
        body[bad.name] = draw(st.just(bad.refused) if bad.has_refused_example else _JSON)
        for f in draw(st.lists(st.sampled_from(rows), max_size=3, unique_by=lambda f: f.name)):
            body[f.name] = draw(_value(f))
        if draw(st.integers(0, 9)) == 0:
            body[draw(st.sampled_from(["bogus", "Messages", "max-tokens", ""]))] = draw(_JSON)
        if not isinstance(body.get("max_tokens", 1), int) or body.get("max_tokens", 1) > 4:
            body.setdefault("max_completion_tokens", 2)
        return body

    return build()


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    """Request bodies as bytes (see the module docstring)."""
    mutated = _mutated(endpoint).map(lambda b: json.dumps(b, ensure_ascii=True).encode())
    valid = _valid(endpoint).map(lambda b: json.dumps(b, ensure_ascii=True).encode())
    nested = st.integers(60, 3000).map(lambda d: b'{"metadata": ' + _deep(d) + b', "messages": [], "prompt": "x"}')
    # weights: most requests fail validation fast (the volume is cheap); about one in seven is valid and runs
    special = st.builds(lambda b, k, v: json.dumps({**b, k: v}, ensure_ascii=True).encode(), _valid(endpoint),
                        st.sampled_from(sorted(k for k in _SPECIAL if k in {f.name for f in TABLE[endpoint]})),
                        st.one_of(list(_SPECIAL.values())))
    return st.one_of([mutated] * 5 + [special] * 2 + [valid, nested, st.binary(max_size=40),
                                                       _JSON.map(lambda v: json.dumps(v).encode())])


def _schema_of_depth(d: int) -> str:
    return '{"properties": {"a": ' * d + "{}" + "}}" * d


HOSTILE: dict[str, list[bytes]] = {
    "chat": [
        b'{"messages":[{"role":"user","content":"hi \\ud800"}]}',
        _deep(10000),
        b'{"messages":[{"role":"user","content":"hi"}],"metadata":' + _deep(10000) + b"}",
        ('{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":'
         '{"name":"x","schema":' + _schema_of_depth(2000) + "}}}").encode(),
        *[json.dumps({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": None, "tool_calls": tc}]}).encode()
          for tc in ("x", [1], [{"function": "f"}], [{"id": "c", "type": "function", "function": {"name": "f"}}],
                     [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}])],
        json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": ["a", "b"]}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}},
                                        "$ref": "#/$defs/n"}}}], "tool_choice": "required"}).encode(),
    ],
    "completions": [b'{"prompt":"hi \\udfff"}', _deep(10000), b'{"prompt": "hi", "stop": [""]}',
                    b'{"prompt": [1, 99999999]}', b'{"prompt": "hi", "max_tokens": 0}', b'{"prompt": "hi", "n": 2}'],
}


def check(status: int, headers: Any, content: bytes) -> None:
    """What every answer must be (see the module docstring)."""
    assert status < 500, (status, content[:300])
    if status >= 400:
        body = json.loads(content)
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)
        if status == 400:
            assert err["param"], err       # a 400 always blames a field (or "body")
        if status == 429:
            assert int(headers["retry-after"]) >= 1
        return
    assert status == 200, status
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln for ln in content.decode().splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", content[-200:]
        for ev in events[:-1]:
            assert "error" not in json.loads(ev[6:]), ev
    else:
        body = json.loads(content)
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0
