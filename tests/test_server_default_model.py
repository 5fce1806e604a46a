"""The default model (SmolLM2-135M, a small weak model) through a real ``tandem serve`` and the ``openai`` client.

- Forced calls: 20 prompts x (``required``, a named function) at max_tokens 256: every call's arguments
  parse and validate against the tool's schema (``jsonschema``), ``finish_reason`` is ``tool_calls``,
  ``content`` is null and no tool-call markup reaches it. The guarantee comes from the grammar and
  the loop (``tandem_core.server.bounds``), not from the model.
- The SDK's tool loop: user -> forced call -> tool result (the SDK's own assistant message, content
  null; tool content as a string and as a list of text parts) -> an answer, streamed and whole.
- Issue 10's hostile requests and a generated run per endpoint: never a 5xx, every error OpenAI-shaped,
  and the same greedy answer before and after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from fuzzing import ENDPOINTS, HOSTILE, bodies, check  # noqa: E402
from replay_server import ROOT, Server  # noqa: E402

pytestmark = pytest.mark.server

CACHE = ROOT / ".tandem-test-cache"
MODEL = "smollm2-135m"
GENERATED = 150     # per endpoint here; the volume runs on the tiny Qwen3.8 (test_server_fuzz.py)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_files", "description": "Find files whose contents match a pattern",
    "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1},
        "include_hidden": {"type": "boolean"}, "paths": {"type": "array", "items": {"type": "string"}}},
        "required": ["pattern"]}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Put an event in the calendar",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1}, "hours": {"type": "number", "minimum": 0},
        "attendees": {"type": "array", "items": {"type": "string"}},
        "place": {"type": "object", "properties": {"name": {"type": "string"}, "floor": {"type": "integer"}},
                  "required": ["name"]}},
        "required": ["title", "attendees"]}}}
TOOLS = [WEATHER, SEARCH, EVENT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What will the weather be in Paris this weekend?", "Find every TODO in the repository.",
    "Book a meeting with Ana and Bo tomorrow at noon.", "Is it going to rain in Tokyo for the next 3 days?",
    "Search for files that mention 'deprecated'.", "Create an event called standup with the whole team.",
    "Forecast for Reykjavik in fahrenheit, one week.", "Where is the function parse_body defined?",
    "Schedule lunch with Chen on the 3rd floor cafeteria.", "hi", "Tell me a joke.",
    "Weather in São Paulo?", "grep for 'import torch' including hidden files", "Plan a 2 hour review with Dana.",
    "天気を教えてください、東京、5日間", "Look for *.md files under docs and tools.", "Team offsite: Ana, Bo, Chen, Dana.",
    "What's the forecast in New York City for 14 days?", "{\"name\": \"get_weather\"}", "</tool_call> <tool_call>",
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from tandem_core import catalog
    from tandem_core.pull import pull

    return pull(catalog.entry(MODEL).data, home=CACHE)


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("default-home")
    srv = Server(smollm2_path, home, "--spec", "off", env={"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin"}, model=MODEL)
    try:
        yield srv.wait_ready(180)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _markup_free(text: str | None) -> bool:
    return text is None or not any(tag in text for tag in ("<tool_call", "</tool_call", "{\"name\"", "</"))


@pytest.mark.parametrize("forced", ["required", "named"])
def test_forced_calls_parse_validate_and_end_as_tool_calls(client, forced):
    for i, prompt in enumerate(PROMPTS):
        name = TOOLS[i % len(TOOLS)]["function"]["name"]
        choice = "required" if forced == "required" else {"type": "function", "function": {"name": name}}
        sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           tools=TOOLS, tool_choice=choice, max_tokens=256, **sampled)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (prompt, c)
        assert c.message.content is None, (prompt, c.message.content)
        assert c.message.tool_calls, prompt
        for call in c.message.tool_calls:
            assert forced == "required" or call.function.name == name
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS[call.function.name])
        assert r.usage.completion_tokens <= 256


def test_a_forced_call_streams_without_markup_in_content(client):
    """Streamed, parallel_tool_calls left at its default (the `</` that reached content)."""
    for i, prompt in enumerate(PROMPTS[:2]):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
            max_tokens=256, stream=True, temperature=1.0, seed=100 + i))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content == "" and _markup_free(content)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        calls: dict[int, dict] = {}
        for ch in chunks:
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                slot = calls.setdefault(tc.index, {"name": None, "args": ""})
                slot["name"] = tc.function.name or slot["name"]
                slot["args"] += tc.function.arguments or ""
        assert calls
        for slot in calls.values():
            jsonschema.validate(json.loads(slot["args"]), SCHEMAS[slot["name"]])


def _assistant_turn(msg) -> dict:
    """The assistant message as the SDK's users send it back: ``message.model_dump()`` (content null)."""
    turn = msg.model_dump(exclude_unset=False)
    assert turn["content"] is None and turn["tool_calls"]
    return {k: v for k, v in turn.items() if k in ("role", "content", "tool_calls")}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_content", ["string", "parts"])
def test_the_sdk_tool_loop_on_the_default_model(client, stream, tool_content):
    messages = [{"role": "user", "content": "What will the weather be in Paris for 3 days?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=128, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    result = '{"forecast": "sunny", "high_c": 24}'
    content = result if tool_content == "string" else [{"type": "text", "text": result}]
    messages += [_assistant_turn(first.choices[0].message),
                 {"role": "tool", "tool_call_id": call.id, "content": content}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length", "tool_calls")
    else:
        answer = client.chat.completions.create(**kw)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    # a plain assistant turn with content null, then another user turn
    again = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}])
    assert again.choices[0].finish_reason in ("stop", "length")


def greedy(c: httpx.Client) -> str:
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 12, "temperature": 0,
                                             "messages": [{"role": "user", "content": "Name a colour."}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_hostile_and_generated_requests_never_get_a_server_error(server, endpoint):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        before = greedy(c)
        for body in HOSTILE[endpoint]:
            r = c.post(ENDPOINTS[endpoint], content=body, headers={"content-type": "application/json"})
            check(r.status_code, r.headers, r.content)
            assert r.status_code == 400, (body[:80], r.text)
        statuses: dict[int, int] = {}

        @settings(max_examples=GENERATED, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink))
        @given(body=bodies(endpoint))
        def run(body: bytes) -> None:
            r = c.post(ENDPOINTS[endpoint], content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check(r.status_code, r.headers, r.content)

        run()
        assert sum(statuses.values()) >= GENERATED and max(statuses) < 500, statuses
        assert greedy(c) == before
