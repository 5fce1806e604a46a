"""Attention of new rows over cached keys and values, under an explicit mask (grouped-query heads).

    attention(q, k, v, mask, scale) -> o
        q:    [T, Hq, D]     the new rows' queries
        k, v: [Hkv, S, D]    every key/value row they may see (the cache's first S positions)
        mask: [T, S] bool    True where row t may attend to position s
        o:    [T, Hq, D]     in q's dtype; scores and softmax in fp32

Query head h reads key/value head ``h // (Hq // Hkv)``. ``causal_mask(start, T)``
is the mask of T consecutive rows appended after ``start`` cached positions; a
tree verify passes its own (each node sees the sequence and its ancestors).
"""

from __future__ import annotations

import torch

from tandem_core.ops.act import softmax

__all__ = ["attention", "causal_mask"]


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
