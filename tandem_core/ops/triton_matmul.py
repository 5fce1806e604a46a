"""Row-invariant skinny matmul for CUDA (Triton): ``y = x @ W^T`` for 1..128 rows, bf16 in, fp32 accumulate.

Decode multiplies one row by every weight; verify multiplies up to 128. A verified
row must equal the decode row bit for bit, so the arithmetic of one output row may
not depend on how many rows are in the call. Here it does not, by construction:

- the kernel config (``MatmulPlan``: tile sizes, split of K, warps, stages) is a
  function of the weight's shape ``(N, K)`` only, never of the row count;
- layout ``"xw"``: rows sit in tiles of a fixed 64 (``BM``); a call of up to 64 rows is
  one tile, 65..128 rows are two tiles that share each loaded weight tile (``MT = 2``);
  layout ``"wx"`` (swapped: the weight tile is the MMA's M side) computes ``W x^T`` with
  rows in tiles of a fixed 16 (``BT``), up to 8 tiles sharing each weight tile, so one
  decode row costs the tensor cores a quarter of the ``"xw"`` work. Either way every row
  goes through the same ``tl.dot`` of the same shape on the same K steps. Layout ``"wy"``
  is ``"wx"`` with one dot as wide as the call's rows (16, 32, 64 or 128 columns) instead
  of several 16-column ones: there the invariance rests on the tensor cores computing a
  column the same way whatever the instruction's width, which the device checks
  (``tests/test_gpu_kernels.py``, and the benchmark's tuner refuses a plan that breaks it);
- with K split in ``split`` parts, each part writes an fp32 partial
  ``[split, M, N]`` and the consumer adds the parts in index order (``reduce_parts``).

    skinny_matmul(x [M, K] bf16, w [N, K] bf16, plan) -> [M, N] bf16         (split == 1)
                                                       -> [split, M, N] fp32 (split > 1)

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["MatmulPlan", "plan_for", "skinny_matmul", "reduce_parts", "BM", "BT", "MAX_ROWS", "set_plan", "plans",
           "fused_matmul", "row_ssq", "NormIn", "AddOut", "ssq_shift"]

BM = 64          # rows per tile of layout "xw" (fixed: the row-invariance rests on it)
BT = 16          # rows per tile of layout "wx"
MAX_ROWS = 128   # two tiles at most
_SMS = 132       # H200 multiprocessors; only the split heuristic reads it

tl: Any = None
_K: dict[str, Any] = {}


@dataclass(frozen=True)
class MatmulPlan:
    """How one weight shape ``(N, K)`` is multiplied: ``BN`` output columns and ``BK`` of K per step, K cut in
    ``split`` parts of ``k_split`` (a multiple of ``BK``), ``warps``, pipeline ``stages``, the ``layout``
    (``"xw"``, ``"wx"`` or ``"wy"``)."""

    BN: int = 64
    BK: int = 128
    split: int = 1
    warps: int = 4
    stages: int = 4
    layout: str = "wy"

    def k_split(self, K: int) -> int:
        return int(math.ceil(K / self.split / self.BK) * self.BK)


_PLANS: dict[tuple[int, int], MatmulPlan] = {}


def plan_for(N: int, K: int) -> MatmulPlan:
    """The plan for a weight of shape ``(N, K)``: a tuned one (``set_plan``) or the heuristic: layout ``"wy"``,
    64-column tiles of 128 K steps, 3 stages, K cut in two while the column tiles leave multiprocessors idle and
    each part keeps at least 16 steps. (On an H200 at the 27B shape, ``tools/bench_gpu.py`` tuned every weight
    shape to ``"wy"``: the weight matmuls of a decode step take 12.4 ms at one row, 4.13 TB/s, and 15.1 ms at 64
    rows; ``"wx"`` 12.7 and 20.4, ``"xw"`` 13.7 and 14.7.)"""
    p = _PLANS.get((N, K))
    if p is not None:
        return p
    BK = 128 if K >= 128 else max(16, 1 << (K - 1).bit_length())
    BN = 64
    tiles = math.ceil(N / BN)
    split = 1
    while tiles * split < 2 * _SMS and K // (BK * split * 2) >= 16:
        split *= 2
    return MatmulPlan(BN, BK, split, 4, 3, "wy")


def set_plan(N: int, K: int, plan: MatmulPlan) -> None:
    """Fix the plan of a weight shape (the benchmark's tuning). Set it before any graph is captured."""
    _PLANS[(N, K)] = plan


def plans() -> dict[tuple[int, int], MatmulPlan]:
    return dict(_PLANS)


def _build() -> dict[str, Any]:
    global tl
    import triton
    import triton.language as _tl

    tl = _tl

    pdl_wait = pdl.jit_helpers()["pdl_wait"]
    globals()["pdl_wait"] = pdl_wait              # Triton resolves a kernel's callees in the module globals

    @triton.jit
    def _ld_x(ptrs, mask, GLU: tl.constexpr, UP):
        # the x tile; with GLU, x = bf16(bf16(silu(gate)) * up) from [gate | up] rows (up UP columns on):
        # the same arithmetic as triton_fused's silu_mul, so the fused product is the unfused one bit for bit
        if GLU:
            g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(ptrs + UP, mask=mask, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
            return (a * u).to(tl.bfloat16)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    globals()["_ld_x"] = _ld_x

    @triton.jit(do_not_specialize=["M"])
    def mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om, UP,
                  BM: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):
        # one program: BN output columns, one K part, every row (MT tiles of BM rows sharing each weight tile)
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < N
        k_lo = pid_s * K_SPLIT
        pdl_wait(PDL)
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        m0_ok = offs_m[:, None] < M
        m1_ok = (BM + offs_m)[:, None] < M
        acc0 = tl.zeros((BM, BN), dtype=tl.float32)
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        for kr in range(0, tl.cdiv(K_SPLIT, BK)):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)                          # w: [BN, BK]
                x0 = _ld_x(x_ptrs, m0_ok, GLU, UP)                                          # x0: [BM, BK]
            else:
                k_ok = (k_lo + kr * BK + offs_k < K) & (kr * BK + offs_k < K_SPLIT)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x0 = _ld_x(x_ptrs, m0_ok & k_ok[None, :], GLU, UP)
            wt = tl.trans(w)                                                              # wt: [BK, BN]
            acc0 = tl.dot(x0, wt, acc0)
            if MT > 1:
                if EVEN_K:
                    x1 = _ld_x(x_ptrs + BM * stride_xm, m1_ok, GLU, UP)
                else:
                    x1 = _ld_x(x_ptrs + BM * stride_xm, m1_ok & k_ok[None, :], GLU, UP)
                acc1 = tl.dot(x1, wt, acc1)
            w_ptrs += BK
            x_ptrs += BK
        o_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        if OUT_F32:
            tl.store(o_ptrs, acc0, mask=m0_ok & n_ok[None, :])
        else:
            tl.store(o_ptrs, acc0.to(tl.bfloat16), mask=m0_ok & n_ok[None, :])
        if MT > 1:
            if OUT_F32:
                tl.store(o_ptrs + BM * stride_om, acc1, mask=m1_ok & n_ok[None, :])
            else:
                tl.store(o_ptrs + BM * stride_om, acc1.to(tl.bfloat16), mask=m1_ok & n_ok[None, :])

    @triton.jit
    def _mmt_step(w, xT_ptrs, t_ok, k_ok, acc, EVEN_K: tl.constexpr, GLU: tl.constexpr, UP):
        if EVEN_K:
            xt = _ld_x(xT_ptrs, t_ok[None, :], GLU, UP)                                    # [BK, BT]
        else:
            xt = _ld_x(xT_ptrs, t_ok[None, :] & k_ok[:, None], GLU, UP)
        return tl.dot(w, xt, acc)

    @triton.jit
    def _mmt_store(o_ptrs, acc, ok, OUT_F32: tl.constexpr):
        if OUT_F32:
            tl.store(o_ptrs, acc, mask=ok)
        else:
            tl.store(o_ptrs, acc.to(tl.bfloat16), mask=ok)

    globals().update(_mmt_step=_mmt_step, _mmt_store=_mmt_store)

    @triton.jit(do_not_specialize=["M"])
    def mmt_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om, UP,
                   BT: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):
        # one program: BN output columns, one K part, every row: out^T[BN, BT] = W[BN, BK] x^T[BK, BT] for MT
        # tiles of BT rows sharing each weight tile
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < N
        k_lo = pid_s * K_SPLIT
        pdl_wait(PDL)
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_t[None, :] * stride_xm + (k_lo + offs_k)[:, None]              # [BK, BT]
        acc0 = tl.zeros((BN, BT), dtype=tl.float32)
        acc1 = tl.zeros((BN, BT), dtype=tl.float32)
        acc2 = tl.zeros((BN, BT), dtype=tl.float32)
        acc3 = tl.zeros((BN, BT), dtype=tl.float32)
        acc4 = tl.zeros((BN, BT), dtype=tl.float32)
        acc5 = tl.zeros((BN, BT), dtype=tl.float32)
        acc6 = tl.zeros((BN, BT), dtype=tl.float32)
        acc7 = tl.zeros((BN, BT), dtype=tl.float32)
        step = BT * stride_xm
        for kr in range(0, tl.cdiv(K_SPLIT, BK)):
            k_ok = (k_lo + kr * BK + offs_k < K) & (kr * BK + offs_k < K_SPLIT)
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)                          # w: [BN, BK]
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc0 = _mmt_step(w, x_ptrs, offs_t < M, k_ok, acc0, EVEN_K, GLU, UP)
            if MT > 1:
                acc1 = _mmt_step(w, x_ptrs + step, BT + offs_t < M, k_ok, acc1, EVEN_K, GLU, UP)
            if MT > 2:
                acc2 = _mmt_step(w, x_ptrs + 2 * step, 2 * BT + offs_t < M, k_ok, acc2, EVEN_K, GLU, UP)
                acc3 = _mmt_step(w, x_ptrs + 3 * step, 3 * BT + offs_t < M, k_ok, acc3, EVEN_K, GLU, UP)
            if MT > 4:
                acc4 = _mmt_step(w, x_ptrs + 4 * step, 4 * BT + offs_t < M, k_ok, acc4, EVEN_K, GLU, UP)
                acc5 = _mmt_step(w, x_ptrs + 5 * step, 5 * BT + offs_t < M, k_ok, acc5, EVEN_K, GLU, UP)
                acc6 = _mmt_step(w, x_ptrs + 6 * step, 6 * BT + offs_t < M, k_ok, acc6, EVEN_K, GLU, UP)
                acc7 = _mmt_step(w, x_ptrs + 7 * step, 7 * BT + offs_t < M, k_ok, acc7, EVEN_K, GLU, UP)
            w_ptrs += BK
            x_ptrs += BK
        o_ptrs = out_ptr + pid_s * stride_os + offs_t[None, :] * stride_om + offs_n[:, None]   # [BN, BT]
        ostep = BT * stride_om
        _mmt_store(o_ptrs, acc0, n_ok[:, None] & (offs_t < M)[None, :], OUT_F32)
        if MT > 1:
            _mmt_store(o_ptrs + ostep, acc1, n_ok[:, None] & (BT + offs_t < M)[None, :], OUT_F32)
        if MT > 2:
            _mmt_store(o_ptrs + 2 * ostep, acc2, n_ok[:, None] & (2 * BT + offs_t < M)[None, :], OUT_F32)
            _mmt_store(o_ptrs + 3 * ostep, acc3, n_ok[:, None] & (3 * BT + offs_t < M)[None, :], OUT_F32)
        if MT > 4:
            _mmt_store(o_ptrs + 4 * ostep, acc4, n_ok[:, None] & (4 * BT + offs_t < M)[None, :], OUT_F32)
            _mmt_store(o_ptrs + 5 * ostep, acc5, n_ok[:, None] & (5 * BT + offs_t < M)[None, :], OUT_F32)
            _mmt_store(o_ptrs + 6 * ostep, acc6, n_ok[:, None] & (6 * BT + offs_t < M)[None, :], OUT_F32)
            _mmt_store(o_ptrs + 7 * ostep, acc7, n_ok[:, None] & (7 * BT + offs_t < M)[None, :], OUT_F32)

    @triton.jit
    def _tile_ssq(xn, SH: tl.constexpr):
        # per column of a [BN, BT] tile of bf16-exact values: the sum of squares, exactly. Each square is
        # exact in fp32 (8 significant bits squared) and is cut to a multiple of 2^(e - SH), e the exponent of
        # the column's largest square (a maximum does not depend on order); BN such terms, each under 2^(e + 1),
        # add up without rounding in fp64 (SH + 1 + log2(BN) <= 53 bits), so the sum is the same whatever order
        # the reduction takes: the same bits for a row however many rows share the tile
        x2 = xn * xn                                                                    # fp32, exact
        mx = tl.max(x2, 0)                                                              # [BT]
        e = ((mx.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.int64)                 # biased fp32 exponent
        ulp = ((e + (1023 - 127 - SH)) << 52).to(tl.float64, bitcast=True)             # 2^(e - 127 - SH)
        return tl.sum(tl.floor(x2.to(tl.float64) / ulp[None, :]) * ulp[None, :], 0)    # [BT] fp64

    @triton.jit
    def _row_inv(ssq_ptr, stride_s, offs_t, t_ok, K, eps, NT: tl.constexpr):
        # 1 / rms of each row from its NT exact tile sums (ssq[i, t], fp64): the sums are cut to a multiple of
        # 2^(e - 54), e the exponent of the row's largest, and added as int64 (each under 2^56, NT <= 128 of
        # them): exact, so in any order; chunks of 32 tiles keep the registers few
        offs_i = tl.arange(0, 32)
        mx = tl.zeros(offs_t.shape, dtype=tl.float64)
        for i0 in tl.static_range(0, NT, 32):
            ok = ((i0 + offs_i) < NT)[:, None] & t_ok[None, :]
            sq = tl.load(ssq_ptr + (i0 + offs_i)[:, None] * stride_s + offs_t[None, :], mask=ok, other=0.0)
            mx = tl.maximum(mx, tl.max(sq, 0))
        e = (mx.to(tl.int64, bitcast=True) >> 52) & 0x7FF
        ulp = (tl.maximum(e - 54, 1) << 52).to(tl.float64, bitcast=True)
        tot = tl.zeros(offs_t.shape, dtype=tl.int64)
        for i0 in tl.static_range(0, NT, 32):
            ok = ((i0 + offs_i) < NT)[:, None] & t_ok[None, :]
            sq = tl.load(ssq_ptr + (i0 + offs_i)[:, None] * stride_s + offs_t[None, :], mask=ok, other=0.0)
            tot += tl.sum(tl.floor(sq / ulp[None, :]).to(tl.int64), 0)
        ms = (tot.to(tl.float64) * ulp).to(tl.float32) / K
        return 1.0 / tl.sqrt(ms + eps)

    globals().update(_tile_ssq=_tile_ssq, _row_inv=_row_inv)

    @triton.jit(do_not_specialize=["M"])
    def mmf_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om, UP,
                   ssq_in_ptr, stride_sin, nw_ptr, eps, res_ptr, stride_res, ssq_out_ptr, stride_sout, cnt_ptr,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   SPLIT: tl.constexpr, GLU: tl.constexpr, NT_IN: tl.constexpr, ADD: tl.constexpr,
                   SH: tl.constexpr, PDL: tl.constexpr):
        # layout "wy" (out^T[BN, BT] = W[BN, BK] x^T[BK, BT], one dot as wide as the rows) with
        #   NT_IN > 0: x is the residual and the tile is its RMS norm as it loads: bf16(x * inv * (1 + nw)),
        #              inv = 1/sqrt(sum_i ssq_in[i] / K + eps) over the producer's NT_IN column tiles
        #   GLU:       x = bf16(bf16(silu(gate)) * up)
        #   ADD:       the K parts (SPLIT of them, in out[s]) are added in index order by the program that
        #              finishes a column tile last, then res <- bf16(res + bf16(sum)), and that tile's exact
        #              sum of squares of the new residual goes to ssq_out[pid_n]
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < N
        t_ok = offs_t < M
        k_lo = pid_s * K_SPLIT
        pdl_wait(PDL)
        if NT_IN > 0:
            inv = _row_inv(ssq_in_ptr, stride_sin, offs_t, t_ok, K, eps, NT_IN)          # [BT]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_t[None, :] * stride_xm + (k_lo + offs_k)[:, None]              # [BK, BT]
        acc = tl.zeros((BN, BT), dtype=tl.float32)
        for kr in range(0, tl.cdiv(K_SPLIT, BK)):
            if EVEN_K:
                k_ok = offs_k < BK
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)                          # w: [BN, BK]
                xm = t_ok[None, :]
            else:
                k_ok = (k_lo + kr * BK + offs_k < K) & (kr * BK + offs_k < K_SPLIT)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xm = t_ok[None, :] & k_ok[:, None]
            if NT_IN > 0:
                nw = tl.load(nw_ptr + k_lo + kr * BK + offs_k, mask=k_ok, other=0.0)
                xt = tl.load(x_ptrs, mask=xm, other=0.0).to(tl.float32)
                xt = (xt * inv[None, :] * (1.0 + nw)[:, None]).to(tl.bfloat16)
            else:
                xt = _ld_x(x_ptrs, xm, GLU, UP)
            acc = tl.dot(w, xt, acc)
            w_ptrs += BK
            x_ptrs += BK
        ok = n_ok[:, None] & t_ok[None, :]
        if ADD:
            if SPLIT > 1:
                o_ptrs = out_ptr + pid_s * stride_os + offs_t[None, :] * stride_om + offs_n[:, None]
                tl.store(o_ptrs, acc, mask=ok)
                tl.debug_barrier()                                   # every thread's part is written ...
                ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")   # ... before the tile's count moves
                if ticket == SPLIT - 1:
                    base = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None]
                    d = tl.load(base, mask=ok, other=0.0, cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT):
                        d += tl.load(base + s * stride_os, mask=ok, other=0.0, cache_modifier=".cg")
                    tl.store(cnt_ptr + pid_n, 0)                     # ready for the next call
                    r_ptrs = res_ptr + offs_t[None, :] * stride_res + offs_n[:, None]
                    xr = tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)
                    xn = (xr + d.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
                    tl.store(r_ptrs, xn, mask=ok)
                    xf = tl.where(ok, xn.to(tl.float32), 0.0)
                    tl.store(ssq_out_ptr + pid_n * stride_sout + offs_t, _tile_ssq(xf, SH), mask=t_ok)
            else:
                r_ptrs = res_ptr + offs_t[None, :] * stride_res + offs_n[:, None]
                xr = tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)
                xn = (xr + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
                tl.store(r_ptrs, xn, mask=ok)
                xf = tl.where(ok, xn.to(tl.float32), 0.0)
                tl.store(ssq_out_ptr + pid_n * stride_sout + offs_t, _tile_ssq(xf, SH), mask=t_ok)
        else:
            o_ptrs = out_ptr + pid_s * stride_os + offs_t[None, :] * stride_om + offs_n[:, None]
            if SPLIT > 1:
                tl.store(o_ptrs, acc, mask=ok)
            else:
                tl.store(o_ptrs, acc.to(tl.bfloat16), mask=ok)

    @triton.jit
    def ssq_kernel(x_ptr, ssq_ptr, M, N, stride_x, stride_s, BN: tl.constexpr, BT: tl.constexpr,
                   SH: tl.constexpr, PDL: tl.constexpr):
        # the exact per-tile sums of squares of rows x[:M] (bf16), BN columns a program, as mmf_kernel's ADD
        pdl_wait(PDL)
        pid_n = tl.program_id(0)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_t = tl.arange(0, BT)
        ok = (offs_n < N)[:, None] & (offs_t < M)[None, :]
        xf = tl.load(x_ptr + offs_t[None, :] * stride_x + offs_n[:, None], mask=ok, other=0.0).to(tl.float32)
        tl.store(ssq_ptr + pid_n * stride_s + offs_t, _tile_ssq(xf, SH), mask=offs_t < M)

    return {"mm": mm_kernel, "mmt": mmt_kernel, "mmf": mmf_kernel, "ssq": ssq_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, plan: MatmulPlan | None = None,
                  out: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """``x: [M, K]`` (row stride free, unit column stride), ``w: [N, K]`` contiguous rows.

    Returns ``[M, N]`` in bf16 when the plan does not split K, else fp32 partials ``[split, M, N]`` (add them in
    index order with ``reduce_parts``). ``out`` (that shape and dtype) is written in place when given.
    ``glu``: ``x`` is ``[M, 2K]``, gate then up, and the product is of ``bf16(bf16(silu(gate)) * up)`` (the MLP's
    activation computed as the tiles are loaded, bit for bit ``triton_fused.silu_mul``'s)."""
    M, K = x.shape
    N = w.shape[0]
    if glu:
        if K != 2 * w.shape[1]:
            raise ValueError(f"skinny_matmul: glu x has {K} columns, not twice the weight's {w.shape[1]}")
        K = K // 2
    if w.shape[1] != K:
        raise ValueError(f"skinny_matmul: x has {K} columns, the weight {w.shape[1]}")
    if M > MAX_ROWS:
        raise ValueError(f"skinny_matmul: {M} rows exceed the row-invariant path's {MAX_ROWS}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_matmul: x and w need a unit column stride")
    p = plan or plan_for(N, K)
    ks = p.k_split(K)
    split = int(math.ceil(K / ks))
    f32 = split > 1
    if out is None:
        out = torch.empty((split, M, N) if f32 else (M, N), dtype=torch.float32 if f32 else x.dtype,
                          device=x.device)
    stride_os = out.stride(0) if f32 else 0
    stride_om = out.stride(1) if f32 else out.stride(0)
    grid = (math.ceil(N / p.BN), split)
    even = ks * split == K and ks % p.BK == 0
    kw = pdl.launch_kw()
    if p.layout in ("wx", "wy"):
        mt = 1 if M <= BT else 2 if M <= 2 * BT else 4 if M <= 4 * BT else 8
        bt, mt = (BT * mt, 1) if p.layout == "wy" else (BT, mt)
        kernels()["mmt"][grid](x, w, out, M, N, K, ks, x.stride(0), w.stride(0), stride_os, stride_om, K,
                               BT=bt, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32, GLU=glu,
                               num_warps=p.warps, num_stages=p.stages, **kw)
    else:
        mt = 1 if M <= BM else 2
        kernels()["mm"][grid](x, w, out, M, N, K, ks, x.stride(0), w.stride(0), stride_os, stride_om, K,
                              BM=BM, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32, GLU=glu,
                              num_warps=p.warps, num_stages=p.stages, **kw)
    return out


class NormIn(NamedTuple):
    """A consumer's RMS norm (zero-centred weight): ``ssq [>= nt, >= rows]`` fp64, the producer's exact per-tile
    sums of squares of the residual rows; ``weight [K]`` fp32; the norm is ``x / rms * (1 + weight)``."""

    ssq: torch.Tensor
    nt: int
    weight: torch.Tensor
    eps: float


class AddOut(NamedTuple):
    """A producer's residual add: ``res [rows, N]`` bf16 (updated in place), ``ssq [>= N/BN, >= rows]`` fp64 (its
    tiles' sums of squares, written), ``count [>= N/BN]`` int32 zeros (left zero), ``parts [split, >= rows, N]``
    fp32 (the K parts; any tensor when the plan does not split)."""

    res: torch.Tensor
    ssq: torch.Tensor
    count: torch.Tensor
    parts: torch.Tensor


def ssq_shift(BN: int) -> int:
    """The bits below a column's largest square kept by ``_tile_ssq`` for a tile of ``BN`` columns: every term
    then has at most ``SH + 1`` significant bits and ``BN`` of them add up exactly in fp64."""
    return 52 - (int(BN) - 1).bit_length()


def fused_matmul(x: torch.Tensor, w: torch.Tensor, plan: MatmulPlan, out: torch.Tensor | None = None, *,
                 glu: bool = False, norm: NormIn | None = None, add: AddOut | None = None) -> torch.Tensor | None:
    """``skinny_matmul`` in layout ``"wy"`` with what a decode step puts around a projection:

    - ``norm``: ``x [M, K]`` is the bf16 residual and each tile is normalised as it loads (the RMS from
      ``norm.ssq``, nothing else reads the row first);
    - ``glu``: ``x [M, 2K]`` is ``[gate | up]`` (as ``skinny_matmul``);
    - ``add``: the product is added to ``add.res`` in place (the K parts in index order, by the program that
      finishes a column tile last) and the new rows' per-tile sums of squares go to ``add.ssq`` for the next
      norm; returns None. Without ``add`` the product goes to ``out`` (``[M, N]`` bf16) as ``skinny_matmul``.

    Every row's arithmetic is independent of ``M``: the plan is the weight shape's, the sums of squares are
    exact (order-free) and added in a fixed order."""
    if plan.layout != "wy":
        raise ValueError(f"fused_matmul: layout {plan.layout!r}; the fused prologue and epilogue are for 'wy'")
    if glu and norm is not None:
        raise ValueError("fused_matmul: glu and norm do not combine")
    M, K = x.shape
    N = w.shape[0]
    if glu:
        if K != 2 * w.shape[1]:
            raise ValueError(f"fused_matmul: glu x has {K} columns, not twice the weight's {w.shape[1]}")
        K = K // 2
    if w.shape[1] != K:
        raise ValueError(f"fused_matmul: x has {K} columns, the weight {w.shape[1]}")
    if M > MAX_ROWS:
        raise ValueError(f"fused_matmul: {M} rows exceed the row-invariant path's {MAX_ROWS}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fused_matmul: x and w need a unit column stride")
    ks = plan.k_split(K)
    split = int(math.ceil(K / ks))
    even = ks * split == K and ks % plan.BK == 0
    bt = BT if M <= BT else 2 * BT if M <= 2 * BT else 4 * BT if M <= 4 * BT else 8 * BT
    grid = (math.ceil(N / plan.BN), split)
    dummy = w
    if norm is not None:
        if norm.ssq.dtype != torch.float64 or norm.weight.numel() != K:
            raise ValueError("fused_matmul: norm.ssq must be fp64 and norm.weight have K entries")
        s_in, s_in_stride, nw, eps, nt_in = norm.ssq, norm.ssq.stride(0), norm.weight, float(norm.eps), int(norm.nt)
    else:
        s_in, s_in_stride, nw, eps, nt_in = dummy, 0, dummy, 0.0, 0
    if add is not None:
        if add.res.shape != (M, N) or add.ssq.dtype != torch.float64 or add.count.numel() < grid[0]:
            raise ValueError("fused_matmul: add.res must be [M, N], add.ssq fp64, add.count one per column tile")
        o = add.parts if split > 1 else dummy
        if split > 1 and (add.parts.shape[0] < split or add.parts.dtype != torch.float32):
            raise ValueError(f"fused_matmul: add.parts needs {split} fp32 parts")
        stride_os, stride_om = (o.stride(0), o.stride(1)) if split > 1 else (0, 0)
        res, s_res, s_out, s_out_stride, cnt = add.res, add.res.stride(0), add.ssq, add.ssq.stride(0), add.count
    else:
        f32 = split > 1
        if out is None:
            out = torch.empty((split, M, N) if f32 else (M, N), dtype=torch.float32 if f32 else x.dtype,
                              device=x.device)
        o = out
        stride_os, stride_om = (out.stride(0), out.stride(1)) if f32 else (0, out.stride(0))
        res, s_res, s_out, s_out_stride, cnt = dummy, 0, dummy, 0, dummy
    kernels()["mmf"][grid](x, w, o, M, N, K, ks, x.stride(0), w.stride(0), stride_os, stride_om, K,
                           s_in, s_in_stride, nw, eps, res, s_res, s_out, s_out_stride, cnt,
                           BT=bt, BN=plan.BN, BK=plan.BK, EVEN_K=even, SPLIT=split, GLU=glu, NT_IN=nt_in,
                           ADD=add is not None, SH=ssq_shift(plan.BN), num_warps=plan.warps,
                           num_stages=plan.stages, **pdl.launch_kw())
    return None if add is not None else out


def row_ssq(x: torch.Tensor, ssq: torch.Tensor, BN: int = 64) -> int:
    """The exact per-tile sums of squares of ``x [M, N]`` bf16 rows into ``ssq [>= N/BN, >= M]`` fp64 (what a
    producer's ``AddOut`` leaves, for the first norm of a step); returns the tile count."""
    M, N = x.shape
    nt = math.ceil(N / BN)
    bt = BT if M <= BT else 2 * BT if M <= 2 * BT else 4 * BT if M <= 4 * BT else 8 * BT
    kernels()["ssq"][(nt,)](x, ssq, M, N, x.stride(0), ssq.stride(0), BN=BN, BT=bt, SH=ssq_shift(BN),
                            num_warps=4, **pdl.launch_kw())
    return nt


def reduce_parts(parts: torch.Tensor) -> torch.Tensor:
    """``[split, M, N]`` fp32 -> ``[M, N]`` fp32, adding the parts in index order (fixed for any M)."""
    acc = parts[0].clone()
    for s in range(1, parts.shape[0]):
        acc += parts[s]
    return acc
