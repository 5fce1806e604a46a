"""Attention of decode and tree-verify rows over the KV cache on CUDA (Triton), row-invariant.

A row (a token at position ``p``) attends to positions ``0..p``. Its keys are cut by
position alone, never by how many rows the call carries or where the tree sits:

- the **prefix** ``[0, ts)`` with ``ts = max(0, floor(p / BS) * BS - TAIL)``: committed
  positions, in fixed splits of ``SPLIT`` positions (blocks of ``BS``); one program per
  (KV head, split, 64-row tile) shares each K/V tile among all rows of all query heads of
  the group and writes an fp32 partial ``(max, sum, acc)`` per row and split;
- the **tail** ``[ts, p]`` (at most ``TAIL + BS`` positions): one program per (KV head,
  node) gathers the node's own keys — committed slots below ``L``, its ancestors' cache
  slots ``L + anc[node, depth]`` above — so a tree node sees exactly the keys plain decode
  sees at that position, at the same offsets;
- the tails and the prefix splits are one launch (``parts_kernel``: the tails first, the
  longest programs); ``SPLIT`` is the default of ``AttnScratch``'s split, one value for every
  call on a scratch (a row's sum order rests on it);
- the **combine**: per (node, query head, ``COMBINE_BD`` of the head's columns) the maximum
  over the splits and the tail, then every part scaled to it and summed (``NSB`` splits at a
  time, in a fixed order for a position), times the output gate ``sigmoid(gate)`` (Qwen's
  gated attention), rounded to bf16.

``TAIL >= 128`` keeps every tree position (depth < 128) inside the tail, so the prefix
holds committed rows only. Decode is the one-node tree; its rows equal verify rows bit
for bit because every row goes through the same kernels with the same partition.

    tree_attention(q, raw, K, V, meta, pos, anc, parts, out, ...)
        q:    [rows, Hq*D] bf16 (after norm and rope)   raw: the projection output (the gates)
        K, V: [Hkv, S, D] bf16 (the rows' own keys already written at slots L + node)
        meta: [2] int32 (L committed, n nodes)          pos: [rows] int32 (L + depth)
        anc:  [rows, rows] int32 (anc[j, d]: node j's ancestor at depth d, j itself at its depth)
        out:  [rows, Hq*D] bf16

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["kernels", "tree_attention", "AttnScratch", "BS", "SPLIT", "TAIL", "n_splits", "COMBINE_BD"]

BS = 64        # key block
SPLIT = 256    # positions per prefix split (a multiple of BS)
TAIL = 128     # positions before the row's block that go to the tail (>= the deepest tree)
BM = 64        # prefix rows per tile
NSB = 32       # splits the combine reads at a time
COMBINE_BD = 64  # head columns per combine program
PARTS_STAGES = 2  # pipeline stages of the partials kernel (K/V tiles in flight)

tl: Any = None
_K: dict[str, Any] = {}


def n_splits(max_positions: int, split: int = SPLIT) -> int:
    return max(1, math.ceil(max_positions / split))


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    @triton.jit
    def _prefix(kvh, s, mt, q_ptr, K_ptr, V_ptr, meta_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, HQ, stride_q,
                stride_kh, stride_ks, stride_ps, qk_scale,
                G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                SPLIT: tl.constexpr, TAIL: tl.constexpr):
        n = tl.load(meta_ptr + 1)
        r = mt * BM + tl.arange(0, BM)                      # row = node * G + head in group
        j = r // G
        hq = kvh * G + r % G
        r_ok = j < n
        p = tl.load(pos_ptr + j, mask=r_ok, other=0)
        ts = tl.maximum((p // BS) * BS - TAIL, 0)
        ts = tl.where(r_ok, ts, 0)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, tl.max(ts, 0))
        if lo < hi:
            offs_d = tl.arange(0, D)
            q = tl.load(q_ptr + j[:, None] * stride_q + hq[:, None] * D + offs_d[None, :], mask=r_ok[:, None],
                        other=0.0)                                                            # [BM, D]
            m_i = tl.full((BM,), -float("inf"), dtype=tl.float32)
            l_i = tl.zeros((BM,), dtype=tl.float32)
            acc = tl.zeros((BM, D), dtype=tl.float32)
            kbase = K_ptr + kvh * stride_kh
            vbase = V_ptr + kvh * stride_kh
            for b in range(lo, hi, BS):
                cols = b + tl.arange(0, BS)
                k = tl.load(kbase + cols[:, None] * stride_ks + offs_d[None, :])              # [BS, D]
                sc = tl.dot(q, tl.trans(k)) * qk_scale                                        # [BM, BS]
                sc = tl.where(cols[None, :] < ts[:, None], sc, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                pr = tl.exp2(sc - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                v = tl.load(vbase + cols[:, None] * stride_ks + offs_d[None, :])              # [BS, D]
                acc = acc * alpha[:, None] + tl.dot(pr.to(tl.bfloat16), v)
                m_i = m_new
            row = j * HQ + hq
            tl.store(m_ptr + s * stride_ps + row, m_i, mask=r_ok)
            tl.store(l_ptr + s * stride_ps + row, l_i, mask=r_ok)
            tl.store(acc_ptr + (s * stride_ps + row)[:, None] * D + offs_d[None, :], acc, mask=r_ok[:, None])

    @triton.jit
    def _tail(kvh, j, q_ptr, K_ptr, V_ptr, meta_ptr, pos_ptr, anc_ptr, m_ptr, l_ptr, acc_ptr, HQ, stride_q,
              stride_kh, stride_ks, stride_anc, qk_scale,
              G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TAIL: tl.constexpr):
        L = tl.load(meta_ptr)
        n = tl.load(meta_ptr + 1)
        if j < n:
            p = tl.load(pos_ptr + j)
            ts = tl.maximum((p // BS) * BS - TAIL, 0)
            gi = tl.arange(0, GP)
            g_ok = gi < G
            hq = kvh * G + gi
            offs_d = tl.arange(0, D)
            q = tl.load(q_ptr + j * stride_q + hq[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
            m_i = tl.full((GP,), -float("inf"), dtype=tl.float32)
            l_i = tl.zeros((GP,), dtype=tl.float32)
            acc = tl.zeros((GP, D), dtype=tl.float32)
            kbase = K_ptr + kvh * stride_kh
            vbase = V_ptr + kvh * stride_kh
            for b in range(ts, p + 1, BS):
                cols = b + tl.arange(0, BS)
                in_tree = (cols >= L) & (cols <= p)
                a = tl.load(anc_ptr + j * stride_anc + tl.where(in_tree, cols - L, 0), mask=in_tree, other=0)
                slot = tl.where(in_tree, L + a, tl.where(cols <= p, cols, L))
                k = tl.load(kbase + slot[:, None] * stride_ks + offs_d[None, :])              # [BS, D]
                sc = tl.dot(q, tl.trans(k)) * qk_scale                                        # [GP, BS]
                sc = tl.where((cols <= p)[None, :], sc, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                pr = tl.exp2(sc - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                v = tl.load(vbase + slot[:, None] * stride_ks + offs_d[None, :])
                acc = acc * alpha[:, None] + tl.dot(pr.to(tl.bfloat16), v)
                m_i = m_new
            row = j * HQ + hq
            tl.store(m_ptr + row, m_i, mask=g_ok)
            tl.store(l_ptr + row, l_i, mask=g_ok)
            tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])

    globals().update(_prefix=_prefix, _tail=_tail)

    @triton.jit
    def parts_kernel(q_ptr, K_ptr, V_ptr, meta_ptr, pos_ptr, anc_ptr, m_ptr, l_ptr, acc_ptr,
                     tm_ptr, tl_ptr, tacc_ptr, HQ, ROWS, MTILES, stride_q, stride_kh, stride_ks, stride_ps,
                     stride_anc, qk_scale,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                     SPLIT: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr):
        # one launch for both kinds of partial: programs 0..ROWS-1 of axis 1 are the nodes' tails (first: they
        # are the longest, so they start first), the rest the prefix splits x row tiles
        pdl_wait(PDL)
        kvh = tl.program_id(0)
        i = tl.program_id(1)
        if i < ROWS:
            _tail(kvh, i, q_ptr, K_ptr, V_ptr, meta_ptr, pos_ptr, anc_ptr, tm_ptr, tl_ptr, tacc_ptr, HQ, stride_q,
                  stride_kh, stride_ks, stride_anc, qk_scale, G, GP, D, BS, TAIL)
        else:
            i = i - ROWS
            _prefix(kvh, i // MTILES, i % MTILES, q_ptr, K_ptr, V_ptr, meta_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                    HQ, stride_q, stride_kh, stride_ks, stride_ps, qk_scale, G, D, BM, BS, SPLIT, TAIL)

    @triton.jit
    def combine_kernel(m_ptr, l_ptr, acc_ptr, tm_ptr, tl_ptr, tacc_ptr, meta_ptr, pos_ptr, gate_ptr, out_ptr,
                       HQ, stride_ps, stride_gate, stride_out,
                       D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
                       TAIL: tl.constexpr, NSB: tl.constexpr, PDL: tl.constexpr):
        # per (node, query head, BD of the head's D columns): the global max over the splits and the tail
        # first, then every part scaled to it and summed, NSB splits at a time (a fixed order for a given
        # position: row-invariant)
        pdl_wait(PDL)
        j = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
        n = tl.load(meta_ptr + 1)
        if j < n:
            p = tl.load(pos_ptr + j)
            ts = tl.maximum((p // BS) * BS - TAIL, 0)
            ns = tl.cdiv(ts, SPLIT)
            row = j * HQ + h
            sb = tl.arange(0, NSB)
            mt = tl.load(tm_ptr + row)                        # the tail holds position p: finite
            mx = mt
            for s0 in range(0, ns, NSB):
                ok = s0 + sb < ns
                ms = tl.load(m_ptr + (s0 + sb) * stride_ps + row, mask=ok, other=-float("inf"))
                mx = tl.maximum(mx, tl.max(ms, 0))
            wt = tl.exp2(mt - mx)
            l = tl.load(tl_ptr + row) * wt
            acc = tl.load(tacc_ptr + row * D + offs_d) * wt
            for s0 in range(0, ns, NSB):
                ok = s0 + sb < ns
                ms = tl.load(m_ptr + (s0 + sb) * stride_ps + row, mask=ok, other=-float("inf"))
                ws = tl.where(ok, tl.exp2(ms - mx), 0.0)
                ls = tl.load(l_ptr + (s0 + sb) * stride_ps + row, mask=ok, other=0.0)
                accs = tl.load(acc_ptr + ((s0 + sb) * stride_ps + row)[:, None] * D + offs_d[None, :],
                               mask=ok[:, None], other=0.0)                                  # [NSB, BD]
                l += tl.sum(ls * ws, 0)
                acc += tl.sum(accs * ws[:, None], 0)
            o = (acc / l).to(tl.bfloat16).to(tl.float32)
            gt = tl.load(gate_ptr + j * stride_gate + h * 2 * D + D + offs_d).to(tl.float32)
            sg = (1.0 / (1.0 + tl.exp(-gt))).to(tl.bfloat16).to(tl.float32)
            tl.store(out_ptr + j * stride_out + h * D + offs_d, (o * sg).to(tl.bfloat16))

    return {"parts": parts_kernel, "combine": combine_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


class AttnScratch:
    """The partials of up to ``rows`` nodes x ``hq`` heads over ``max_positions`` positions, head dim ``D``: the
    prefix cut in splits of ``split`` positions (a multiple of ``BS``; one value for every call on this scratch,
    decode and verify alike: a row's sum order rests on it)."""

    def __init__(self, rows: int, hq: int, D: int, max_positions: int, device: torch.device,
                 split: int = SPLIT) -> None:
        if split <= 0 or split % BS:
            raise ValueError(f"AttnScratch: split {split} is not a positive multiple of the key block {BS}")
        f32 = dict(dtype=torch.float32, device=device)
        splits = n_splits(max_positions, split)
        self.rows, self.splits, self.split = rows, splits, split
        self.m = torch.empty(splits, rows * hq, **f32)
        self.l = torch.empty(splits, rows * hq, **f32)
        self.acc = torch.empty(splits, rows * hq, D, **f32)
        self.tm = torch.empty(rows * hq, **f32)
        self.tl = torch.empty(rows * hq, **f32)
        self.tacc = torch.empty(rows * hq, D, **f32)


def tree_attention(q: torch.Tensor, raw: torch.Tensor, K: torch.Tensor, V: torch.Tensor, meta: torch.Tensor,
                   pos: torch.Tensor, anc: torch.Tensor, scratch: AttnScratch, out: torch.Tensor, *, hq: int,
                   hkv: int, head_dim: int, scale: float, rows: int) -> torch.Tensor:
    """See the module docstring. ``rows`` is the call's width (nodes ``>= meta[1]`` are skipped)."""
    G = hq // hkv
    D = head_dim
    qk_scale = float(scale) * 1.4426950408889634          # exp2 domain
    kk = kernels()
    kw = pdl.launch_kw()
    mtiles = math.ceil(rows * G / BM)
    kk["parts"][(hkv, rows + scratch.splits * mtiles)](
        q, K, V, meta, pos, anc, scratch.m, scratch.l, scratch.acc, scratch.tm, scratch.tl, scratch.tacc, hq, rows,
        mtiles, q.stride(0), K.stride(0), K.stride(1), scratch.m.stride(0), anc.stride(0), qk_scale,
        G=G, GP=max(16, 1 << (G - 1).bit_length()), D=D, BM=BM, BS=BS, SPLIT=scratch.split, TAIL=TAIL,
        num_warps=8, num_stages=PARTS_STAGES, **kw)
    BD = min(D, COMBINE_BD)
    kk["combine"][(rows, hq, D // BD)](scratch.m, scratch.l, scratch.acc, scratch.tm, scratch.tl, scratch.tacc, meta,
                                       pos, raw, out, hq, scratch.m.stride(0), raw.stride(0), out.stride(0), D=D,
                                       BD=BD, BS=BS, SPLIT=scratch.split, TAIL=TAIL, NSB=NSB, num_warps=4, **kw)
    return out
