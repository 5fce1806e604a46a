"""An incremental scanner of one JSON object, for a call body written as JSON while it streams."""

from __future__ import annotations

import json

__all__ = ["JsonScan"]


class JsonScan:
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
