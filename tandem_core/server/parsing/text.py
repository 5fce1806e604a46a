"""What every streaming parser here shares: a buffer fed in pieces, held tag prefixes, and the
whitespace next to a tag, which is the format's and not text.

``TextParser`` is the skeleton: ``feed(text)`` appends to the buffer and runs the subclass's
``_run(out, final)``; ``finish()`` runs it once more with ``final=True`` and lets out the
whitespace held at the end. ``_text`` writes section text with the section's leading whitespace
dropped and its trailing whitespace held (a tag may follow, whose whitespace it then is).
``NoCalls`` is the parser of a model that writes no calls: everything is content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tandem_core.server.parsing.events import Content, Event, Reasoning, push

__all__ = ["NoCalls", "TextParser", "could_be", "held"]


def held(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    i = buf.find(tag[0], max(0, len(buf) - len(tag) + 1))
    while i >= 0:
        if tag.startswith(buf[i:]):
            return len(buf) - i
        i = buf.find(tag[0], i + 1)
    return 0


def could_be(buf: str, *tags: str) -> bool:
    """True when ``buf`` is a proper prefix of one of ``tags`` (more text decides)."""
    return any(len(buf) < len(t) and t.startswith(buf) for t in tags)


class TextParser(ABC):
    """A buffer fed in pieces; the subclass's ``_run(out, final)`` decides what it holds."""

    def __init__(self, kind: type[Content] | type[Reasoning] = Content) -> None:
        self._buf = ""
        self._seen = 0  # chars at the start of _buf already searched for the awaited tag, none found
        self._done = False
        self._ws = ""  # whitespace held at the end of the current section
        self._lead = True  # the section has emitted nothing yet (leading whitespace is the format's)
        self._kind: type[Content] | type[Reasoning] = kind

    def feed(self, text: str) -> list[Event]:
        """Events decided by ``text`` (and what was held before it)."""
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.feed after finish")
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
            push(out, self._kind(self._ws))
            self._ws = ""
        self._done = True
        return out

    @abstractmethod
    def _run(self, out: list[Event], final: bool) -> None:
        """Emit into ``out`` what the buffer decides (``final``: the output has ended, hold nothing back)."""

    def _text(self, out: list[Event], text: str) -> None:
        """Section text, with the section's leading and trailing whitespace held."""
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        body = text.rstrip()
        if body:
            push(out, self._kind(self._ws + body))
            self._ws = text[len(body):]
        else:
            self._ws += text

    def _section(self, kind: type[Content] | type[Reasoning]) -> None:
        """A tag ends the section: its held whitespace was the format's."""
        self._ws = ""
        self._lead = True
        self._kind = kind

    def _until(self, out: list[Event], tag: str, final: bool) -> int:
        """Emit section text up to ``tag``: 0 when found (the buffer then starts with it), else -1."""
        i = self._buf.find(tag, max(0, self._seen - len(tag) + 1))
        if i >= 0:
            self._text(out, self._buf[:i])
            self._buf = self._buf[i:]
            self._seen = 0
            return 0
        keep = 0 if final else held(self._buf, tag)
        cut = len(self._buf) - keep
        if cut:
            self._text(out, self._buf[:cut])
            self._buf = self._buf[cut:]
        self._seen = len(self._buf)
        return -1


class NoCalls(TextParser):
    """A model that writes no calls (``tool_format`` ``"none"``): all of it is content."""

    def _run(self, out: list[Event], final: bool) -> None:
        if self._buf:
            self._text(out, self._buf)
            self._buf = ""
