"""JSON schemas made bounded, so a constrained answer can always close within its token budget.

A forced tool call or a ``json_schema`` answer must end complete within ``max_tokens`` even
when the model is weak or its logits random: the guarantee comes from the grammar, never
from the model. llguidance's ``%json`` lets a free string, an array, a number's digits and
the whitespace between tokens grow without end, and it allows any property a schema does
not forbid (a small model repeats keys and never closes). ``tighten(schema, bounds)``
returns a schema that accepts a subset of what the original accepts (every answer still
validates against the original) with a finite longest answer:

- strings without ``enum``/``const`` get ``maxLength`` (at most ``bounds.string`` characters,
  never less than their ``minLength``); arrays get ``maxItems`` (``bounds.items``; one item
  when ``uniqueItems``, which llguidance cannot enforce: one item is unique);
- integers and numbers without bounds get ``±(10**15 - 1)``; numbers without ``multipleOf``
  get ``1e-6`` (llguidance bounds the fraction's digits only through it);
- an object with ``properties`` takes only those (``additionalProperties: false``; llguidance
  writes them once each, in the schema's order, so no key repeats), and only the required ones
  on the tightest rungs (``bounds.optional`` false); a free-form object (no ``properties``)
  holds at most one key of at most ``bounds.key`` word characters (one key cannot repeat);
- ``true`` / ``{}`` (any value) becomes a bounded scalar; ``$ref`` is inlined (a recursive one
  cannot be bounded: ``BoundError``).

``worst_bytes(tightened)`` is the longest compact-JSON answer in UTF-8 bytes. A token is at
least one byte (byte-level BPE; SentencePiece's byte fallback), so it bounds the tokens too.
``COMPACT`` is the ``x-guidance`` block the top-level ``%json`` schema carries: no free
whitespace (one optional space after ``,`` and ``:``, as models write JSON) and no ``\\u`` escapes
escapes (a character is then at most 4 bytes, an escape 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["Bounds", "LADDER", "BoundError", "COMPACT", "KEY_CHARS", "tighten", "worst_bytes", "choose",
           "raw_string_bytes", "json_rule"]

INT_LIMIT = 10 ** 15 - 1        # integers past this are refused by the bounded grammar (JS-safe is 2**53)
FRACTION = 1e-6                 # a number's finest step when the schema names none
KEY_CHARS = 64                  # the longest key of a free-form object
COMPACT = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?",
           "json_allowed_escapes": 'nrbtf\\"'}
SEP = 2                         # the most bytes a separator takes (", " and ": ")
_KEY_PATTERN = "^[A-Za-z0-9_.-]{1,%d}$"
_ANNOTATIONS = {"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                "writeOnly", "$schema", "$id", "$defs", "definitions", "strict"}


class BoundError(ValueError):
    """A schema whose answers cannot be bounded (a recursive ``$ref``)."""


@dataclass(frozen=True)
class Bounds:
    """The free parts' limits: characters of a string (and of a free-form key), items of an array, and whether
    properties the schema does not require may be written (``optional``)."""

    string: int
    items: int
    optional: bool = True

    @property
    def key(self) -> int:
        return max(1, min(KEY_CHARS, self.string))


# most generous first; ``choose`` takes the first whose longest answer fits the budget. Past the rungs that keep
# every property, the optional ones go first (a required value's room matters more than an optional's).
LADDER = (Bounds(2048, 64), Bounds(1024, 32), Bounds(512, 16), Bounds(256, 8), Bounds(128, 8), Bounds(64, 4),
          Bounds(32, 4), Bounds(16, 2), Bounds(64, 2, False), Bounds(32, 2, False), Bounds(16, 1, False),
          Bounds(8, 1, False), Bounds(4, 1, False), Bounds(1, 1, False), Bounds(0, 0, False))


def _any(b: Bounds) -> dict[str, Any]:
    """A bounded "any value": a scalar (a string of at most ``b.string`` characters, a number, a boolean, null)."""
    return {"anyOf": [{"type": "string", "maxLength": b.string},
                      {"type": "integer", "minimum": -INT_LIMIT, "maximum": INT_LIMIT},
                      {"type": "boolean"}, {"type": "null"}]}


def _types(s: Mapping[str, Any]) -> set[str]:
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    got = set()
    if "properties" in s or "additionalProperties" in s or "patternProperties" in s:
        got.add("object")
    if "items" in s or "prefixItems" in s:
        got.add("array")
    return got


def _ref(root: Mapping[str, Any], ref: str) -> Any:
    if not ref.startswith("#/"):
        raise BoundError(f"$ref {ref!r}: only references inside the schema ('#/...') are served")
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise BoundError(f"$ref {ref!r} points at nothing")
        node = node[part]
    return node


def tighten(schema: Any, b: Bounds, root: Any = None, refs: tuple[str, ...] = ()) -> Any:
    """``schema`` (a JSON schema, ``True``/``False`` included) bounded by ``b``; see the module docstring."""
    root = schema if root is None else root
    if schema is True or schema is None:
        return _any(b)
    if schema is False or not isinstance(schema, Mapping):
        return schema
    s = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
    if "$ref" in s:
        ref = s.pop("$ref")
        if ref in refs:
            raise BoundError(f"$ref {ref!r} refers to itself: a recursive schema cannot be bounded")
        target = tighten(_ref(root, ref), b, root, (*refs, ref))
        return target if not s else {"allOf": [target, tighten(s, b, root, refs)]}
    if not s:
        return _any(b)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(s.get(key), list):
            s[key] = [tighten(x, b, root, refs) for x in s[key]]
    if "enum" in s or "const" in s:
        return s
    types = _types(s)
    if "string" in types:
        lo = int(s.get("minLength", 0) or 0)
        s["maxLength"] = max(lo, min(int(s.get("maxLength", b.string)), b.string))
    for t in ("integer", "number"):
        if t in types:
            if "minimum" not in s and "exclusiveMinimum" not in s:
                s["minimum"] = -INT_LIMIT
            if "maximum" not in s and "exclusiveMaximum" not in s:
                s["maximum"] = INT_LIMIT
    if "number" in types and "multipleOf" not in s:
        s["multipleOf"] = FRACTION
    if "array" in types:
        lo = int(s.get("minItems", 0) or 0)
        hi = min(int(s.get("maxItems", b.items)), b.items, 1 if s.pop("uniqueItems", False) else b.items)
        s["maxItems"] = max(lo, hi)
        if isinstance(s.get("prefixItems"), list):
            s["prefixItems"] = [tighten(x, b, root, refs) for x in s["prefixItems"]]
        s["items"] = tighten(s.get("items", True), b, root, refs) if s.get("items") is not False else False
    if "object" in types:
        props = s.get("properties")
        required = set(s.get("required") or ())
        if isinstance(props, Mapping) and props:
            s["properties"] = {k: tighten(v, b, root, refs) for k, v in props.items()
                               if b.optional or k in required}
            s["additionalProperties"] = False
            s.pop("patternProperties", None)
        else:
            s.pop("properties", None)
            extra = s.get("additionalProperties", True)
            s.pop("patternProperties", None)
            s["additionalProperties"] = False
            least = int(s.get("minProperties", 0) or 0)
            if extra is not False and least <= 1 and (b.optional or least == 1 or required):
                s["patternProperties"] = {_KEY_PATTERN % b.key: tighten(extra, b, root, refs)}
                s["maxProperties"] = 1
    if not types and not any(k in s for k in ("anyOf", "oneOf", "allOf")):
        return _any(b)
    return s


def json_rule(schema: Any) -> str:
    """Lark's ``%json`` of a ``tighten``-ed schema, written compact (``COMPACT``)."""
    body = dict(schema) if isinstance(schema, Mapping) else {"anyOf": [schema]}
    body["x-guidance"] = COMPACT
    return "%json " + json.dumps(body, ensure_ascii=False)


def raw_string_bytes(chars: int) -> int:
    """The most UTF-8 bytes ``chars`` characters of raw (unescaped) text take."""
    return 4 * chars


def _number_bytes(s: Mapping[str, Any], fraction: bool) -> int:
    lo = s.get("minimum", s.get("exclusiveMinimum", -INT_LIMIT))
    hi = s.get("maximum", s.get("exclusiveMaximum", INT_LIMIT))
    whole = max(len(str(int(abs(float(lo))))), len(str(int(abs(float(hi)))))) + 1  # and a sign
    if not fraction:
        return whole
    step = s.get("multipleOf", FRACTION)
    digits = len(f"{float(step):.15f}".rstrip("0").split(".")[1]) if float(step) < 1 else 0
    return whole + 1 + digits


def _max(values: Iterable[int]) -> int:
    return max(values, default=0)


def worst_bytes(s: Any) -> int:
    """The longest compact-JSON answer of a ``tighten``-ed schema, in UTF-8 bytes."""
    if s is False:
        return 0
    if not isinstance(s, Mapping):
        return 0
    if "enum" in s or "const" in s:
        values = list(s.get("enum") or ()) + ([s["const"]] if "const" in s else [])
        return _max(len(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()) for v in values)
    if isinstance(s.get("allOf"), list) and s["allOf"]:
        return min(worst_bytes(x) for x in s["allOf"])
    alts = [x for k in ("anyOf", "oneOf") for x in (s.get(k) or ())]
    if alts:
        return _max(worst_bytes(x) for x in alts)
    sizes = []
    for t in _types(s):
        if t == "string":
            sizes.append(2 + 4 * int(s.get("maxLength", 0)))   # a char <= 4 bytes, an escape 2
        elif t == "integer":
            sizes.append(_number_bytes(s, False))
        elif t == "number":
            sizes.append(_number_bytes(s, True))
        elif t == "boolean":
            sizes.append(5)
        elif t == "null":
            sizes.append(4)
        elif t == "array":
            n = int(s.get("maxItems", 0))
            prefix = [worst_bytes(x) for x in (s.get("prefixItems") or ())]
            items = prefix[:n] + [worst_bytes(s.get("items", False))] * max(0, n - len(prefix))
            sizes.append(2 + sum(items) + SEP * max(0, len(items) - 1))
        elif t == "object":
            parts = [len(json.dumps(k, ensure_ascii=False).encode()) + SEP + worst_bytes(v)
                     for k, v in (s.get("properties") or {}).items()]
            for pattern, v in (s.get("patternProperties") or {}).items():
                key = int(pattern.rsplit(",", 1)[1].split("}")[0]) if pattern.endswith("}$") else KEY_CHARS
                parts += [2 + key + SEP + worst_bytes(v)] * int(s.get("maxProperties", 1))
            sizes.append(2 + sum(parts) + SEP * max(0, len(parts) - 1))
    return _max(sizes)


def choose(need: Any, budget: int) -> tuple[Bounds, int]:
    """The most generous rung of ``LADDER`` whose answer fits ``budget`` bytes, and that answer's worst size.

    ``need(bounds) -> bytes`` is the longest answer under those bounds. When even the last rung does not fit
    (the schema itself asks for more: required properties, ``minLength``), the last rung: the answer is then
    as short as the schema allows, and may still not fit."""
    size = 0
    for b in LADDER:
        size = need(b)
        if size <= budget:
            return b, size
    return LADDER[-1], size
