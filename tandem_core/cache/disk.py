"""The disk tier: snapshots for prefixes that come back, as files under a byte budget.

One directory a model (one process at a time). Each snapshot is one file,
``<key>.safetensors`` (see ``files``: tensors + a JSON header with tokens, length,
view axes, signature, anchors and fingerprint), and ``manifest.json`` lists them:
file, sha256, bytes, tokens held, anchor positions, hits, last use, and the
FINGERPRINT of what computed the rows (``engine.manifest().fingerprint()``: the model
files that compute stored rows and the settings that change arithmetic).

Never used, always dropped with a log line (and the file deleted):
- an entry whose fingerprint is not this engine's (checked when the tier opens),
- a file whose sha256 is not the manifest's, or whose header disagrees with its
  tensors or its name (checked when it is loaded: the lookup then misses cleanly or
  falls back to the next-best entry),
- a file the manifest does not list (a write a crash interrupted).

Every file and the manifest are written to a temporary name, fsync'd, renamed, and
the directory fsync'd. Over the budget the least valuable entry goes first (recompute
seconds saved times ``1 + hits``, per byte; ties least recently used first).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tandem_core.cache.base import CacheContext, CostModel, Hit, Snapshot, TierStats, as_tokens
from tandem_core.cache.files import (
    CorruptFile, read_header, read_verified, snapshot_from_payload, snapshot_payload, write_atomic,
    write_json_atomic,
)
from tandem_core.cache.keys import PrefixIndex, sequence_key
from tandem_core.state import ModelState

__all__ = ["DiskTier", "DiskEntry"]

log = logging.getLogger("tandem.cache")

MANIFEST = "manifest.json"
SUFFIX = ".safetensors"


@dataclass
class DiskEntry:
    file: str
    sha256: str
    bytes: int
    length: int
    fingerprint: str
    recurrent: bool
    anchors: list[int] = field(default_factory=list)
    hits: int = 0
    last_used: float = 0.0


class DiskTier:
    """Snapshot files in ``directory``, at most ``budget_bytes`` of them, for engine ``fingerprint``.

    Thread-safe within one process. ``load`` returns a state that owns its tensors (on the CPU).
    """

    name = "disk"

    def __init__(self, directory: Path | str, fingerprint: str, budget_bytes: int, *, cost: CostModel | None = None,
                 block: int = 256) -> None:
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.budget = max(0, int(budget_bytes))
        self.cost = cost or CostModel()
        self._index = PrefixIndex(block)
        self._entries: dict[str, DiskEntry] = {}
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0
        self.dropped = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._open()

    @classmethod
    def build(cls, ctx: CacheContext) -> "DiskTier":
        from tandem_core.settings import SETTINGS

        return cls(ctx.directory / "disk", ctx.fingerprint, int(SETTINGS.get("CACHE_DISK_BYTES")), cost=ctx.cost)

    # -- opening ------------------------------------------------------------------------
    def _drop_file(self, name: str, why: str) -> None:
        log.warning("disk cache: dropped %s: %s", name, why)
        self.dropped += 1
        (self.dir / name).unlink(missing_ok=True)

    def _open(self) -> None:
        path = self.dir / MANIFEST
        records: dict[str, dict] = {}
        if path.exists():
            try:
                raw = json.loads(path.read_text())
                records = dict(raw["entries"])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("disk cache: %s unreadable (%s): its files are dropped", path, exc)
        for key, rec in records.items():
            try:
                e = DiskEntry(**rec)
            except TypeError as exc:
                self._drop_file(str(rec.get("file", key + SUFFIX)) if isinstance(rec, dict) else key + SUFFIX,
                                f"manifest record malformed ({exc})")
                continue
            if e.fingerprint != self.fingerprint:
                self._drop_file(e.file, f"computed under fingerprint {e.fingerprint[:12]}…, "
                                        f"this engine's is {self.fingerprint[:12]}…")
                continue
            if e.file != key + SUFFIX or not (self.dir / e.file).is_file():
                self._drop_file(e.file, "file missing or misnamed")
                continue
            try:
                meta = read_header(self.dir / e.file)
                tokens = np.asarray(meta["tokens"], dtype=np.int64)
            except (CorruptFile, OSError, KeyError, TypeError, ValueError) as exc:
                self._drop_file(e.file, f"header unreadable ({exc})")
                continue
            if meta.get("fingerprint") != self.fingerprint or len(tokens) != e.length or sequence_key(tokens) != key:
                self._drop_file(e.file, "header does not match its manifest record")
                continue
            self._entries[key] = e
            self._index.add(key, tokens)
        known = {e.file for e in self._entries.values()}
        for p in sorted(self.dir.iterdir()):
            if p.name == MANIFEST or p.name in known or not p.is_file():
                continue
            if p.name.endswith((SUFFIX, SUFFIX + ".tmp", ".json.tmp")):
                self._drop_file(p.name, "not in the manifest (an interrupted write)")
        self._save()

    def _save(self) -> None:
        write_json_atomic(self.dir / MANIFEST,
                          {"format": 1, "entries": {k: asdict(e) for k, e in self._entries.items()}})

    # -- value ----------------------------------------------------------------------------
    def _value(self, e: DiskEntry) -> float:
        return self.cost.seconds(0, e.length) * (1 + e.hits) / max(1, e.bytes)

    def _order(self) -> list[tuple[str, DiskEntry]]:
        return sorted(self._entries.items(), key=lambda kv: (self._value(kv[1]), kv[1].last_used))

    # -- in -------------------------------------------------------------------------------
    def offer(self, snap: Snapshot) -> bool:
        """Write ``snap`` if it is worth its bytes (pushing out cheaper files); returns whether it is kept."""
        if snap.length == 0 or self.budget == 0:
            return False
        key = sequence_key(snap.tokens)
        with self._lock:
            if key in self._entries:
                self._entries[key].last_used = time.time()
                self._save()
                return True
            size = snap.nbytes
            if size > self.budget:
                return False
            mine = self.cost.seconds(0, snap.length) / max(1, size)
            room = self.budget - self.nbytes
            victims: list[str] = []
            for k, e in self._order():
                if room >= size:
                    break
                if self._value(e) > mine:
                    return False
                victims.append(k)
                room += e.bytes
            if room < size:
                return False
            tensors, meta = snapshot_payload(snap, fingerprint=self.fingerprint)
            digest, written = write_atomic(self.dir / (key + SUFFIX), tensors, meta)
            for k in victims:
                self._remove(k)
            self._entries[key] = DiskEntry(key + SUFFIX, digest, written, snap.length, self.fingerprint,
                                           bool(snap.state.sections), [a.position for a in snap.anchors],
                                           0, time.time())
            self._index.add(key, snap.tokens.copy())
            while self.nbytes > self.budget and len(self._entries) > 1:
                # the header made the file a little larger than its tensors
                cheapest = next(k for k, _ in self._order() if k != key)
                self._remove(cheapest)
            self._save()
            return True

    # -- out ------------------------------------------------------------------------------
    def _usable(self, key: str, common: int) -> int:
        e = self._entries[key]
        if common >= e.length:
            return e.length
        if not e.recurrent:
            return common
        return max((p for p in e.anchors if p <= common), default=0)

    def lookup(self, tokens: np.ndarray, limit: int) -> Hit | None:
        toks = as_tokens(tokens)
        with self._lock:
            found = self._index.search(toks, limit, self._usable)
            if found is None:
                self.misses += 1
                return None
            key, start, common = found
            return Hit(self.name, key, start, common)

    def load(self, hit: Hit) -> ModelState | None:
        """The whole state at ``hit.start``, read from its file after the sum check; None (the entry
        dropped, with a log line) when the file does not verify."""
        with self._lock:
            e = self._entries.get(hit.key)
            if e is None:
                return None
            path = self.dir / e.file
            try:
                tensors, meta = read_verified(path, e.sha256)
                if meta.get("fingerprint") != self.fingerprint:
                    raise CorruptFile(f"{e.file}: header fingerprint is not this engine's")
                snap = snapshot_from_payload(tensors, meta, e.file)
                if sequence_key(snap.tokens) != hit.key:
                    raise CorruptFile(f"{e.file}: tokens do not match the file's name")
                state = snap.state_at(hit.start)
            except (CorruptFile, OSError, ValueError) as exc:
                self._drop_file(e.file, str(exc))
                self._forget(hit.key)
                self.misses += 1
                self._save()
                return None
            e.hits += 1
            e.last_used = time.time()
            self.hits += 1
            self._save()
            return state

    def entries(self) -> dict[str, DiskEntry]:
        with self._lock:
            return {k: DiskEntry(**asdict(e)) for k, e in self._entries.items()}

    def path(self, key: str) -> Path:
        return self.dir / self._entries[key].file

    def _forget(self, key: str) -> None:
        self._entries.pop(key, None)
        self._index.remove(key)

    def _remove(self, key: str) -> None:
        e = self._entries.get(key)
        if e is not None:
            (self.dir / e.file).unlink(missing_ok=True)
        self._forget(key)

    def remove(self, key: str) -> None:
        with self._lock:
            self._remove(key)
            self._save()

    # -- accounting -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def value_per_byte(self) -> float:
        with self._lock:
            order = self._order()
            return self._value(order[0][1]) if order else math.inf

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.nbytes, len(self._entries), self.hits, self.misses)
