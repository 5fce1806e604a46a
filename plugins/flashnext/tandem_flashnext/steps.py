"""What one call appends or verifies, and how it multiplies: the three forms of every layer.

- prefill (``Step`` of several rows): rows batched through every op; not row invariant,
  and need not be (plain and speculative decoding start from the same prefill).
- decode (``Step`` of one row): the recurrent forms, every projection through the
  row-invariant ``linear_rows`` op (``tandem_core.ops.rows``).
- verify (``TreeStep``): every projection through ``linear_rows``, each node from its
  parent's state and over its own ancestors; norms and activations batched (row
  invariant). A verified row equals the decode row at that position bit for bit.

``Rows`` is what a call returns: the hidden rows after the final mixer, the logits,
and the drafter taps. ``Capture`` collects (point name, rows) after every layer's
mixer and MLP and after the final mixer (the self-check names a differing layer by it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from tandem_core.ops import _tree

__all__ = ["Step", "TreeStep", "Rows", "Capture", "batched", "tree_step"]

Capture = list[tuple[str, torch.Tensor]]   # (point name, rows [T, ...]) in forward order


@dataclass(frozen=True)
class Step:
    """``count`` rows appended at positions ``start .. start + count - 1``."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def rowwise(self) -> bool:
        """A decode step (one row): the recurrent forms and ``linear_rows``."""
        return self.count == 1

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=device)                  # [T]


@dataclass(frozen=True)
class TreeStep:
    """``len(parents)`` nodes verified on top of ``start`` committed tokens, node ``i`` at position
    ``start + depth[i]`` (``parents[i] < i``, -1 for a child of the last committed token)."""

    start: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.parents)

    @property
    def rowwise(self) -> bool:
        return True

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long, device=device) + self.start   # [N]

    @property
    def preorder(self) -> list[int]:
        return _tree.preorder(self.parents)


def tree_step(start: int, parents: Any) -> TreeStep:
    """The checked ``TreeStep`` of ``parents`` on top of ``start`` tokens."""
    par = _tree.as_parents(parents)
    return TreeStep(int(start), tuple(par), tuple(_tree.depths(par)))


class Rows(NamedTuple):
    hidden: torch.Tensor               # [T, H] after the final mixer
    logits: torch.Tensor | None        # fp32 [T, V] ("all"), [1, V] ("last"), None ("none")
    taps: dict[int, torch.Tensor]      # hidden rows at the layers a drafter asked for (may be empty)


def batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    """A prefill's product: every row at once."""
    return lin.matmul(x)


MatMul = Callable[[Any, torch.Tensor], torch.Tensor]
