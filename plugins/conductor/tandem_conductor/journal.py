"""The journal (JSON lines of decisions: ids, names, counts and times, never text) and the notes store.

``Journal.write(record)`` refuses a record holding a string it does not know to be a name or an
id (``_SAFE``): the journal never holds prompt or answer text. ``NotesStore`` is the SQLite file
that ``<tandem_memory>`` blocks go to (memory notes on): that text is the point of the store.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["Journal", "NotesStore", "JOURNAL_FIELDS"]

# the fields a journal line may hold; every string in them is a name, an id or a fixed word
JOURNAL_FIELDS = {"ts", "request_id", "endpoint", "profile", "profile_by", "class", "class_by", "note_id",
                  "side", "session", "classifier_ms", "actions", "prompt_tokens", "completion_tokens",
                  "hidden_tokens", "reasoning_tokens", "finish", "prefill_start", "prefill_tokens", "ttft_s",
                  "decode_tps", "plan_ms", "memory_notes", "status_lines", "tool_calls", "transcript"}


class Journal:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines = 0
        self._lock = threading.Lock()
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        unknown = set(record) - JOURNAL_FIELDS
        if unknown:
            raise ValueError(f"journal: fields {sorted(unknown)} are not journal fields")
        with self._lock:
            self.lines += 1
            if self._f is not None:
                self._f.write(json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n")
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


class NotesStore:
    """``notes(id, ts, session, profile, text)`` in SQLite; written from the worker threads."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, ts REAL NOT NULL, "
                         "session TEXT, profile TEXT NOT NULL, text TEXT NOT NULL)")
        self._db.commit()
        self._lock = threading.Lock()

    def add(self, session: str | None, profile: str, text: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO notes (ts, session, profile, text) VALUES (?, ?, ?, ?)",
                             (time.time(), session, profile, text))
            self._db.commit()

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM notes").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
