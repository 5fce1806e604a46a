"""The snapshot store: other sessions' states, in memory, under a byte budget.

When a new prompt displaces the resident sequence (another agent session, a
sub-agent, a side request), the displaced session's whole state (views included)
and its end anchors can be kept here as a ``Snapshot``. A later prompt that shares
a prefix with a stored sequence resumes from it: at its end when the prompt
extends it, or at one of its anchors (at the shared prefix itself for a model
without sections) when the prompt diverges inside it.

Entries are found by the token-prefix hash chain (``keys.PrefixIndex``). Over the
budget, the least valuable entry goes first: value = recompute seconds it saves
(its tokens times ``cost.per_token_s``) times ``1 + hits``, per byte; ties go least
recently used first. A snapshot worth less than everything it would push out is
refused instead. An evicted entry is handed to ``on_evict(snapshot, hits)``
(the cache stack writes entries that came back to the disk tier).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from tandem_core.cache.base import (
    Anchor, CacheContext, CostModel, Hit, Snapshot, TierStats, as_tokens, clone_sections,
)
from tandem_core.cache.keys import PrefixIndex, sequence_key
from tandem_core.state import ModelState

__all__ = ["SnapshotStore", "StoreEntry"]


@dataclass
class StoreEntry:
    key: str
    snap: Snapshot
    nbytes: int
    hits: int
    last_used: int


class SnapshotStore:
    """Snapshots in memory (on ``device``), at most ``budget_bytes`` of them.

    Thread-safe. Snapshots handed to ``offer`` become the store's (it may move them
    to its device); ``load`` returns a state sharing the entry's tensors, to restore
    from at once.
    """

    name = "store"

    def __init__(self, budget_bytes: int, *, cost: CostModel | None = None, device: str = "cpu", block: int = 256,
                 on_evict: Callable[[Snapshot, int], None] | None = None, pin: bool = False) -> None:
        self.budget = max(0, int(budget_bytes))
        self.cost = cost or CostModel()
        self.device = device
        self.pin = pin              # host copies page-locked (an engine on a GPU)
        self.on_evict = on_evict
        self._index = PrefixIndex(block)
        self._entries: dict[str, StoreEntry] = {}
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def build(cls, ctx: CacheContext) -> "SnapshotStore":
        from tandem_core.settings import SETTINGS

        return cls(int(SETTINGS.get("CACHE_STORE_BYTES")), cost=ctx.cost, device=ctx.device, pin=ctx.pin)

    # -- value ----------------------------------------------------------------------------
    def _value(self, length: int, nbytes: int, hits: int) -> float:
        return self.cost.seconds(0, length) * (1 + hits) / max(1, nbytes)

    def _order(self) -> list[StoreEntry]:
        return sorted(self._entries.values(),
                      key=lambda e: (self._value(e.snap.length, e.nbytes, e.hits), e.last_used))

    def _victims(self, length: int, nbytes: int) -> list[StoreEntry] | None:
        """Entries to push out (cheapest first) so ``nbytes`` more fit; None if that would push out
        one worth more than the newcomer, or it cannot fit at all."""
        if nbytes > self.budget:
            return None
        mine = self._value(length, nbytes, 0)
        room = self.budget - self.nbytes
        out: list[StoreEntry] = []
        for e in self._order():
            if room >= nbytes:
                break
            if self._value(e.snap.length, e.nbytes, e.hits) > mine:
                return None
            out.append(e)
            room += e.nbytes
        return out if room >= nbytes else None

    def would_keep(self, length: int, nbytes: int) -> bool:
        """Would a snapshot of ``length`` tokens and ``nbytes`` bytes be kept (checked before cloning one)?"""
        with self._lock:
            return self._victims(length, nbytes) is not None

    # -- in -------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int] | np.ndarray, state: ModelState, anchors: Sequence[Anchor] = ()) -> bool:
        """Clone ``state`` (holding ``tokens``) and ``anchors`` onto the store's device and offer it."""
        toks = as_tokens(tokens)[:state.length]
        size = state.nbytes + sum(a.nbytes for a in anchors)
        if not self.would_keep(len(toks), size):
            return False
        snap = Snapshot(toks, state.clone(device=self.device, pin=self.pin),
                        tuple(Anchor(a.position, clone_sections(a.sections, self.device, self.pin), a.kind)
                              for a in anchors if 0 < a.position < len(toks)))
        return self.offer(snap)

    def offer(self, snap: Snapshot) -> bool:
        if snap.length == 0:
            return False
        key = sequence_key(snap.tokens)
        evicted: list[StoreEntry] = []
        with self._lock:
            if key in self._entries:
                self._entries[key].last_used = next(self._clock)
                return True
            victims = self._victims(snap.length, snap.nbytes)
            if victims is None:
                return False
            for e in victims:
                self._drop(e.key)
                evicted.append(e)
            snap = self._on_device(snap)
            self._entries[key] = StoreEntry(key, snap, snap.nbytes, 0, next(self._clock))
            self._index.add(key, snap.tokens)
        self._hand_down(evicted)
        return True

    def _on_device(self, snap: Snapshot) -> Snapshot:
        dev = torch.device(self.device)
        tensors = list(snap.state.sections.values()) + [v.tensor for v in snap.state.views.values()]
        if all(t.device == dev for t in tensors):
            return snap
        return Snapshot(snap.tokens, snap.state.clone(device=dev, pin=self.pin),
                        tuple(Anchor(a.position, clone_sections(a.sections, dev, self.pin), a.kind)
                              for a in snap.anchors))

    # -- out ------------------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, limit: int) -> Hit | None:
        """The furthest start ``<= limit`` a stored snapshot gives ``tokens``; a miss counts when none does."""
        toks = as_tokens(tokens)
        with self._lock:
            found = self._index.search(toks, limit, lambda k, c: self._entries[k].snap.resumable(c))
            if found is None:
                self.misses += 1
                return None
            key, start, common = found
            return Hit(self.name, key, start, common)

    def load(self, hit: Hit) -> ModelState | None:
        """The whole state at ``hit.start`` (sharing the entry's tensors); None if the entry is gone."""
        with self._lock:
            e = self._entries.get(hit.key)
            if e is None:
                return None
            e.hits += 1
            e.last_used = next(self._clock)
            self.hits += 1
            return e.snap.state_at(hit.start)

    def entries(self) -> list[StoreEntry]:
        """The entries, cheapest (next out) first."""
        with self._lock:
            return self._order()

    def remove(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            for k in list(self._entries):
                self._drop(k)

    def _drop(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._index.remove(key)

    def _hand_down(self, evicted: list[StoreEntry]) -> None:
        if self.on_evict is not None:
            for e in evicted:
                self.on_evict(e.snap, e.hits)

    # -- memory ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def value_per_byte(self) -> float:
        with self._lock:
            order = self._order()
            return self._value(order[0].snap.length, order[0].nbytes, order[0].hits) if order else math.inf

    def release(self, bytes_needed: int) -> int:
        """Drop entries cheapest first until ``bytes_needed`` are freed or the store is empty."""
        freed = 0
        evicted: list[StoreEntry] = []
        with self._lock:
            for e in self._order():
                if freed >= bytes_needed:
                    break
                self._drop(e.key)
                evicted.append(e)
                freed += e.nbytes
        self._hand_down(evicted)
        return freed

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.nbytes, len(self._entries), self.hits, self.misses)
