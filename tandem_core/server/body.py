"""A request body -> a JSON value, with limits checked before anything recurses into it.

``read_body(raw)`` refuses (``FieldError`` naming the place) what would otherwise reach
the server's code as a Python exception:

- bytes that are not UTF-8 JSON, or JSON with ``NaN``/``Infinity`` (not JSON) or an integer
  past Python's digit limit: ``body``;
- nesting deeper than ``MAX_DEPTH`` arrays/objects (``'[' * 10000`` made ``json.loads`` raise
  ``RecursionError``): scanned on the text first, so the decoder never recurses that deep;
  the message names the path down to where the limit was passed (``response_format.
  json_schema.schema.properties.a...``), and ``param`` its first ``PARAM_PARTS`` parts;
- a lone surrogate (``"\\ud800"`` decodes to a Python string the tokenizer cannot encode): the
  field holding it (``messages[0].content``).

``loads_bounded(text, where)`` applies the same depth limit to JSON text found inside a
request (tool-call arguments sent back as a string).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem_core.server.fields import FieldError

__all__ = ["MAX_DEPTH", "MAX_BODY_BYTES", "read_body", "loads_bounded", "join_path"]

MAX_DEPTH = 64                  # arrays/objects inside one another; a real request nests < 25 (tools' schemas)
MAX_BODY_BYTES = 64 * 1024 * 1024
PARAM_PARTS = 3                 # how much of a deep path ``param`` names (the message has it whole, cut)

# a JSON string token, or one structural character (numbers and literals are not needed for depth)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]', re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")


def join_path(parts: list[str | int]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _too_deep(text: str, where: list[str | int]) -> list[str | int] | None:
    """The path at which ``text`` nests deeper than ``MAX_DEPTH`` (relative to ``where``), or None."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return None
    stack: list[list[Any]] = []          # [kind, key-or-index, expecting-a-key]
    pending: str | None = None
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok[0] == '"':
            if stack and stack[-1][0] == "o" and stack[-1][2]:
                try:
                    pending = json.loads(tok)
                except ValueError:
                    pending = "?"
            continue
        if tok in "[{":
            if len(stack) >= MAX_DEPTH:
                return [*where, *(s[1] for s in stack if s[1] is not None)]
            stack.append(["o", None, True] if tok == "{" else ["a", 0, False])
        elif tok in "]}":
            if stack:
                stack.pop()
        elif tok == ":":
            if stack and stack[-1][0] == "o":
                stack[-1][1], stack[-1][2] = pending, False
        elif stack:  # ","
            if stack[-1][0] == "a":
                stack[-1][1] += 1
            else:
                stack[-1][2] = True
    return None


def loads_bounded(text: str, where: list[str | int]) -> Any:
    """``json.loads`` of ``text`` (found at ``where`` in the request) within the depth limit.
    ``ValueError`` when it is not JSON; ``FieldError`` when it nests too deep."""
    deep = _too_deep(text, where)
    if deep is not None:
        raise _depth_error(deep)
    return json.loads(text, parse_constant=_no_constant)


def _depth_error(path: list[str | int]) -> FieldError:
    param = join_path(path[:PARAM_PARTS]) if path and isinstance(path[0], str) else "body"
    shown = join_path(path[:12]) + ("..." if len(path) > 12 else "")
    return FieldError(param, f"nested deeper than {MAX_DEPTH} levels (at {shown or 'the top'})")


def read_body(raw: bytes) -> Any:
    """The request's JSON value; ``FieldError`` for what the server refuses before reading it."""
    if len(raw) > MAX_BODY_BYTES:
        raise FieldError("body", f"{len(raw)} bytes is more than this server reads ({MAX_BODY_BYTES})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FieldError("body", "not valid JSON (the bytes are not UTF-8)") from None
    try:
        value = loads_bounded(text, [])
    except FieldError:
        raise
    except (ValueError, RecursionError):  # RecursionError cannot come past the scan; kept as a guard
        raise FieldError("body", "not valid JSON") from None
    where = _lone_surrogate(value, [])
    if where is not None:
        raise FieldError(join_path(where) or "body",
                         "contains a lone surrogate (a \\ud800-\\udfff escape without its pair), "
                         "which is not Unicode text")
    return value


def _lone_surrogate(value: Any, path: list[str | int]) -> list[str | int] | None:
    """The path of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE.search(k):
                return path or ["body"]    # a key: the object holding it
            got = _lone_surrogate(v, [*path, k])
            if got is not None:
                return got
    elif isinstance(value, list):
        for i, v in enumerate(value):
            got = _lone_surrogate(v, [*path, i])
            if got is not None:
                return got
    return None
