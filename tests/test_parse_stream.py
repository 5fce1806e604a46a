"""The output parser gives the same result however the text is split.

Each case is a realistic model output with the result it must parse to; it is
fed whole, split at every single boundary, char by char, and in random pieces,
and every way must give the expected content, reasoning, calls and malformed
reasons.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from tandem_core.server.parse import (
    Collected, Content, Malformed, OutputParser, Reasoning, ToolCallArgs, ToolCallBegin, ToolCallEnd,
    parse_complete,
)

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"},
        "replace_all": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "langs": {"type": "array"},
        "threshold": {"type": "number"}, "cursor": {"type": ["string", "null"]}}}}},
]


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    fmt: str
    reasoning: bool
    think_in_prompt: bool
    content: str
    thought: str
    calls: tuple[tuple[str, dict], ...]
    malformed: tuple[str, ...] = ()
    tools: bool = True


EDIT_OLD = 'if a < b and c > d:\n    return "<tag>"\n'
EDIT_NEW = "if a <= b:\n\n    return '</parameter' + \"x\"\n  \n"

CASES = [
    Case(
        "xml-reasoning-two-calls",
        "The user wants the file.\nI'll read it first.\n</think>\n\nLet me look at the file.\n\n"
        "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
        "<parameter=offset>\n10\n</parameter>\n<parameter=limit>\n200\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n</function>\n</tool_call>",
        "qwen_xml", True, True,
        "Let me look at the file.",
        "The user wants the file.\nI'll read it first.",
        (("read_file", {"path": "src/main.py", "offset": 10, "limit": 200}),
         ("read_file", {"path": "README.md"})),
    ),
    Case(
        "xml-multiline-values-with-tags",
        "<tool_call>\n<function=edit>\n<parameter=path>\nsrc/ü/日本.py\n</parameter>\n"
        f"<parameter=old>\n{EDIT_OLD}\n</parameter>\n<parameter=new>\n{EDIT_NEW}\n</parameter>\n"
        "<parameter=replace_all>\nfalse\n</parameter>\n</function>\n</tool_call>",
        "qwen_xml", True, False,
        "", "",
        (("edit", {"path": "src/ü/日本.py", "old": EDIT_OLD, "new": EDIT_NEW, "replace_all": False}),),
    ),
    Case(
        "xml-typed-nested-json-unicode",
        "<think>\nNeed a search 🔍 — über-fast.\n</think>\n\n"
        "<tool_call>\n<function=search>\n<parameter=query>\nwhere is \"main\" défini? 🐍\n</parameter>\n"
        "<parameter=filters>\n{\"ext\": [\".py\", \".pyi\"], \"depth\": {\"max\": 3, \"follow\": true}}"
        "\n</parameter>\n"
        "<parameter=langs>\n[\"py\", \"日本語\"]\n</parameter>\n<parameter=threshold>\n0.75\n</parameter>\n"
        "<parameter=cursor>\nnull\n</parameter>\n</function>\n</tool_call>\n\nSearching now.",
        "qwen_xml", True, False,
        "Searching now.",
        "Need a search 🔍 — über-fast.",
        (("search", {"query": 'where is "main" défini? 🐍',
                     "filters": {"ext": [".py", ".pyi"], "depth": {"max": 3, "follow": True}},
                     "langs": ["py", "日本語"], "threshold": 0.75, "cursor": None}),),
    ),
    Case(
        "xml-parallel-in-one-block",
        "Two reads.\n<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n</function>\n"
        "<function=read_file>\n<parameter=path>\nb.py\n</parameter>\n</function>\n</tool_call>",
        "qwen_xml", False, False,
        "Two reads.", "",
        (("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})),
    ),
    Case(
        "xml-no-tools-best-effort",
        "<tool_call>\n<function=anything>\n<parameter=n>\n42\n</parameter>\n"
        "<parameter=s>\nhello <world>\n</parameter>\n"
        "<parameter=o>\n{\"k\": [1, 2.5, null]}\n</parameter>\n</function>\n</tool_call>",
        "qwen_xml", False, False,
        "", "",
        (("anything", {"n": 42, "s": "hello <world>", "o": {"k": [1, 2.5, None]}}),),
        tools=False,
    ),
    Case(
        "hermes-reasoning-parallel",
        "Checking both files.\n</think>\n\nReading them.\n<tool_call>\n"
        "{\"name\": \"read_file\", \"arguments\": {\"path\": \"a <b>.py\", \"limit\": 5}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x}\\\"y\", "
        "\"filters\": {\"nested\": {\"deep\": [1, {\"z\": \"</tool_call>\"}]}}}}\n</tool_call>",
        "hermes_json", True, True,
        "Reading them.",
        "Checking both files.",
        (("read_file", {"path": "a <b>.py", "limit": 5}),
         ("search", {"query": 'x}"y', "filters": {"nested": {"deep": [1, {"z": "</tool_call>"}]}}})),
    ),
    Case(
        "hermes-arguments-first-and-string-args",
        "<tool_call>\n{\"arguments\": {\"path\": \"ü.txt\"}, \"name\": \"read_file\"}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"read_file\", \"arguments\": \"{\\\"path\\\": \\\"b\\\"}\"}\n</tool_call>",
        "hermes_json", False, False,
        "", "",
        (("read_file", {"path": "ü.txt"}), ("read_file", {"path": "b"})),
    ),
    Case(
        "content-only-with-lookalike-tags",
        "Use <tool> or <think carefully> and a<b; x </thinking> <tool_cal not a call. 日本語 ✓\n\nDone.",
        "qwen_xml", True, False,
        "Use <tool> or <think carefully> and a<b; x </thinking> <tool_cal not a call. 日本語 ✓\n\nDone.", "",
        (),
    ),
    Case(
        "unclosed-reasoning",
        "Thinking about <tool_call> inside the block\nand it never ends </thin",
        "qwen_xml", True, True,
        "", "Thinking about <tool_call> inside the block\nand it never ends </thin",
        (),
    ),
    Case(
        "malformed-unknown-function-then-good-call",
        "Try.\n\n<tool_call>\n<function=delete_everything>\n<parameter=path>\n/\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n</function>\n</tool_call>",
        "qwen_xml", False, False,
        "Try.\n\n<tool_call>\n<function=delete_everything>\n<parameter=path>\n/\n</parameter>\n</function>\n"
        "</tool_call>",
        "",
        (("read_file", {"path": "x"}),),
        ("unknown function name",),
    ),
    Case(
        "malformed-bad-json-and-unclosed",
        "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"<oops}}\n</tool_call>"
        "\nAfter.\n"
        "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"half",
        "hermes_json", False, False,
        "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"<oops}}\n</tool_call>"
        "\nAfter.\n"
        "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"half",
        "",
        (),
        ("tool call JSON: unexpected character outside a string", "tool call not closed"),
    ),
]


def _result(events: list) -> tuple:
    got = Collected().add(events)
    calls = tuple((c.name, json.loads(c.arguments)) for c in got.tool_calls)
    raw_args = tuple(c.arguments for c in got.tool_calls)
    return got.content, got.reasoning, calls, tuple(got.malformed), raw_args


def _parser(case: Case) -> OutputParser:
    return OutputParser(case.fmt, case.reasoning, case.think_in_prompt, TOOLS if case.tools else None,
                        id_prefix="t")


def _feed(case: Case, pieces: list[str]) -> tuple:
    p = _parser(case)
    events: list = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return _result(events)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_text_parses_to_the_expected_result(case: Case) -> None:
    content, thought, calls, malformed, raw_args = _feed(case, [case.text])
    assert (content, thought, calls, malformed) == (case.content, case.thought, case.calls, case.malformed)
    for raw in raw_args:
        assert isinstance(json.loads(raw), dict)
    parsed = parse_complete(case.text, case.fmt, case.reasoning, case.think_in_prompt,
                            TOOLS if case.tools else None, id_prefix="t")
    assert (parsed.content, parsed.reasoning) == (case.content, case.thought)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == list(case.calls)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_split_point_gives_the_same_result(case: Case) -> None:
    whole = _feed(case, [case.text])
    for k in range(len(case.text) + 1):
        assert _feed(case, [case.text[:k], case.text[k:]]) == whole, f"split at {k}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_char_by_char_and_random_pieces_give_the_same_result(case: Case) -> None:
    whole = _feed(case, [case.text])
    assert _feed(case, list(case.text)) == whole
    rng = random.Random(case.id)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(case.text)), rng.randint(1, min(12, len(case.text) - 1))))
        pieces = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(case.text)])]
        assert _feed(case, pieces) == whole, f"cuts {cuts}"


def test_arguments_stream_while_the_call_is_written() -> None:
    """Deltas arrive before the call ends: a string value streams inside its parameter."""
    case = CASES[1]
    p = _parser(case)
    stop = case.text.index("return '</parameter'")  # in the middle of the "new" value
    events: list = []
    for ch in case.text[:stop]:
        events += p.feed(ch)
    begins = [e for e in events if isinstance(e, ToolCallBegin)]
    assert [b.name for b in begins] == ["edit"]
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    sofar = "".join(e.delta for e in events if isinstance(e, ToolCallArgs))
    assert sofar.startswith('{"path": "src/ü/日本.py", "old": ')
    assert sofar.endswith('"new": "if a <= b:\\n\\n    ')
    deltas_before = sum(isinstance(e, ToolCallArgs) for e in events)
    assert deltas_before > 20  # char by char: many deltas, not one at the end
    for ch in case.text[stop:]:
        events += p.feed(ch)
    events += p.finish()
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(end) == 1
    assert "".join(e.delta for e in events if isinstance(e, ToolCallArgs)) == end[0].arguments


def test_hermes_arguments_stream_while_the_call_is_written() -> None:
    case = CASES[5]
    p = _parser(case)
    stop = case.text.index("deep")
    events: list = []
    for ch in case.text[:stop]:
        events += p.feed(ch)
    second = [e for e in events if isinstance(e, ToolCallArgs) and e.index == 1]
    assert "".join(e.delta for e in second) == '{"query": "x}\\"y", "filters": {"nested": {"'
    assert len([e for e in events if isinstance(e, ToolCallEnd)]) == 1


def test_held_back_text_is_released_once_decided() -> None:
    p = OutputParser("qwen_xml", True, False, None)
    assert p.feed("  <thi") == []
    assert p.feed("s is text <tool") == [Content("<this is text")]
    assert p.feed("box>") == [Content(" <toolbox>")]
    assert p.feed(" <") == []
    assert p.finish() == [Content(" <")]


def test_events_carry_no_duplicates_when_tags_are_split() -> None:
    p = OutputParser("qwen_xml", True, True, TOOLS, id_prefix="t")
    events: list = []
    for piece in ["Plan", "</", "think", ">\n\n", "Ok", "<tool", "_call>\n<func", "tion=read_file>\n<param",
                  "eter=limit>\n", "1", "2\n</param", "eter>\n</function>\n</tool_call>"]:
        events += p.feed(piece)
    events += p.finish()
    assert events == [
        Reasoning("Plan"), Content("Ok"), ToolCallBegin(0, "call_t_0", "read_file"), ToolCallArgs(0, "{"),
        ToolCallArgs(0, '"limit": '), ToolCallArgs(0, "12}"), ToolCallEnd(0, '{"limit": 12}'),
    ]
    assert not any(isinstance(e, Malformed) for e in events)
