"""Streaming parser for what a model writes: reasoning, content and tool calls.

``OutputParser(tool_format, reasoning, think_in_prompt, tools)`` reads the
decoded text in pieces of any size (``feed``) and returns typed events;
``finish`` resolves whatever was held back when the output ends. The events for
one output are the same whatever the pieces are (split anywhere, or fed whole):
every decision depends on the text only, and text that merely looks like the
start of a tag (``<``, ``<tool``, ``</thi``) is held back until decided, then
emitted once.

Structure read::

    [<think>] reasoning </think>  content  <tool_call> call </tool_call>  content ...

- reasoning: with ``reasoning=True`` a ``<think>`` block at the very start of
  the output (after whitespace) is reasoning; with ``think_in_prompt=True`` the
  template already opened it and the output starts inside it (a repeated
  ``<think>`` there is dropped). An output that ends inside the block is all
  reasoning.
- a call (``tool_format`` ``"qwen_xml"`` or ``"hermes_json"``; ``"none"`` reads
  no calls) is either body form, whichever the model wrote::

      <tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
      <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

  XML parameter values are typed by the tool's JSON schema (``tools``, OpenAI
  form): integer/number -> JSON number, boolean, null, object/array -> parsed
  JSON, string -> JSON string (streamed as it is written); a parameter without
  a schema gets a JSON literal if the text is one, else a string. One newline
  after ``<parameter=P>`` and one before ``</parameter>`` belong to the format.
  Several ``<function=`` blocks in one ``<tool_call>`` are several calls.
- whitespace next to a tag (after ``<think>``, ``</think>``, ``</tool_call>``
  and at the start of the output; before ``</think>`` and ``<tool_call>``) is the
  format's, not text; other whitespace is kept.

A call streams ``ToolCallBegin`` once its name is known, ``ToolCallArgs``
deltas while its arguments are written, and ``ToolCallEnd`` whose
``arguments`` (a JSON object) equals the concatenated deltas. A malformed call
(bad JSON, unknown function when ``tools`` were given, not closed when the
output ends, unexpected text inside) is never dropped: ``Malformed(reason)``
(the reason names no text) and then the call's raw text, from the whitespace
before ``<tool_call>`` to ``</tool_call>``, as ``Content``. A call that had
begun and then turns out malformed gets no ``ToolCallEnd``: its deltas are void
and its index is not reused. With ``keep_malformed=False`` (a call a grammar forced) the raw
text is dropped instead: the model's markup never reaches content.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

from tandem_core.server.toolformat import schema_types as _schema_types

__all__ = [
    "Content", "Reasoning", "ToolCallBegin", "ToolCallArgs", "ToolCallEnd", "Malformed", "Event",
    "TOOL_FORMATS", "OutputParser", "ToolCall", "Collected", "Parsed", "parse_complete", "think_open_at_end",
]

TOOL_FORMATS = ("qwen_xml", "hermes_json", "none")


@dataclass(frozen=True)
class Content:
    """Answer text (a delta)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text from the ``<think>`` block (a delta)."""

    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    """Call ``index`` (0, 1, ... in this output) named ``name`` has begun."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """The next piece of call ``index``'s arguments JSON."""

    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``index`` is complete; ``arguments`` (a JSON object) is its deltas joined."""

    index: int
    arguments: str


@dataclass(frozen=True)
class Malformed:
    """A call could not be read; ``reason`` names no model text. Its raw text follows as Content."""

    reason: str


Event = Union[Content, Reasoning, ToolCallBegin, ToolCallArgs, ToolCallEnd, Malformed]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_NAME_MAX = 256  # longest function / parameter name read before the call is called malformed

# states
_START, _REASON, _CONTENT, _BODY, _FUNC, _PARAMS, _VALUE_START, _VALUE, _JSON, _AFTER, _PASS = range(11)


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    i = buf.find(tag[0], max(0, len(buf) - len(tag) + 1))
    while i >= 0:
        if tag.startswith(buf[i:]):
            return len(buf) - i
        i = buf.find(tag[0], i + 1)
    return 0


def _could_be(buf: str, *tags: str) -> bool:
    """True when ``buf`` is a proper prefix of one of ``tags`` (more text decides)."""
    return any(len(buf) < len(t) and t.startswith(buf) for t in tags)


class OutputParser:
    """Events for one generation's text, fed in pieces.

    tool_format     ``"qwen_xml"``, ``"hermes_json"`` or ``"none"``
    reasoning       the model writes a ``<think>`` block
    think_in_prompt the prompt ends inside an open ``<think>`` (see ``think_open_at_end``)
    tools           the request's tools (OpenAI form) or None: names a call may use, schemas that type
                    XML parameter values
    id_prefix       call ids are ``call_<id_prefix>_<index>``; random when None
    keep_malformed  a malformed call's raw text becomes Content (False: it is dropped, for a call a grammar
                    forced: its markup never reaches content, even when the budget cut it short)
    """

    def __init__(self, tool_format: str, reasoning: bool, think_in_prompt: bool,
                 tools: Sequence[dict[str, Any]] | None = None, *, id_prefix: str | None = None,
                 keep_malformed: bool = True) -> None:
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format {tool_format!r}: expected one of {', '.join(TOOL_FORMATS)}")
        self.tool_format = tool_format
        self._keep_malformed = keep_malformed
        self._schemas = _tool_schemas(tools)
        self._prefix = id_prefix if id_prefix is not None else secrets.token_hex(6)
        self._buf = ""
        self._seen = 0  # chars at the start of _buf already searched for the awaited tag, none found
        self._done = False
        self._ws = ""  # whitespace held at the end of the current section
        self._lead = True  # the section has emitted nothing yet (leading whitespace is the format's)
        self._kind: type[Content] | type[Reasoning] = Content
        self._think_in_prompt = reasoning and think_in_prompt
        self._state = _START if reasoning else _CONTENT
        # the call being read
        self._calls = 0
        self._index = -1
        self._begun = False
        self._raw: list[str] = []
        self._name = ""
        self._args: list[str] = []
        self._params: set[str] = set()
        self._param = ""
        self._value_parts: list[str] = []  # a typed (not streamed) value read so far
        self._stream_str = False
        self._json: _JsonScan | None = None
        self._steps: tuple[Callable[[list[Event], bool], bool], ...] = (
            self._start, self._reason, self._content, self._body, self._func, self._params_step,
            self._value_start, self._value, self._json_step, self._after, self._pass)  # by state number

    # -- public -------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        """Events decided by ``text`` (and what was held before it)."""
        if self._done:
            raise RuntimeError("OutputParser.feed after finish")
        out: list[Event] = []
        if text:
            self._buf += text
            self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        """Events for what was held back; the output has ended."""
        if self._done:
            return []
        out: list[Event] = []
        self._run(out, final=True)
        if self._ws:
            self._push(out, self._kind(self._ws))
            self._ws = ""
        self._done = True
        return out

    # -- machinery -------------------------------------------------------------------------------

    def _run(self, out: list[Event], final: bool) -> None:
        steps = self._steps
        while steps[self._state](out, final):
            pass

    def _take(self, n: int) -> str:
        """Consume ``n`` chars of the buffer (recorded as the call's raw text inside a call)."""
        got, self._buf = self._buf[:n], self._buf[n:]
        self._seen = 0
        if self._state not in (_START, _REASON, _CONTENT, _PASS):
            self._raw.append(got)
        return got

    def _goto(self, state: int) -> bool:
        self._state = state
        self._seen = 0
        return True

    def _push(self, out: list[Event], ev: Event) -> None:
        last = out[-1] if out else None
        if isinstance(ev, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + ev.text)
        elif isinstance(ev, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + ev.text)
        elif isinstance(ev, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == ev.index:
            out[-1] = ToolCallArgs(ev.index, last.delta + ev.delta)
        else:
            out.append(ev)

    def _text(self, out: list[Event], text: str) -> None:
        """Section text, with the section's leading and trailing whitespace held."""
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        body = text.rstrip()
        if body:
            self._push(out, self._kind(self._ws + body))
            self._ws = text[len(body):]
        else:
            self._ws += text

    def _section(self, kind: type[Content] | type[Reasoning]) -> None:
        """A tag ends the section: its held whitespace was the format's."""
        self._ws = ""
        self._lead = True
        self._kind = kind

    def _until(self, out: list[Event], tag: str, final: bool) -> int:
        """Emit section text up to ``tag``; its index in the buffer when found, else -1."""
        i = self._buf.find(tag, max(0, self._seen - len(tag) + 1))
        if i >= 0:
            self._text(out, self._buf[:i])
            self._buf = self._buf[i:]
            self._seen = 0
            return 0
        keep = 0 if final else _held(self._buf, tag)
        cut = len(self._buf) - keep
        if cut:
            self._text(out, self._buf[:cut])
            self._buf = self._buf[cut:]
        self._seen = len(self._buf)
        return -1

    # -- reasoning and content --------------------------------------------------------------------

    def _start(self, out: list[Event], final: bool) -> bool:
        """Output start with reasoning on: a ``<think>`` here opens the block (or is a repeat of the
        one the prompt opened)."""
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN):]
            self._section(Reasoning)
            return self._goto(_REASON)
        if not final and (not stripped or _could_be(stripped, THINK_OPEN)):
            return False
        if self._think_in_prompt:
            self._section(Reasoning)
            return self._goto(_REASON)
        return self._goto(_CONTENT)

    def _reason(self, out: list[Event], final: bool) -> bool:
        if self._until(out, THINK_CLOSE, final) < 0:
            return False
        self._buf = self._buf[len(THINK_CLOSE):]
        self._section(Content)
        return self._goto(_CONTENT)

    def _content(self, out: list[Event], final: bool) -> bool:
        if self.tool_format == "none":
            if self._buf:
                self._text(out, self._buf)
                self._buf = ""
            return False
        if self._until(out, CALL_OPEN, final) < 0:
            return False
        self._raw = [self._ws, CALL_OPEN]
        self._ws = ""
        self._buf = self._buf[len(CALL_OPEN):]
        return self._goto(_BODY)

    # -- a call ------------------------------------------------------------------------------------

    def _skip_ws(self) -> None:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._take(n)

    def _body(self, out: list[Event], final: bool) -> bool:
        """After ``<tool_call>`` (or a finished call in the same block): which body form follows."""
        self._skip_ws()
        if self._buf.startswith("{"):
            self._json = _JsonScan()
            return self._goto(_JSON)
        if self._buf.startswith(FUNC_OPEN):
            return self._goto(_FUNC)
        if not final and (not self._buf or _could_be(self._buf, FUNC_OPEN, CALL_CLOSE)):
            return False
        if self._buf.startswith(CALL_CLOSE):
            return self._malformed(out, "empty tool call")
        if not self._buf:
            return self._malformed(out, "tool call not closed")
        return self._malformed(out, "tool call body is neither <function=...> nor a JSON object")

    def _func(self, out: list[Event], final: bool) -> bool:
        """``<function=NAME>``."""
        name, why = self._tag_name(FUNC_OPEN, final)
        if why:
            return self._malformed(out, f"function name {why}")
        if name is None:
            return False
        if self._schemas is not None and name not in self._schemas:
            return self._malformed(out, "unknown function name")
        self._begin(out, name)
        self._params = set()
        self._args = ["{"]
        self._push(out, ToolCallArgs(self._index, "{"))
        return self._goto(_PARAMS)

    def _params_step(self, out: list[Event], final: bool) -> bool:
        self._skip_ws()
        if self._buf.startswith(PARAM_OPEN):
            name, why = self._tag_name(PARAM_OPEN, final)
            if why:
                return self._malformed(out, f"parameter name {why}")
            if name is None:
                return False
            if name in self._params:
                return self._malformed(out, "parameter given twice")
            key = ("" if not self._params else ", ") + json.dumps(name, ensure_ascii=False) + ": "
            self._params.add(name)
            self._param = name
            self._value_parts = []
            self._stream_str = self._types(name) == {"string"}
            self._arg(out, key + ('"' if self._stream_str else ""))
            return self._goto(_VALUE_START)
        if self._buf.startswith(FUNC_CLOSE):
            self._take(len(FUNC_CLOSE))
            self._end(out)
            return self._goto(_AFTER)
        if self._buf.startswith(CALL_CLOSE):  # </function> left out: the block's end closes it
            self._take(len(CALL_CLOSE))
            self._end(out)
            self._section(Content)
            return self._goto(_CONTENT)
        if not final and (not self._buf or _could_be(self._buf, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE)):
            return False
        if not self._buf or _could_be(self._buf, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE):
            return self._malformed(out, "tool call not closed")
        return self._malformed(out, "unexpected text between parameters")

    def _value_start(self, out: list[Event], final: bool) -> bool:
        if not self._buf:
            return self._malformed(out, "tool call not closed") if final else False
        if self._buf.startswith("\n"):
            self._take(1)
        return self._goto(_VALUE)

    def _value(self, out: list[Event], final: bool) -> bool:
        i = self._buf.find(PARAM_CLOSE, max(0, self._seen - len(PARAM_CLOSE) + 1))
        if i < 0:
            if final:
                return self._malformed(out, "tool call not closed")
            # all but what may be the closing newline and tag: streamed (a string) or kept
            keep = max(_held(self._buf, "\n" + PARAM_CLOSE), _held(self._buf, PARAM_CLOSE))
            cut = len(self._buf) - keep
            if cut:
                piece = self._take(cut)
                if self._stream_str:
                    self._arg(out, json.dumps(piece, ensure_ascii=False)[1:-1])
                else:
                    self._value_parts.append(piece)
            self._seen = len(self._buf)
            return False
        value = self._take(i)
        self._take(len(PARAM_CLOSE))
        if value.endswith("\n"):
            value = value[:-1]
        if self._stream_str:
            self._arg(out, json.dumps(value, ensure_ascii=False)[1:-1] + '"')
        else:
            whole = "".join(self._value_parts) + value
            self._arg(out, json.dumps(_typed(whole, self._types(self._param)), ensure_ascii=False))
        self._value_parts = []
        return self._goto(_PARAMS)

    def _json_step(self, out: list[Event], final: bool) -> bool:
        """A JSON body ``{"name": ..., "arguments": {...}}``, its arguments streamed as written."""
        scan = self._json
        assert scan is not None
        start = scan.length
        chunk = self._take(scan.feed(self._buf))
        if scan.error:
            return self._malformed(out, f"tool call JSON: {scan.error}")
        begin_at = start
        if not self._begun and scan.name is not None:
            if self._schemas is not None and scan.name not in self._schemas:
                return self._malformed(out, "unknown function name")
            if scan.args_start is not None and scan.args_open == "{":
                self._begin(out, scan.name)
                self._args = []
                begin_at = scan.args_start
        if self._begun and scan.args_start is not None:
            lo = max(begin_at, scan.args_start)
            hi = scan.args_end if scan.args_end is not None else scan.length
            if hi > lo:
                self._arg(out, chunk[lo - start: hi - start] if lo >= start else scan.slice(lo, hi))
        if scan.end is None:
            if final:
                return self._malformed(out, "tool call not closed")
            return False
        try:
            obj = json.loads(scan.slice(0, scan.end), parse_constant=_no_constant)
        except ValueError:
            return self._malformed(out, "tool call JSON does not parse")
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name:
            return self._malformed(out, "tool call JSON has no function name")
        if self._schemas is not None and name not in self._schemas:
            return self._malformed(out, "unknown function name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args, parse_constant=_no_constant)
            except ValueError:
                return self._malformed(out, "tool call arguments string is not JSON")
        if not isinstance(args, dict):
            return self._malformed(out, "tool call arguments are not a JSON object")
        if self._begun:
            if name != self._name or json.loads("".join(self._args)) != args:
                return self._malformed(out, "tool call name or arguments given twice")
        else:
            self._begin(out, name)
            self._args = []
            self._arg(out, json.dumps(args, ensure_ascii=False))
        self._end(out)
        return self._goto(_AFTER)

    def _after(self, out: list[Event], final: bool) -> bool:
        """After a complete call: ``</tool_call>``, another call body, or text."""
        self._raw = []
        stripped = self._buf.lstrip()
        if stripped.startswith(CALL_CLOSE):
            self._buf = stripped[len(CALL_CLOSE):]
            self._section(Content)
            return self._goto(_CONTENT)
        if stripped.startswith((FUNC_OPEN, "{")):
            self._buf = stripped
            self._raw = [""]
            return self._goto(_BODY)
        if not final and (not stripped or _could_be(stripped, CALL_CLOSE, FUNC_OPEN)):
            return False
        self._buf = stripped
        self._section(Content)
        return self._goto(_CONTENT)

    def _pass(self, out: list[Event], final: bool) -> bool:
        """A malformed call's raw text, as content, through its ``</tool_call>``."""
        i = self._buf.find(CALL_CLOSE, max(0, self._seen - len(CALL_CLOSE) + 1))
        if i >= 0:
            self._raw_content(out, self._buf[: i + len(CALL_CLOSE)])
            self._buf = self._buf[i + len(CALL_CLOSE):]
            return self._goto(_CONTENT)
        keep = 0 if final else _held(self._buf, CALL_CLOSE)
        cut = len(self._buf) - keep
        if cut:
            self._raw_content(out, self._buf[:cut])
            self._buf = self._buf[cut:]
        self._seen = len(self._buf)
        return False

    # -- call helpers ---------------------------------------------------------------------------

    def _tag_name(self, opener: str, final: bool) -> tuple[str | None, str | None]:
        """``<function=NAME>`` / ``<parameter=NAME>`` at the buffer's start: (name, None) when read,
        (None, None) when more text is needed, (None, why) when it cannot be a name."""
        j = self._buf.find(">", len(opener))
        head = self._buf[len(opener): j if j >= 0 else len(self._buf)]
        if "<" in head or "\n" in head:
            return None, "is not closed by '>'"
        if len(head) > _NAME_MAX:
            return None, "is too long"
        if j < 0:
            return (None, "is not closed by '>'") if final else (None, None)
        name = head.strip()
        if not name:
            return None, "is empty"
        self._take(j + 1)
        return name, None

    def _types(self, param: str) -> set[str] | None:
        props = self._schemas.get(self._name, {}) if self._schemas is not None else {}
        schema = props.get(param)
        return _schema_types(schema) if isinstance(schema, dict) else None

    def _begin(self, out: list[Event], name: str) -> None:
        self._index = self._calls
        self._calls += 1
        self._begun = True
        self._name = name
        self._push(out, ToolCallBegin(self._index, f"call_{self._prefix}_{self._index}", name))

    def _arg(self, out: list[Event], delta: str) -> None:
        if delta:
            self._args.append(delta)
            self._push(out, ToolCallArgs(self._index, delta))

    def _end(self, out: list[Event]) -> None:
        if self._state != _JSON:
            self._arg(out, "}")
        self._push(out, ToolCallEnd(self._index, "".join(self._args)))
        self._begun = False
        self._raw = []

    def _malformed(self, out: list[Event], reason: str) -> bool:
        self._push(out, Malformed(reason))
        raw = "".join(self._raw)
        self._raw = []
        self._begun = False
        self._json = None
        self._lead = False
        self._kind = Content
        if raw and self._keep_malformed:
            self._push(out, Content(raw))
        return self._goto(_PASS)

    def _raw_content(self, out: list[Event], text: str) -> None:
        if text and self._keep_malformed:
            self._lead = False
            self._push(out, Content(text))


class _JsonScan:
    """Incremental scanner of one JSON object: finds the top-level ``"name"`` string and the span
    of the ``"arguments"`` (or ``"parameters"``) value while the text grows. Validates only what a
    streaming reader must (no text outside strings that JSON forbids); ``json.loads`` checks the rest.
    Keeps the text as a list of pieces (joined only for top-level strings' neighbours and at the end),
    so a long argument value costs O(n).
    """

    _ALLOWED = frozenset(' \t\r\n{}[],:"-+.0123456789eEtrufalsn')

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._joined = ""
        self.length = 0
        self.depth = 0
        self.in_str = False
        self.esc = False
        self._token: list[str] | None = None  # the top-level string being read, quotes included
        self._last = -1  # index of the last char that was not whitespace outside a string
        self.expect_key = False
        self.key: str | None = None
        self.value_key: str | None = None  # the top-level key whose value is being read
        self.value_start: int | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_open = ""  # the first char of the arguments value
        self.args_end: int | None = None
        self.end: int | None = None  # index just past the closing brace
        self.error: str | None = None

    def slice(self, lo: int, hi: int) -> str:
        if hi > len(self._joined):
            self._joined = "".join(self._parts)
        return self._joined[lo:hi]

    def feed(self, chunk: str) -> int:
        """Scan ``chunk``; returns how many of its chars were read: all of them, or those up to the
        object's closing brace, or those before a char that cannot be JSON (``error`` says so)."""
        base = self.length
        n = len(chunk)
        for k, ch in enumerate(chunk):
            if self.end is not None:
                n = k
                break
            self._char(base + k, ch)
            if self.error:  # the offending char is not read
                n = k
                break
        self._parts.append(chunk[:n])
        self.length += n
        return n

    def _char(self, i: int, ch: str) -> None:
        if self.in_str:
            if self._token is not None:
                self._token.append(ch)
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                self._string_done(i)
            self._last = i
            return
        if ch not in self._ALLOWED:
            self.error = "unexpected character outside a string"
            return
        if ch in " \t\r\n":
            return
        if self.depth == 0 and ch != "{":
            self.error = "does not start with '{'"
            return
        if self.depth == 1 and self.value_key is not None and self.value_start is None:
            self.value_start = i
            if self.value_key in ("arguments", "parameters") and self.args_start is None:
                self.args_start, self.args_open = i, ch
        if ch == '"':
            self.in_str = True
            self._token = ['"'] if self.depth == 1 else None
        elif ch in "{[":
            self.depth += 1
            if self.depth == 1:
                self.expect_key = True
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_done(i + 1)
            elif self.depth == 0:
                if self.value_start is not None:
                    self._value_done(self._last + 1)
                self.end = i + 1
            elif self.depth < 0:
                self.error = "unbalanced brackets"
        elif self.depth == 1:
            if ch == ":":
                if self.key is None:
                    self.error = "':' without a key"
                    return
                self.value_key, self.value_start, self.key = self.key, None, None
            elif ch == ",":
                if self.value_start is not None:
                    self._value_done(self._last + 1)
                self.value_key = None
                self.expect_key = True
        self._last = i

    def _string_done(self, i: int) -> None:
        if self._token is None:
            return
        token, self._token = "".join(self._token), None
        try:
            text = json.loads(token)
        except ValueError:
            self.error = "bad string"
            return
        if self.expect_key and self.value_key is None:
            self.key = text
            self.expect_key = False
        elif self.value_key is not None and self.value_start == i + 1 - len(token):
            if self.value_key == "name" and self.name is None and text:
                self.name = text
            self._value_done(i + 1)

    def _value_done(self, stop: int) -> None:
        """The top-level value being read ends at ``stop`` (exclusive)."""
        if self.value_key is None or self.value_start is None:
            return
        if self.value_start == self.args_start and self.args_end is None:
            self.args_end = stop
        self.value_key = None
        self.value_start = None


# -- schema typing -------------------------------------------------------------------------------

_INT = re.compile(r"-?(?:0|[1-9]\d*)")
_NUM = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _tool_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
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


def _typed(value: str, types: set[str] | None) -> Any:
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
        return json.loads(value, parse_constant=_no_constant)
    except ValueError:
        return value


def _structured(s: str) -> Any:
    """JSON, or a Python literal (the single-quoted dicts some models write) that JSON can hold."""
    try:
        return json.loads(s, parse_constant=_no_constant)
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


# -- collecting events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A complete call, as ``Collected`` gathers it."""

    index: int
    id: str
    name: str
    arguments: str  # a JSON object

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class Collected:
    """Events folded into what a non-streamed answer holds."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    _open: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)

    def add(self, events: Sequence[Event]) -> Collected:
        for ev in events:
            if isinstance(ev, Content):
                self.content += ev.text
            elif isinstance(ev, Reasoning):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallBegin):
                self._open[ev.index] = (ev.id, ev.name, [])
            elif isinstance(ev, ToolCallArgs):
                self._open[ev.index][2].append(ev.delta)
            elif isinstance(ev, ToolCallEnd):
                cid, name, deltas = self._open.pop(ev.index)
                if "".join(deltas) != ev.arguments:
                    raise AssertionError(f"tool call {ev.index}: deltas do not add up to its arguments")
                self.tool_calls.append(ToolCall(ev.index, cid, name, ev.arguments))
            elif isinstance(ev, Malformed):
                self.malformed.append(ev.reason)
                self._open.clear()  # a begun call that turned out malformed is void
        return self


class Parsed(NamedTuple):
    content: str
    reasoning: str
    tool_calls: list[ToolCall]


def parse_complete(text: str, tool_format: str, reasoning: bool, think_in_prompt: bool,
                   tools: Sequence[dict[str, Any]] | None = None, *, id_prefix: str | None = None,
                   on_malformed: Callable[[str], None] | None = None) -> Parsed:
    """A whole output at once: (content, reasoning, tool_calls).

    ``on_malformed(reason)`` is called once per malformed call (its raw text is in the content)."""
    parser = OutputParser(tool_format, reasoning, think_in_prompt, tools, id_prefix=id_prefix)
    got = Collected().add(parser.feed(text)).add(parser.finish())
    if on_malformed is not None:
        for reason in got.malformed:
            on_malformed(reason)
    return Parsed(got.content, got.reasoning, got.tool_calls)


def think_open_at_end(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block (the template opened it),
    so the output starts in reasoning: the value for ``think_in_prompt``."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
