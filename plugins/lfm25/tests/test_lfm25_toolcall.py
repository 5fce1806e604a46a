"""LFM2's Pythonic tool calls: the parser gives the same result however the text is split.

Each case is an output in LFM2's format (the calls LiquidAI's model cards show, and the quirks
LFM2 is known to write: raw newlines inside a one-line string, JSON constants inside a dict,
a trailing comma) with the result it must parse to. It is fed whole, split at every single
character boundary, char by char and in random pieces; every way must give the expected
content, calls and malformed reasons.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

import conftest_lfm25  # noqa: F401  (the plugin's source on sys.path)

from tandem_core.server.parse import Collected, Content, Malformed, ToolCallArgs, ToolCallBegin, ToolCallEnd
from tandem_lfm25.pyliteral import LiteralError, StringDecoder, literal
from tandem_lfm25.toolcall import CALL_END, CALL_START, Lfm2CallParser

S, E = CALL_START, CALL_END
# a coding agent's tools, and the model card's example
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"},
        "replace_all": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "langs": {"type": "array"},
        "threshold": {"type": "number"}, "cursor": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_candidate_status", "parameters": {"type": "object",
        "properties": {"candidate_id": {"type": "string"}}, "required": ["candidate_id"]}}},
]


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str
    calls: tuple[tuple[str, dict], ...]
    malformed: tuple[str, ...] = ()
    tools: bool = True


OLD = 'if a < b and c > d:\n    return "<tag>"\n'
NEW = "if a <= b:\n\n    return '<|x|>' + \"y\" \\ z\n"

CASES = [
    Case("model-card-example",
         f'{S}[get_candidate_status(candidate_id="12345")]{E}Checking the current status of candidate ID 12345.',
         "Checking the current status of candidate ID 12345.",
         (("get_candidate_status", {"candidate_id": "12345"}),)),
    Case("content-then-two-calls-then-content",
         f'Let me look.\n\n{S}[read_file(path="src/main.py", offset=10, limit=200), read_file(path=\'README.md\')]'
         f'{E}\n\nReading both.',
         "Let me look.Reading both.",
         (("read_file", {"path": "src/main.py", "offset": 10, "limit": 200}), ("read_file", {"path": "README.md"}))),
    Case("escapes-unicode-and-marker-like-text",
         f"{S}[edit(path='src/ü/日本.py', old={json.dumps(OLD)}, new={NEW!r}, replace_all=False)]{E}",
         "", (("edit", {"path": "src/ü/日本.py", "old": OLD, "new": NEW, "replace_all": False}),)),
    Case("raw-newline-in-a-one-line-string-and-a-triple-quoted-one",
         f'{S}[edit(path="a.py", old="line one\nline two", new="""x = "1"\n\'\'\'\n""")]{E}',
         "", (("edit", {"path": "a.py", "old": "line one\nline two", "new": 'x = "1"\n\'\'\'\n'}),)),
    Case("typed-values-nested-literals-and-json-constants",
         f"  {S}[search(query='where is \"main\"? 🐍', filters={{'ext': ['.py', '.pyi'], 'depth': {{'max': 3, "
         f"'follow': True}}, \"deep\": true}}, langs=('py', \"日本語\"), threshold=-0.75, cursor=None)]{E}  "
         "Searching now.",
         "Searching now.",
         (("search", {"query": 'where is "main"? 🐍',
                      "filters": {"ext": [".py", ".pyi"], "depth": {"max": 3, "follow": True}, "deep": True},
                      "langs": ["py", "日本語"], "threshold": -0.75, "cursor": None}),)),
    Case("values-typed-by-the-schema",
         f'{S}[read_file(path=123, offset="10", limit=20.0)]{E}',
         "", (("read_file", {"path": "123", "offset": 10, "limit": 20.0}),)),
    Case("no-brackets-trailing-commas-and-raw-strings",
         f'{S}read_file(path=r"C:\\dir\\file.txt",){E}{S}[read_file(path="b", ), ]{E}',
         "", (("read_file", {"path": "C:\\dir\\file.txt"}), ("read_file", {"path": "b"}))),
    Case("no-tools-any-name-and-untyped-values",
         f'{S}[run(cmd="ls -la", timeout=30, env={{"A": "1"}}), noop()]{E}done',
         "done", (("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}}), ("noop", {})), tools=False),
    Case("marker-like-text-is-content",
         "Use <|tool_call_start without the bar, or a <|tag|>; both are text.",
         "Use <|tool_call_start without the bar, or a <|tag|>; both are text.", ()),
    Case("unknown-function",
         f"Sure.{S}[delete_everything(path='/')]{E} Then {S}[read_file(path='a')]{E}",
         f"Sure.{S}[delete_everything(path='/')]{E}Then",
         (("read_file", {"path": "a"}),), ("unknown function name",)),
    Case("positional-argument",
         f"{S}[read_file('a.py')]{E}",
         f"{S}[read_file('a.py')]{E}", (), ("a positional argument (arguments are KEY=value)",)),
    Case("parameter-given-twice-after-a-good-call",
         f"{S}[read_file(path='a'), read_file(path='b', path='c')]{E}ok",
         f", read_file(path='b', path='c')]{E}ok",
         (("read_file", {"path": "a"}),), ("parameter given twice",)),
    Case("value-that-is-not-a-literal",
         f"{S}[read_file(path=os.getcwd())]{E}",
         f"{S}[read_file(path=os.getcwd())]{E}", (), ("an argument value is not a literal",)),
    Case("empty-list",
         f"x {S}[]{E} y", f"x {S}[]{E}y", (), ("empty tool call",)),
    Case("text-after-the-list",
         f"{S}[read_file(path='a')] oops{E}",
         f"] oops{E}", (("read_file", {"path": "a"}),), ("text after the list of calls",)),
    Case("not-closed-when-the-output-ends",
         f"Reading.{S}[read_file(path='a', limit=2",
         f"Reading.{S}[read_file(path='a', limit=2", (), ("tool call not closed",)),
    Case("string-not-closed-before-the-end-marker",
         f"{S}[read_file(path='a){E}after",
         f"{S}[read_file(path='a){E}after", (), ("tool call not closed",)),
]


def _result(events: list) -> tuple:
    got = Collected().add(events)
    calls = tuple((c.name, json.loads(c.arguments)) for c in got.tool_calls)
    return got.content, calls, tuple(got.malformed)


def _feed(case: Case, pieces: list[str]) -> tuple:
    p = Lfm2CallParser(TOOLS if case.tools else None, id_prefix="t")
    events = []
    for piece in pieces:
        events += p.feed(piece)
    return _result(events + p.finish())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_text_parses_to_the_expected_result(case: Case) -> None:
    assert _feed(case, [case.text]) == (case.content, case.calls, case.malformed)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_split_point_gives_the_same_result(case: Case) -> None:
    whole = _feed(case, [case.text])
    for k in range(1, len(case.text)):
        assert _feed(case, [case.text[:k], case.text[k:]]) == whole, f"split at {k}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_split_of_the_utf8_bytes_gives_the_same_result(case: Case) -> None:
    """The detokenizer hands over text, never half a character; a byte split lands between characters."""
    data = case.text.encode()
    whole = _feed(case, [case.text])
    for k in range(1, len(data)):
        head = data[:k].decode("utf-8", errors="ignore")
        assert _feed(case, [head, data[len(head.encode()):].decode()]) == whole, f"byte {k}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_char_by_char_and_random_pieces_give_the_same_result(case: Case) -> None:
    whole = _feed(case, [case.text])
    assert _feed(case, list(case.text)) == whole
    rng = random.Random(case.id)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(case.text)), min(len(case.text) - 1, rng.randrange(1, 8))))
        pieces = [case.text[a:b] for a, b in zip([0] + cuts, cuts + [len(case.text)])]
        assert _feed(case, pieces) == whole, f"cuts {cuts}"


def test_a_string_argument_streams_while_it_is_written() -> None:
    text = f"{S}[edit(path='a.py', old={OLD!r}, new={NEW!r})]{E}"
    p = Lfm2CallParser(TOOLS, id_prefix="t")
    events = []
    cut = text.rindex("return ")                        # inside the new value
    for ch in text[:cut]:
        events += p.feed(ch)
    assert [e.name for e in events if isinstance(e, ToolCallBegin)] == ["edit"]
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    sofar = "".join(e.delta for e in events if isinstance(e, ToolCallArgs))
    assert sofar == '{"path": "a.py", "old": ' + json.dumps(OLD) + ', "new": "if a <= b:\\n\\n    '
    assert sum(isinstance(e, ToolCallArgs) for e in events) > 20
    for ch in text[cut:]:
        events += p.feed(ch)
    events += p.finish()
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(end) == 1 and json.loads(end[0].arguments) == {"path": "a.py", "old": OLD, "new": NEW}
    assert "".join(e.delta for e in events if isinstance(e, ToolCallArgs)) == end[0].arguments


def test_a_malformed_call_voids_its_deltas_and_keeps_its_text() -> None:
    p = Lfm2CallParser(TOOLS, id_prefix="t")
    events = p.feed(f"{S}[read_file(path='a', ") + p.feed("path='b')]") + p.feed(f"{E}next") + p.finish()
    begins = [e for e in events if isinstance(e, ToolCallBegin)]
    assert [(b.index, b.name) for b in begins] == [(0, "read_file")]
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert Malformed("parameter given twice") in events
    assert Collected().add(events).content == f"{S}[read_file(path='a', path='b')]{E}next"
    # the next call takes a new index
    q = Lfm2CallParser(TOOLS, id_prefix="t")
    ev = q.feed(f"{S}[nope(x=1)]{E}{S}[read_file(path='z')]{E}") + q.finish()     # refused before it began
    assert [e.index for e in ev if isinstance(e, ToolCallEnd)] == [0]
    ev = Lfm2CallParser(TOOLS, id_prefix="t")
    got = ev.feed(f"{S}[read_file(path='a', offset=os)]{E}{S}[read_file(path='z')]{E}") + ev.finish()
    assert [e.index for e in got if isinstance(e, ToolCallEnd)] == [1]


def test_held_back_text_is_released_once_decided() -> None:
    p = Lfm2CallParser(TOOLS)
    assert p.feed("  Hi <|tool_") == [Content("Hi")]
    assert p.feed("box|>") == [Content(" <|tool_box|>")]
    assert p.feed(" <|") == []
    assert p.finish() == [Content(" <|")]


@pytest.mark.parametrize("text,value", [
    ("'a\\tb'", "a\tb"), ('"\\x41\\u00e9\\U0001F40D\\N{BULLET}\\101"', "Aé🐍•A"), ("'''x\n'''", "x\n"),
    ("r'\\d+'", "\\d+"), ("-3", -3), ("+2.5e-3", 2.5e-3), ("[1, (2, 3), {'a': None}]", [1, [2, 3], {"a": None}]),
    ("{1: 'x'}", {"1": "x"}), ("{'k': null, 'b': false}", {"k": None, "b": False}), ("'a\nb'", "a\nb"),
])
def test_literals_read_as_python_writes_them(text, value):
    assert literal(text) == value


@pytest.mark.parametrize("text", ["os.getcwd()", "a + b", "x", "float('nan')", "{**d}", "[1, 2", "1e999"])
def test_what_is_not_a_literal_is_refused(text):
    with pytest.raises(LiteralError):
        literal(text)


def test_a_string_decodes_the_same_in_any_pieces():
    body = "a\\tb\\x4\\u00e9\\N{BULLET}\\101\\\nc\\q\"rest"
    whole = StringDecoder('"').feed(body)
    assert whole == ("a\tb\\x4é•Ac\\q", len(body) - 4, True)
    for k in range(body.index('"rest') + 1):
        d = StringDecoder('"')
        first, used, closed = d.feed(body[:k])
        assert not closed
        second, used2, closed2 = d.feed(body[used:])
        assert (first + second, closed2) == (whole[0], True), f"split at {k}"
