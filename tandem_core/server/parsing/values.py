"""A parameter's text as the JSON value its schema calls for, and the tools' schemas by function.

``typed(text, types)`` reads a value a format writes as text (an XML parameter's body): by the
JSON types its schema allows (``tandem_core.server.toolformat.schema_types``): integer/number ->
a JSON number, boolean, null, object/array -> parsed JSON (or the Python literal some models
write), string -> the text itself; without a schema, a JSON literal if the text is one, else a
string. ``tool_schemas(tools)`` maps each function name to its parameters' ``properties``.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["no_constant", "tool_schemas", "typed"]

_INT = re.compile(r"-?(?:0|[1-9]\d*)")
_NUM = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """Function name -> its parameters' ``properties``; None when no tools were given."""
    if not tools:
        return None
    out: dict[str, dict[str, Any]] = {}
    for n, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{n}]: no function name")
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def typed(value: str, types: set[str] | None) -> Any:
    """A parameter's text as the JSON value its schema types call for."""
    if types is None:
        return _literal_or_string(value)
    s = value.strip()
    low = s.lower()
    if "null" in types and low in ("null", "none"):
        return None
    if "boolean" in types and low in ("true", "false"):
        return low == "true"
    if "integer" in types:
        if _INT.fullmatch(s):
            return int(s)
        if _NUM.fullmatch(s) and float(s).is_integer() and "number" not in types:
            return int(float(s))
    if "number" in types and _NUM.fullmatch(s):
        return int(s) if _INT.fullmatch(s) else float(s)
    if types & {"object", "array"}:
        parsed = _structured(s)
        if isinstance(parsed, dict) and "object" in types or isinstance(parsed, list) and "array" in types:
            return parsed
    if "string" in types:
        return value
    return _literal_or_string(value)


def _literal_or_string(value: str) -> Any:
    try:
        return json.loads(value, parse_constant=no_constant)
    except ValueError:
        return value


def _structured(s: str) -> Any:
    """JSON, or a Python literal (the single-quoted dicts some models write) that JSON can hold."""
    try:
        return json.loads(s, parse_constant=no_constant)
    except ValueError:
        pass
    try:
        got = ast.literal_eval(s)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    try:
        json.dumps(got, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return got if isinstance(got, (dict, list)) and _all_finite(got) else None


def _all_finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _all_finite(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_all_finite(x) for x in v)
    return True
