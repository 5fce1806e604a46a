"""Tool-call formats: how a model writes a call, read as it streams, forced by a grammar, as prompt text.

A format is a plugin's: the hook ``tandem_tool_formats(register)`` registers it by name
(``register(name, "module:Class")``; the core's ``hermes_json`` through ``tandem_core.default_tool_formats``,
a model family's own through its plugin: ``docs/plugins.md``, section 8). A model's ``Served.tool_format``
names one (or ``"none"``: the model writes no calls); the server finds it only through
``tool_format(name)``, and refuses at start a name nobody registered.

A ``ToolFormat`` gives, for the OpenAI function tools of a request:

- ``parser(tools, id_prefix=..., keep_malformed=...)``: a streaming parser of what the model writes
  after any reasoning block (``feed(text)``, ``finish()`` -> ``tandem_core.server.parsing`` events:
  content, and each call as ``ToolCallBegin``, ``ToolCallArgs`` deltas of its arguments as JSON text,
  ``ToolCallEnd``; a call it cannot read as ``Malformed`` then its raw text as content, or dropped
  when ``keep_malformed`` is False). The events must not depend on how the text is split.
- ``call_rules(tools, lit, bounds)``: Lark rules defining the rule ``call`` (one call, from the
  opening tag to the closing one) and the most UTF-8 bytes one call can take under ``bounds``
  (``tandem_core.server.bounds``). Arguments follow each tool's schema, bounded, so a forced call
  always parses, validates and closes. ``lit(text)`` writes a tag as Lark (the special token when
  the tokenizer has it as one).
- ``render_calls(calls)``: an assistant's OpenAI ``tool_calls`` (arguments as objects) written
  as the model writes them, for a chat template that never reads ``tool_calls``;
- ``render_tools(tools)``: the system text that lists the tools and the format, for a chat
  template that never reads ``tools``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tandem_core.server.bounds import Bounds

__all__ = [
    "NO_CALLS", "CallParser", "Lit", "ToolFormat", "UnknownToolFormat", "known_formats", "lit_bytes",
    "params_schema", "schema_types", "tool_format", "tool_lines",
]

NO_CALLS = "none"   # the name of no format: the model writes no calls
Lit = Callable[[str], str]


class CallParser(Protocol):
    """A format's streaming parser for one output (after its reasoning block)."""

    def feed(self, text: str) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


class ToolFormat(Protocol):
    name: str

    def parser(self, tools: Sequence[Mapping[str, Any]] | None, *, id_prefix: str | None = None,
               keep_malformed: bool = True) -> CallParser: ...

    def call_rules(self, tools: Sequence[Mapping[str, Any]], lit: Lit,
                   bounds: Bounds) -> tuple[list[str], int]: ...

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str: ...

    def render_tools(self, tools: Sequence[Mapping[str, Any]]) -> str: ...


class UnknownToolFormat(ValueError):
    """A model names a tool-call format no installed plugin registered."""


_made: dict[tuple[str, str], ToolFormat] = {}
_lock = threading.Lock()


def known_formats() -> list[str]:
    """The registered formats' names, sorted."""
    from tandem_core.plugins import registries

    return sorted(registries().tool_formats)


def tool_format(name: str) -> ToolFormat | None:
    """The format registered as ``name``; None for ``"none"`` (the model writes no calls).
    ``UnknownToolFormat`` naming the known ones when no plugin registered it."""
    from tandem_core.plugins import import_string, registries

    if name == NO_CALLS:
        return None
    path = registries().tool_formats.get(name)
    if path is None:
        known = ", ".join([*known_formats(), NO_CALLS])
        raise UnknownToolFormat(f"tool_format {name!r} is not registered by any installed plugin; "
                                f"known: {known}")
    with _lock:
        made = _made.get((name, path))
        if made is None:
            obj = import_string(path)
            made = obj() if isinstance(obj, type) else obj
            _made[(name, path)] = made
    return made


# -- helpers a format's grammar and prompt text share ------------------------------------------------

def tool_lines(tools: Sequence[Mapping[str, Any]]) -> str:
    """Each tool as one line of JSON."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def lit_bytes(text: str) -> int:
    return len(text.encode())


def params_schema(fn: Mapping[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` schema (an empty object schema when it gives none)."""
    p = fn.get("parameters")
    return dict(p) if isinstance(p, Mapping) else {"type": "object", "properties": {}}


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
