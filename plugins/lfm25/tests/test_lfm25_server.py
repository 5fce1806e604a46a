"""LFM2 through a real ``tandem serve`` and the official ``openai`` client, with the plugin's tool-call format.

The tiny dense ``lfm2`` checkpoint (random weights, the test tokenizer, the plugin's chat template) serves
with ``tool_format="lfm2_pythonic"``, which the plugin registers through ``tandem_tool_formats``: a chat
answers; a streamed forced call (``tool_choice="required"``: the grammar makes the random model write LFM2's
format) arrives as ``tool_calls`` deltas whose joined arguments are JSON that validates, with no markup in
the content; a forced named call (not streamed) validates against its schema, and the next turn (the call
sent back with ``content: null`` and the tool's answer) is accepted.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from openai import OpenAI

from conftest_lfm25 import PLUGIN_SRC, ROOT, lfm25_ckpts  # noqa: F401  (fixture)
from replay_server import Server

pytestmark = pytest.mark.server

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                         "langs": {"type": "array", "items": {"enum": ["py", "rs"]}},
                                         "exact": {"type": "boolean"}},
        "required": ["query", "exact"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(lfm25_ckpts, tmp_path_factory):
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_lfm25.plugin",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "plugins"), str(ROOT), str(PLUGIN_SRC)])}
    srv = Server(lfm25_ckpts.dense.path, tmp_path_factory.mktemp("lfm2-serve"), "--spec", "off", "--no-cache",
                 "--max-context", "1024", env=env)
    try:
        srv.wait_ready(180)
        yield OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    finally:
        srv.stop()


def test_a_chat_answers(client):
    r = client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "Hi there."}],
                                       max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.content, str) and not msg.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_a_streamed_forced_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="replay-test", messages=[{"role": "user", "content": "Find where main is defined."}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_tokens=32000, temperature=0.7, seed=3,
        stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    content, finish, pieces = "", None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or tc.id
            call["name"] = call["name"] or (tc.function.name if tc.function else None)
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
                pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and list(calls) == [0], (finish, content, calls)
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert pieces >= 1


def test_a_forced_named_call_validates_and_the_next_turn_is_accepted(client):
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Search for the parser."}]
    r = client.chat.completions.create(
        model="replay-test", messages=messages, tools=TOOLS, max_tokens=32000, temperature=0.9, seed=11,
        tool_choice={"type": "function", "function": {"name": "search"}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, msg
    assert [c.function.name for c in msg.tool_calls] == ["search"]
    args = json.loads(msg.tool_calls[0].function.arguments)
    jsonschema.validate(args, SCHEMAS["search"])
    follow = client.chat.completions.create(
        model="replay-test", max_tokens=8, temperature=0, tools=TOOLS,
        messages=[*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": msg.tool_calls[0].id, "type": "function",
             "function": {"name": "search", "arguments": msg.tool_calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "tandem_core/server/parse.py"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens
