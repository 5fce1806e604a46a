"""The ``hermes_json`` tool-call format (Hermes, Qwen2.5, SmolLM, Llama's tool templates), the core's default.

``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``: read by the core's
``TaggedCalls`` with the JSON body, forced by a JSON-schema grammar of the call, listed in the
system prompt the way Hermes' template lists tools. Registered through ``tandem_tool_formats``
by ``tandem_core.default_tool_formats``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tandem_core.server.bounds import Bounds, json_rule, tighten, worst_bytes
from tandem_core.server.parsing.tagged import CALL_CLOSE, CALL_OPEN, JsonBody, TaggedCalls
from tandem_core.server.toolformat import Lit, lit_bytes, params_schema, tool_lines

__all__ = ["HermesJson"]


class HermesJson:
    """``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2.5, SmolLM...)."""

    name = "hermes_json"

    def parser(self, tools: Sequence[Mapping[str, Any]] | None, *, id_prefix: str | None = None,
               keep_malformed: bool = True) -> TaggedCalls:
        return TaggedCalls([JsonBody()], tools, id_prefix=id_prefix, keep_malformed=keep_malformed)

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit, bounds: Bounds) -> tuple[list[str], int]:
        variants = []
        for t in tools:
            fn = t["function"]
            variants.append({"type": "object", "properties": {
                "name": {"const": fn["name"]}, "arguments": params_schema(fn)},
                "required": ["name", "arguments"], "additionalProperties": False})
        body = tighten(variants[0] if len(variants) == 1 else {"anyOf": variants}, bounds)
        open_, close = lit(CALL_OPEN), lit(CALL_CLOSE)
        rules = [f"call: {open_} ws body ws {close}", "body: " + json_rule(body)]
        return rules, lit_bytes(CALL_OPEN + CALL_CLOSE) + 4 + worst_bytes(body)

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n" + tool_lines(tools) +
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
