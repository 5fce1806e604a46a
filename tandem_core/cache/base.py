"""Records every cache tier shares: anchors, snapshots, hits, stats, the cost model, and the tier protocols.

Every tier reads and writes a sequence only through ``tandem_core.state.ModelState``:
its ``sections`` (recurrent state, copied whole) and ``views`` (buffers with a token
axis, cut by length). Nothing here knows which model computed the rows.

Ownership: an ``Anchor`` or ``Snapshot`` owns its tensors (detached clones); a tier
never keeps a reference to the engine's live buffers. A ``ModelState`` returned by
``Snapshot.state_at`` shares the snapshot's tensors and is only read (``restore``
copies out of it at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from tandem_core.state import ModelState, copy_to

__all__ = [
    "GRID", "PROMPT_END", "GEN_END", "RESTORED", "CostModel", "Anchor", "Snapshot", "Hit", "TierStats",
    "PrefillStart", "Releasable", "SnapshotTier", "CacheContext", "as_tokens", "common_prefix",
    "clone_sections",
]

# anchor kinds
GRID = "grid"              # every ``every`` tokens
PROMPT_END = "prompt"      # the end of a prompt's prefill
GEN_END = "generation"     # the end of a generation (the last committed token)
RESTORED = "restored"      # where a lower tier's snapshot was restored


@dataclass(frozen=True)
class CostModel:
    """What a prefilled token is worth: ``per_token_s`` seconds to recompute it.

    The default is the seed's measured cold prefill, 208.3 s for a 128k-token prompt
    (1.6 ms a token). Tiers price an entry as the recompute time it saves per byte.
    """

    per_token_s: float = 208.3 / 131072

    def seconds(self, start: int, end: int) -> float:
        """Seconds to prefill positions ``[start, end)``."""
        return max(0, end - start) * self.per_token_s


def as_tokens(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Token ids as a 1-D int64 numpy array (a copy when the input is not one already)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().to("cpu", torch.int64).reshape(-1).numpy()
    arr = np.asarray(tokens, dtype=np.int64)
    return arr.reshape(-1)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def clone_sections(sections: Mapping[str, torch.Tensor], device: torch.device | str | None = None, pin: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Detached copies of ``sections`` (on ``device``, default: where each one is; ``pin``: page-locked)."""
    return {k: copy_to(v, device, pin) for k, v in sections.items()}


@dataclass(frozen=True, eq=False)
class Anchor:
    """The recurrent state after exactly ``position`` tokens: clones of a state's sections only.

    Tiny for an attention model (no sections), megabytes for a recurrent one. Together
    with the views' first ``position`` rows it is the whole state at ``position``.
    """

    position: int
    sections: Mapping[str, torch.Tensor]
    kind: str = GRID

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sections.values())


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A sequence's whole state, detached: ``state`` holds ``tokens`` (views cut to ``len(tokens)``).

    ``anchors`` are section clones at positions below ``len(tokens)``: with the
    snapshot's views they give the whole state at those positions too, so a prompt
    that shares only part of ``tokens`` can still resume from this snapshot.
    """

    tokens: np.ndarray          # [L] int64
    state: ModelState           # length == L, owns its tensors
    anchors: tuple[Anchor, ...] = ()

    def __post_init__(self) -> None:
        if self.state.length != len(self.tokens):
            raise ValueError(f"snapshot: state holds {self.state.length} tokens, tokens has {len(self.tokens)}")
        for a in self.anchors:
            if not 0 < a.position < len(self.tokens):
                raise ValueError(f"snapshot: anchor at {a.position} outside (0, {len(self.tokens)})")

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + sum(a.nbytes for a in self.anchors)

    def resumable(self, common: int) -> int:
        """The furthest position ``<= common`` at which this snapshot gives a whole state (0: none)."""
        if common >= self.length:
            return self.length
        if not self.state.sections:
            return max(0, common)
        return max((a.position for a in self.anchors if a.position <= common), default=0)

    def state_at(self, n: int) -> ModelState:
        """The whole state after ``n`` tokens, sharing this snapshot's tensors (read it, don't write it)."""
        if n == self.length:
            return self.state
        if not 0 < n < self.length:
            raise ValueError(f"snapshot of {self.length} tokens has no state at {n}")
        if not self.state.sections:
            return ModelState({}, dict(self.state.views), n)
        for a in self.anchors:
            if a.position == n:
                return ModelState(dict(a.sections), dict(self.state.views), n)
        raise ValueError(f"snapshot of {self.length} tokens has no anchor at {n}")


class Hit(NamedTuple):
    """A lower tier's answer to a lookup: it can give the whole state after ``start`` tokens."""

    tier: str
    key: str
    start: int      # tokens the restore covers
    common: int     # the longest common prefix with the stored sequence (>= start)


@dataclass(frozen=True)
class TierStats:
    """What ``/health`` and ``/metrics`` show for one tier."""

    tier: str
    bytes: int
    entries: int
    hits: int
    misses: int

    def as_dict(self) -> dict[str, int | str]:
        return {"tier": self.tier, "bytes": self.bytes, "entries": self.entries, "hits": self.hits,
                "misses": self.misses}


class PrefillStart(NamedTuple):
    """Where a prefill started: ``tier`` (``resident``, ``store``, ``disk``, ``cold``...), ``start`` of ``total``."""

    tier: str
    start: int
    total: int
    anchor: bool = False    # resumed at a recurrent-state anchor (not just a trimmed view)

    def describe(self) -> str:
        """One line for the log: ``"resident anchor at 2048 of 2310"``, ``"disk 1024 of 2310"``, ``"cold 0 of 2310"``."""
        if self.anchor:
            return f"{self.tier} anchor at {self.start} of {self.total}"
        return f"{self.tier} {self.start} of {self.total}"


@runtime_checkable
class Releasable(Protocol):
    """Memory a cache can give back to the memory gate.

    ``value_per_byte()`` prices the entry the next ``release`` would drop (recompute
    seconds it saves per byte; ``inf`` when nothing can go). ``release(bytes_needed)``
    drops entries cheapest first until ``bytes_needed`` are freed or nothing is left,
    and returns the bytes freed (it may free more than asked: entries go whole).
    """

    name: str

    def release(self, bytes_needed: int) -> int: ...

    def value_per_byte(self) -> float: ...

    def stats(self) -> TierStats: ...


@runtime_checkable
class SnapshotTier(Protocol):
    """A tier below the resident prefix (the store, the disk, a plugin's).

    ``lookup(tokens, limit)`` finds the furthest start ``<= limit`` it can restore for
    ``tokens`` ([T] int64), or None (a miss). ``load(hit)`` returns the whole state at
    ``hit.start`` to restore from at once, or None when the entry turned out unusable
    (it is then dropped, with a log line). ``offer(snap)`` keeps ``snap`` if it is worth
    its bytes and returns whether it did.
    """

    name: str

    def lookup(self, tokens: np.ndarray, limit: int) -> Hit | None: ...

    def load(self, hit: Hit) -> ModelState | None: ...

    def offer(self, snap: Snapshot) -> bool: ...

    def stats(self) -> TierStats: ...


@dataclass(frozen=True)
class CacheContext:
    """What a registered tier's ``build(ctx)`` may use.

    fingerprint  ``engine.manifest().fingerprint()``: what computed the rows
    directory    where this model's disk tier and spill live
    device       where the snapshot store keeps its tensors (the host, for an engine on a GPU)
    pin          keep them in page-locked host memory (an engine on a GPU: restores are fast DMA copies)
    cost         the recompute price of a token
    chunk        the rows a prefill forward takes at a time (0: not known); the resident's anchor grid is
                 never finer, so that no grid point splits a forward
    """

    fingerprint: str
    directory: Path
    device: str = "cpu"
    pin: bool = False
    cost: CostModel = field(default_factory=CostModel)
    chunk: int = 0

