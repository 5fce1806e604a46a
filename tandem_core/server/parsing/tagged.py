"""Calls in a tagged block: ``<tool_call>`` body ``</tool_call>``, the body in one of the format's forms.

``TaggedCalls(bodies, tools, id_prefix=..., keep_malformed=...)`` reads content and calls. A
block holds one or more call bodies (whitespace between them); each ``Body`` is one way of
writing a call (``JsonBody`` here: ``{"name": NAME, "arguments": {...}}``; a plugin's own, such as
an XML ``<function=NAME><parameter=P>...`` form). The first of ``bodies`` whose ``opener`` starts the
text after ``<tool_call>`` reads it. Whitespace before ``<tool_call>`` and after
``</tool_call>`` is the format's; other whitespace is kept.

A call streams ``ToolCallBegin`` once its name is known, ``ToolCallArgs`` deltas while its
arguments are written, and ``ToolCallEnd`` whose ``arguments`` (a JSON object) equals the
concatenated deltas. A malformed call (bad JSON, unknown function when ``tools`` were given,
not closed when the output ends, unexpected text inside) is never dropped: ``Malformed(reason)``
(the reason names no text) and then the call's raw text, from the whitespace before
``<tool_call>`` to ``</tool_call>``, as ``Content``. A call that had begun and then turns out
malformed gets no ``ToolCallEnd``: its deltas are void and its index is not reused. With
``keep_malformed=False`` (a call a grammar forced) the raw text is dropped instead: the model's
markup never reaches content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tandem_core.server.parsing.events import (
    Content, Event, Malformed, ToolCallArgs, ToolCallBegin, ToolCallEnd, push,
)
from tandem_core.server.parsing.jsonscan import JsonScan
from tandem_core.server.parsing.text import TextParser, could_be, held
from tandem_core.server.parsing.values import no_constant, tool_schemas
from tandem_core.server.toolformat import schema_types

__all__ = ["CALL_CLOSE", "CALL_OPEN", "Body", "JsonBody", "TaggedCalls"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_CONTENT, _BODY, _READ, _AFTER, _PASS = range(5)


class Body(Protocol):
    """One way of writing a call's body inside the block.

    ``opener``   the text the body starts with (``"{"``, ``"<function="``)
    ``what``     how a refusal names the form (``"a JSON object"``)
    ``start()``  a fresh reader of one body (the block may hold several)
    """

    opener: str
    what: str

    def start(self) -> BodyReader: ...


class BodyReader(Protocol):
    def step(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        """Read from ``p``'s buffer; True to run again, False when more text is needed. At the body's end it
        calls ``p.end(out)`` then ``p.after_call()``; on an error ``return p.malformed(out, reason)``."""
        ...


class TaggedCalls(TextParser):
    """Content and calls between ``open_tag`` and ``close_tag``, each call in one of ``bodies``' forms."""

    def __init__(self, bodies: Sequence[Body], tools: Sequence[Mapping[str, Any]] | None = None, *,
                 id_prefix: str | None = None, keep_malformed: bool = True,
                 open_tag: str = CALL_OPEN, close_tag: str = CALL_CLOSE) -> None:
        super().__init__(Content)
        self.bodies = tuple(bodies)
        self.open_tag, self.close_tag = open_tag, close_tag
        self._openers = tuple(b.opener for b in self.bodies)
        self.schemas = tool_schemas(tools)
        self._keep_malformed = keep_malformed
        self._prefix = id_prefix if id_prefix is not None else secrets.token_hex(6)
        self._state = _CONTENT
        self._reader: BodyReader | None = None
        # the call being read
        self._calls = 0
        self.index = -1
        self.begun = False
        self.raw: list[str] = []
        self.name = ""
        self.args: list[str] = []
        self._steps: tuple[Callable[[list[Event], bool], bool], ...] = (
            self._content, self._body, self._read, self._after, self._pass)  # by state number

    # -- what a body reader uses ----------------------------------------------------------------

    @property
    def buf(self) -> str:
        return self._buf

    @property
    def seen(self) -> int:
        return self._seen

    @seen.setter
    def seen(self, n: int) -> None:
        self._seen = n

    def take(self, n: int) -> str:
        """Consume ``n`` chars of the buffer (recorded as the call's raw text)."""
        got, self._buf = self._buf[:n], self._buf[n:]
        self._seen = 0
        self.raw.append(got)
        return got

    def skip_ws(self) -> None:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self.take(n)

    def known(self, name: str) -> bool:
        """Whether a call may name ``name`` (any name when the request gave no tools)."""
        return self.schemas is None or name in self.schemas

    def types(self, param: str) -> set[str] | None:
        """The JSON types the current call's parameter ``param`` allows (None: its schema does not say)."""
        props = self.schemas.get(self.name, {}) if self.schemas is not None else {}
        schema = props.get(param)
        return schema_types(schema) if isinstance(schema, dict) else None

    def begin(self, out: list[Event], name: str) -> None:
        self.index = self._calls
        self._calls += 1
        self.begun = True
        self.name = name
        self.args = []
        push(out, ToolCallBegin(self.index, f"call_{self._prefix}_{self.index}", name))

    def arg(self, out: list[Event], delta: str) -> None:
        if delta:
            self.args.append(delta)
            push(out, ToolCallArgs(self.index, delta))

    def end(self, out: list[Event]) -> None:
        push(out, ToolCallEnd(self.index, "".join(self.args)))
        self.begun = False
        self.raw = []

    def after_call(self) -> bool:
        """A call is complete: what follows is the block's end, another body, or text."""
        return self._goto(_AFTER)

    def close_block(self) -> bool:
        """The body read the block's closing tag itself."""
        self._section(Content)
        return self._goto(_CONTENT)

    def malformed(self, out: list[Event], reason: str) -> bool:
        push(out, Malformed(reason))
        raw = "".join(self.raw)
        self.raw = []
        self.begun = False
        self._reader = None
        self._lead = False
        self._kind = Content
        if raw and self._keep_malformed:
            push(out, Content(raw))
        return self._goto(_PASS)

    # -- machinery -------------------------------------------------------------------------------

    def _run(self, out: list[Event], final: bool) -> None:
        steps = self._steps
        while steps[self._state](out, final):
            pass

    def _goto(self, state: int) -> bool:
        self._state = state
        self._seen = 0
        return True

    def _content(self, out: list[Event], final: bool) -> bool:
        if self._until(out, self.open_tag, final) < 0:
            return False
        self.raw = [self._ws, self.open_tag]
        self._ws = ""
        self._buf = self._buf[len(self.open_tag):]
        return self._goto(_BODY)

    def _body(self, out: list[Event], final: bool) -> bool:
        """After the opening tag (or a finished call in the same block): which body form follows."""
        self.skip_ws()
        for body in self.bodies:
            if self._buf.startswith(body.opener):
                self._reader = body.start()
                return self._goto(_READ)
        if not final and (not self._buf or could_be(self._buf, *self._openers, self.close_tag)):
            return False
        if self._buf.startswith(self.close_tag):
            return self.malformed(out, "empty tool call")
        if not self._buf:
            return self.malformed(out, "tool call not closed")
        forms = [b.what for b in self.bodies]
        either = forms[0] if len(forms) == 1 else "neither " + ", ".join(forms[:-1]) + " nor " + forms[-1]
        return self.malformed(out, f"tool call body is {'not ' if len(forms) == 1 else ''}{either}")

    def _read(self, out: list[Event], final: bool) -> bool:
        assert self._reader is not None
        return self._reader.step(self, out, final)

    def _after(self, out: list[Event], final: bool) -> bool:
        """After a complete call: the closing tag, another call body, or text."""
        self.raw = []
        self._reader = None
        stripped = self._buf.lstrip()
        if stripped.startswith(self.close_tag):
            self._buf = stripped[len(self.close_tag):]
            return self.close_block()
        if stripped.startswith(self._openers):
            self._buf = stripped
            self.raw = [""]
            return self._goto(_BODY)
        if not final and (not stripped or could_be(stripped, self.close_tag, *self._openers)):
            return False
        self._buf = stripped
        self._section(Content)
        return self._goto(_CONTENT)

    def _pass(self, out: list[Event], final: bool) -> bool:
        """A malformed call's raw text, as content, through the closing tag."""
        close = self.close_tag
        i = self._buf.find(close, max(0, self._seen - len(close) + 1))
        if i >= 0:
            self._raw_content(out, self._buf[: i + len(close)])
            self._buf = self._buf[i + len(close):]
            return self._goto(_CONTENT)
        keep = 0 if final else held(self._buf, close)
        cut = len(self._buf) - keep
        if cut:
            self._raw_content(out, self._buf[:cut])
            self._buf = self._buf[cut:]
        self._seen = len(self._buf)
        return False

    def _raw_content(self, out: list[Event], text: str) -> None:
        if text and self._keep_malformed:
            self._lead = False
            push(out, Content(text))


class JsonBody:
    """``{"name": NAME, "arguments": {...}}`` (``"parameters"`` read as ``"arguments"``; arguments given as a
    JSON string are parsed), the arguments streamed as they are written."""

    opener = "{"
    what = "a JSON object"

    def start(self) -> _JsonReader:
        return _JsonReader()


class _JsonReader:
    def __init__(self) -> None:
        self.scan = JsonScan()

    def step(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        scan = self.scan
        start = scan.length
        chunk = p.take(scan.feed(p.buf))
        if scan.error:
            return p.malformed(out, f"tool call JSON: {scan.error}")
        begin_at = start
        if not p.begun and scan.name is not None:
            if not p.known(scan.name):
                return p.malformed(out, "unknown function name")
            if scan.args_start is not None and scan.args_open == "{":
                p.begin(out, scan.name)
                begin_at = scan.args_start
        if p.begun and scan.args_start is not None:
            lo = max(begin_at, scan.args_start)
            hi = scan.args_end if scan.args_end is not None else scan.length
            if hi > lo:
                p.arg(out, chunk[lo - start: hi - start] if lo >= start else scan.slice(lo, hi))
        if scan.end is None:
            if final:
                return p.malformed(out, "tool call not closed")
            return False
        try:
            obj = json.loads(scan.slice(0, scan.end), parse_constant=no_constant)
        except ValueError:
            return p.malformed(out, "tool call JSON does not parse")
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name:
            return p.malformed(out, "tool call JSON has no function name")
        if not p.known(name):
            return p.malformed(out, "unknown function name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args, parse_constant=no_constant)
            except ValueError:
                return p.malformed(out, "tool call arguments string is not JSON")
        if not isinstance(args, dict):
            return p.malformed(out, "tool call arguments are not a JSON object")
        if p.begun:
            if name != p.name or json.loads("".join(p.args)) != args:
                return p.malformed(out, "tool call name or arguments given twice")
        else:
            p.begin(out, name)
            p.arg(out, json.dumps(args, ensure_ascii=False))
        p.end(out)
        return p.after_call()
