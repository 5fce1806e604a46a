"""Qwen's XML call body, read as it streams: ``<function=NAME>``, ``<parameter=P>`` values, ``</function>``.

What Qwen3-Coder and Qwen3.5 write inside ``<tool_call>`` (the core's ``TaggedCalls`` holds the
block)::

    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

Parameter values are typed by the tool's JSON schema (``tandem_core.server.parsing.values.typed``):
integer/number -> JSON number, boolean, null, object/array -> parsed JSON, string -> JSON string
(streamed as it is written); a parameter without a schema gets a JSON literal if the text is one,
else a string. One newline after ``<parameter=P>`` and one before ``</parameter>`` belong to the
format. Several ``<function=`` blocks in one ``<tool_call>`` are several calls; ``</function>``
left out before ``</tool_call>`` is read as closed.
"""

from __future__ import annotations

import json

from tandem_core.server.parsing.events import Event
from tandem_core.server.parsing.tagged import TaggedCalls
from tandem_core.server.parsing.text import could_be, held
from tandem_core.server.parsing.values import typed

__all__ = ["FUNC_CLOSE", "FUNC_OPEN", "PARAM_CLOSE", "PARAM_OPEN", "XmlBody"]

FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_NAME_MAX = 256  # longest function / parameter name read before the call is called malformed

_FUNC, _PARAMS, _VALUE_START, _VALUE = range(4)


class XmlBody:
    """The ``<function=NAME>...</function>`` body form."""

    opener = FUNC_OPEN
    what = "<function=...>"

    def start(self) -> _XmlReader:
        return _XmlReader()


class _XmlReader:
    def __init__(self) -> None:
        self._state = _FUNC
        self._params: set[str] = set()
        self._param = ""
        self._parts: list[str] = []  # a typed (not streamed) value read so far
        self._stream_str = False

    def _goto(self, p: TaggedCalls, state: int) -> bool:
        self._state = state
        p.seen = 0
        return True

    def step(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        if self._state == _FUNC:
            return self._func(p, out, final)
        if self._state == _PARAMS:
            return self._params_step(p, out, final)
        if self._state == _VALUE_START:
            if not p.buf:
                return p.malformed(out, "tool call not closed") if final else False
            if p.buf.startswith("\n"):
                p.take(1)
            return self._goto(p, _VALUE)
        return self._value(p, out, final)

    def _func(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        """``<function=NAME>``."""
        name, why = _tag_name(p, FUNC_OPEN, final)
        if why:
            return p.malformed(out, f"function name {why}")
        if name is None:
            return False
        if not p.known(name):
            return p.malformed(out, "unknown function name")
        p.begin(out, name)
        p.arg(out, "{")
        return self._goto(p, _PARAMS)

    def _params_step(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        p.skip_ws()
        buf = p.buf
        if buf.startswith(PARAM_OPEN):
            name, why = _tag_name(p, PARAM_OPEN, final)
            if why:
                return p.malformed(out, f"parameter name {why}")
            if name is None:
                return False
            if name in self._params:
                return p.malformed(out, "parameter given twice")
            key = ("" if not self._params else ", ") + json.dumps(name, ensure_ascii=False) + ": "
            self._params.add(name)
            self._param = name
            self._parts = []
            self._stream_str = p.types(name) == {"string"}
            p.arg(out, key + ('"' if self._stream_str else ""))
            return self._goto(p, _VALUE_START)
        if buf.startswith(FUNC_CLOSE):
            p.take(len(FUNC_CLOSE))
            p.arg(out, "}")
            p.end(out)
            return p.after_call()
        if buf.startswith(p.close_tag):  # </function> left out: the block's end closes it
            p.take(len(p.close_tag))
            p.arg(out, "}")
            p.end(out)
            return p.close_block()
        if not final and (not buf or could_be(buf, PARAM_OPEN, FUNC_CLOSE, p.close_tag)):
            return False
        if not buf or could_be(buf, PARAM_OPEN, FUNC_CLOSE, p.close_tag):
            return p.malformed(out, "tool call not closed")
        return p.malformed(out, "unexpected text between parameters")

    def _value(self, p: TaggedCalls, out: list[Event], final: bool) -> bool:
        buf = p.buf
        i = buf.find(PARAM_CLOSE, max(0, p.seen - len(PARAM_CLOSE) + 1))
        if i < 0:
            if final:
                return p.malformed(out, "tool call not closed")
            # all but what may be the closing newline and tag: streamed (a string) or kept
            keep = max(held(buf, "\n" + PARAM_CLOSE), held(buf, PARAM_CLOSE))
            cut = len(buf) - keep
            if cut:
                piece = p.take(cut)
                if self._stream_str:
                    p.arg(out, json.dumps(piece, ensure_ascii=False)[1:-1])
                else:
                    self._parts.append(piece)
            p.seen = len(p.buf)
            return False
        value = p.take(i)
        p.take(len(PARAM_CLOSE))
        if value.endswith("\n"):
            value = value[:-1]
        if self._stream_str:
            p.arg(out, json.dumps(value, ensure_ascii=False)[1:-1] + '"')
        else:
            whole = "".join(self._parts) + value
            p.arg(out, json.dumps(typed(whole, p.types(self._param)), ensure_ascii=False))
        self._parts = []
        return self._goto(p, _PARAMS)


def _tag_name(p: TaggedCalls, opener: str, final: bool) -> tuple[str | None, str | None]:
    """``<function=NAME>`` / ``<parameter=NAME>`` at the buffer's start: (name, None) when read,
    (None, None) when more text is needed, (None, why) when it cannot be a name."""
    buf = p.buf
    j = buf.find(">", len(opener))
    head = buf[len(opener): j if j >= 0 else len(buf)]
    if "<" in head or "\n" in head:
        return None, "is not closed by '>'"
    if len(head) > _NAME_MAX:
        return None, "is too long"
    if j < 0:
        return (None, "is not closed by '>'") if final else (None, None)
    name = head.strip()
    if not name:
        return None, "is empty"
    p.take(j + 1)
    return name, None
