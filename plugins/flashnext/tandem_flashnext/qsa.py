"""QSA indexed attention: gated attention over the tokens its indexer selects, in three forms.

The indexer (per attention layer) projects each token to ``Hi`` query heads and one raw
key of ``Di`` features. Its queries are normed (zero-centred RMS) and rotated at their
positions; the raw keys are kept as they are (view ``IK``). For a query at position ``p``:

1. its visible tokens ``0 .. p`` fall in ``nb = (p + 1) // r`` complete blocks of
   ``r = indexer_compress_ratio`` tokens, then an incomplete tail;
2. each complete block's key is the mean of its raw keys, normed (``k_layernorm``) and
   rotated at the block's first position;
3. a block scores ``sum over heads of relu(q_h . key_b) / sqrt(Di)``; the
   ``min(indexer_budget // r, nb)`` best blocks are selected (``torch.topk`` of the
   block scores, as the reference), and the tail always is;
4. the attention attends to the selected tokens only (a query whose own block is
   complete and not selected does not see itself: the reference does the same).

Forms: a prefill pools the blocks once and selects row by row over a mask; a decode
step and each verified node select from the buffer rows ``0 .. p`` of their own path
(a verify writes a node's K, V and raw key at its position, in depth-first order, as
``tandem_core.ops.attention_tree`` does) with the same calls on the same shapes, so a
verified row equals the decode row bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from tandem_core.engine import TreeStep
from tandem_core.ops import rope as _rope
from tandem_core.ops.attention import causal_mask

from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.steps import MatMul
from tandem_flashnext.weights import AttentionWeights

__all__ = ["AttentionRows", "indexed_attention", "block_keys", "selection"]

Ops = dict[str, Callable[..., Any]]


class AttentionRows(NamedTuple):
    """Per attention slot, one row a verified node: what its commit writes into the views."""

    k: torch.Tensor         # [N, Hkv, D] after k_norm and rope
    v: torch.Tensor         # [N, Hkv, D]
    ik: torch.Tensor        # [N, Di] the indexer's raw keys

    def take(self, idx: torch.Tensor) -> "AttentionRows":
        return AttentionRows(*(t.index_select(0, idx) for t in self))


def block_keys(op: Ops, raw: torch.Tensor, nb: int, w: AttentionWeights, cfg: FlashNextConfig,
               inv_freq: torch.Tensor) -> torch.Tensor:
    """The first ``nb`` complete blocks' keys ``[nb, Di]`` from the raw keys ``raw: [>= nb*r, Di]``: mean
    (summed row by row: elementwise, so a block's key does not depend on ``nb``), norm, rope at the
    block's first position."""
    r = cfg.indexer_compress_ratio
    if nb == 0:
        return raw.new_zeros(0, raw.shape[-1])
    groups = raw[:nb * r].float().view(nb, r, -1)                             # groups: [nb, r, Di]
    total = groups[:, 0]
    for j in range(1, r):
        total = total + groups[:, j]
    pooled = op["rms_norm_1p"]((total / r).to(raw.dtype), w.index_k_norm, cfg.rms_norm_eps)
    starts = torch.arange(nb, device=raw.device) * r
    cos, sin = _rope.cos_sin(starts, inv_freq)                                 # [nb, R] each
    return op["rope"](pooled[:, None, :], cos, sin)[:, 0]                      # [nb, Di]


def _scores(q: torch.Tensor, keys: torch.Tensor, cfg: FlashNextConfig) -> torch.Tensor:
    # q: [..., Hi, Di], keys: [nb, Di] -> [..., nb]: sum over heads of relu(q . key) / sqrt(Di)
    s = torch.relu(q.float() @ keys.float().transpose(-1, -2))                 # [..., Hi, nb]
    return s.sum(dim=-2) / math.sqrt(cfg.indexer_head_dim)


def selection(scores: torch.Tensor, p: int, cfg: FlashNextConfig, out: torch.Tensor) -> None:
    """Mark in ``out: [>= p + 1] bool`` the tokens a query at position ``p`` attends to, from its block
    scores ``[nb]`` (``nb = (p + 1) // r``): the best ``min(block_topk, nb)`` blocks and the tail."""
    r = cfg.indexer_compress_ratio
    nb = (p + 1) // r
    if nb:
        best = scores[:nb].topk(min(cfg.block_topk, nb), dim=0).indices       # as the reference selects
        tokens = (best[:, None] * r + torch.arange(r, device=best.device)[None, :]).reshape(-1)
        out[tokens] = True
    out[nb * r:p + 1] = True


def indexed_attention(op: Ops, mm: MatMul, x: torch.Tensor, w: AttentionWeights, cfg: FlashNextConfig,
                      step: Any, K: torch.Tensor, V: torch.Tensor, IK: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor
                      ) -> tuple[torch.Tensor, AttentionRows | None]:
    """``x: [T, H] -> [T, H]``. ``K, V: [Hkv, cap, D]`` and ``IK: [cap, Di]`` are the slot's views. A
    ``Step`` writes rows ``start .. end - 1`` of them; a ``TreeStep`` writes only scratch rows past
    ``start`` and returns the nodes' rows for the commit. ``cos, sin: [T, R]`` at the rows' positions."""
    T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    qg = mm(w.q, x).view(T, hq, 2 * D)                                         # qg: [T, Hq, 2D]
    q, gate = qg[..., :D], qg[..., D:].reshape(T, hq * D)                      # [T, Hq, D], [T, Hq*D]
    k = mm(w.k, x).view(T, hkv, D)                                             # k: [T, Hkv, D]
    v = mm(w.v, x).view(T, hkv, D)                                             # v: [T, Hkv, D]
    q = op["rope"](op["rms_norm_1p"](q, w.q_norm, cfg.rms_norm_eps), cos, sin)
    k = op["rope"](op["rms_norm_1p"](k, w.k_norm, cfg.rms_norm_eps), cos, sin)
    iqk = mm(w.index_qk, x)                                                    # iqk: [T, (Hi + 1)*Di]
    iq = op["rope"](op["rms_norm_1p"](iqk[:, :hi * di].reshape(T, hi, di), w.index_q_norm, cfg.rms_norm_eps),
                    cos, sin)                                                  # iq: [T, Hi, Di]
    ik = iqk[:, hi * di:]                                                      # ik: [T, Di] raw keys
    scale = D ** -0.5

    if isinstance(step, TreeStep):
        o = torch.empty_like(q)
        for i in step.order:                                                # ancestors first
            p = step.start + step.depth[i]
            K[:, p], V[:, p], IK[p] = k[i], v[i], ik[i]
            o[i] = _attend_one(op, q[i:i + 1], iq[i], p, K, V, IK, w, cfg, inv_freq, scale)[0]
        rows: AttentionRows | None = AttentionRows(k, v, ik)
    else:
        start, end = step.start, step.start + T
        K[:, start:end], V[:, start:end], IK[start:end] = k.transpose(0, 1), v.transpose(0, 1), ik
        if step.count == 1:
            o = _attend_one(op, q, iq[0], start, K, V, IK, w, cfg, inv_freq, scale)
        else:
            mask = causal_mask(start, T, x.device)                             # mask: [T, end]
            keys = block_keys(op, IK, end // cfg.indexer_compress_ratio, w, cfg, inv_freq)
            scores = _scores(iq, keys, cfg)                                    # scores: [T, end // r]
            chosen = torch.zeros_like(mask)
            for t in range(T):
                selection(scores[t], start + t, cfg, chosen[t])
            o = op["attention"](q, K[:, :end], V[:, :end], mask & chosen, scale)
        rows = None
    o = o.reshape(T, hq * D) * op["sigmoid"](gate).to(x.dtype)
    return mm(w.o, o), rows


def _attend_one(op: Ops, q: torch.Tensor, iq: torch.Tensor, p: int, K: torch.Tensor, V: torch.Tensor,
                IK: torch.Tensor, w: AttentionWeights, cfg: FlashNextConfig, inv_freq: torch.Tensor,
                scale: float) -> torch.Tensor:
    # one query at position p (q: [1, Hq, D], iq: [Hi, Di]) over buffer rows 0..p: the decode step's calls
    nb = (p + 1) // cfg.indexer_compress_ratio
    mask = torch.zeros(1, p + 1, dtype=torch.bool, device=q.device)
    scores = _scores(iq, block_keys(op, IK, nb, w, cfg, inv_freq), cfg) if nb else iq.new_zeros(0)
    selection(scores, p, cfg, mask[0])
    return op["attention"](q, K[:, :p + 1], V[:, :p + 1], mask, scale)
