"""The conductor through a real ``tandem serve --conductor`` and the official ``openai`` client, on a test engine
that replays chosen token sequences (``script_plugin``): profiles resolved three ways, the classifier's answer
always a class name (random logits under its choice grammar), a tool-result turn keeping its class with no
classifier call, the hidden note reaching the model and replayed on the next turn, the thinking budget, every
monitor task (a looping reasoning block, an empty turn, malformed tool calls repaired or regenerated, a repeated
call stopped) with the usage unchanged by the hidden parts, status lines shown and stripped from the next prompt,
memory notes to the notes store, and a journal that holds no text. One server for the module."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests" / "plugins"))

from replay_server import Server, build_tokenizer  # noqa: E402
from script_plugin import write_script_model  # noqa: E402

pytestmark = pytest.mark.server  # starts processes

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
SCHEMA = WEATHER["function"]["parameters"]
CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
LETTERS = " ".join("abcdefghijklmnopqrstuvwxyz")
SCRIPTS = [
    {"when": "Write the facts from this conversation", "text": "<tandem_memory>The user is in Paris.</tandem_memory>"},
    {"when": "You route requests", "random": True},
    {"when": "You are a title generator", "random": True, "endless": True},   # would write forever                     # the classifier: only its grammar helps
    {"when": "\u203a reading", "text": "STATUS LEAKED"},                # a status line that reached the prompt
    {"when": "[[after-tool]]", "text": "It is sunny."},
    {"when": "NOTE-MARKER-7", "text": "I saw the note."},
    {"when": "[[weather]]", "text": CALL.format(args='{"city": "Paris", "days": 3}')},
    {"when": "[[think-long]]", "text": f"<think>{LETTERS}</think>Full answer.",
     "then": {"</think>\n\n": "Budget answer."}},
    {"when": "[[loop]]", "text": "<think>" + "spin the wheel " * 30 + "</think>Never.",
     "then": {"</think>\n\n": "Out of the loop."}},
    {"when": "[[empty]]", "text": "<think>nothing</think>", "then": {"\n\n": "Now the answer."}},
    {"when": "[[coerce]]", "text": CALL.format(args='{"city": "Paris", "days": "3"}')},
    {"when": "[[broken]]", "text": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}\n'
                                   '</tool_call>'},
    {"when": "[[regen]]", "text": CALL.format(args='{"town": "Paris"}')},
    {"when": "[[twice]]", "text": CALL.format(args='{"city": "Rome", "days": 1}') + "\n"
                                  + CALL.format(args='{"city": "Rome", "days": 1}')},
    {"when": "[[remember]]", "text": "Sure.<tandem_memory>The user likes tea.</tandem_memory> Done."},
]

PROFILE = """\
model_name: TandemLLM
default_profile: main
journal: journal.jsonl
notes_store: notes.sqlite
packages:
  python:
    file: python.md
clients:
  - name: opencode
    user_agent: "^opencode/"
    profile: opencode
profiles:
  main:
    side_requests:
      - {name: title, roles: [system, user, user], tools: false, stream: true, system_contains: title}
    classes:
      quick:
        description: a short question
        effort: Answer briefly.
        rules: [Keep it short.]
      deep:
        description: a hard task
        effort: Think it through.
        packages: [python]
  opencode:
    classifier: none
    classes:
      build:
        effort: OPENCODE-NOTE
  fixed:
    classifier: none
    classes:
      only:
        effort: NOTE-MARKER-7
        rules: [Use the tools.]
  monitor:
    classifier: none
    efforts: {low: 6}
    monitor:
      loop: {ngram: 3, repeats: 4}
    classes:
      only: {}
  status:
    classifier: none
    status_lines: true
    classes:
      only: {}
  memory:
    classifier: none
    memory_notes: true
    classes:
      only: {}
  writer:
    classifier: none
    memory_notes: true
    memory_writer: {quiet_s: 0.5, max_tokens: 40}
    classes:
      only: {}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("conductor")
    (root / "python.md").write_text("Prefer the standard library.")
    (root / "profile.yaml").write_text(PROFILE)
    model = write_script_model(root / "model", SCRIPTS)
    env = {"TANDEM_EXTRA_PLUGINS": "script_plugin,tandem_conductor.plugin",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "tests" / "plugins"), str(ROOT),
                                          str(ROOT / "plugins" / "conductor"), os.environ.get("PYTHONPATH", "")])}
    srv = Server(model, root / "home", "--conductor", str(root / "profile.yaml"), env=env)
    srv.root = root
    try:
        yield srv.wait_ready(90)
    finally:
        srv.stop()


def client(server, profile: str | None = None, **headers: str) -> OpenAI:
    h = dict(headers)
    if profile:
        h["X-Tandem-Profile"] = profile
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0, default_headers=h)


def journal(server) -> dict[str, dict]:
    path = server.root / "journal.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    return {ln["request_id"]: ln for ln in lines if "request_id" in ln}


def metric(server, name: str) -> float:
    for ln in httpx.get(server.url + "/metrics").text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[-1])
    return 0.0


def tokens(text: str) -> int:
    return len(build_tokenizer().encode(text).ids)


def ask(c: OpenAI, text: str, **kw):
    return c.chat.completions.create(model="TandemLLM", messages=[{"role": "user", "content": text}], **kw)


# -- profiles, the model name ----------------------------------------------------------------------------

def test_the_server_serves_tandemllm(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["TandemLLM"]
    r = ask(c, "hi")
    assert r.model == "TandemLLM"
    with pytest.raises(Exception) as exc:
        c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "hi"}])
    assert getattr(exc.value, "status_code", None) == 404


def test_profile_by_header_by_client_and_by_default(server):
    by_header = ask(client(server, "fixed"), "hello")
    by_client = ask(client(server, **{"User-Agent": "opencode/0.15.0 ai-sdk/provider-utils/3.0.9 runtime/bun/1.3"}),
                    "hello")
    by_default = ask(client(server), "hello")
    j = journal(server)
    assert (j[by_header.id]["profile"], j[by_header.id]["profile_by"]) == ("fixed", "header")
    assert (j[by_client.id]["profile"], j[by_client.id]["profile_by"]) == ("opencode", "client:opencode")
    assert (j[by_default.id]["profile"], j[by_default.id]["profile_by"]) == ("main", "default")
    assert by_header.choices[0].message.content == "I saw the note."       # the fixed profile's note was there
    with pytest.raises(Exception) as exc:
        ask(client(server, "nope"), "hello")
    assert getattr(exc.value, "status_code", None) == 400 and "X-Tandem-Profile" in str(exc.value)


# -- the router ------------------------------------------------------------------------------------------

def test_the_classifier_answers_a_class_name_and_a_tool_result_turn_keeps_it(server):
    c = client(server)
    before = metric(server, "tandem_conductor_classifier_calls_total")
    firsts = [ask(c, f"[[weather]] question {i}", tools=[WEATHER]) for i in range(4)]
    assert metric(server, "tandem_conductor_classifier_calls_total") == before + 4
    j = journal(server)
    for r in firsts:
        assert j[r.id]["class"] in ("quick", "deep") and j[r.id]["class_by"] == "classifier"
        assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason == "tool_calls"
    # the tool-result turn of the first one: the same class, no classifier call
    first = firsts[0]
    call = first.choices[0].message.tool_calls[0]
    turn2 = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], messages=[
        {"role": "user", "content": "[[weather]] question 0"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny [[after-tool]]"}])
    assert metric(server, "tandem_conductor_classifier_calls_total") == before + 4
    j = journal(server)
    assert j[turn2.id]["class"] == j[first.id]["class"] and j[turn2.id]["class_by"] == "session"
    assert j[turn2.id]["note_id"] == j[first.id]["note_id"] != ""
    assert turn2.choices[0].message.content == "It is sunny."
    # the classifier's requests are nobody's usage: no ledger row, while every client request has one
    rows = sqlite3.connect(str(server.ledger)).execute("SELECT request_id, endpoint FROM usage").fetchall()
    assert {r.id for r in [*firsts, turn2]} <= {rid for rid, _ in rows}
    assert all(endpoint == "chat" for _, endpoint in rows)


def test_a_title_request_is_recognised_by_its_shape(server):
    c = client(server)
    before = metric(server, "tandem_conductor_classifier_calls_total")
    sides = metric(server, "tandem_conductor_side_requests_total")
    messages = [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
                {"role": "user", "content": "Generate a title for this conversation:"},
                {"role": "user", "content": "[[weather]] in Paris"}]
    usage, finish = None, None
    for chunk in c.chat.completions.create(model="TandemLLM", messages=messages, max_tokens=32000, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        finish = next((ch.finish_reason for ch in chunk.choices if ch.finish_reason), finish)
    assert usage.completion_tokens == 64 and finish == "length"       # capped, not 32000
    assert metric(server, "tandem_conductor_classifier_calls_total") == before       # no classifier
    assert metric(server, "tandem_conductor_side_requests_total") == sides + 1
    # no note: the prompt is the client's own (the same shape, not streamed, is a plain turn with a note)
    plain = c.chat.completions.create(model="TandemLLM", messages=messages, max_tokens=4)
    assert plain.usage.prompt_tokens > usage.prompt_tokens


def test_a_session_header_keeps_the_class_when_the_prefix_changed(server):
    c = client(server, **{"X-Tandem-Session": "s-42"})
    before = metric(server, "tandem_conductor_classifier_calls_total")
    r1 = ask(c, "[[weather]] header session", tools=[WEATHER])
    call = r1.choices[0].message.tool_calls[0]
    # the client rewrote its first message (the prefix no longer matches): the header still names the session
    r2 = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], messages=[
        {"role": "user", "content": "[[weather]] header session, edited"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "[[after-tool]]"}])
    assert metric(server, "tandem_conductor_classifier_calls_total") == before + 1
    j = journal(server)
    assert j[r2.id]["class_by"] == "header" and j[r2.id]["class"] == j[r1.id]["class"]
    assert j[r2.id]["session"] == "s-42"


def test_the_note_is_hidden_and_replayed_on_the_next_turn(server):
    c = client(server, "fixed")
    r1 = c.chat.completions.create(model="TandemLLM", tools=[WEATHER],
                                   messages=[{"role": "user", "content": "[[weather]] in Paris"}])
    # NOTE-MARKER-7 is in the note only: the engine saw it (its script answered), the client never sent it
    assert r1.choices[0].message.content == "I saw the note."
    r2 = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], messages=[
        {"role": "user", "content": "[[weather]] in Paris"},
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}])
    assert r2.choices[0].message.content == "I saw the note."      # replayed in the first user message


# -- the thinking budget and the monitor -----------------------------------------------------------------

def visible_tokens(msg) -> int:
    """Tokens of what the client got: the reasoning block as the model wrote it, the content, the end token."""
    reasoning = getattr(msg, "reasoning_content", None) or ""
    return tokens("<think>" + reasoning) + tokens(msg.content or "") + 1


@pytest.mark.parametrize("how", [{"thinking_budget": 6}, {"reasoning_effort": "low"}])
def test_the_thinking_budget_closes_the_reasoning_block(server, how):
    c = client(server, "monitor")
    full = ask(c, "[[think-long]]", extra_body={"thinking_budget": 1000})
    assert full.choices[0].message.content == "Full answer."
    r = ask(c, "[[think-long]]", extra_body=how if "thinking_budget" in how else None,
            **({"reasoning_effort": how["reasoning_effort"]} if "reasoning_effort" in how else {}))
    msg = r.choices[0].message
    assert msg.content.strip() == "Budget answer."
    assert len(msg.reasoning_content) < len(full.choices[0].message.reasoning_content)
    assert r.usage.completion_tokens == visible_tokens(msg)             # the hidden </think> is not counted
    assert "budget_closed" in journal(server)[r.id]["actions"]


def test_a_looping_reasoning_block_is_closed(server):
    r = ask(client(server, "monitor"), "[[loop]]")
    msg = r.choices[0].message
    assert msg.content.strip() == "Out of the loop."
    assert msg.reasoning_content.count("spin the wheel") < 10
    assert r.usage.completion_tokens == visible_tokens(msg)
    assert "loop_closed" in journal(server)[r.id]["actions"]


def test_an_empty_turn_goes_on(server):
    r = ask(client(server, "monitor"), "[[empty]]")
    msg = r.choices[0].message
    assert msg.content.strip() == "Now the answer." and r.choices[0].finish_reason == "stop"
    assert "continued_empty" in journal(server)[r.id]["actions"]
    # the end token drawn and dropped is not in the usage, nor the hidden text; the usage is what was sent
    assert r.usage.completion_tokens == tokens("<think>nothing</think>") + tokens(msg.content) + 1


def test_a_grammar_bounded_answer_is_left_alone(server):
    c = client(server, "monitor")
    r = ask(c, "[[loop]]", response_format={"type": "json_object"}, max_tokens=60, extra_body={"thinking_budget": 2})
    json.loads(r.choices[0].message.content)                # the grammar's answer, whole
    assert journal(server)[r.id]["actions"] == [] and journal(server)[r.id]["hidden_tokens"] == 0
    # an answer with no room left for the hidden text: the budget cannot close it, it ends at max_tokens
    short = ask(c, "[[think-long]]", max_tokens=8, extra_body={"thinking_budget": 2})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 8


@pytest.mark.parametrize("marker,action", [("[[coerce]]", "repaired_call"), ("[[broken]]", "repaired_call"),
                                           ("[[regen]]", "regenerated_call")])
def test_a_malformed_tool_call_is_repaired_or_regenerated(server, marker, action):
    c = client(server, "monitor")
    for stream in (False, True):
        if stream:
            calls: dict[int, dict] = {}
            rid = None
            for chunk in c.chat.completions.create(model="TandemLLM", tools=[WEATHER], max_tokens=150, stream=True,
                                                   messages=[{"role": "user", "content": marker}]):
                rid = chunk.id
                for ch in chunk.choices:
                    for t in ch.delta.tool_calls or []:
                        got = calls.setdefault(t.index, {"name": None, "arguments": ""})
                        got["name"] = t.function.name or got["name"]
                        got["arguments"] += t.function.arguments or ""
            assert len(calls) == 1
            name, args = calls[0]["name"], calls[0]["arguments"]
        else:
            r = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], max_tokens=150,
                                          messages=[{"role": "user", "content": marker}])
            rid = r.id
            assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
            (call,) = r.choices[0].message.tool_calls
            name, args = call.function.name, call.function.arguments
        assert name == "get_weather"
        jsonschema.validate(json.loads(args), SCHEMA)
        assert action in journal(server)[rid]["actions"]
        if marker == "[[coerce]]":
            assert json.loads(args) == {"city": "Paris", "days": 3}
        if marker == "[[broken]]":
            assert json.loads(args) == {"city": "Oslo", "days": 2}


def test_a_repeated_call_is_stopped(server):
    c = client(server, "monitor")
    r = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], messages=[{"role": "user", "content": "[[twice]]"}])
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 1}
    assert "repeat_stopped" in journal(server)[r.id]["actions"]
    # the same call as the conversation's last one: stopped, no call goes out
    again = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], messages=[
        {"role": "user", "content": "[[weather]] now"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"}])
    assert not again.choices[0].message.tool_calls
    assert "repeat_stopped" in journal(server)[again.id]["actions"]


# -- status lines, memory notes, the journal -------------------------------------------------------------

def test_status_lines_appear_and_never_reach_the_next_prompt(server):
    c = client(server, "status")
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="TandemLLM", messages=[{"role": "user", "content": "hi there"}], stream=True) if ch.choices]
    text = "".join(parts)
    assert text.startswith("\u203a reading ") and " tokens" in text.splitlines()[0]
    assert text.splitlines()[-1] == "Hello there!"
    history = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": text},
               {"role": "user", "content": "and now"}]
    r = c.chat.completions.create(model="TandemLLM", messages=history)
    assert "STATUS LEAKED" not in r.choices[0].message.content        # the engine never saw the status line
    clean = [history[0], {"role": "assistant", "content": "Hello there!"}, history[2]]
    assert r.usage.prompt_tokens == c.chat.completions.create(model="TandemLLM", messages=clean).usage.prompt_tokens


def test_a_memory_block_goes_to_the_notes_store(server):
    r = ask(client(server, "memory"), "[[remember]]")
    assert r.choices[0].message.content == "Sure. Done."
    db = sqlite3.connect(str(server.root / "notes.sqlite"))
    assert ("The user likes tea.",) in db.execute("SELECT text FROM notes").fetchall()
    assert journal(server)[r.id]["memory_notes"] == 1


def test_a_quiet_session_gets_its_facts_written_as_notes(server):
    c = client(server, "writer", **{"X-Tandem-Session": "quiet-1"})
    r = ask(c, "hello from the south")
    assert r.choices[0].message.content == "Hello there!"      # the writer never touched the answer
    db = sqlite3.connect(str(server.root / "notes.sqlite"))
    deadline = time.monotonic() + 30
    rows: list = []
    while time.monotonic() < deadline and not rows:
        time.sleep(0.2)
        rows = db.execute("SELECT text FROM notes WHERE session = 'quiet-1'").fetchall()
    assert rows == [("The user is in Paris.",)]
    time.sleep(1.5)                                           # quiet sessions are written once
    assert db.execute("SELECT COUNT(*) FROM notes WHERE session = 'quiet-1'").fetchone()[0] == 1
    lines = [json.loads(ln) for ln in (server.root / "journal.jsonl").read_text().splitlines()]
    assert [ln for ln in lines if ln.get("actions") == ["quiet_writer"] and ln.get("session") == "quiet-1"]
    # and a request after it is answered as before (the session's engine state came back)
    assert ask(c, "hello again").choices[0].message.content == "Hello there!"


def test_the_journal_holds_no_text(server):
    from tandem_conductor.journal import JOURNAL_FIELDS

    lines = [json.loads(ln) for ln in (server.root / "journal.jsonl").read_text().splitlines()]
    assert lines
    words = ["[[weather]]", "question 0", "Paris", "sunny", "hello", "NOTE-MARKER", "wheel", "likes tea", "Hello there", "Budget answer"]
    for ln in lines:
        assert set(ln) <= JOURNAL_FIELDS
        flat = json.dumps(ln)
        assert not any(w.lower() in flat.lower() for w in words), flat


# -- hostile input: never a 5xx through the conductor ----------------------------------------------------

CONDUCTOR_HOSTILE = [
    {"messages": [{"role": "user", "content": "hi"}], "thinking_budget": "lots"},
    {"messages": [{"role": "user", "content": "hi"}], "thinking_budget": -1},
    {"messages": [{"role": "user", "content": "hi"}], "thinking_budget": True},
    {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"},
    {"messages": [{"role": "user", "content": 7}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, 3]}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": [1]}]}, {"role": "tool"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5, "tool_calls": "x"}]},
    {"messages": "hi"},
    {"messages": [None, {"role": "user", "content": "hi"}]},
    {"model": "other", "messages": [{"role": "user", "content": "hi"}]},
]


@pytest.mark.parametrize("profile", [None, "monitor", "status"])
def test_hostile_and_generated_bodies_never_get_a_server_error(server, profile):
    from fuzzing import HOSTILE, bodies, check
    from hypothesis import HealthCheck, Phase, given, settings

    headers = {"X-Tandem-Profile": profile} if profile else {}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as h:
        for body in [*HOSTILE["chat"], *(json.dumps(b).encode() for b in CONDUCTOR_HOSTILE)]:
            r = h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            check(r.status_code, r.headers, r.content)
            assert r.status_code in (400, 404), (body[:80], r.text)
        statuses: dict[int, int] = {}

        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
        @given(body=bodies("chat"))
        def run(body: bytes) -> None:
            r = h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check(r.status_code, r.headers, r.content)

        run()
        assert max(statuses) < 500 and statuses.get(200, 0) >= 5, statuses
    assert ask(client(server, profile), "hi").choices[0].message.content
    failed = [ln for ln in server.log_text().splitlines() if "planning failed" in ln]
    assert not failed, failed[:3]       # the conductor refused or passed on every body, never crashed on one
