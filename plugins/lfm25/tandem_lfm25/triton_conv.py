"""LFM2's gated short convolution over a token tree on CUDA (Triton), row-invariant.

    gated_conv(bcx, tail, weight, win, n, keep, out, advance)      advance: a device flag, or None
                                                                   bcx: [rows, 3H] bf16, or [S, rows, 3H] fp32 parts

For each node ``i < n[0]`` of a call of ``rows`` nodes, one program per (node, channel block)::

    B, C, X = bcx[i] split in three           # the in_proj row [3H] bf16
    bx = bf16(B * X)                          # the conv's input, kept for the commit: keep[i]
    y  = sum_k weight[:, k] * window_k        # fp32, taps in order k = 0 .. K-1, oldest first
    out[i] = bf16(C * bf16(y))

``window_0 .. window_{K-2}`` are ``win[i, k]``: below ``K-1`` a column of the committed ``tail [H, K-1]``, else
``K-1 + node``, an ancestor's ``bx`` (recomputed from its own ``bcx`` row, the same bits); ``window_{K-1}`` is the
node's own ``bx``. This is ``tandem_lfm25.model``'s ``_short_conv`` (``tandem_core.ops.conv.causal_conv_tree``
without an activation, between the ``B * x`` gate and the ``C *`` one) with the reference's roundings. A node's
row depends on its window alone, never on the call's width, so a verified row equals the decode row.

``advance`` (a one-element int32 device tensor; a call of one node): where it holds 1 (a decode step, the node's
window the tail) the tail moves on by the node's ``bx`` in the same program (each program owns its channels: the
tail is read before it is written); 0 (a one-node verify) leaves it. One graph serves both.

Triton is imported when the kernel is first built, never at import.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["gated_conv", "kernels"]

tl: Any = None
_K: dict[str, Any] = {}
BLOCK = 256


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())

    @triton.jit
    def _bcx(ptrs, stride_s, mask, NP: tl.constexpr):
        # in_proj values in fp32: the bf16 row (NP 0), or NP fp32 partials added in index order and rounded to
        # bf16 (the bits of bf16(reduce_parts))
        if NP == 0:
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
            for s in tl.static_range(1, NP):
                v += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
            v = v.to(tl.bfloat16).to(tl.float32)
        return v

    globals().update(_bcx=_bcx)

    @triton.jit
    def gated_conv_kernel(bcx_ptr, tail_ptr, w_ptr, win_ptr, n_ptr, adv_ptr, keep_ptr, out_ptr, H, stride_bcx,
                          stride_keep,
                          stride_out, stride_s, KW: tl.constexpr, BLOCK: tl.constexpr, ADVANCE: tl.constexpr,
                          NP: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        i = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        n = tl.load(n_ptr)
        if i < n:
            ok = c < H
            row = bcx_ptr + i * stride_bcx
            b = _bcx(row + c, stride_s, ok, NP)
            cg = _bcx(row + H + c, stride_s, ok, NP)
            xx = _bcx(row + 2 * H + c, stride_s, ok, NP)
            bx = (b * xx).to(tl.bfloat16)
            tl.store(keep_ptr + i * stride_keep + c, bx, mask=ok)
            y = tl.zeros((BLOCK,), dtype=tl.float32)
            for k in tl.static_range(KW - 1):
                src = tl.load(win_ptr + i * (KW - 1) + k)
                from_tail = src < KW - 1
                node = tl.where(from_tail, 0, src - (KW - 1))
                # the masks as channel bounds (a tensor & a scalar condition would do the same on the GPU; the
                # Triton interpreter refuses it)
                t_ok = c < tl.where(from_tail, H, 0)
                r_ok = c < tl.where(from_tail, 0, H)
                xt = tl.load(tail_ptr + c * (KW - 1) + tl.where(from_tail, src, 0), mask=t_ok, other=0.0)
                xt = xt.to(tl.float32)
                nrow = bcx_ptr + node * stride_bcx
                nb = _bcx(nrow + c, stride_s, r_ok, NP)
                nx = _bcx(nrow + 2 * H + c, stride_s, r_ok, NP)
                xr = (nb * nx).to(tl.bfloat16).to(tl.float32)
                x = tl.where(from_tail, xt, xr)
                wk = tl.load(w_ptr + c * KW + k, mask=ok, other=0.0)
                if k == 0:
                    y = x * wk
                else:
                    y = y + x * wk
            y = y + bx.to(tl.float32) * tl.load(w_ptr + c * KW + (KW - 1), mask=ok, other=0.0)
            o = cg * y.to(tl.bfloat16).to(tl.float32)
            tl.store(out_ptr + i * stride_out + c, o.to(tl.bfloat16), mask=ok)
            if ADVANCE:
                adv = tl.load(adv_ptr)
                t_ok = c < tl.where(adv != 0, H, 0)
                for j in tl.static_range(KW - 2):
                    nxt = tl.load(tail_ptr + c * (KW - 1) + (j + 1), mask=t_ok, other=0.0)
                    tl.store(tail_ptr + c * (KW - 1) + j, nxt, mask=t_ok)
                tl.store(tail_ptr + c * (KW - 1) + (KW - 2), bx, mask=t_ok)

    return {"gated_conv": gated_conv_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


def gated_conv(bcx: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, win: torch.Tensor, n: torch.Tensor,
               keep: torch.Tensor, out: torch.Tensor, advance: torch.Tensor | None = None) -> torch.Tensor:
    """``bcx: [rows, 3H]`` bf16 (unit column stride), or the in_proj's fp32 partials ``[S, rows, 3H]`` (a K cut in
    ``S`` parts: added in index order and rounded to bf16 where they are read, the bits of
    ``bf16(reduce_parts(bcx))``), ``tail: [H, K-1]`` bf16 contiguous (moved on when ``advance[0]`` is 1),
    ``weight: [H, K]`` fp32 contiguous, ``win: [rows, K-1]`` int32 contiguous, ``n: [1]`` int32 (the nodes
    computed), ``keep: [rows, H]`` bf16 (each node's ``bx``), ``out: [rows, H]`` bf16. Returns ``out``."""
    H, KW = weight.shape
    if bcx.dim() == 3:
        if bcx.dtype != torch.float32:
            raise ValueError(f"gated_conv: partials [S, rows, 3H] must be fp32, got {bcx.dtype}")
        n_parts, stride_s, stride_r = int(bcx.shape[0]), bcx.stride(0), bcx.stride(1)
    else:
        n_parts, stride_s, stride_r = 0, 0, bcx.stride(0)
    rows = bcx.shape[-2]
    if bcx.shape[-1] != 3 * H or bcx.stride(-1) != 1:
        raise ValueError(f"gated_conv: bcx {tuple(bcx.shape)} is not [(S,) rows, 3 * {H}] with a unit column stride")
    kernels()["gated_conv"][(rows, (H + BLOCK - 1) // BLOCK)](
        bcx, tail, weight, win, n, n if advance is None else advance, keep, out, H, stride_r, keep.stride(0),
        out.stride(0), stride_s, KW=KW, BLOCK=BLOCK, ADVANCE=advance is not None, NP=n_parts, num_warps=2,
        **pdl.launch_kw())
    return out
