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
from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["MatmulPlan", "plan_for", "skinny_matmul", "reduce_parts", "BM", "BT", "MAX_ROWS", "set_plan", "plans"]

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
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    @triton.jit(do_not_specialize=["M"])
    def mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om,
                  BM: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, PDL: tl.constexpr):
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
                x0 = tl.load(x_ptrs, mask=m0_ok, other=0.0)                                 # x0: [BM, BK]
            else:
                k_ok = (k_lo + kr * BK + offs_k < K) & (kr * BK + offs_k < K_SPLIT)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x0 = tl.load(x_ptrs, mask=m0_ok & k_ok[None, :], other=0.0)
            wt = tl.trans(w)                                                              # wt: [BK, BN]
            acc0 = tl.dot(x0, wt, acc0)
            if MT > 1:
                if EVEN_K:
                    x1 = tl.load(x_ptrs + BM * stride_xm, mask=m1_ok, other=0.0)
                else:
                    x1 = tl.load(x_ptrs + BM * stride_xm, mask=m1_ok & k_ok[None, :], other=0.0)
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
    def _mmt_step(w, xT_ptrs, t_ok, k_ok, acc, EVEN_K: tl.constexpr):
        if EVEN_K:
            xt = tl.load(xT_ptrs, mask=t_ok[None, :], other=0.0)                            # [BK, BT]
        else:
            xt = tl.load(xT_ptrs, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        return tl.dot(w, xt, acc)

    @triton.jit
    def _mmt_store(o_ptrs, acc, ok, OUT_F32: tl.constexpr):
        if OUT_F32:
            tl.store(o_ptrs, acc, mask=ok)
        else:
            tl.store(o_ptrs, acc.to(tl.bfloat16), mask=ok)

    globals().update(_mmt_step=_mmt_step, _mmt_store=_mmt_store)

    @triton.jit(do_not_specialize=["M"])
    def mmt_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om,
                   BT: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, PDL: tl.constexpr):
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
            acc0 = _mmt_step(w, x_ptrs, offs_t < M, k_ok, acc0, EVEN_K)
            if MT > 1:
                acc1 = _mmt_step(w, x_ptrs + step, BT + offs_t < M, k_ok, acc1, EVEN_K)
            if MT > 2:
                acc2 = _mmt_step(w, x_ptrs + 2 * step, 2 * BT + offs_t < M, k_ok, acc2, EVEN_K)
                acc3 = _mmt_step(w, x_ptrs + 3 * step, 3 * BT + offs_t < M, k_ok, acc3, EVEN_K)
            if MT > 4:
                acc4 = _mmt_step(w, x_ptrs + 4 * step, 4 * BT + offs_t < M, k_ok, acc4, EVEN_K)
                acc5 = _mmt_step(w, x_ptrs + 5 * step, 5 * BT + offs_t < M, k_ok, acc5, EVEN_K)
                acc6 = _mmt_step(w, x_ptrs + 6 * step, 6 * BT + offs_t < M, k_ok, acc6, EVEN_K)
                acc7 = _mmt_step(w, x_ptrs + 7 * step, 7 * BT + offs_t < M, k_ok, acc7, EVEN_K)
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

    return {"mm": mm_kernel, "mmt": mmt_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, plan: MatmulPlan | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x: [M, K]`` (row stride free, unit column stride), ``w: [N, K]`` contiguous rows.

    Returns ``[M, N]`` in bf16 when the plan does not split K, else fp32 partials ``[split, M, N]`` (add them in
    index order with ``reduce_parts``). ``out`` (that shape and dtype) is written in place when given."""
    M, K = x.shape
    N = w.shape[0]
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
        kernels()["mmt"][grid](x, w, out, M, N, K, ks, x.stride(0), w.stride(0), stride_os, stride_om,
                               BT=bt, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32,
                               num_warps=p.warps, num_stages=p.stages, **kw)
    else:
        mt = 1 if M <= BM else 2
        kernels()["mm"][grid](x, w, out, M, N, K, ks, x.stride(0), w.stride(0), stride_os, stride_om,
                              BM=BM, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32,
                              num_warps=p.warps, num_stages=p.stages, **kw)
    return out


def reduce_parts(parts: torch.Tensor) -> torch.Tensor:
    """``[split, M, N]`` fp32 -> ``[M, N]`` fp32, adding the parts in index order (fixed for any M)."""
    acc = parts[0].clone()
    for s in range(1, parts.shape[0]):
        acc += parts[s]
    return acc
