"""The output parser's rules, one at a time: schema typing, malformed calls, whitespace, reasoning."""

from __future__ import annotations

import json

import pytest

from tandem_core.server.parse import (
    Collected, Content, Malformed, OutputParser, Reasoning, ToolCallArgs, ToolCallBegin, ToolCallEnd,
    parse_complete, think_open_at_end,
)


def _tool(name: str, props: dict) -> dict:
    params = {"type": "object", "properties": props}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _xml(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _args(text: str, tools: list | None, fmt: str = "qwen_xml") -> list[dict]:
    parsed = parse_complete(text, fmt, False, False, tools)
    return [json.loads(c.arguments) for c in parsed.tool_calls]


TYPED = [
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " -7 ", -7),
    ({"type": "integer"}, "3.0", 3),
    ({"type": "integer"}, "many", "many"),
    ({"type": "number"}, "2.5e3", 2500.0),
    ({"type": "number"}, "12", 12),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "false", False),
    ({"type": "null"}, "null", None),
    ({"type": ["integer", "null"]}, "None", None),
    ({"type": ["integer", "null"]}, "5", 5),
    ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ({"type": "object"}, "{'a': True, 'b': None}", {"a": True, "b": None}),
    ({"type": "array"}, "[1, \"x\"]", [1, "x"]),
    ({"type": "array"}, "not a list", "not a list"),
    ({"type": "string"}, "007", "007"),
    ({"type": "string"}, "true", "true"),
    ({"type": "string"}, "  padded  ", "  padded  "),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": ["string", "null"]}, "text", "text"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "9", 9),
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"enum": ["a", "b"]}, "b", "b"),
    ({}, "17", 17),
    ({}, "[1, 2]", [1, 2]),
    ({}, "plain words", "plain words"),
]


@pytest.mark.parametrize("schema,text,want", TYPED, ids=[f"{s}-{t}" for s, t, _ in TYPED])
def test_xml_values_are_typed_by_the_schema(schema: dict, text: str, want: object) -> None:
    tools = [_tool("f", {"p": schema})]
    assert _args(_xml("f", {"p": text}), tools) == [{"p": want}]


def test_unknown_parameter_and_schemaless_values_are_best_effort() -> None:
    tools = [_tool("f", {"known": {"type": "string"}})]
    got = _args(_xml("f", {"known": "12", "extra": "12", "words": "a b", "flag": "true"}), tools)
    assert got == [{"known": "12", "extra": 12, "words": "a b", "flag": True}]


def test_an_integer_arrives_as_a_json_number_in_the_deltas() -> None:
    tools = [_tool("read", {"path": {"type": "string"}, "limit": {"type": "integer"}})]
    p = OutputParser("qwen_xml", False, False, tools, id_prefix="x")
    events = p.feed(_xml("read", {"path": "a.py", "limit": "100"})) + p.finish()
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert end == [ToolCallEnd(0, '{"path": "a.py", "limit": 100}')]


def test_value_newlines_belong_to_the_format_once() -> None:
    tools = [_tool("w", {"s": {"type": "string"}})]
    text = "<tool_call>\n<function=w>\n<parameter=s>\n\nline\n\n</parameter>\n</function>\n</tool_call>"
    assert _args(text, tools) == [{"s": "\nline\n"}]
    tight = "<tool_call><function=w><parameter=s>x</parameter></function></tool_call>"
    assert _args(tight, tools) == [{"s": "x"}]
    empty = "<tool_call>\n<function=w>\n<parameter=s>\n</parameter>\n</function>\n</tool_call>"
    assert _args(empty, tools) == [{"s": ""}]


def test_function_without_parameters_has_empty_arguments() -> None:
    text = "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    parsed = parse_complete(text, "qwen_xml", False, False, [_tool("now", {})])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("now", "{}")]


def test_missing_function_close_is_closed_by_the_block_end() -> None:
    text = "<tool_call>\n<function=now>\n<parameter=tz>\nUTC\n</parameter>\n</tool_call>\nok"
    parsed = parse_complete(text, "qwen_xml", False, False, None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("now", {"tz": "UTC"})]
    assert parsed.content == "ok"


def test_call_without_closing_block_tag_at_the_end_is_complete() -> None:
    """Generation stopped right after ``</function>`` (a stop token): the call is whole."""
    text = "<tool_call>\n<function=now>\n</function>\n"
    parsed = parse_complete(text, "qwen_xml", False, False, None)
    assert [c.name for c in parsed.tool_calls] == ["now"]


def test_other_body_form_is_read_too() -> None:
    """A model whose native form is XML sometimes writes the JSON form: ``qwen_xml`` reads both. ``hermes_json``
    is the JSON form only (Qwen's XML body is the Qwen plugin's): an XML body there is malformed, kept as text."""
    json_body = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    xml_body = _xml("f", {"x": "1"})
    assert _args(json_body, None, "qwen_xml") == [{"x": 1}]
    reasons: list[str] = []
    parsed = parse_complete(xml_body, "hermes_json", False, False, None, on_malformed=reasons.append)
    assert parsed.tool_calls == [] and parsed.content == xml_body
    assert reasons == ["tool call body is not a JSON object"]


def test_format_none_reads_no_calls() -> None:
    text = _xml("f", {"x": "1"})
    parsed = parse_complete(text, "none", False, False, None)
    assert parsed.tool_calls == [] and parsed.content == text


MALFORMED = [
    ("unknown xml function", _xml("nope", {"a": "1"}), "qwen_xml", "unknown function name"),
    ("unknown json function", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "hermes_json",
     "unknown function name"),
    ("json does not parse", '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',
     "hermes_json",
     "tool call JSON does not parse"),
    ("json without name", '<tool_call>\n{"arguments": {}}\n</tool_call>', "hermes_json",
     "tool call JSON has no function name"),
    ("json args not object", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "hermes_json",
     "tool call arguments are not a JSON object"),
    ("empty call", "<tool_call>\n</tool_call>", "qwen_xml", "empty tool call"),
    ("prose in call", "<tool_call>\nI will call f\n</tool_call>", "qwen_xml",
     "tool call body is neither <function=...> nor a JSON object"),
    ("text between parameters", "<tool_call>\n<function=f>\nhmm\n</function>\n</tool_call>", "qwen_xml",
     "unexpected text between parameters"),
    ("duplicate parameter",
     _xml("f", {"a": "1"}).replace("</function>", "<parameter=a>\n2\n</parameter>\n</function>"),
     "qwen_xml", "parameter given twice"),
    ("name not closed", "<tool_call>\n<function=f\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
     "qwen_xml", "function name is not closed by '>'"),
    ("unclosed value", "<tool_call>\n<function=f>\n<parameter=a>\nvalue never closed", "qwen_xml",
     "tool call not closed"),
    ("unclosed json", '<tool_call>\n{"name": "f", "arguments": {"a": "x', "hermes_json",
     "tool call not closed"),
]


@pytest.mark.parametrize("what,text,fmt,reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_calls_are_reported_and_kept_as_content(what: str, text: str, fmt: str,
                                                          reason: str) -> None:
    tools = [_tool("f", {"a": {"type": "integer"}})]
    seen: list[str] = []
    parsed = parse_complete("Before.\n\n" + text + "\n\nAfter.", fmt, False, False, tools,
                            on_malformed=seen.append)
    assert seen == [reason]
    assert parsed.tool_calls == []
    assert text in parsed.content
    assert parsed.content.startswith("Before.") and parsed.content.endswith("After.")


def test_a_begun_call_that_turns_malformed_is_void_and_its_index_is_not_reused() -> None:
    tools = [_tool("f", {"a": {"type": "string"}})]
    bad = "<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\noops\n</function>\n</tool_call>"
    good = _xml("f", {"a": "y"})
    p = OutputParser("qwen_xml", False, False, tools, id_prefix="v")
    events = p.feed(bad + "\n" + good) + p.finish()
    begins = [e for e in events if isinstance(e, ToolCallBegin)]
    assert [b.index for b in begins] == [0, 1]
    assert [e.index for e in events if isinstance(e, ToolCallEnd)] == [1]
    mal = events.index(Malformed("unexpected text between parameters"))
    raw = events[mal + 1]
    assert isinstance(raw, Content) and raw.text.startswith("<tool_call>\n<function=f>")
    got = Collected().add(events)
    assert [(c.index, json.loads(c.arguments)) for c in got.tool_calls] == [(1, {"a": "y"})]
    assert bad in got.content


def test_whitespace_next_to_tags_is_the_formats() -> None:
    text = "\n\n  Reasoning line.\n\n</think>\n\n  Answer:\n\n  indented\n\n" + _xml("f", {}) + "\n\n"
    parsed = parse_complete(text, "qwen_xml", True, True, None)
    assert parsed.reasoning == "Reasoning line."
    assert parsed.content == "Answer:\n\n  indented"
    plain = parse_complete("Hello\n\n  world \n", "qwen_xml", False, False, None)
    assert plain.content == "Hello\n\n  world \n"


def test_reasoning_opens_only_at_the_start() -> None:
    opened = parse_complete("\n<think>\nhmm\n</think>\n\nYes.", "none", True, False, None)
    assert (opened.reasoning, opened.content) == ("hmm", "Yes.")
    late = parse_complete("Yes. <think>hmm</think>", "none", True, False, None)
    assert (late.reasoning, late.content) == ("", "Yes. <think>hmm</think>")
    again = parse_complete("<think>\nhmm</think>Yes.", "none", True, True, None)
    assert (again.reasoning, again.content) == ("hmm", "Yes.")
    off = parse_complete("<think>hmm</think>Yes.", "none", False, False, None)
    assert (off.reasoning, off.content) == ("", "<think>hmm</think>Yes.")


def test_reasoning_streams_as_deltas() -> None:
    p = OutputParser("qwen_xml", True, True, None)
    assert p.feed("First") == [Reasoning("First")]
    assert p.feed(" step, ") == [Reasoning(" step,")]
    assert p.feed("second</th") == [Reasoning(" second")]
    assert p.feed("ink>\n\nDone") == [Content("Done")]
    assert p.finish() == []


def test_think_open_at_end() -> None:
    assert think_open_at_end("<|im_start|>assistant\n<think>\n")
    assert not think_open_at_end("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_open_at_end("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_argument_deltas_always_add_up() -> None:
    tools = [_tool("f", {"s": {"type": "string"}, "n": {"type": "number"}})]
    p = OutputParser("qwen_xml", False, False, tools)
    text = _xml("f", {"s": 'quote " backslash \\ tab \t nl\n end', "n": "-0.5"})
    events: list = []
    for ch in text:
        events += p.feed(ch)
    events += p.finish()
    deltas = "".join(e.delta for e in events if isinstance(e, ToolCallArgs))
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert deltas == end.arguments
    assert json.loads(end.arguments) == {"s": 'quote " backslash \\ tab \t nl\n end', "n": -0.5}
    (begin,) = [e for e in events if isinstance(e, ToolCallBegin)]
    assert begin.id.startswith("call_") and begin.name == "f"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="tool_format"):
        OutputParser("xml", False, False, None)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        OutputParser("qwen_xml", False, False, [{"type": "function"}])
    p = OutputParser("none", False, False, None)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


def _collect(pieces: list[str], fmt: str, tools: list | None) -> tuple:
    p = OutputParser(fmt, False, False, tools, id_prefix="s")
    events: list = []
    for piece in pieces:
        events += p.feed(piece)
    got = Collected().add(events + p.finish())
    return got.content, got.reasoning, got.tool_calls, got.malformed


@pytest.mark.parametrize("what,text,fmt,reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_results_do_not_depend_on_the_split(what: str, text: str, fmt: str, reason: str) -> None:
    tools = [_tool("f", {"a": {"type": "integer"}})]
    closed = text.endswith("</tool_call>")  # else the call swallows whatever follows
    good = _xml("f", {"a": "1"}) if fmt == "qwen_xml" else '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    full = "Before.\n\n" + text + ("\n\nAfter. " + good if closed else "")
    whole = _collect([full], fmt, tools)
    assert whole[3] == [reason] and len(whole[2]) == (1 if closed else 0)
    for k in range(len(full) + 1):
        assert _collect([full[:k], full[k:]], fmt, tools) == whole, f"split at {k}"


def test_long_values_in_small_pieces() -> None:
    """A long typed value and a long JSON body, fed 3 chars at a time (kept as pieces, joined once)."""
    big = {"rows": [{"id": i, "text": f"line {i} <x> ü"} for i in range(1500)]}
    tools = [_tool("write", {"data": {"type": "object"}, "body": {"type": "string"}})]
    body = "y\n" * 20_000
    xml = _xml("write", {"data": json.dumps(big), "body": body})
    hermes = '<tool_call>\n{"name": "write", "arguments": ' + json.dumps({"data": big}) + "}\n</tool_call>"
    for fmt, text in (("qwen_xml", xml), ("hermes_json", hermes)):
        got = _collect([text[i:i + 3] for i in range(0, len(text), 3)], fmt, tools)
        args = json.loads(got[2][0].arguments)
        assert args["data"] == big
        assert fmt == "hermes_json" or args["body"] == body


def test_reasoning_tags_are_the_models() -> None:
    """A plugin whose model writes other tags (``Served.think_tags``) gets its block read the same way, split
    anywhere; ``<think>`` is then plain text."""
    tags = ("<|reason|>", "<|/reason|>")
    text = "  <|reason|>\nWhy <think> here?\n<|/reason|>\n\nThe answer."
    whole = parse_complete(text, "none", True, False, None, think_tags=tags)
    assert (whole.reasoning, whole.content) == ("Why <think> here?", "The answer.")
    for k in range(len(text) + 1):
        p = OutputParser("none", True, False, None, think_tags=tags)
        got = Collected().add(p.feed(text[:k])).add(p.feed(text[k:])).add(p.finish())
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), k
    assert think_open_at_end("<|im_start|>assistant\n<|reason|>\n", tags)
    assert not think_open_at_end("<|im_start|>assistant\n<think>\n", tags)
