"""The engine contract: the hot verbs the decode loop calls and the cold verbs the server and caches call.

An engine holds one sequence (batch 1): its tokens' KV rows and recurrent state
live in buffers the engine owns. What an engine can do beyond the base verbs is
said by its ``caps`` (a frozen ``Capabilities`` record), never by probing it.

Protocols here are split by capability:

- ``Engine``: every engine. ``forward`` appends tokens to the sequence and
  returns their logits; ``state`` is the live ``ModelState``; ``reset`` empties.
- ``TreeEngine`` (``caps.tree``): speculation verbs. ``forward_tree`` verifies a
  token tree on top of the sequence without committing; ``commit_tree(path)``
  keeps one root-to-leaf path; ``rollback_to(n)`` forgets tokens past ``n``.
- ``ResumableEngine`` (``caps.resume``): cache verbs. ``resume_at(n)``,
  ``settle()``, ``discard_pending()``, ``trim_pending(n)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from tandem_core.state import ModelState

__all__ = [
    "Capabilities", "MemoryPart", "Manifest", "Engine", "TreeEngine", "ResumableEngine", "KVInfo",
    "TreeOut",
]


@dataclass(frozen=True)
class Capabilities:
    """What an engine offers beyond the base verbs. Read it; never ``hasattr`` an engine."""

    tree: bool = False          # forward_tree / forward_block / commit_tree / rollback_to
    resume: bool = False        # resume_at / settle / discard_pending / trim_pending
    recurrent: bool = False     # its ModelState has sections (anchors are needed to resume mid-sequence)
    max_context: int = 0        # the most tokens its buffers hold
    max_tree: int = 0           # the widest tree forward_tree verifies in one call
    hidden_layers: tuple[int, ...] = ()  # layers whose hidden states a drafter may read
    device: str = "cpu"
    dtype: str = "fp32"


class MemoryPart(NamedTuple):
    """One part of an engine's memory: ``name``, bytes, and where it lives."""

    name: str
    nbytes: int
    device: str


@dataclass(frozen=True)
class Manifest:
    """What computed an engine's rows: the files, the settings that change arithmetic, and anything else.

    ``fingerprint()`` hashes the files' bytes, the settings and the extras; a cache
    row written under one fingerprint is never read under another.
    """

    files: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.files):
            p = Path(f)
            h.update(p.name.encode())
            h.update(p.read_bytes())
        h.update(json.dumps(self.settings, sort_keys=True, default=str).encode())
        h.update(json.dumps(self.extra, sort_keys=True, default=str).encode())
        return h.hexdigest()


class KVInfo(Protocol):
    @property
    def length(self) -> int:
        """Tokens the sequence holds (committed)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """The base verbs every engine has."""

    caps: Capabilities
    kv: KVInfo

    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64) to the sequence; return logits ``[T, V]`` (all) or ``[1, V]`` (last).

        Long inputs run in prefill chunks; the result equals one full forward.
        The returned tensor is new (the caller owns it).
        """
        ...

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's own greedy picks: ``argmax`` over the last axis, ``[R, V] -> [R]``."""
        ...

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's hidden states after the final norm, ``[T, H]`` (valid until the next forward)."""
        ...

    @property
    def state(self) -> ModelState:
        """The live state over the engine's own buffers (restore into it lands in place)."""
        ...

    def reset(self) -> None:
        """Forget the sequence: length 0, recurrent state zero."""
        ...

    def cache_state(self) -> ModelState:
        """The live state, ``length == kv.length``; tiers clone it to keep it."""
        ...

    def manifest(self) -> Manifest:
        ...

    def memory_parts(self) -> list[MemoryPart]:
        ...


class TreeOut(NamedTuple):
    """A verified tree: ``logits[n]`` is the model's next-token distribution after node ``n``."""

    logits: torch.Tensor  # [N, V]


@runtime_checkable
class TreeEngine(Engine, Protocol):
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> TreeOut:
        """Verify a token tree on top of the sequence (parents[i] < i, -1 for the root's children)."""
        ...

    def forward_block(self, tokens: torch.Tensor) -> TreeOut:
        """Verify a chain (a tree where each node's parent is the one before)."""
        ...

    def commit_tree(self, path: Sequence[int]) -> None:
        """Keep the nodes of ``path`` (indices into the last verified tree) as the sequence's next tokens."""
        ...

    def rollback_to(self, n: int) -> None:
        """Forget every token past ``n``."""
        ...


@runtime_checkable
class ResumableEngine(Engine, Protocol):
    def resume_at(self, n: int) -> None: ...

    def settle(self) -> None: ...

    def discard_pending(self) -> None: ...

    def trim_pending(self, n: int) -> None: ...
