"""The usage ledger: one SQLite row per request (counts and times, never text).

``Ledger(path)`` creates the table when needed (and adds the columns a ledger written
by an older version lacks); ``write(row)`` is safe from any thread; ``last(n)`` reads
the newest rows, oldest first; ``summary(by)`` sums them by model or by day. The
default file is ``$TANDEM_HOME/ledger.sqlite``.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["UsageRow", "Ledger", "Summary", "default_path"]


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
    backend: str = "local"      # "local" (this server's engine) or the backends file's name of a relay
    cost: float = 0.0           # from the backend's prices per million tokens (0 for the local model)
    status: int = 200           # the HTTP status the client got (499: it went away)
    counted: bool = False       # tokens counted by the proxy (the backend sent no usage)




@dataclass(frozen=True)
class Summary:
    """The sums of one group of rows (a model, a day, or all of them)."""

    key: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    errors: int                 # rows whose status is not 200
    mean_ttft_s: float | None
    mean_decode_tps: float | None


def _sql_type(f: Any) -> str:
    base = f.type if isinstance(f.type, str) else f.type.__name__
    return "REAL" if "float" in base else "INTEGER" if ("int" in base or "bool" in base) else "TEXT"


def _sql_default(f: Any) -> str:
    if f.default is MISSING:
        return ""
    return f" DEFAULT {f.default!r}" if not isinstance(f.default, bool) else f" DEFAULT {int(f.default)}"


def _columns() -> str:
    return ", ".join(f"{f.name} {_sql_type(f)}" for f in fields(UsageRow))


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
            have = {r[1] for r in self._db.execute("PRAGMA table_info(usage)")}
            for f in fields(UsageRow):
                if f.name not in have:     # a ledger of an older version: the new columns, with their defaults
                    self._db.execute(f"ALTER TABLE usage ADD COLUMN {f.name} {_sql_type(f)}{_sql_default(f)}")

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
            d["counted"] = bool(d["counted"])
            out.append(UsageRow(**d))
        return out

    def summary(self, by: str | None = None) -> list[Summary]:
        """Sums by ``model``, by ``day`` (local time, ``YYYY-MM-DD``) or, with None, of every row (one group)."""
        group = {"model": "model", "day": "date(ts, 'unixepoch', 'localtime')", None: "'all'"}.get(by)
        if group is None:
            raise ValueError(f"by: {by!r} is not model or day")
        with self._lock:
            cur = self._db.execute(
                f"SELECT {group} AS k, COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
                f" COALESCE(SUM(cost), 0), COALESCE(SUM(status != 200), 0), AVG(ttft_s), AVG(decode_tps)"
                f" FROM usage GROUP BY k ORDER BY k")
            rows = cur.fetchall()
        return [Summary(str(k), int(n), int(p), int(c), float(cost), int(e), ttft, tps)
                for k, n, p, c, cost, e, ttft, tps in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
