"""Forced calls and json_schema answers close within their budget whatever the logits: random draws over
what the grammar allows, at budgets from tight to generous, always end complete, parse, validate against the
request's own schema, and never take more tokens than the budget."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import build_tokenizer  # noqa: E402

from tandem_core.server.bounds import LADDER, tighten, worst_bytes  # noqa: E402
from tandem_core.server.grammar import Grammars  # noqa: E402
from tandem_core.server.parse import parse_complete  # noqa: E402
from tandem_core.tokenizer import HFTokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "string", "enum": ["c", "f"]},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "days"]}}}
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string", "minLength": 1}, "line": {"type": "integer", "minimum": 1},
        "scale": {"type": "number"}, "dry": {"type": "boolean"},
        "opts": {"type": "object", "properties": {"mode": {"type": ["string", "null"]}}},
        "extra": {"type": "object"}},
    "required": ["path", "line"]}}}
SCHEMAS = [
    WEATHER["function"]["parameters"],
    EDIT["function"]["parameters"],
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "uniqueItems": True,
                                                "items": {"type": "integer"}}}, "required": ["items"]},
    {"$defs": {"p": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"anyOf": [{"type": "integer"},
                                                                                 {"type": "string"}]}},
     "required": ["a", "b"]},
]


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer(build_tokenizer(), eos_tokens=["<|im_end|>"])


def draw(tok, grammars: Grammars, lark: str, budget: int, seed: int) -> tuple[str, int, bool]:
    """Uniform random tokens among those the grammar allows, as the decode loop takes them (it stops once only
    a stop can follow): (text, tokens, ended complete)."""
    rng = random.Random(seed)
    c = grammars.constraint(lark)
    ids: list[int] = []
    while len(ids) < budget:
        allowed = c.allowed(tok.vocab_size).nonzero().flatten().tolist()
        t = rng.choice(allowed)
        c.advance(t)
        if t in tok.eos_token_ids:
            return tok.decode(ids), len(ids) + 1, True
        ids.append(t)
        if c.done():
            return tok.decode(ids), len(ids), True
    return tok.decode(ids), len(ids), False


@pytest.mark.parametrize("budget", [80, 128, 256, 1024])
@pytest.mark.parametrize("fmt", ["hermes_json", "qwen_xml"])
@pytest.mark.parametrize("think", ["none", "maybe"])
def test_forced_calls_close_within_the_budget_from_random_logits(tok, fmt, think, budget):
    g = Grammars(tok, tok.eos_token_ids)
    tools = [WEATHER, EDIT]
    schemas = {"get_weather": WEATHER["function"]["parameters"], "edit": EDIT["function"]["parameters"]}
    for parallel in (True, False):
        lark = g.tool_grammar(tools, fmt, think, parallel, budget)
        for seed in range(6):
            text, n, complete = draw(tok, g, lark, budget, seed)
            assert complete and n <= budget, (fmt, think, budget, parallel, seed, text[-120:])
            got = parse_complete(text, fmt, think != "none", False, tools)
            assert got.tool_calls and not got.content.strip(), text[-200:]
            assert parallel or len(got.tool_calls) == 1
            for call in got.tool_calls:
                args = json.loads(call.arguments)
                jsonschema.validate(args, schemas[call.name])
                assert len(args) == len(set(args))


@pytest.mark.parametrize("budget", [64, 200, 2000])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["weather", "edit", "unique", "refs"])
def test_json_schema_answers_close_within_the_budget_from_random_logits(tok, schema, budget):
    g = Grammars(tok, tok.eos_token_ids)
    lark = g.json_grammar(schema, "none", budget)
    for seed in range(5):
        text, n, complete = draw(tok, g, lark, budget, seed)
        assert complete and n <= budget, (budget, seed, text[-120:])
        jsonschema.validate(json.loads(text), schema)


def test_the_bounded_schema_is_tighter_and_its_worst_size_holds(tok):
    """tighten keeps the schema's own limits when they are tighter, bounds what it left free, and the longest
    answer it admits is what worst_bytes says (every string at its longest, of 4-byte characters)."""
    s = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}, "t": {"type": "string"},
                                          "a": {"type": "array", "items": {"type": "integer"}}},
         "required": ["s", "t", "a"]}
    b = LADDER[8]
    t = tighten(s, b)
    assert t["properties"]["s"]["maxLength"] == 3 and t["properties"]["t"]["maxLength"] == b.string
    assert t["properties"]["a"]["maxItems"] == b.items and t["additionalProperties"] is False
    longest = {"s": "😀" * 3, "t": "😀" * b.string, "a": [-(10 ** 15 - 1)] * b.items}
    jsonschema.validate(longest, t)
    assert len(json.dumps(longest, ensure_ascii=False).encode()) <= worst_bytes(t)


def test_a_recursive_schema_is_refused_naming_why(tok):
    from tandem_core.server.grammar import GrammarError

    g = Grammars(tok, tok.eos_token_ids)
    tree = {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
            "$ref": "#/$defs/n"}
    with pytest.raises(GrammarError, match="recursive"):
        g.json_grammar(tree, "none", 256)
