"""LFM2's format as the server finds it: registered by the plugin's hook, read through the core's ``OutputParser``
(real-format text split at every character boundary), and forced by the bounded grammar the server compiles for
``tool_choice`` (random tokens under it always make calls that parse, validate and fit the budget)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

import conftest_lfm25  # noqa: F401  (the plugin's source on sys.path)
from lfm2_tokenizer import lfm2_tokenizer

from tandem_core.plugins import register_plugin, registries, unregister_plugin
from tandem_core.server.grammar import Grammars
from tandem_core.server.parse import Collected, OutputParser, ToolCallArgs, parse_complete
from tandem_core.server.toolformat import UnknownToolFormat, tool_format
from tandem_lfm25 import plugin as lfm25_plugin
from tandem_lfm25.toolcall import CALL_END, CALL_START
from tandem_lfm25.toolformat import Lfm2Pythonic

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "offset": {"type": "integer"}, "follow": {"type": "boolean"}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "langs": {"type": "array", "items": {"type": "string"}},
        "cursor": {"type": ["string", "null"]}, "filters": {"type": "object"}},
        "required": ["query"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TEXT = (f'Reading it.\n{CALL_START}[read_file(path="src/ü \\"a\\".py", offset=3, follow=True), '
        f"search(query='x = \"1\"', langs=('py', \"rs\"), cursor=None, filters={{'deep': true}})]{CALL_END}\nDone.")
WANT = [("read_file", {"path": 'src/ü "a".py', "offset": 3, "follow": True}),
        ("search", {"query": 'x = "1"', "langs": ["py", "rs"], "cursor": None, "filters": {"deep": True}})]


@pytest.fixture(scope="module")
def registered():
    """The plugin registered as an installed distribution would be (its hooks, nothing else)."""
    from tandem_core.plugins import load_plugins, plugin_manager

    load_plugins()
    added = plugin_manager().get_plugin("lfm25") is None and not plugin_manager().is_registered(lfm25_plugin)
    if added:
        register_plugin(lfm25_plugin, "lfm25")
    yield
    if added:
        unregister_plugin("lfm25")


def test_the_plugin_registers_its_format_and_the_server_finds_it_by_name(registered):
    assert registries().tool_formats["lfm2_pythonic"] == "tandem_lfm25.toolformat:Lfm2Pythonic"
    assert registries().owners[("tool_format", "lfm2_pythonic")] == "lfm25"
    assert isinstance(tool_format("lfm2_pythonic"), Lfm2Pythonic)
    with pytest.raises(UnknownToolFormat, match=r"'lfm2_json'.*known: .*hermes_json.*lfm2_pythonic"):
        tool_format("lfm2_json")


def _events(pieces: list[str], **kw) -> tuple:
    p = OutputParser("lfm2_pythonic", False, False, TOOLS, id_prefix="t", **kw)
    got = Collected()
    for piece in pieces:
        got.add(p.feed(piece))
    got.add(p.finish())
    return got.content, [(c.name, json.loads(c.arguments)) for c in got.tool_calls], got.malformed


def test_the_output_parser_reads_lfm2_calls_however_the_text_is_split(registered):
    whole = _events([TEXT])
    assert whole == ("Reading it.Done.", WANT, [])  # whitespace next to a marker is the format's
    for k in range(len(TEXT) + 1):
        assert _events([TEXT[:k], TEXT[k:]]) == whole, f"split at {k}"
    assert _events(list(TEXT)) == whole


def test_the_streamed_arguments_are_json_text_deltas(registered):
    """The deltas a client joins are JSON while they stream: a string argument arrives piece by piece."""
    p = OutputParser("lfm2_pythonic", False, False, TOOLS, id_prefix="t")
    deltas: dict[int, list[str]] = {}
    for ch in TEXT:
        for ev in p.feed(ch):
            if isinstance(ev, ToolCallArgs):
                deltas.setdefault(ev.index, []).append(ev.delta)
    assert [json.loads("".join(d)) for _, d in sorted(deltas.items())] == [w[1] for w in WANT]
    assert len(deltas[0]) > len('src/ü "a".py')      # the path streamed a character at a time


def test_a_forced_call_cut_short_leaves_no_markup_in_content(registered):
    cut = TEXT[:TEXT.index("offset")]
    kept = parse_complete(cut, "lfm2_pythonic", False, False, TOOLS)
    assert CALL_START in kept.content and not kept.tool_calls
    assert _events([cut], keep_malformed=False) == ("Reading it.", [], ["tool call not closed"])


@pytest.mark.parametrize("budget,seed", [(24000, 0), (24000, 1), (400, 2), (400, 3), (120, 4), (120, 5)])
def test_random_tokens_under_the_forced_grammar_make_calls_that_validate_within_the_budget(registered, budget,
                                                                                          seed):
    tok = lfm2_tokenizer()
    g = Grammars(tok, tok.eos_token_ids)
    c = g.constraint(g.tool_grammar(TOOLS, "lfm2_pythonic", parallel=True, budget=budget))
    rng = random.Random(seed)
    ids: list[int] = []
    while not c.done():
        allowed = c.allowed(tok.vocab_size).nonzero().reshape(-1).tolist()
        allowed = [i for i in allowed if i not in tok.eos_token_ids] or allowed
        assert allowed and len(ids) < budget, len(ids)
        ids.append(rng.choice(allowed))
        c.advance(ids[-1])
    assert len(ids) + 1 <= budget
    got = Collected().add(OutputParser("lfm2_pythonic", False, False, TOOLS, keep_malformed=False)
                          .feed(tok.decode(ids)))
    assert got.tool_calls and not got.malformed and got.content == ""
    for call in got.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_named_forced_call_takes_that_function_only(registered):
    tok = lfm2_tokenizer()
    g = Grammars(tok, tok.eos_token_ids)
    c = g.constraint(g.tool_grammar(TOOLS[1:], "lfm2_pythonic", parallel=False, budget=300))
    for i in tok.encode(CALL_START + '[read_file(path="a")]'):
        if not c.allowed(tok.vocab_size)[i]:
            break
        c.advance(i)
    else:
        raise AssertionError("the grammar took a call of a function it does not name")
