"""LFM2's chat template and tool-call format: what the template writes, that the parser reads it back, and that
the forced-call grammar takes only calls that parse and validate."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

import conftest_lfm25  # noqa: F401  (the plugin's source on sys.path)
from lfm2_tokenizer import lfm2_tokenizer

from tandem_core.server.grammar import Grammars
from tandem_core.server.parse import Collected
from tandem_core.server.template import render_chat
from tandem_core.serving import Served
from tandem_lfm25.toolcall import Lfm2CallParser
from tandem_lfm25.serving import plugin_template
from tandem_lfm25.toolformat import call_grammar, render_calls, render_tools

TEMPLATE = plugin_template()
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read <a> file",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 24},
                                          "offset": {"type": "integer", "minimum": 0, "maximum": 9999},
                                          "follow": {"type": "boolean"}},
                                          "required": ["path"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 16}, "mode": {"type": "string", "enum": ["fast", "deep"]},
        "langs": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "cursor": {"type": ["string", "null"], "maxLength": 8},
        "filters": {"type": "object", "properties": {"ext": {"type": "string", "maxLength": 4}},
                    "additionalProperties": False}},
        "required": ["query", "mode"]}}},
]
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {
        "path": 'src/"ü"\\a\n.py', "offset": 10, "follow": True}}},
    {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {
        "query": "x", "mode": "deep", "langs": ["py", "日本"], "cursor": None, "filters": {"ext": ".py"}}}},
]


@pytest.fixture(scope="module")
def tok():
    return lfm2_tokenizer()


def served(tok) -> Served:
    return Served("m", None, tok, TEMPLATE)  # type: ignore[arg-type]


def test_the_template_writes_lfm2s_format(tok):
    msgs = [{"role": "developer", "content": "Be <brief>."},
            {"role": "user", "content": [{"type": "text", "text": "Read it."}]},
            {"role": "assistant", "content": None, "tool_calls": [
                dict(CALLS[0], function=dict(CALLS[0]["function"],
                                             arguments=json.dumps(CALLS[0]["function"]["arguments"])))]},
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "assistant", "content": "It prints 1."},
            {"role": "user", "content": "Thanks"}]
    text = render_chat(served(tok), msgs, tools=TOOLS)
    tools_json = ", ".join(json.dumps(t["function"], ensure_ascii=False) for t in TOOLS)
    assert text == (
        "<|startoftext|><|im_start|>system\nBe <brief>.\nList of tools: [" + tools_json + "]<|im_end|>\n"
        "<|im_start|>user\nRead it.<|im_end|>\n"
        "<|im_start|>assistant\n" + render_calls(CALLS[:1]) + "<|im_end|>\n"
        "<|im_start|>tool\nprint(1)<|im_end|>\n"
        "<|im_start|>assistant\nIt prints 1.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render_tools(TOOLS) in text
    assert render_chat(served(tok), msgs[1:2]) == "<|startoftext|><|im_start|>user\nRead it.<|im_end|>\n" \
                                                 "<|im_start|>assistant\n"


def test_the_template_and_render_calls_write_calls_alike(tok):
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Both.", "tool_calls": CALLS}]
    text = render_chat(served(tok), msgs, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n" + render_calls(CALLS) + "Both.<|im_end|>\n")
    assert render_calls(CALLS).startswith('<|tool_call_start|>[read_file(path="src/\\"ü\\"\\\\a\\n.py", offset=10, '
                                          'follow=True), search(query="x", mode="deep", langs=["py", "日本"], '
                                          'cursor=None, filters={"ext": ".py"})]')


def test_what_the_template_writes_parses_back_to_the_calls():
    p = Lfm2CallParser(TOOLS, id_prefix="t")
    got = Collected().add(p.feed(render_calls(CALLS) + "Both.") + p.finish())
    assert got.content == "Both." and not got.malformed
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS]


def _walk(g: Grammars, tok, lark: str, text: str) -> bool:
    """Whether the grammar takes ``text`` token by token and is then done."""
    c = g.constraint(lark)
    for i in tok.encode(text):
        if not c.allowed(tok.vocab_size)[i]:
            return False
        c.advance(i)
    return c.done()


def _lark(g: Grammars, parallel: bool = True) -> str:
    return "\n".join(["start: call", *call_grammar(TOOLS, g.literal, parallel)])


def test_the_grammar_takes_the_format_and_refuses_other_text(tok):
    g = Grammars(tok, tok.eos_token_ids)
    lark = _lark(g)
    assert _walk(g, tok, lark, render_calls(CALLS))
    assert _walk(g, tok, lark, render_calls(CALLS[1:]))
    assert not _walk(g, tok, _lark(g, parallel=False), render_calls(CALLS))       # one call only
    assert not _walk(g, tok, lark, "Hello")                                       # text is refused
    for bad in ['[read_file(offset=1)]', '[read_file(path="a", path="b")]', '[delete(path="a")]',
                '[search(query="x", mode="slow")]', '[read_file(path="a", follow=true)]',
                '[read_file(path="\\u0041")]', '[read_file( path="a")]']:
        assert not _walk(g, tok, lark, "<|tool_call_start|>" + bad + "<|tool_call_end|>"), bad


@pytest.mark.parametrize("seed", range(6))
def test_random_tokens_under_the_grammar_make_a_call_that_parses_and_validates(tok, seed):
    g = Grammars(tok, tok.eos_token_ids)
    c = g.constraint(_lark(g))
    rng = random.Random(seed)
    ids = []
    while not c.done():
        allowed = c.allowed(tok.vocab_size).nonzero().reshape(-1).tolist()
        assert allowed and len(ids) < 2000
        ids.append(rng.choice(allowed))
        c.advance(ids[-1])
    text = tok.decode(ids)
    p = Lfm2CallParser(TOOLS, id_prefix="t")
    got = Collected().add(p.feed(text) + p.finish())
    assert not got.malformed and got.content == "" and got.tool_calls, text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in got.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
