"""Qwen's tool-call format, ``qwen_xml``: registered through ``tandem_tool_formats`` by this plugin.

``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`` (Qwen3-Coder,
Qwen3.5, and the families that write it: Flash-Next). The parser is the core's ``TaggedCalls`` with this
plugin's XML body (``tandem_qwen38.xmlcall``) and the core's JSON body, which Qwen models write too; the
grammar of a forced call writes a string value as raw text and any other value as JSON by its schema; the
prompt text is Qwen3.5's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tandem_core.server.bounds import Bounds, json_rule, raw_string_bytes, tighten, worst_bytes
from tandem_core.server.parsing.tagged import CALL_CLOSE, CALL_OPEN, JsonBody, TaggedCalls
from tandem_core.server.toolformat import Lit, lit_bytes, params_schema, schema_types, tool_lines

from tandem_qwen38.xmlcall import XmlBody

__all__ = ["QwenXml"]


class QwenXml:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``
    (Qwen3-Coder, Qwen3.5): a string value is raw text, any other value JSON."""

    name = "qwen_xml"

    def parser(self, tools: Sequence[Mapping[str, Any]] | None, *, id_prefix: str | None = None,
               keep_malformed: bool = True) -> TaggedCalls:
        """Both body forms: a model whose native form is XML sometimes writes the JSON one."""
        return TaggedCalls([XmlBody(), JsonBody()], tools, id_prefix=id_prefix, keep_malformed=keep_malformed)
    _END = "\n</parameter>"

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]:
        rules, names, worst = [], [], 0
        for i, t in enumerate(tools):
            fn = t["function"]
            params = tighten(params_schema(fn), bounds)
            props = params.get("properties") or {}
            required = set(params.get("required") or ())
            head = f"<function={fn['name']}>\n"
            seq, size = [], lit_bytes(head + "</function>")
            for j, (pname, pschema) in enumerate(props.items()):
                opener = f"<parameter={pname}>\n"
                value, vbytes = self._value(f"v{i}_{j}", pschema, bounds)
                rules.extend(value)
                rules.append(f"p{i}_{j}: " + json.dumps(opener, ensure_ascii=False) + f" v{i}_{j} \"\\n\"")
                seq.append(f"p{i}_{j}" + ("" if pname in required else "?"))
                size += lit_bytes(opener) + vbytes + lit_bytes(self._END) + 1
            names.append(f"f{i}")
            rules.append(f"f{i}: " + json.dumps(head, ensure_ascii=False) + f" {' '.join(seq)} \"</function>\"")
            worst = max(worst, size)
        open_, close = lit(CALL_OPEN), lit(CALL_CLOSE)
        rules.append(f"call: {open_} ws ({' | '.join(names)}) ws {close}")
        return rules, lit_bytes(CALL_OPEN + CALL_CLOSE) + 4 + worst

    def _value(self, rule: str, schema: Any, bounds: Bounds) -> tuple[list[str], int]:
        """A parameter's value then ``\\n</parameter>``: raw text for a string, else JSON by its schema."""
        end = json.dumps(self._END)
        types = schema_types(schema) or {"string"}
        values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else []) \
            if isinstance(schema, Mapping) else []
        if values and all(isinstance(v, str) for v in values):
            alts = " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
            return [f"{rule}: ({alts}) {end}"], max(lit_bytes(v) for v in values)
        if "string" in types and not values:
            s = schema if isinstance(schema, Mapping) else {}
            lo, chars = int(s.get("minLength", 0)), int(s.get("maxLength", bounds.string))
            return [f"{rule}[suffix={end}]: /(?s:.{{{lo},{chars}}})/"], raw_string_bytes(chars)
        return [f"{rule}: {json_rule(schema)} {end}"], worst_bytes(schema)

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + tool_lines(tools) +
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
