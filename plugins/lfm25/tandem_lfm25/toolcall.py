"""LFM2's tool calls: a Python list of calls between ``<|tool_call_start|>`` and ``<|tool_call_end|>``.

What the model writes (LiquidAI's model cards and templates)::

    <|tool_call_start|>[read_file(path="src/a.py", limit=200), search(query='x', langs=["py"])]<|tool_call_end|>
    Reading the file first.

``Lfm2CallParser(tools)`` reads the decoded text in pieces of any size (``feed``) and
returns the core's events (``tandem_core.server.parse``): ``Content`` outside the
markers, and for each call ``ToolCallBegin`` once its name and ``(`` are read,
``ToolCallArgs`` deltas of its arguments as a JSON object while they are written, and
``ToolCallEnd`` whose ``arguments`` equals the deltas joined. ``finish`` resolves what
was held back. The result is the same however the text is split: every decision
depends on the text only, and text that may be the start of a marker is held back.

Arguments are Python keyword arguments (``tandem_lfm25.pyliteral``):

- a string literal streams as a JSON string while it is written (escapes decoded), when
  the parameter's schema allows a string or says nothing;
- any other value (a number, ``True``, ``None``, a list, a dict; or a string whose schema
  allows no string) is emitted whole once it ends, typed by the schema where the text
  allows (``"5"`` for an integer parameter is ``5``; ``3`` for a string one is ``"3"``).

Whitespace at the start of the output and next to a marker is the format's, not text.
The brackets may be left out (``<|tool_call_start|>f(x=1)<|tool_call_end|>``). A call that
cannot be read (unknown function when ``tools`` were given, a positional argument, a
parameter given twice, a value that is no literal, the block not closed when the output
ends) is never dropped: ``Malformed(reason)`` (naming no text), then its raw text, from the
whitespace before the marker (or after the last complete call of the block) through
``<|tool_call_end|>``, as ``Content``. A call that had begun gets no ``ToolCallEnd`` then:
its deltas are void and its index is not reused.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable, Mapping, Sequence

from tandem_core.server.parsing.events import (Content, Event, Malformed, ToolCallArgs, ToolCallBegin, ToolCallEnd,
                                              push)
from tandem_core.server.parsing.text import TextParser

from tandem_lfm25.pyliteral import QUOTES, LiteralError, StringDecoder, literal

__all__ = ["CALL_START", "CALL_END", "Lfm2CallParser", "parameter_types"]

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
_NAME_MAX = 256
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_IDENT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_IDENT = _IDENT_START | frozenset("0123456789")
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
               list: "array", dict: "object"}


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, set[str] | None]] | None:
    """Function name -> parameter -> the JSON types its schema allows (None: it does not say); None when
    no tools were given."""
    if not tools:
        return None
    out: dict[str, dict[str, set[str] | None]] = {}
    for n, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{n}]: no function name")
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = {k: _types(v) for k, v in (props.items() if isinstance(props, Mapping) else ())}
    return out


def _types(schema: Any) -> set[str] | None:
    if not isinstance(schema, Mapping):
        return None
    got: set[str] = set()
    t = schema.get("type")
    got.update([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            got.update(_types(sub) or ())
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    got.update(_JSON_TYPES.get(type(v), "object") for v in values)
    return got or None


def _coerce(value: Any, source: str, types: set[str] | None) -> Any:
    """``value`` (read from ``source``) as its parameter's schema types allow."""
    if types is None:
        return value
    kind = _JSON_TYPES.get(type(value))
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.lower() in ("true", "false") and "boolean" in types:
            return s.lower() == "true"
        if s.lower() in ("null", "none") and "null" in types:
            return None
        try:
            number = json.loads(s)
        except ValueError:
            return value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return value
        if isinstance(number, int) and types & {"integer", "number"}:
            return number
        if isinstance(number, float) and "number" in types:
            return number
        return value
    if types == {"string"} and not isinstance(value, (list, dict)):
        return source.strip()
    return value


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


# states
_OUT, _OPEN, _NAME, _ARG, _STRING, _VALUE, _ARG_SEP, _AFTER_CALL, _CLOSE, _PASS = range(10)


class Lfm2CallParser(TextParser):
    """Events for one generation's text (see the module docstring). ``tools``: the request's tools (OpenAI
    form) or None; ``id_prefix``: call ids are ``call_<id_prefix>_<index>`` (random when None);
    ``keep_malformed`` False (a call a grammar forced): a malformed call's raw text is dropped, not content."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, *, id_prefix: str | None = None,
                 keep_malformed: bool = True) -> None:
        self._schemas = parameter_types(tools)
        self._keep_malformed = keep_malformed
        self._prefix = id_prefix if id_prefix is not None else secrets.token_hex(6)
        super().__init__(Content)     # the buffer, and the content's held whitespace (TextParser._text)
        self._state = _OUT
        self._raw: list[str] = []     # the unfinished call's text, for a malformed one
        self._bracketed = False
        self._block_calls = 0         # complete calls in the current block
        self._calls = 0
        self._index = -1
        self._begun = False
        self._name = ""
        self._args: list[str] = []
        self._keys: set[str] = set()
        self._key = ""
        self._decoder: StringDecoder | None = None
        self._value: list[str] = []   # the non-streamed value's text so far
        self._depth = 0
        self._quote = ""              # inside a string of the non-streamed value: its quote
        self._steps: tuple[Callable[[list[Event], bool], bool], ...] = (
            self._out, self._open, self._call_name, self._arg, self._string, self._scan_value, self._arg_sep,
            self._after_call, self._close, self._pass)

    # -- machinery ----------------------------------------------------------------------------------
    def _run(self, out: list[Event], final: bool) -> None:
        while self._steps[self._state](out, final):
            pass

    def _take(self, n: int) -> str:
        got, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(got)
        return got

    def _skip_ws(self) -> None:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._take(n)

    def _goto(self, state: int) -> bool:
        self._state = state
        return True

    def _ended(self, final: bool) -> bool:
        """Nothing to read now: the buffer is empty, or holds what may be the start of ``CALL_END``."""
        return not final and (not self._buf or CALL_END.startswith(self._buf))

    # -- content ------------------------------------------------------------------------------------
    def _out(self, out: list[Event], final: bool) -> bool:
        i = self._buf.find(CALL_START)
        if i < 0:
            keep = 0 if final else _held(self._buf, CALL_START)
            self._text(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._text(out, self._buf[:i])
        self._raw = [self._ws, CALL_START]
        self._ws = ""
        self._buf = self._buf[i + len(CALL_START):]
        return self._goto(_OPEN)

    # -- a block of calls ---------------------------------------------------------------------------
    def _open(self, out: list[Event], final: bool) -> bool:
        """After ``<|tool_call_start|>``: the list's ``[`` (or a call without one)."""
        self._skip_ws()
        self._block_calls = 0
        if self._buf.startswith("["):
            self._take(1)
            self._bracketed = True
            return self._goto(_NAME)
        if self._buf[:1] in _IDENT_START:
            self._bracketed = False
            return self._goto(_NAME)
        if self._buf.startswith(CALL_END):
            return self._malformed(out, "empty tool call")
        return self._stuck(out, final, "tool call is not a list of calls")

    def _call_name(self, out: list[Event], final: bool) -> bool:
        """``NAME(`` (or, in a list, its ``]`` after a trailing comma)."""
        self._skip_ws()
        if self._bracketed and self._buf.startswith("]"):
            if not self._block_calls:
                return self._malformed(out, "empty tool call")
            self._take(1)
            return self._goto(_CLOSE)
        n = 0
        while n < len(self._buf) and self._buf[n] in _NAME_CHARS:
            n += 1
        if n > _NAME_MAX:
            return self._malformed(out, "function name is too long")
        j = n
        while j < len(self._buf) and self._buf[j] in " \t":
            j += 1
        if j == len(self._buf):
            return self._malformed(out, "tool call not closed") if final else False
        if n == 0 or self._buf[j] != "(":
            if self._buf.startswith(CALL_END) or (n == 0 and self._ended(final)):
                return self._malformed(out, "tool call not closed") if not self._ended(final) else False
            return self._malformed(out, "a call is not NAME(arguments)")
        name = self._buf[:n]
        if self._schemas is not None and name not in self._schemas:
            return self._malformed(out, "unknown function name")
        self._take(j + 1)
        self._index, self._calls, self._begun, self._name = self._calls, self._calls + 1, True, name
        push(out, ToolCallBegin(self._index, f"call_{self._prefix}_{self._index}", name))
        self._keys = set()
        self._args = []
        self._arg_delta(out, "{")
        return self._goto(_ARG)

    def _arg(self, out: list[Event], final: bool) -> bool:
        """A keyword argument's ``KEY=`` and the start of its value, or the call's ``)``. Nothing is consumed
        until the value's first characters say its kind (a string, maybe after an ``r``/``u`` prefix, in
        one quote or three, or anything else)."""
        self._skip_ws()
        buf = self._buf
        if buf.startswith(")"):
            self._take(1)
            return self._end_call(out)
        if not buf or buf.startswith(CALL_END):
            return self._malformed(out, "tool call not closed") if final or buf else False
        if buf[0] not in _IDENT_START:
            if self._ended(final):
                return False
            return self._malformed(out, "a positional argument (arguments are KEY=value)")
        n = 1
        while n < len(buf) and buf[n] in _IDENT:
            n += 1
        j = n
        while j < len(buf) and buf[j] in " \t":
            j += 1
        k = j + 1
        while k < len(buf) and buf[k] in " \t":
            k += 1
        quote_at = k + 1 if buf[k:k + 1] in ("r", "R", "u", "U") else k
        look = buf[quote_at:quote_at + 3]
        undecided = (j >= len(buf) or (buf[j] == "=" and k >= len(buf))
                     or (quote_at > k and quote_at >= len(buf))
                     or (look[:1] in QUOTES and len(look) < 3 and look == look[0] * len(look)))
        if undecided and not final:
            return False
        if j >= len(buf) or (buf[j] == "=" and k >= len(buf)):
            return self._malformed(out, "tool call not closed")
        if buf[j] != "=" or buf[j + 1:j + 2] == "=":
            return self._malformed(out, "a positional argument (arguments are KEY=value)")
        key = buf[:n]
        if key in self._keys:
            return self._malformed(out, "parameter given twice")
        is_string = buf[quote_at:quote_at + 1] in QUOTES
        if not is_string:
            quote_at = k                                        # an r/u not before a quote is the value's own
        types = self._types(key)
        comma = ", " if self._keys else ""
        self._keys.add(key)
        self._key = key
        self._take(k)
        if is_string and (types is None or "string" in types):
            q = buf[quote_at]
            triple = buf.startswith(q * 3, quote_at)
            self._take(quote_at - k + (3 if triple else 1))
            self._decoder = StringDecoder(q * 3 if triple else q, raw=buf[k] in "rR" and quote_at > k)
            self._arg_delta(out, comma + json.dumps(key, ensure_ascii=False) + ': "')
            return self._goto(_STRING)
        self._arg_delta(out, comma + json.dumps(key, ensure_ascii=False) + ": ")
        self._value, self._depth, self._quote = [], 0, ""
        return self._goto(_VALUE)

    def _string(self, out: list[Event], final: bool) -> bool:
        """A streamed string value, up to its closing quote."""
        assert self._decoder is not None
        stop = self._buf.find(CALL_END)
        avail = self._buf if stop < 0 else self._buf[:stop]
        hold = 0 if (final or stop >= 0) else _held(avail, CALL_END)
        decoded, used, closed = self._decoder.feed(avail[:len(avail) - hold], final=final or stop >= 0)
        self._take(used)
        if decoded:
            self._arg_delta(out, json.dumps(decoded, ensure_ascii=False)[1:-1])
        if closed:
            self._arg_delta(out, '"')
            self._decoder = None
            return self._goto(_ARG_SEP)
        if stop >= 0 or final:
            return self._malformed(out, "tool call not closed")
        return False

    def _scan_value(self, out: list[Event], final: bool) -> bool:
        """A value emitted whole: read to its end (a ``,`` or ``)`` outside brackets and strings)."""
        i, n = 0, len(self._buf)
        while i < n:
            if self._buf.startswith(CALL_END, i) or (not final and CALL_END.startswith(self._buf[i:])):
                break
            ch = self._buf[i]
            if self._quote:
                if ch == "\\":
                    if i + 1 >= n:
                        break
                    i += 2
                    continue
                if self._buf.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = ""
                    continue
                if len(self._quote) == 3 and self._quote.startswith(self._buf[i:]) and not final:
                    break
                i += 1
                continue
            if ch in QUOTES:
                if i + 3 > n and not final:
                    break                                  # a triple quote or an empty string: wait
                self._quote = ch * 3 if self._buf.startswith(ch * 3, i) else ch
                i += len(self._quote)
                continue
            if ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                if self._depth == 0:
                    if ch != ")":
                        return self._malformed(out, "an argument value is not a literal")
                    break
                self._depth -= 1
            elif ch == "," and self._depth == 0:
                break
            i += 1
        self._value.append(self._take(i))
        at_end = i < n and not self._quote and self._depth == 0 and self._buf[:1] in (",", ")")
        if not at_end:
            if self._buf.startswith(CALL_END) or final:
                return self._malformed(out, "tool call not closed")
            return False
        source = "".join(self._value)
        try:
            value = literal(source)
        except LiteralError:
            return self._malformed(out, "an argument value is not a literal")
        value = _coerce(value, source, self._types(self._key))
        self._arg_delta(out, json.dumps(value, ensure_ascii=False))
        return self._goto(_ARG_SEP)

    def _arg_sep(self, out: list[Event], final: bool) -> bool:
        self._skip_ws()
        if self._buf.startswith(","):
            self._take(1)
            return self._goto(_ARG)
        if self._buf.startswith(")"):
            self._take(1)
            return self._end_call(out)
        return self._stuck(out, final, "unexpected text after an argument")

    def _end_call(self, out: list[Event]) -> bool:
        self._block_calls += 1
        self._arg_delta(out, "}")
        push(out, ToolCallEnd(self._index, "".join(self._args)))
        self._begun = False
        self._raw = []
        return self._goto(_AFTER_CALL)

    def _after_call(self, out: list[Event], final: bool) -> bool:
        self._skip_ws()
        if self._buf.startswith(","):
            self._take(1)
            return self._goto(_NAME)
        if self._bracketed and self._buf.startswith("]"):
            self._take(1)
            return self._goto(_CLOSE)
        if not self._bracketed:
            return self._close(out, final)
        return self._stuck(out, final, "unexpected text after a call")

    def _close(self, out: list[Event], final: bool) -> bool:
        """``<|tool_call_end|>`` after the list."""
        self._skip_ws()
        if self._buf.startswith(CALL_END):
            self._buf = self._buf[len(CALL_END):]
            self._raw = []
            self._lead = True
            return self._goto(_OUT)
        return self._stuck(out, final, "text after the list of calls")

    def _pass(self, out: list[Event], final: bool) -> bool:
        """A malformed call's raw text, as content, through ``<|tool_call_end|>``."""
        i = self._buf.find(CALL_END)
        if i >= 0:
            self._raw_content(out, self._buf[:i + len(CALL_END)])
            self._buf = self._buf[i + len(CALL_END):]
            self._lead = True
            return self._goto(_OUT)
        keep = 0 if final else _held(self._buf, CALL_END)
        self._raw_content(out, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    # -- helpers ------------------------------------------------------------------------------------
    def _types(self, param: str) -> set[str] | None:
        if self._schemas is None:
            return None
        return self._schemas.get(self._name, {}).get(param)

    def _arg_delta(self, out: list[Event], delta: str) -> None:
        self._args.append(delta)
        push(out, ToolCallArgs(self._index, delta))

    def _stuck(self, out: list[Event], final: bool, unexpected: str) -> bool:
        """No expected text here: wait for more (it may be the end marker's start), or the call is not closed
        (the buffer ended, or the end marker came), or ``unexpected`` text is there."""
        if self._ended(final):
            return False
        closed = not self._buf or self._buf.startswith(CALL_END)
        return self._malformed(out, "tool call not closed" if closed else unexpected)

    def _malformed(self, out: list[Event], reason: str) -> bool:
        push(out, Malformed(reason))
        raw = "".join(self._raw)
        self._raw = []
        self._begun = False
        self._decoder = None
        self._raw_content(out, raw)
        return self._goto(_PASS)

    def _raw_content(self, out: list[Event], text: str) -> None:
        if text and self._keep_malformed:
            self._lead = False
            push(out, Content(text))
