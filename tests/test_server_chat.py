"""A real ``tandem serve`` process with the replay test model, through the official ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import CHAT_TEMPLATE, ROOT, Server, build_tokenizer, write_model  # noqa: E402

CONTEXT = 2048
LONG = "The weather in Paris is sunny today, and tomorrow it will rain. " * 4
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TWO_CALLS = CALL + "\n" + CALL.replace("Paris", "Rome")
THINK = "<think>\nI think the answer is 42.\n</think>\n\nThe answer is 42."
SCRIPTS = [
    {"when": "[[weather]]", "text": CALL},
    {"when": "[[two]]", "text": TWO_CALLS},
    {"when": "[[think]]", "text": THINK},
    {"when": "[[long]]", "text": LONG},
    {"when": "[[random]]", "random": True},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC"]}},
                                       "required": ["zone"], "additionalProperties": False}}}

pytestmark = pytest.mark.server  # starts processes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    srv = Server(write_model(root / "model", SCRIPTS, max_context=CONTEXT), root / "home")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prompt_tokens(messages, **kw) -> int:
    from tandem_core.server.template import render_chat
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    tok = HFTokenizer(build_tokenizer(), eos_tokens=["<|im_end|>"])
    return len(tok.encode(render_chat(Served("m", None, tok, CHAT_TEMPLATE), messages, **kw)))  # type: ignore


def test_chat_whole(client):
    r = client.chat.completions.create(model="replay-test", messages=user("hi"))
    assert r.choices[0].message.content == "Hello there!"
    assert r.choices[0].finish_reason == "stop"
    assert r.model == "replay-test" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == prompt_tokens(user("hi"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_with_usage_in_the_last_chunk(client):
    chunks = list(client.chat.completions.create(model="replay-test", messages=user("[[long]]"), stream=True,
                                                  stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == LONG
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 10  # streamed, not whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    whole = client.chat.completions.create(model="replay-test", messages=user("[[long]]"))
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_sequence_is_cut_and_never_sent(client):
    r = client.chat.completions.create(model="replay-test", messages=user("[[long]]"), stop=["in Paris", "zzz"])
    assert r.choices[0].message.content == "The weather "
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="replay-test", messages=user("[[long]]"), stop="sunny",
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The weather in Paris is "


def test_max_tokens_finish_reason_length(client):
    r = client.chat.completions.create(model="replay-test", messages=user("[[long]]"), max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model="replay-test", messages=user("[[long]]"), max_completion_tokens=3,
                                       max_tokens=50)
    assert r.usage.completion_tokens == 3


def test_a_max_tokens_past_the_context_is_capped_not_refused(client, server):
    r = client.chat.completions.create(model="replay-test", messages=user("[[long]]"), max_tokens=32000)
    n = prompt_tokens(user("[[long]]"))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == LONG
    line = next(ln for ln in server.log_text().splitlines() if r.id in ln)
    assert f"capped_max_tokens=32000->{CONTEXT - n}" in line


def test_seeded_sampling_is_reproducible(client):
    def run(seed, stream=False):
        kw = dict(model="replay-test", messages=user("[[random]]"), seed=seed, temperature=1.0, max_tokens=24,
                  logprobs=True)
        if stream:
            chunks = client.chat.completions.create(stream=True, **kw)
            return [t.token for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
        return [t.token for t in client.chat.completions.create(**kw).choices[0].logprobs.content]

    a = run(7)
    assert len(a) == 24
    assert run(7) == a and run(7, stream=True) == a
    assert run(8) != a


def test_json_schema_output_parses_and_validates(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 30},
        "rain": {"type": "boolean"}}, "required": ["city", "days", "rain"], "additionalProperties": False}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="replay-test", messages=user("[[random]]"), seed=seed, temperature=1.0, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="replay-test", messages=user("[[random]]"), seed=4, max_tokens=300,
                                       response_format={"type": "json_object"}, temperature=0.3,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model="replay-test", messages=user("hi"), logprobs=True, top_logprobs=2,
                                       temperature=0)
    items = r.choices[0].logprobs.content
    assert "".join(t.token for t in items) == r.choices[0].message.content
    for t in items:
        assert -0.01 < t.logprob <= 0.0  # the replayed token holds nearly all the mass
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[1].logprob < t.top_logprobs[0].logprob
        assert bytes(t.bytes).decode() == t.token
    r = client.chat.completions.create(model="replay-test", messages=user("hi"))
    assert r.choices[0].logprobs is None


def test_completions_text_ids_logprobs_and_stream(client):
    r = client.completions.create(model="replay-test", prompt="[[long]]", max_tokens=4, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "length" and len(lp.tokens) == 4
    assert "".join(lp.tokens) == r.choices[0].text == "".join(LONG)[:len(r.choices[0].text)]
    assert all(len(d) == 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
    tok = build_tokenizer()
    ids = tok.encode("[[long]]").ids
    r2 = client.completions.create(model="replay-test", prompt=ids, max_tokens=4, temperature=0)
    assert r2.choices[0].text == r.choices[0].text and r2.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="replay-test", prompt="hi", max_tokens=50, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello there!"
    assert chunks[-1].usage.completion_tokens == len(tok.encode("Hello there!").ids) + 1


def test_models_and_unknown_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["replay-test"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", messages=user("hi"))
    assert "model" in str(err.value) and "gpt-5" in str(err.value)


def test_a_prompt_past_the_context_is_refused_naming_messages(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="replay-test", messages=user("weather " * CONTEXT))
    assert err.value.body["param"] == "messages"


def test_tool_call_streams_as_argument_deltas(client):
    chunks = list(client.chat.completions.create(model="replay-test", messages=user("[[weather]]"),
                                                  tools=[WEATHER, TIME], tool_choice="auto", stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    arg_deltas = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(arg_deltas) > 1  # written piece by piece, not at the end
    assert json.loads("".join(arg_deltas)) == {"city": "Paris", "days": 3}
    assert all(tc.index == 0 for tc in calls)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    whole = client.chat.completions.create(model="replay-test", messages=user("[[weather]]"), tools=[WEATHER])
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


def test_tool_results_go_back_through_the_template(client):
    msgs = user("[[weather]]") + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model="replay-test", messages=msgs, tools=[WEATHER])
    assert r.usage.prompt_tokens == prompt_tokens(msgs, tools=[WEATHER])


def test_parallel_tool_calls_false_keeps_one_call(client):
    r = client.chat.completions.create(model="replay-test", messages=user("[[two]]"), tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris", "Rome"]
    r = client.chat.completions.create(model="replay-test", messages=user("[[two]]"), tools=[WEATHER],
                                       parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_makes_random_logits_call_a_tool(client, choice):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model="replay-test", messages=user("[[random]]"), tools=[WEATHER, TIME], tool_choice=choice, seed=seed,
            max_tokens=300, parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        name = calls[0].function.name
        assert name in ("get_weather", "get_time") if choice == "required" else name == "get_time"
        args = json.loads(calls[0].function.arguments)
        schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(args, schema)


def test_tool_choice_none_renders_no_tools(client):
    r = client.chat.completions.create(model="replay-test", messages=user("hi"), tools=[WEATHER], tool_choice="none")
    assert r.usage.prompt_tokens == prompt_tokens(user("hi"))


def test_reasoning_content_under_both_names(client):
    r = client.chat.completions.create(model="replay-test", messages=user("[[think]]"))
    msg = r.choices[0].message
    assert msg.content == "The answer is 42."
    assert msg.model_extra["reasoning_content"] == "I think the answer is 42."
    assert msg.model_extra["reasoning"] == "I think the answer is 42."
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(model="replay-test", messages=user("[[think]]"), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    assert len(reasoning) > 1 and "".join(reasoning) == "I think the answer is 42."
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "I think the answer is 42."
    assert "".join(d.content or "" for d in deltas) == "The answer is 42."


def test_an_opencode_shaped_session(client, server):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}}
             for i in range(9)] + [WEATHER]
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] + user("[[weather]]")
    chunks = list(client.chat.completions.create(model="replay-test", messages=msgs, tools=tools,
                                                  tool_choice="auto", max_tokens=32000, stream=True,
                                                  stream_options={"include_usage": True}, temperature=0.6,
                                                  top_p=0.95))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and chunks[-1].usage.completion_tokens > 0
    title = client.chat.completions.create(
        model="replay-test", max_tokens=32000, messages=[
            {"role": "system", "content": "Generate a short title for the conversation."}] + user("hi"))
    assert title.choices[0].message.content == "Hello there!"
    assert "capped_max_tokens=32000->" in server.log_text()


def test_health_and_metrics(server, client):
    client.chat.completions.create(model="replay-test", messages=user("hi"))
    h = httpx.get(server.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["model"] == "replay-test"
    assert len(h["fingerprints"]["tokenizer"]) == 64 and h["fingerprints"]["replay"] == "test"
    assert [s[0] for s in h["load_stages"]] == ["resolve", "weights", "tokenizer", "engine"]
    assert h["memory"][0]["name"] == "replay rows" and h["memory"][0]["bytes"] > 0
    assert h["engine"]["engines"] == 1 and h["engine"]["queue"] == 8 and h["engine"]["max_context"] == CONTEXT
    log = server.log_text()  # the load progress: a bar for the weights, then the stages
    assert "weights [" in log and "100.0%" in log and "loaded: engine" in log
    m = httpx.get(server.url + "/metrics", timeout=10)
    assert m.headers["content-type"].startswith("text/plain")
    lines = m.text.splitlines()
    stop = [ln for ln in lines if ln.startswith('tandem_requests_total{endpoint="chat",finish_reason="stop"}')]
    assert stop and int(stop[0].split()[-1]) >= 1
    assert any(ln.startswith("tandem_ttft_seconds_count ") and int(ln.split()[-1]) >= 1 for ln in lines)
    assert "tandem_queue_waiting 0" in lines and "tandem_engines_busy 0" in lines
    assert any(ln.startswith("tandem_completion_tokens_total ") for ln in lines)
    host = {k: int(ln.split()[-1]) for ln in lines for k in ("anon", "file", "peak")
            if ln.startswith(f'tandem_host_memory_bytes{{kind="{k}"}} ')}
    assert set(host) == {"anon", "file", "peak"} and host["peak"] >= host["anon"] > 10 * 2**20


def test_log_lines_and_ledger_hold_no_text(server, client):
    r = client.chat.completions.create(model="replay-test", messages=user("[[long]] secret-words"))
    log = server.log_text()
    line = next(ln for ln in log.splitlines() if r.id in ln)
    assert "finish=stop" in line and f"completion={r.usage.completion_tokens}" in line and "ttft=" in line
    assert "secret-words" not in log and "sunny" not in log
    out = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "ledger", "--ledger", str(server.ledger),
                          "--json", "-n", "500"], env=server.env, cwd=str(ROOT), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(ln) for ln in out.stdout.splitlines()]
    row = next(x for x in rows if x["request_id"] == r.id)
    assert row["prompt_tokens"] == r.usage.prompt_tokens and row["finish_reason"] == "stop"
    assert row["completion_tokens"] == r.usage.completion_tokens and row["ttft_s"] > 0
    assert b"secret-words" not in server.ledger.read_bytes()
    table = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "ledger", "--ledger", str(server.ledger)],
                           env=server.env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.id in table.stdout and table.stdout.splitlines()[0].startswith("time")


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def xml_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("xml")
    srv = Server(write_model(root / "model", [{"when": "[[weather]]", "text": XML_CALL}], tool_format="qwen_xml"),
                 root / "home", env={"TANDEM_EXTRA_PLUGINS": "replay_plugin,tandem_qwen38.plugin"})  # its format
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    finally:
        srv.stop()


def test_qwen_xml_tool_call_streams_typed_argument_deltas(xml_client):
    chunks = list(xml_client.chat.completions.create(model="replay-test", messages=user("[[weather]]"),
                                                      tools=[WEATHER], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"city": "Paris", "days": 3}  # the integer arrives as a JSON number
    assert len([tc for tc in calls if tc.function.arguments]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_content", ["string", "parts"])
def test_the_sdk_tool_loop_with_content_null(client, stream, tool_content):
    """user -> forced call -> the SDK's own assistant message (content null) -> a tool result (a string, or a
    list of text parts) -> an answer; the template concatenates content, so null and parts are normalised."""
    messages = user("[[weather]]")
    kw = dict(model="replay-test", tools=[WEATHER], tool_choice="required", max_tokens=300)
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
        parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        call = {"id": parts[0].id, "type": "function", "function": {
            "name": parts[0].function.name, "arguments": "".join(p.function.arguments or "" for p in parts)}}
        assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    else:
        first = client.chat.completions.create(messages=messages, **kw)
        assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
        turn = first.choices[0].message.model_dump()
        assistant = {k: turn[k] for k in ("role", "content", "tool_calls")}
        call = turn["tool_calls"][0]
    assert assistant["content"] is None
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    result = "sunny, 24 C"
    content = result if tool_content == "string" else [{"type": "text", "text": result}]
    messages += [assistant, {"role": "tool", "tool_call_id": call["id"], "content": content}, *user("hi")]
    answer = client.chat.completions.create(model="replay-test", messages=messages, tools=[WEATHER])
    assert answer.choices[0].finish_reason == "tool_calls"  # the replay model answers its [[weather]] script again
    assert answer.usage.prompt_tokens == prompt_tokens(
        [*messages[:1], {**assistant, "content": ""}, {**messages[2], "content": result}, *messages[3:]],
        tools=[WEATHER])


def test_a_template_failure_names_the_message_and_part_not_the_exception(tmp_path):
    from tandem_core.server.template import TemplateError, render_chat
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    tok = HFTokenizer(build_tokenizer(), eos_tokens=["<|im_end|>"])
    template = ("{% for m in messages %}{{ m.role + ': ' + m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.items() | list | length }}{% endfor %}"
                "{% endfor %}")
    served = Served("m", None, tok, template)  # type: ignore[arg-type]
    ok = [{"role": "user", "content": None}, {"role": "assistant", "content": None}]
    assert render_chat(served, ok) == "user: assistant: "
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    with pytest.raises(TemplateError) as err:
        render_chat(served, bad)
    assert err.value.field == "messages[1].tool_calls"
    assert "Error" not in str(err.value) and "str object" not in str(err.value)
