"""Sessions without client help: a conversation is known by the hash of its messages up to a user message.

A client sends the whole conversation each turn. The key of user message ``i`` is the SHA-256 of
messages ``0..i`` as the client wrote them (status lines stripped; the hidden note is never in
the client's copy), so every later turn of the same conversation finds it again: the class the
router chose for that user message and the note appended to it (replayed at the same place, so
the rendered prompt, and the cached prefix, stay the same). ``X-Tandem-Session`` names a session
outright. Both stores are bounded (least recently used out).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["STATUS_PREFIX", "strip_status", "text_of", "prefix_keys", "Remembered", "Sessions"]

STATUS_PREFIX = "\u203a "                     # "› ": a status line starts with it
_STATUS = re.compile(r"(?m)^\u203a [^\n]*\n")


def strip_status(text: str) -> str:
    """``text`` without the status lines the conductor sent (whole lines starting with "› ")."""
    return _STATUS.sub("", text)


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _canon(m: Any) -> Any:
    if not isinstance(m, dict):
        return m
    return {"role": m.get("role"), "content": text_of(m.get("content")), "name": m.get("name"),
            "tool_calls": m.get("tool_calls"), "tool_call_id": m.get("tool_call_id")}


def prefix_keys(messages: Sequence[Any]) -> dict[int, str]:
    """The key of every user message: index -> hash of the messages up to it."""
    h = hashlib.sha256()
    out: dict[int, str] = {}
    for i, m in enumerate(messages):
        h.update(json.dumps(_canon(m), sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\x00")
        if isinstance(m, dict) and m.get("role") == "user":
            out[i] = h.copy().hexdigest()[:32]
    return out


@dataclass(frozen=True)
class Remembered:
    profile: str
    klass: str
    note: str          # "" when no note was appended
    note_id: str       # the note's short hash ("" without one)


class Sessions:
    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_key: OrderedDict[str, Remembered] = OrderedDict()
        self._by_session: OrderedDict[str, Remembered] = OrderedDict()
        self._lock = threading.Lock()

    def _put(self, store: OrderedDict[str, Remembered], key: str, value: Remembered) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > self.limit:
            store.popitem(last=False)

    def remember(self, key: str, value: Remembered, session: str | None = None) -> None:
        with self._lock:
            self._put(self._by_key, key, value)
            if session:
                self._put(self._by_session, session, value)

    def by_key(self, key: str) -> Remembered | None:
        with self._lock:
            found = self._by_key.get(key)
            if found is not None:
                self._by_key.move_to_end(key)
            return found

    def by_session(self, session: str) -> Remembered | None:
        with self._lock:
            return self._by_session.get(session)

    def __len__(self) -> int:
        return len(self._by_key)
