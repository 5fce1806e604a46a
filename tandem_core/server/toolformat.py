"""Tool-call formats: how a model writes a call, as a grammar for forced calls and as text for the prompt.

A ``ToolFormat`` gives, for the OpenAI function tools of a request:

- ``call_rules(tools, lit, bounds)``: Lark rules defining the rule ``call`` (one call, from the
  opening tag to the closing one) and the most UTF-8 bytes one call can take under ``bounds``
  (``tandem_core.server.bounds``). Arguments follow each tool's schema, bounded, so a forced call
  always parses, validates and closes. ``lit(text)`` writes a tag as Lark (the special token when
  the tokenizer has it as one).
- ``render_calls(calls)``: an assistant's OpenAI ``tool_calls`` (arguments as objects) written
  as the model writes them, for a chat template that never reads ``tool_calls``;
- ``render_tools(tools)``: the system text that lists the tools and the format, for a chat
  template that never reads ``tools``.

``hermes_json`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and ``qwen_xml``
(``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``) are the
two the server knows; ``tool_format(name)`` looks one up.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Protocol, Sequence

from tandem_core.server.bounds import Bounds, json_rule, raw_string_bytes, tighten, worst_bytes

__all__ = ["ToolFormat", "HermesJson", "QwenXml", "FORMATS", "tool_format", "schema_types"]

Lit = Callable[[str], str]


class ToolFormat(Protocol):
    name: str

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]: ...

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str: ...

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str: ...


def _tool_lines(tools: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def _lit_bytes(text: str) -> int:
    return len(text.encode())


def _params(fn: Mapping[str, Any]) -> dict[str, Any]:
    p = fn.get("parameters")
    return dict(p) if isinstance(p, Mapping) else {"type": "object", "properties": {}}


class HermesJson:
    """``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2.5, SmolLM...)."""

    name = "hermes_json"

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]:
        variants = []
        for t in tools:
            fn = t["function"]
            variants.append({"type": "object", "properties": {
                "name": {"const": fn["name"]}, "arguments": _params(fn)},
                "required": ["name", "arguments"], "additionalProperties": False})
        body = tighten(variants[0] if len(variants) == 1 else {"anyOf": variants}, bounds)
        open_, close = lit("<tool_call>"), lit("</tool_call>")
        rules = [f"call: {open_} ws body ws {close}", "body: " + json_rule(body)]
        return rules, _lit_bytes("<tool_call></tool_call>") + 4 + worst_bytes(body)

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n" + _tool_lines(tools) +
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        out = []
        for c in calls:
            fn = c.get("function") or {}
            body = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            out.append("<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>")
        return "\n".join(out)


def schema_types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows, or None when it does not say."""
    if not isinstance(schema, Mapping):
        return None
    got: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        got.add(t)
    elif isinstance(t, list):
        got.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            got.update(schema_types(sub) or ())
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    if not got and values:
        got.update(_json_type(v) for v in values)
    return got or None


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


class QwenXml:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``
    (Qwen3-Coder, Qwen3.5): a string value is raw text, any other value JSON."""

    name = "qwen_xml"
    _END = "\n</parameter>"

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]:
        rules, names, worst = [], [], 0
        for i, t in enumerate(tools):
            fn = t["function"]
            params = tighten(_params(fn), bounds)
            props = params.get("properties") or {}
            required = set(params.get("required") or ())
            head = f"<function={fn['name']}>\n"
            seq, size = [], _lit_bytes(head + "</function>")
            for j, (pname, pschema) in enumerate(props.items()):
                opener = f"<parameter={pname}>\n"
                value, vbytes = self._value(f"v{i}_{j}", pschema, bounds)
                rules.extend(value)
                rules.append(f"p{i}_{j}: " + json.dumps(opener, ensure_ascii=False) + f" v{i}_{j} \"\\n\"")
                seq.append(f"p{i}_{j}" + ("" if pname in required else "?"))
                size += _lit_bytes(opener) + vbytes + _lit_bytes(self._END) + 1
            names.append(f"f{i}")
            rules.append(f"f{i}: " + json.dumps(head, ensure_ascii=False) + f" {' '.join(seq)} \"</function>\"")
            worst = max(worst, size)
        open_, close = lit("<tool_call>"), lit("</tool_call>")
        rules.append(f"call: {open_} ws ({' | '.join(names)}) ws {close}")
        return rules, _lit_bytes("<tool_call></tool_call>") + 4 + worst

    def _value(self, rule: str, schema: Any, bounds: Bounds) -> tuple[list[str], int]:
        """A parameter's value then ``\\n</parameter>``: raw text for a string, else JSON by its schema."""
        end = json.dumps(self._END)
        types = schema_types(schema) or {"string"}
        values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else []) \
            if isinstance(schema, Mapping) else []
        if values and all(isinstance(v, str) for v in values):
            alts = " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
            return [f"{rule}: ({alts}) {end}"], max(_lit_bytes(v) for v in values)
        if "string" in types and not values:
            s = schema if isinstance(schema, Mapping) else {}
            lo, chars = int(s.get("minLength", 0)), int(s.get("maxLength", bounds.string))
            return [f"{rule}[suffix={end}]: /(?s:.{{{lo},{chars}}})/"], raw_string_bytes(chars)
        return [f"{rule}: {json_rule(schema)} {end}"], worst_bytes(schema)

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + _tool_lines(tools) +
                "\n</tools>\n\nIf you choose to call a function, reply in the following format:\n<tool_call>\n"
                "<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n"
                "</function>\n</tool_call>")

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        out = []
        for c in calls:
            fn = c.get("function") or {}
            args = fn.get("arguments")
            lines = [f"<function={fn.get('name')}>"]
            for k, v in (args.items() if isinstance(args, Mapping) else ()):
                text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                lines += [f"<parameter={k}>", text, "</parameter>"]
            lines.append("</function>")
            out.append("<tool_call>\n" + "\n".join(lines) + "\n</tool_call>")
        return "\n".join(out)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesJson(), QwenXml())}


def tool_format(name: str) -> ToolFormat | None:
    """The format named ``name``, or None (``"none"``: the model writes no calls)."""
    return FORMATS.get(name)
