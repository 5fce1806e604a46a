"""Depthwise causal convolution over time with its tail state (Gated DeltaNet's and LFM2's short conv).

``causal_conv(x, tail, weight)``: ``x: [T, C]`` the new inputs, ``tail: [C, K-1]``
the ``K-1`` inputs before them (oldest first; zeros at the start of a sequence),
``weight: [C, K]``. Output ``y[t, c] = act(sum_k weight[c, k] * xx[t + k, c])``
where ``xx = [tail^T; x]``, and the new tail is the last ``K-1`` rows of ``xx``.
The taps are summed in a fixed order in fp32 (no library convolution, whose
kernel choice depends on the CPU).

``causal_conv_tree(x, tail, weight, parents)`` is the same convolution over a token
tree: node ``i`` reads the ``K-1`` inputs before it on its own path (its ancestors,
then the committed ``tail``), so its row equals, bit for bit, the row
``causal_conv`` computes for that node's token as a decode step (one row, with
the tail the path leaves). It returns no tail: the caller keeps the nodes' inputs
and takes the tail of the path it commits (``conv_tail``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem_core.ops._tree import ancestors, as_parents
from tandem_core.ops.act import silu

__all__ = ["causal_conv", "causal_conv_tree", "conv_tail"]


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
                activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y [T, C] in x's dtype, new_tail [C, K-1] in tail's dtype)``; neither input is mutated."""
    T = x.shape[0]
    K = weight.shape[1]
    xx = torch.cat([tail.t().to(x.dtype), x], dim=0)     # xx: [K-1+T, C]
    xf = xx.float()
    w = weight.float()                                   # w: [C, K]
    y = xf[0:T] * w[:, 0]                                 # y: [T, C]
    for k in range(1, K):
        y = y + xf[k:k + T] * w[:, k]
    y = _activate(y, activation)
    new_tail = xx[T:].t().to(tail.dtype)                  # new_tail: [C, K-1]
    return y.to(x.dtype), new_tail


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "silu":
        return silu(y)
    if activation is not None:
        raise ValueError(f"causal_conv: unknown activation {activation!r}")
    return y


def causal_conv_tree(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
                     parents: torch.Tensor | Sequence[int], activation: str | None = "silu") -> torch.Tensor:
    """``x: [N, C]`` the tree's new inputs, ``tail: [C, K-1]`` the committed sequence's, ``parents: [N]``
    (``-1``: a child of the last committed token) -> ``y [N, C]`` in x's dtype. Mutates nothing.

    Node ``i`` at depth ``d`` sees ``[tail[:, d:]^T; x[ancestors root..parent]; x[i]]`` (the last
    ``K-1`` inputs of its path, then its own), summed tap by tap in ``causal_conv``'s order.
    """
    par = as_parents(parents)
    K = weight.shape[1]
    src = torch.cat([tail.t().to(x.dtype), x], dim=0).float()      # src: [K-1+N, C]; tail rows first
    index = []
    for i in range(len(par)):
        anc = ancestors(par, i, K - 1)                              # nearest first
        window = [K - 1 + a for a in reversed(anc)] + [K - 1 + i]   # the path's own rows, oldest first
        window = list(range(len(window) - 1, K - 1)) + window     # the committed tail's last rows before
        index.append(window)
    idx = torch.tensor(index, dtype=torch.long, device=x.device)    # idx: [N, K] rows of src
    w = weight.float()                                               # w: [C, K]
    y = src[idx[:, 0]] * w[:, 0]                                     # y: [N, C]
    for k in range(1, K):
        y = y + src[idx[:, k]] * w[:, k]
    return _activate(y, activation).to(x.dtype)


def conv_tail(tail: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The tail after appending the inputs ``x: [P, C]`` to a sequence whose tail is ``tail: [C, K-1]``
    (what ``causal_conv(x, tail, ...)`` returns as its new tail). ``[C, K-1]`` in tail's dtype."""
    K1 = tail.shape[1]
    xx = torch.cat([tail.t().to(x.dtype), x], dim=0)      # xx: [K-1+P, C]
    return xx[xx.shape[0] - K1:].t().to(tail.dtype)
