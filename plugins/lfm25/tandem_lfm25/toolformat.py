"""LFM2's tool-call format, ``lfm2_pythonic``: ``<|tool_call_start|>[f(a="x", n=3)]<|tool_call_end|>``.

``Lfm2Pythonic`` is the format the plugin registers through ``tandem_tool_formats`` (``plugin.py``):
its ``parser`` is ``tandem_lfm25.toolcall.Lfm2CallParser``; ``call_rules`` the bounded grammar of one
forced call (``tandem_core.server.bounds``: the arguments' free parts limited so the call closes within
the request's budget); ``render_calls`` and ``render_tools`` below.

- ``render_calls(calls)``: an assistant's OpenAI ``tool_calls`` (arguments as objects) written as
  the plugin's chat template writes them (``chat_template.jinja``): strings double-quoted (a JSON
  string is a Python string literal), ``True``/``False``/``None``, numbers, lists and dicts as JSON
  (which LFM2 reads and ``Lfm2CallParser`` parses);
- ``render_tools(tools)``: the system prompt's ``List of tools: [...]`` (the functions as JSON);
- ``call_grammar(tools, lit, parallel)``: Lark (llguidance) for a forced call, unbounded: the call markers,
  one call (or a list of them when ``parallel``) of the given tools, keyword arguments in the
  schema's order, required ones always and optional ones at most once, each value typed by its
  schema: a string or a number as ``%json`` of its schema (both are Python literals), a boolean as
  ``True``/``False``, null as ``None``, an object or an array as ``%json`` (JSON constants inside,
  as the template writes them). ``lit(text)`` writes a marker as Lark (the special token when the
  tokenizer has it as one: ``tandem_core.server.grammar.Grammars.literal``).

What the grammar accepts, the parser reads as a call whose arguments validate against the schema.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from tandem_core.server.bounds import Bounds, tighten, worst_bytes
from tandem_core.server.toolformat import lit_bytes, params_schema

from tandem_lfm25.toolcall import CALL_END, CALL_START, Lfm2CallParser

__all__ = ["NAME", "Lfm2Pythonic", "render_calls", "render_tools", "call_grammar", "py_value"]

NAME = "lfm2_pythonic"
Lit = Callable[[str], str]
# JSON as llguidance writes it inside a call: no free whitespace, and only the escapes that mean the same in a
# Python string literal (no \\u escapes, no \\/), so the call is Python and the parser reads the value JSON meant
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
            "json_allowed_escapes": 'nrbtf\\"'}


def py_value(value: Any) -> str:
    """One argument value as the template writes it."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    return json.dumps(value, ensure_ascii=False)


def render_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    out = []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments")
        if isinstance(args, Mapping):
            inner = ", ".join(f"{k}={py_value(v)}" for k, v in args.items())
        else:
            inner = str(args or "")
        out.append(f"{fn.get('name')}({inner})")
    return CALL_START + "[" + ", ".join(out) + "]" + CALL_END


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    fns = [t.get("function", t) for t in tools]
    return "List of tools: [" + ", ".join(json.dumps(f, ensure_ascii=False) for f in fns) + "]"


def _types(schema: Any) -> set[str]:
    t = schema.get("type") if isinstance(schema, Mapping) else None
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _value_rule(rule: str, schema: Any) -> list[str]:
    """The Lark rule ``rule`` for one argument value of ``schema``: its JSON part (a string, a number, an
    object, an array, or anything when the schema names no type) as compact ``%json``, a boolean as
    ``True``/``False``, null as ``None``."""
    s = dict(schema) if isinstance(schema, Mapping) else {}
    types = _types(s)
    rest = {k: v for k, v in s.items() if k != "type"}
    rest["x-guidance"] = _COMPACT
    alts = []
    others = sorted(types - {"boolean", "null"})
    if not types:
        alts.append("%json " + json.dumps(rest, ensure_ascii=False))
    elif others:
        one = dict(rest, type=others[0] if len(others) == 1 else others)
        alts.append("%json " + json.dumps(one, ensure_ascii=False))
    if "boolean" in types:
        alts.append('"True" | "False"')
    if "null" in types:
        alts.append('"None"')
    return [f"{rule}: " + " | ".join(alts)]


def _joined(items: list[tuple[str, bool]]) -> str:
    """Lark for ``items`` (rule, required) in order, each present or (when optional) not, joined by ``", "``."""

    def tail(k: int) -> str:                       # after something was written
        if k == len(items):
            return ""
        rule, required = items[k]
        rest = tail(k + 1)
        piece = f'", " {rule}' if required else f'(", " {rule})?'
        return (piece + " " + rest).strip()

    def head(k: int) -> str:                       # nothing written yet
        if k == len(items):
            return ""
        rule, required = items[k]
        first = (rule + " " + tail(k + 1)).strip()
        if required:
            return first
        other = head(k + 1)
        return f"({first} | {other})" if other else f"({first})?"

    return head(0)


def _functions(tools: Sequence[Mapping[str, Any]], bounds: Bounds | None) -> tuple[list[str], list[str], int]:
    """(Lark rules, the rule of each function's call, the most UTF-8 bytes one call takes) for ``tools``; each
    function's parameters ``tighten``-ed by ``bounds`` (None: as the schema gives them; then the size is 0)."""
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    rules, names, worst = [], [], 0
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = params_schema(fn) if bounds is None else tighten(params_schema(fn), bounds)
        props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
        required = set(params.get("required") or ())
        items, size = [], lit_bytes(f"{fn['name']}()")
        for j, (pname, pschema) in enumerate(props.items()):
            rules.extend(_value_rule(f"v{i}_{j}", pschema))
            rules.append(f"a{i}_{j}: " + json.dumps(f"{pname}=", ensure_ascii=False) + f" v{i}_{j}")
            items.append((f"a{i}_{j}", pname in required))
            if bounds is not None:
                size += lit_bytes(f", {pname}=") + worst_bytes(pschema)   # True/False/None: as long as JSON's
        args = _joined(items)
        rules.append(f"f{i}: " + json.dumps(f"{fn['name']}(", ensure_ascii=False) + (f" {args}" if args else "")
                     + ' ")"')
        names.append(f"f{i}")
        worst = max(worst, size)
    return rules, names, worst


def call_grammar(tools: Sequence[Mapping[str, Any]], lit: Lit, parallel: bool = True) -> list[str]:
    """Lark rules defining ``call``: one block of calls of ``tools`` (OpenAI function tools), markers included."""
    rules, names, _ = _functions(tools, None)
    rules.append("one_call: " + " | ".join(names))
    calls = 'one_call (", " one_call)*' if parallel else "one_call"
    rules.append(f'call: {lit(CALL_START)} "[" {calls} "]" {lit(CALL_END)}')
    return rules


class Lfm2Pythonic:
    """LFM2's format as the server uses it: the streaming parser, the forced call's grammar, the prompt text."""

    name = NAME

    def parser(self, tools: Sequence[Mapping[str, Any]] | None, *, id_prefix: str | None = None,
               keep_malformed: bool = True) -> Lfm2CallParser:
        return Lfm2CallParser(tools, id_prefix=id_prefix, keep_malformed=keep_malformed)

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]:
        """``call``: one block holding one call of ``tools``, its arguments bounded; several forced calls are
        several blocks (the parser reads each). The size counts the markers as text (a special token is one
        token, its text several bytes: an overestimate)."""
        rules, names, worst = _functions(tools, bounds)
        rules.append("one_call: " + " | ".join(names))
        rules.append(f'call: {lit(CALL_START)} "[" one_call "]" {lit(CALL_END)}')
        return rules, lit_bytes(CALL_START + "[]" + CALL_END) + worst

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return render_calls(calls)

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return render_tools(tools)
