"""The reasoning block at the start of an output, split from what follows.

``ReasoningSplitter(calls, reasoning=..., think_in_prompt=..., tags=(open, close))`` reads the
output's start: with ``reasoning`` a block opened by ``open`` at the very start (after
whitespace) is reasoning up to ``close``; with ``think_in_prompt`` the template already opened
it and the output starts inside it (a repeated ``open`` there is dropped). An output that ends
inside the block is all reasoning. Everything after the block goes to ``calls``, the tool-call
format's parser (content and calls). Whitespace after ``open`` and ``close`` and before
``close`` is the format's; the rest is kept. The tags are the model's (``Served.think_tags``,
``<think>`` and ``</think>`` unless its plugin says otherwise).
"""

from __future__ import annotations

from tandem_core.server.parsing.events import Content, Event, Reasoning, push
from tandem_core.server.parsing.text import TextParser, could_be
from tandem_core.server.toolformat import CallParser

__all__ = ["THINK_TAGS", "ReasoningSplitter"]

THINK_TAGS = ("<think>", "</think>")

_START, _REASON, _REST = range(3)


class ReasoningSplitter(TextParser):
    """Reasoning events for the block at the start, then ``calls``' events for the rest."""

    def __init__(self, calls: CallParser, *, reasoning: bool, think_in_prompt: bool,
                 tags: tuple[str, str] = THINK_TAGS) -> None:
        super().__init__(Content)
        self.calls = calls
        self._open, self._close = tags
        self._think_in_prompt = reasoning and think_in_prompt
        self._state = _START if reasoning else _REST

    def feed(self, text: str) -> list[Event]:
        if self._state == _REST and not self._done:
            return self.calls.feed(text)
        return super().feed(text)

    def finish(self) -> list[Event]:
        if self._done:
            return []
        out = super().finish() if self._state != _REST else []
        self._done = True
        for ev in self.calls.finish():
            push(out, ev)
        return out

    def _run(self, out: list[Event], final: bool) -> None:
        if self._state == _START and not self._start(final):
            return
        if self._state == _REASON:
            if self._until(out, self._close, final) < 0:
                return
            self._buf = self._buf[len(self._close):]
            self._section(Content)
            self._state = _REST
        rest, self._buf = self._buf, ""
        if rest:
            for ev in self.calls.feed(rest):
                push(out, ev)

    def _start(self, final: bool) -> bool:
        """The output's start: an ``open`` tag here opens the block (or repeats the one the prompt opened).
        False while more text must decide."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self._open):
            self._buf = stripped[len(self._open):]
            self._section(Reasoning)
            self._state = _REASON
            return True
        if not final and (not stripped or could_be(stripped, self._open)):
            return False
        if self._think_in_prompt:
            self._section(Reasoning)
            self._state = _REASON
        else:
            self._state = _REST
        return True
