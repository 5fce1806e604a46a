"""Attention of new rows over cached keys and values, under an explicit mask (grouped-query heads).

    attention(q, k, v, mask, scale) -> o
        q:    [T, Hq, D]     the new rows' queries
        k, v: [Hkv, S, D]    every key/value row they may see (the cache's first S positions)
        mask: [T, S] bool    True where row t may attend to position s
        o:    [T, Hq, D]     in q's dtype; scores and softmax in fp32

Query head h reads key/value head ``h // (Hq // Hkv)``. ``causal_mask(start, T)``
is the mask of T consecutive rows appended after ``start`` cached positions.

    attention_tree(q, k, v, K, V, start, parents, scale) -> o
        q:     [N, Hq, D]          the tree's queries; k, v: [N, Hkv, D] its keys and values
        K, V:  [Hkv, cap, D]       the cache buffers; positions [0, start) hold the sequence
        o:     [N, Hq, D]

Node ``i`` at depth ``d`` attends over the sequence, its ancestors and itself,
laid out as the decode step's cache would hold them after committing its path:
positions ``0 .. start + d``. The nodes run in depth-first order, each writing its
key and value at ``start + d`` (scratch past the sequence: ``K``/``V`` positions
``start .. start + max depth`` are overwritten, nothing before ``start``), then
calling ``attention`` for its one row over ``K[:, :start + d + 1]``, which is the
decode step's call with the same operands, so its row equals the decode step's
bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem_core.ops._tree import as_parents, depths, preorder
from tandem_core.ops.act import softmax

__all__ = ["attention", "causal_mask", "attention_tree"]


def causal_mask(start: int, T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T, start + T]``: row t sees positions ``0 .. start + t``."""
    rows = torch.arange(T, device=device)[:, None] + start
    cols = torch.arange(start + T, device=device)[None, :]
    return cols <= rows


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    T, hq, D = q.shape
    hkv, S, _ = k.shape
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} key/value heads")
    rep = hq // hkv
    qg = q.float().transpose(0, 1).reshape(hkv, rep * T, D)            # qg: [Hkv, rep*T, D]
    scores = (qg @ k.float().transpose(-1, -2)) * scale                 # scores: [Hkv, rep*T, S]
    scores = scores.view(hkv, rep, T, S).masked_fill(~mask, float("-inf"))
    p = softmax(scores).view(hkv, rep * T, S)
    o = p @ v.float()                                                   # o: [Hkv, rep*T, D]
    return o.view(hq, T, D).transpose(0, 1).to(q.dtype)


def attention_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                   start: int, parents: torch.Tensor | Sequence[int], scale: float) -> torch.Tensor:
    """Tree attention over the cache (see the module docstring). Writes ``K``/``V`` at positions
    ``start .. start + max depth`` (past the sequence); returns ``o [N, Hq, D]`` in q's dtype."""
    from tandem_core import ops

    attend = ops.get("attention", q.device)
    par = as_parents(parents)
    depth = depths(par)
    if start + max(depth) + 1 > K.shape[1]:
        raise ValueError(f"attention_tree: positions up to {start + max(depth)} exceed the cache's "
                         f"{K.shape[1]}")
    out = torch.empty_like(q)
    for i in preorder(par):
        end = start + depth[i] + 1
        K[:, end - 1] = k[i]
        V[:, end - 1] = v[i]
        mask = causal_mask(end - 1, 1, q.device)                       # [1, end]: the decode step's mask
        out[i] = attend(q[i:i + 1], K[:, :end], V[:, :end], mask, scale)[0]
    return out
