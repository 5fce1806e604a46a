"""The usage ledger: one SQLite row per request (counts and times, never text).

``Ledger(path)`` creates the table when needed; ``write(row)`` is safe from any
thread; ``last(n)`` reads the newest rows, oldest first. The default file is
``$TANDEM_HOME/ledger.sqlite``.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["UsageRow", "Ledger", "default_path"]


@dataclass(frozen=True)
class UsageRow:
    ts: float                   # unix time the request arrived
    request_id: str
    model: str
    endpoint: str               # "chat" or "completions"
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str          # stop, length, tool_calls, cancelled, error
    ttft_s: float | None        # arrival to the first token
    decode_tps: float | None    # tokens per second after the first
    queued_s: float             # time waiting for an engine
    duration_s: float           # arrival to the end
    max_tokens: int             # what the generation was allowed
    capped_from: int | None     # the request's max_tokens when it was capped to fit the context
    stream: bool




def _columns() -> str:
    out = []
    for f in fields(UsageRow):
        base = f.type if isinstance(f.type, str) else f.type.__name__
        sql = "REAL" if "float" in base else "INTEGER" if ("int" in base or "bool" in base) else "TEXT"
        out.append(f"{f.name} {sql}")
    return ", ".join(out)


def default_path() -> Path:
    from tandem_core.catalog import home

    return home() / "ledger.sqlite"


class Ledger:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        with self._lock, self._db:
            self._db.execute(f"CREATE TABLE IF NOT EXISTS usage (id INTEGER PRIMARY KEY AUTOINCREMENT, {_columns()})")

    def write(self, row: UsageRow) -> None:
        data = asdict(row)
        names = ", ".join(data)
        marks = ", ".join("?" for _ in data)
        with self._lock, self._db:
            self._db.execute(f"INSERT INTO usage ({names}) VALUES ({marks})", list(data.values()))

    def last(self, n: int = 20) -> list[UsageRow]:
        names = [f.name for f in fields(UsageRow)]
        with self._lock:
            cur = self._db.execute(f"SELECT {', '.join(names)} FROM usage ORDER BY id DESC LIMIT ?", (n,))
            rows = cur.fetchall()
        out = []
        for r in reversed(rows):
            d = dict(zip(names, r))
            d["stream"] = bool(d["stream"])
            out.append(UsageRow(**d))
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()
