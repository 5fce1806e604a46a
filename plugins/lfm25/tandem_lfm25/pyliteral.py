"""Python literals as LFM2 writes them in a tool call's arguments, read into JSON values.

LFM2 writes a call's arguments as Python keyword arguments (``f(path="a.py", n=3, ok=True)``)
and, since LiquidAI's templates render a mapping argument as JSON, sometimes JSON constants
inside them (``{"deep": true}``). ``literal(text)`` reads one value of either kind:

- strings in single, double or triple quotes (``r``/``u`` prefixes too), with Python's escapes;
  a raw newline or tab inside a one-line string (which LFM2 writes, and Python refuses) is
  read as itself;
- numbers (``-3``, ``0.5``, ``1e-3``), ``True``/``False``/``None`` and ``true``/``false``/``null``;
- lists and tuples (both a JSON array), dicts (a JSON object; a non-string key becomes its text).

Anything else (a name, a call, an operator) is ``LiteralError``: a call's arguments are data.

``StringDecoder`` decodes one string literal's body as it arrives, so a string argument can
stream; it holds back an escape until it is complete.
"""

from __future__ import annotations

import ast
import math
from typing import Any

__all__ = ["LiteralError", "literal", "StringDecoder", "QUOTES"]

QUOTES = ("'", '"')
_CONSTANTS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f",
           "v": "\v"}


class LiteralError(ValueError):
    """The text is not a literal value (the reason names no text)."""


def _sanitise(text: str) -> str:
    """``text`` with raw control characters inside one-line string literals escaped (Python refuses them)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in QUOTES:
            triple = text.startswith(ch * 3, i)
            q = ch * 3 if triple else ch
            j = i + len(q)
            out.append(q)
            while j < n and not text.startswith(q, j):
                c = text[j]
                if c == "\\" and j + 1 < n:
                    out.append(text[j:j + 2])
                    j += 2
                    continue
                out.append(c if triple or c not in "\n\r\t" else repr(c)[1:-1])
                j += 1
            out.append(text[j:j + len(q)])
            i = j + len(q)
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise LiteralError("a dict unpacking is not a literal")
            key = _value(k)
            out[key if isinstance(key, str) else str(key)] = _value(v)
        return out
    raise LiteralError(f"{type(node).__name__} is not a literal")


def literal(text: str) -> Any:
    """One Python (or JSON) literal value -> the JSON value it is."""
    try:
        tree = ast.parse(_sanitise(text.strip()), mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise LiteralError("not a Python literal") from exc
    value = _value(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise LiteralError("a non-finite number has no JSON form")
    return value


class StringDecoder:
    """The body of one string literal (after its opening quote), decoded piece by piece.

    ``feed(text)`` returns ``(decoded, consumed, closed)``: the characters decoded from the start
    of ``text``, how many of its characters were read (the closing quote included when ``closed``),
    and whether the literal closed. Unread characters (an escape or a closing triple quote not yet
    complete) are to be fed again with what follows. ``final`` reads what is left as it stands.
    """

    def __init__(self, quote: str, raw: bool = False) -> None:
        self.quote = quote          # "'" / '"' or a triple of either
        self.raw = raw

    def feed(self, text: str, final: bool = False) -> tuple[str, int, bool]:
        out: list[str] = []
        q, i, n = self.quote, 0, len(text)
        while i < n:
            if text.startswith(q, i):
                return "".join(out), i + len(q), True
            if len(q) == 3 and q.startswith(text[i:]) and not final:
                break                                   # maybe the closing triple quote
            ch = text[i]
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            got, used = self._escape(text, i, final)
            if used == 0:
                break                                   # an escape not yet complete
            out.append(got)
            i += used
        return "".join(out), i, False

    def _escape(self, text: str, i: int, final: bool) -> tuple[str, int]:
        """The escape at ``text[i] == "\\"``: (its characters, chars read), (``""``, 0) when incomplete."""
        rest = text[i + 1:]
        if not rest:
            return ("\\", 1) if final else ("", 0)
        c = rest[0]
        if self.raw:                                    # r'...': the backslash stays; it still escapes a quote
            return "\\" + c, 2
        if c == "\n":
            return "", 2                                # a line continuation
        if c in _SIMPLE:
            return _SIMPLE[c], 2
        if c in "01234567":
            digits = c
            for d in rest[1:3]:
                if d not in "01234567":
                    break
                digits += d
            if len(digits) < 3 and len(rest) == len(digits) and not final:
                return "", 0                            # more octal digits may follow
            return chr(int(digits, 8)), 1 + len(digits)
        width = {"x": 2, "u": 4, "U": 8}.get(c)
        if width is not None:
            hexa = rest[1:1 + width]
            if len(hexa) < width and not final:
                return "", 0
            try:
                if len(hexa) == width:
                    return chr(int(hexa, 16)), 2 + width
            except ValueError:
                pass
            return "\\" + c, 2                          # not a valid escape: kept as written
        if c == "N":
            close = rest.find("}")
            if rest[1:2] != "{" and (len(rest) > 1 or final):
                return "\\N", 2
            if close < 0:
                return ("\\N", 2) if final else ("", 0)
            import unicodedata

            try:
                return unicodedata.lookup(rest[2:close]), 2 + close
            except KeyError:
                return "\\N", 2
        return "\\" + c, 2                              # an unknown escape keeps its backslash (as Python)
