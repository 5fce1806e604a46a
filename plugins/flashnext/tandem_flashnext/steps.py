"""The three forms of every layer, over the core's ``Step`` and ``TreeStep`` (``tandem_core.engine``).

- prefill (``Step`` of several rows): rows batched through every op; not row invariant,
  and need not be (plain and speculative decoding start from the same prefill).
- decode (``Step`` of one row): the recurrent forms, every projection through the
  row-invariant ``linear_rows`` op (``tandem_core.ops.rows``).
- verify (``TreeStep``): every projection through ``linear_rows``, each node from its
  parent's state and over its own ancestors; norms and activations batched (row
  invariant). A verified row equals the decode row at that position bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tandem_core.engine import Step, TreeStep
from tandem_core.ops import _tree

__all__ = ["MatMul", "batched", "rowwise", "tree_step"]

MatMul = Callable[[Any, torch.Tensor], torch.Tensor]


def batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    """A prefill's product: every row at once."""
    return lin.matmul(x)


def rowwise(step: Step | TreeStep) -> bool:
    """A decode step or a verify: the forms whose rows are row invariant (``linear_rows``, recurrent)."""
    return isinstance(step, TreeStep) or step.count == 1


def tree_step(start: int, parents: Sequence[int]) -> TreeStep:
    """The ``TreeStep`` of ``parents`` on top of ``start`` tokens, as the engine builds it (tools, tests)."""
    par = _tree.as_parents(parents)
    return TreeStep(int(start), tuple(par), tuple(_tree.depths(par)), tuple(_tree.preorder(par)))
