"""A mixture of experts on CUDA (Triton): routing and the grouped expert matmul, row-invariant and capturable in a
CUDA graph. The plain-torch references are ``tandem_core.ops.moe`` (``route``, ``grouped_experts``): same
contracts, same dtype flow.

    route(logits [T, E], bias [E] | None, top_k, scoring, renorm, scale, eps, out=None)
        -> (experts [T, k] int32 ascending along k, weights [T, k] fp32)
    grouped_experts(x [T, H] bf16, experts [T, k] int, weights [T, k] fp32, w_gate_up [E, 2I, H] bf16,
                    w_down [E, H, I] bf16, plan=None, out=None, live=None, blocks=None) -> y [T, H] bf16
    combine_add_norm(d [T*k, H], experts, weights, x, norm_w, eps, out, live=None): step 4 below with the
        residual add and the next norm after it (``grouped_experts(..., combine=False)`` gives ``d``)
    route_plan(logits [T, E] | partials [S, T, E], bias, top_k, plan, renorm, scale, eps, live=None)
        -> Routed(experts, weights, sorted, table): route (sigmoid) and step 1 below in one program, from the
           router matmul's fp32 partials when its K was cut (the decode and verify widths' router)

The experts, four launches and nothing read back by the host (so a CUDA graph captures a call whole):

1. ``plan`` (one program): the call's ``P = T * k`` (row, slot) pairs sorted by expert on the device (stable: a
   pair's place is the count of pairs before it in (expert, pair) order), and a table of blocks of at most ``BT``
   pairs of one expert each: ``(expert, first sorted pair, pairs)``. The grid of the matmuls is the fixed upper
   bound ``max_blocks(P, E, BT)`` on the number of blocks; a block past the call's count is marked ``-1`` and its
   programs exit at once.
2. ``gate_up``: per (column tile, block): ``gate`` and ``up`` of the block's rows for ``BN_UP`` columns each, the
   weight tile the MMA's M side and the rows its N side (``BT`` wide, as the skinny matmul's ``"wx"`` layout), then
   in the epilogue ``h = bf16(bf16(silu(bf16(gate))) * bf16(up))`` into the pair's row of ``h [P, I]``.
3. ``down``: per (column tile, block): ``bf16(down_e h)`` into the pair's row of ``d [P, H]``.
4. ``combine``: per row: ``sum of weight * d`` over its pairs in increasing expert (then slot), fp32 from zero,
   rounded to bf16 once.

An expert's weight tiles are read once per block (once a call for an expert that at most ``BT`` pairs chose: a
decode step, or a 16-node verify that shares an expert between at most 16 nodes).

Row invariance: ``MoePlan`` (block rows, tiles, warps, stages) is a function of the weight shape only
(``plan_for``), the K loops run over the whole hidden / expert width in fixed steps, and every pair goes through
the same ``tl.dot`` of the same shape whatever else shares its block; so a pair's ``d`` row, and a row's sum, do not
depend on how many rows share its experts or on the call's width: a verified row equals the decode row bit for
bit. (Prefill may take a wider plan, ``PREFILL_PLAN``: it need not match decode.)

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = [
    "PREFILL_PLAN",
    "SCORING",
    "MoePlan",
    "Routed",
    "combine_add_norm",
    "grouped_experts",
    "kernels",
    "max_blocks",
    "plan_for",
    "plans",
    "route",
    "route_plan",
    "set_plan",
]

SCORING = {"sigmoid": 0, "softmax": 1}

tl: Any = None
_K: dict[str, Any] = {}


@dataclass(frozen=True)
class MoePlan:
    """How one expert shape is multiplied: ``BT`` pairs a block (the MMA's N side), ``BN_UP`` gate (and as many
    up) columns a ``gate_up`` program, ``BN_DOWN`` output columns a ``down`` program, ``BK`` of K a step, warps and
    pipeline stages."""

    BT: int = 16
    BN_UP: int = 32
    BN_DOWN: int = 32
    BK: int = 128
    warps: int = 4
    stages: int = 4


PREFILL_PLAN = MoePlan(BT=64, BN_UP=64, BN_DOWN=64, BK=64, warps=4, stages=3)

_PLANS: dict[tuple[int, int, int], MoePlan] = {}


def plan_for(E: int, I: int, H: int) -> MoePlan:
    """The plan for ``E`` experts of width ``I`` over hidden ``H``: a tuned one (``set_plan``) or the default
    (16-pair blocks; 32-column tiles, so a decode step of 4 experts at I = 1536 has 192 ``gate_up`` programs)."""
    p = _PLANS.get((E, I, H))
    if p is not None:
        return p
    BK = 128 if min(I, H) >= 128 else max(16, 1 << (min(I, H) - 1).bit_length())
    return MoePlan(BK=BK)


def set_plan(E: int, I: int, H: int, plan: MoePlan) -> None:
    """Fix the plan of an expert shape (a benchmark's tuning). Set it before any graph is captured."""
    _PLANS[(E, I, H)] = plan


def plans() -> dict[tuple[int, int, int], MoePlan]:
    return dict(_PLANS)


def max_blocks(P: int, E: int, BT: int) -> int:
    """The most blocks ``P`` pairs over ``E`` experts can need: an expert of ``c`` pairs takes ``ceil(c / BT)``,
    at most ``(c + BT - 1) / BT``, and at most ``min(E, P)`` experts are chosen."""
    return max(1, (P + min(E, P) * (BT - 1)) // BT)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    @triton.jit
    def route_kernel(lg_ptr, bias_ptr, exp_ptr, wt_ptr, E, stride_l, scale, eps,
                     TOPK: tl.constexpr, BE: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RENORM: tl.constexpr, PDL: tl.constexpr):
        # one row: p = sigmoid / softmax(logits); the TOPK largest p + bias (ties: the lower expert); weights p
        # there, renormalised, scaled; written in increasing expert index
        pdl_wait(PDL)
        t = tl.program_id(0)
        ex = tl.arange(0, BE)
        ok = ex < E
        lg = tl.load(lg_ptr + t * stride_l + ex, mask=ok, other=0.0).to(tl.float32)
        if SCORING == 0:
            p = 1.0 / (1.0 + tl.exp(-lg))
        else:
            lm = tl.where(ok, lg, -float("inf"))
            z = tl.exp(lm - tl.max(lm, 0))
            p = z / tl.sum(z, 0)
        p = tl.where(ok, p, 0.0)
        s = p
        if HAS_BIAS:
            s = p + tl.load(bias_ptr + ex, mask=ok, other=0.0)
        s = tl.where(ok, s, -float("inf"))
        chosen = ex < 0
        for _ in tl.static_range(TOPK):
            top = tl.max(s, 0)
            i = tl.min(tl.where(s == top, ex, BE), 0)               # the lowest expert of the largest score
            chosen = chosen | (ex == i)
            s = tl.where(ex == i, -float("inf"), s)
        w = tl.where(chosen, p, 0.0)
        if RENORM:
            w = w / (tl.sum(w, 0) + eps)
        w = w * scale
        rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(exp_ptr + t * TOPK + rank, ex, mask=chosen)
        tl.store(wt_ptr + t * TOPK + rank, w, mask=chosen)

    @triton.jit
    def plan_kernel(exp_ptr, live_ptr, sorted_ptr, blk_ptr, P, MAXB,
                    KTOP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BQ: tl.constexpr, BB: tl.constexpr,
                    HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
        # one program. blk: [3, MAXB] int32 rows (expert or -1, first sorted pair, pairs); the pairs of rows past
        # live[0] take no part
        pdl_wait(PDL)
        if HAS_LIVE:
            PL = tl.minimum(P, tl.load(live_ptr) * KTOP)
        else:
            PL = P
        ex = tl.arange(0, BE)
        cnt = tl.zeros((BE,), dtype=tl.int32)
        for q0 in range(0, PL, BQ):
            q = q0 + tl.arange(0, BQ)
            e = tl.load(exp_ptr + q, mask=q < PL, other=BE).to(tl.int32)
            cnt += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), 0)
        nb = (cnt + BT - 1) // BT
        bend = tl.cumsum(nb, 0)                                  # blocks through expert e
        bstart = bend - nb
        pstart = tl.cumsum(cnt, 0) - cnt                         # the expert's first sorted pair
        total = tl.sum(nb, 0)
        # each pair's place: its expert's start, plus the pairs of that expert before it
        run = pstart
        for q0 in range(0, PL, BQ):
            q = q0 + tl.arange(0, BQ)
            e = tl.load(exp_ptr + q, mask=q < PL, other=BE).to(tl.int32)
            oh = (e[:, None] == ex[None, :]).to(tl.int32)                        # [BQ, BE]
            before = tl.cumsum(oh, 0) - oh
            at = tl.sum(oh * (before + run[None, :]), 1)
            tl.store(sorted_ptr + at, q, mask=q < PL)
            run += tl.sum(oh, 0)
        for b0 in range(0, MAXB, BB):
            b = b0 + tl.arange(0, BB)
            eb = tl.sum((bend[None, :] <= b[:, None]).to(tl.int32), 1)          # the expert holding block b
            oh = (ex[None, :] == eb[:, None]).to(tl.int32)                       # [BB, BE]
            j = b - tl.sum(oh * bstart[None, :], 1)
            lo = tl.sum(oh * pstart[None, :], 1) + j * BT
            n = tl.minimum(tl.sum(oh * cnt[None, :], 1) - j * BT, BT)
            live = b < total
            b_ok = b < MAXB
            tl.store(blk_ptr + b, tl.where(live, eb, -1), mask=b_ok)
            tl.store(blk_ptr + MAXB + b, tl.where(live, lo, 0), mask=b_ok)
            tl.store(blk_ptr + 2 * MAXB + b, tl.where(live, n, 0), mask=b_ok)

    @triton.jit
    def _route_rows(lg_ptr, bias_ptr, r0, T, E, stride_ls, stride_lt, scale, eps, NP: tl.constexpr,
                    ROUND: tl.constexpr, TOPK: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
        # rows r0 .. r0 + BR - 1: logits = the NP parts added in index order (rounded to bf16 when ROUND);
        # p = sigmoid; the TOPK largest p + bias (ties: the lower expert); their weights renormalised by a sum
        # taken in increasing expert index, one term at a time. Every reduction over the experts is exact (a max,
        # a min of indices, a count, a sum of one non-zero term), so a row's results do not depend on BR or on
        # the rows beside it.
        rows = r0 + tl.arange(0, BR)
        ex = tl.arange(0, BE)
        ok = (rows < T)[:, None] & (ex < E)[None, :]
        ptrs = lg_ptr + rows[:, None] * stride_lt + ex[None, :]
        lg = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, NP):
            lg += tl.load(ptrs + s * stride_ls, mask=ok, other=0.0).to(tl.float32)
        if ROUND:
            lg = lg.to(tl.bfloat16).to(tl.float32)
        p = tl.where(ok, 1.0 / (1.0 + tl.exp(-lg)), 0.0)
        sc = p
        if HAS_BIAS:
            sc = p + tl.load(bias_ptr + ex, mask=ex < E, other=0.0)[None, :]
        sc = tl.where(ok, sc, -float("inf"))
        chosen = ok & (ex[None, :] < 0)
        for _ in tl.static_range(TOPK):
            top = tl.max(sc, 1)
            i = tl.min(tl.where(sc == top[:, None], ex[None, :], BE), 1)    # the lowest expert of the largest
            hit = ex[None, :] == i[:, None]
            chosen = chosen | hit
            sc = tl.where(hit, -float("inf"), sc)
        chosen = chosen & ok
        rank = tl.cumsum(chosen.to(tl.int32), 1) - 1                        # the slot: increasing expert
        w = tl.where(chosen, p, 0.0)
        if RENORM:
            tot = tl.zeros((BR,), dtype=tl.float32)
            for r in tl.static_range(TOPK):
                tot += tl.sum(tl.where(chosen & (rank == r), p, 0.0), 1)
            w = w / (tot + eps)[:, None]
        w = w * scale
        return rows, chosen, rank, w

    globals().update(_route_rows=_route_rows)

    @triton.jit
    def route_plan_kernel(lg_ptr, bias_ptr, live_ptr, exp_ptr, wt_ptr, sorted_ptr, blk_ptr, T, E, MAXB,
                          stride_ls, stride_lt, scale, eps, NP: tl.constexpr, ROUND: tl.constexpr,
                          TOPK: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
                          BB: tl.constexpr, ONE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                          HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
        # one program: route every row (route_kernel's contract, sigmoid scoring) and build plan_kernel's sorted
        # pairs and block table from the chosen experts directly (a row's pairs are its experts in increasing
        # index; an expert's pairs are in row order); the rows from live[0] on take no part in the plan.
        # ONE: all rows in one block of BR (routed once); else two passes over blocks, the second routing again.
        pdl_wait(PDL)
        ex = tl.arange(0, BE)
        if HAS_LIVE:
            TL = tl.minimum(T, tl.load(live_ptr))
        else:
            TL = T
        if ONE:
            rows, chosen, rank, w = _route_rows(lg_ptr, bias_ptr, 0, T, E, stride_ls, stride_lt, scale, eps, NP,
                                                ROUND, TOPK, BR, BE, HAS_BIAS, RENORM)
            tl.store(exp_ptr + rows[:, None] * TOPK + rank, tl.broadcast_to(ex[None, :], (BR, BE)), mask=chosen)
            tl.store(wt_ptr + rows[:, None] * TOPK + rank, w, mask=chosen)
            lv = (chosen & (rows < TL)[:, None]).to(tl.int32)
            cnt = tl.sum(lv, 0)
            pstart = tl.cumsum(cnt, 0) - cnt                    # the expert's first sorted pair
            at = tl.cumsum(lv, 0) - lv + pstart[None, :]
            tl.store(sorted_ptr + at, rows[:, None] * TOPK + rank, mask=lv != 0)
        else:
            cnt = tl.zeros((BE,), dtype=tl.int32)
            for r0 in range(0, T, BR):
                rows, chosen, rank, w = _route_rows(lg_ptr, bias_ptr, r0, T, E, stride_ls, stride_lt, scale, eps,
                                                    NP, ROUND, TOPK, BR, BE, HAS_BIAS, RENORM)
                tl.store(exp_ptr + rows[:, None] * TOPK + rank, tl.broadcast_to(ex[None, :], (BR, BE)),
                         mask=chosen)
                tl.store(wt_ptr + rows[:, None] * TOPK + rank, w, mask=chosen)
                cnt += tl.sum((chosen & (rows < TL)[:, None]).to(tl.int32), 0)
            pstart = tl.cumsum(cnt, 0) - cnt
            run = pstart
            for r0 in range(0, T, BR):
                rows, chosen, rank, w = _route_rows(lg_ptr, bias_ptr, r0, T, E, stride_ls, stride_lt, scale, eps,
                                                    NP, ROUND, TOPK, BR, BE, HAS_BIAS, RENORM)
                lv = (chosen & (rows < TL)[:, None]).to(tl.int32)
                at = tl.cumsum(lv, 0) - lv + run[None, :]
                tl.store(sorted_ptr + at, rows[:, None] * TOPK + rank, mask=lv != 0)
                run += tl.sum(lv, 0)
        nb = (cnt + BT - 1) // BT
        bend = tl.cumsum(nb, 0)                                  # blocks through expert e
        bstart = bend - nb
        total = tl.sum(nb, 0)
        for b0 in range(0, MAXB, BB):
            b = b0 + tl.arange(0, BB)
            eb = tl.sum((bend[None, :] <= b[:, None]).to(tl.int32), 1)          # the expert holding block b
            oh = (ex[None, :] == eb[:, None]).to(tl.int32)                       # [BB, BE]
            j = b - tl.sum(oh * bstart[None, :], 1)
            lo = tl.sum(oh * pstart[None, :], 1) + j * BT
            n = tl.minimum(tl.sum(oh * cnt[None, :], 1) - j * BT, BT)
            live = b < total
            b_ok = b < MAXB
            tl.store(blk_ptr + b, tl.where(live, eb, -1), mask=b_ok)
            tl.store(blk_ptr + MAXB + b, tl.where(live, lo, 0), mask=b_ok)
            tl.store(blk_ptr + 2 * MAXB + b, tl.where(live, n, 0), mask=b_ok)

    @triton.jit
    def gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, blk_ptr, MAXB, H, I, stride_x, stride_we, stride_wr,
                       stride_h, KTOP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, PDL: tl.constexpr):
        # one (column tile, block): gate^T, up^T [BN, BT] = W[BN, H] x^T[H, BT]; h = bf16(silu(gate)) * up
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
        pdl_wait(PDL)
        e = tl.load(blk_ptr + b)
        if e >= 0:
            lo = tl.load(blk_ptr + MAXB + b)
            n = tl.load(blk_ptr + 2 * MAXB + b)
            r = tl.arange(0, BT)
            r_ok = r < n
            pair = tl.load(sorted_ptr + lo + r, mask=r_ok, other=0)
            tok = pair // KTOP
            offs_n = pid_n * BN + tl.arange(0, BN)
            offs_k = tl.arange(0, BK)
            n_ok = offs_n < I
            wg_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wr + offs_k[None, :]
            wu_ptrs = wg_ptrs + I * stride_wr
            x_ptrs = x_ptr + tok[None, :].to(tl.int64) * stride_x + offs_k[:, None]              # [BK, BT]
            acc_g = tl.zeros((BN, BT), dtype=tl.float32)
            acc_u = tl.zeros((BN, BT), dtype=tl.float32)
            for kr in range(tl.cdiv(H, BK)):
                if EVEN_K:
                    wg = tl.load(wg_ptrs, mask=n_ok[:, None], other=0.0)
                    wu = tl.load(wu_ptrs, mask=n_ok[:, None], other=0.0)
                    xt = tl.load(x_ptrs, mask=r_ok[None, :], other=0.0)
                else:
                    k_ok = kr * BK + offs_k < H
                    wg = tl.load(wg_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    wu = tl.load(wu_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    xt = tl.load(x_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
                acc_g = tl.dot(wg, xt, acc_g)
                acc_u = tl.dot(wu, xt, acc_u)
                wg_ptrs += BK
                wu_ptrs += BK
                x_ptrs += BK
            g = acc_g.to(tl.bfloat16).to(tl.float32)
            u = acc_u.to(tl.bfloat16).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
            h_ptrs = h_ptr + pair[None, :].to(tl.int64) * stride_h + offs_n[:, None]
            tl.store(h_ptrs, (a * u).to(tl.bfloat16), mask=n_ok[:, None] & r_ok[None, :])

    @triton.jit
    def down_kernel(h_ptr, w_ptr, d_ptr, sorted_ptr, blk_ptr, MAXB, H, I, stride_h, stride_we, stride_wr,
                    stride_d, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                    PDL: tl.constexpr):
        # one (column tile, block): d^T [BN, BT] = W_down[BN, I] h^T[I, BT], rounded to bf16
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
        pdl_wait(PDL)
        e = tl.load(blk_ptr + b)
        if e >= 0:
            lo = tl.load(blk_ptr + MAXB + b)
            n = tl.load(blk_ptr + 2 * MAXB + b)
            r = tl.arange(0, BT)
            r_ok = r < n
            pair = tl.load(sorted_ptr + lo + r, mask=r_ok, other=0).to(tl.int64)
            offs_n = pid_n * BN + tl.arange(0, BN)
            offs_k = tl.arange(0, BK)
            n_ok = offs_n < H
            w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wr + offs_k[None, :]
            h_ptrs = h_ptr + pair[None, :] * stride_h + offs_k[:, None]                            # [BK, BT]
            acc = tl.zeros((BN, BT), dtype=tl.float32)
            for kr in range(tl.cdiv(I, BK)):
                if EVEN_K:
                    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
                    ht = tl.load(h_ptrs, mask=r_ok[None, :], other=0.0)
                else:
                    k_ok = kr * BK + offs_k < I
                    w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    ht = tl.load(h_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(w, ht, acc)
                w_ptrs += BK
                h_ptrs += BK
            d_ptrs = d_ptr + pair[None, :] * stride_d + offs_n[:, None]
            tl.store(d_ptrs, acc.to(tl.bfloat16), mask=n_ok[:, None] & r_ok[None, :])

    @triton.jit
    def combine_kernel(d_ptr, exp_ptr, wt_ptr, live_ptr, out_ptr, H, stride_d, stride_o, stride_e, stride_w,
                       KTOP: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, HAS_LIVE: tl.constexpr,
                       PDL: tl.constexpr):
        # one (row, column block): sum over the row's pairs in increasing (expert, slot) of weight * d, fp32;
        # a row past live[0]: zeros
        pdl_wait(PDL)
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if HAS_LIVE:
            ok = offs < tl.where(t < tl.load(live_ptr), H, 0)     # a row past live: nothing read, zeros written
        else:
            ok = offs < H
        j = tl.arange(0, KP)
        j_ok = j < KTOP
        e = tl.load(exp_ptr + t * stride_e + j, mask=j_ok, other=2147483647).to(tl.int32)
        wv = tl.load(wt_ptr + t * stride_w + j, mask=j_ok, other=0.0)
        # rank[j]: the slots added before slot j
        before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(KTOP):
            at = rank == r
            slot = tl.sum(tl.where(at, j, 0), 0)
            w = tl.sum(tl.where(at, wv, 0.0), 0)
            dv = tl.load(d_ptr + (t * KTOP + slot).to(tl.int64) * stride_d + offs, mask=ok, other=0.0)
            acc = acc + dv.to(tl.float32) * w
        tl.store(out_ptr + t * stride_o + offs, acc.to(tl.bfloat16), mask=offs < H)

    @triton.jit
    def combine_norm_kernel(d_ptr, exp_ptr, wt_ptr, live_ptr, x_ptr, nw_ptr, out_ptr, H, stride_d, stride_e,
                            stride_w, stride_x, stride_o, eps, KTOP: tl.constexpr, KP: tl.constexpr,
                            BLOCK: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
        # one row: y = bf16(combine_kernel's sum); x <- bf16(x + y); out = bf16(x / rms(x) * (1 + w)) (the
        # residual add and the next norm, triton_fused.add_rms_norm_1p's arithmetic); a row past live[0]: y = 0
        pdl_wait(PDL)
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        if HAS_LIVE:
            d_ok = offs < tl.where(t < tl.load(live_ptr), H, 0)
        else:
            d_ok = ok
        nw = tl.load(nw_ptr + offs, mask=ok, other=0.0)
        x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        j = tl.arange(0, KP)
        j_ok = j < KTOP
        e = tl.load(exp_ptr + t * stride_e + j, mask=j_ok, other=2147483647).to(tl.int32)
        wv = tl.load(wt_ptr + t * stride_w + j, mask=j_ok, other=0.0)
        before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(KTOP):
            at = rank == r
            slot = tl.sum(tl.where(at, j, 0), 0)
            w = tl.sum(tl.where(at, wv, 0.0), 0)
            dv = tl.load(d_ptr + (t * KTOP + slot).to(tl.int64) * stride_d + offs, mask=d_ok, other=0.0)
            acc = acc + dv.to(tl.float32) * w
        x = (x + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        tl.store(x_ptr + t * stride_x + offs, x.to(tl.bfloat16), mask=ok)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
        tl.store(out_ptr + t * stride_o + offs, (x * inv * (1.0 + nw)).to(tl.bfloat16), mask=ok)

    return {"route": route_kernel, "plan": plan_kernel, "route_plan": route_plan_kernel, "gate_up": gate_up_kernel,
            "down": down_kernel, "combine": combine_kernel, "combine_norm": combine_norm_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


# -- launchers ---------------------------------------------------------------------------------------------
def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str = "sigmoid",
          renorm: bool = True, scale: float = 1.0, eps: float = 1e-6,
          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits: [T, E]`` (bf16 or fp32, unit column stride) -> ``(experts [T, k] int32 ascending, weights [T, k]
    fp32)`` (``out``: those two tensors, written in place). ``bias``: ``[E]`` fp32 or None. One program a row."""
    if scoring not in SCORING:
        raise ValueError(f"route: scoring {scoring!r} is not one of {tuple(SCORING)}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k {top_k} is not in 1..{E} (the experts)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = (torch.empty(T, top_k, dtype=torch.int32, device=logits.device),
               torch.empty(T, top_k, dtype=torch.float32, device=logits.device))
    experts, weights = out
    b = bias if bias is not None else weights
    kernels()["route"][(T,)](logits, b, experts, weights, E, logits.stride(0), float(scale), float(eps),
                             TOPK=int(top_k), BE=max(16, _pow2(E)), SCORING=SCORING[scoring],
                             HAS_BIAS=bias is not None, RENORM=bool(renorm), num_warps=1 if E <= 128 else 4,
                             **pdl.launch_kw())
    return experts, weights


class Routed(NamedTuple):
    """``route_plan``'s results: ``route``'s two and ``grouped_experts``' plan (``blocks`` for it)."""

    experts: torch.Tensor   # [T, k] int32, ascending along k
    weights: torch.Tensor   # [T, k] fp32
    sorted: torch.Tensor    # [T * k] int32: the live pairs ``t * k + slot`` in (expert, row) order (the rest unwritten)
    table: torch.Tensor     # [3, max_blocks] int32: (expert or -1, first sorted pair, pairs) a block
    block_rows: int         # the plan's BT: at most this many pairs a block


def route_plan(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, plan: MoePlan, renorm: bool = True,
               scale: float = 1.0, eps: float = 1e-6, live: torch.Tensor | None = None) -> Routed:
    """``route`` (sigmoid scoring) and ``grouped_experts``' plan in one program: the decode and verify widths'
    router, where the two launches of ``route`` and the plan kernel cost more than their work.

    ``logits``: ``[T, E]`` (bf16 or fp32, unit column stride), or ``[S, T, E]`` fp32 partials of a bf16 matmul
    whose K was cut in ``S`` parts (``triton_matmul.skinny_matmul``): added in index order and rounded to bf16,
    the bits of ``bf16(reduce_parts(logits))``. ``plan``: the experts' plan (its ``BT``). ``live``: as in
    ``grouped_experts`` (the rows from ``live[0]`` on are routed but take no part in the plan). A row's experts
    and weights do not depend on the other rows or on ``T`` (every reduction over the experts is exact; the
    renormalising sum is taken in increasing expert index), so a verified row routes as its decode row, bit for
    bit. Pass the result to ``grouped_experts(..., plan=plan, live=live, blocks=r)``."""
    parts = logits.dim() == 3
    if logits.dim() not in (2, 3):
        raise ValueError(f"route_plan: logits must be [T, E] or [S, T, E] partials, got {tuple(logits.shape)}")
    if parts and logits.dtype != torch.float32:
        raise ValueError(f"route_plan: partials [S, T, E] must be fp32, got {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    T, E = int(logits.shape[-2]), int(logits.shape[-1])
    if not 1 <= top_k <= E:
        raise ValueError(f"route_plan: top_k {top_k} is not in 1..{E} (the experts)")
    if E > 1024:
        raise ValueError(f"route_plan: {E} experts exceed the 1024 one program holds")
    dev = logits.device
    P = T * top_k
    maxb = max_blocks(P, E, plan.BT)
    experts = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    srt = torch.empty(P, dtype=torch.int32, device=dev)
    blk = torch.empty(3, maxb, dtype=torch.int32, device=dev)
    BE = max(16, _pow2(E))
    BR = max(2, min(_pow2(T), 8192 // BE))
    b = bias if bias is not None else weights
    np_, sls, slt = (int(logits.shape[0]), logits.stride(0), logits.stride(1)) if parts else (1, 0, logits.stride(0))
    kernels()["route_plan"][(1,)](
        logits, b, live if live is not None else srt, experts, weights, srt, blk, T, E, maxb, sls, slt, float(scale),
        float(eps), NP=np_, ROUND=parts, TOPK=int(top_k), BR=BR, BE=BE, BT=plan.BT,
        BB=max(2, min(32, 8192 // BE, _pow2(maxb))),
        ONE=T <= BR, HAS_BIAS=bias is not None, RENORM=bool(renorm), HAS_LIVE=live is not None,
        num_warps=min(8, max(1, BR * BE // 512)), **pdl.launch_kw())     # 4 .. 16 (row, expert) cells a thread
    return Routed(experts, weights, srt, blk, int(plan.BT))


def combine_add_norm(d: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                     norm_w: torch.Tensor, eps: float, out: torch.Tensor,
                     live: torch.Tensor | None = None) -> torch.Tensor:
    """The combine of ``grouped_experts`` (step 4) with the residual add and the next RMS norm after it, one program
    a row: ``x <- bf16(x + bf16(sum over the row's pairs, in increasing (expert, slot), of weight * d))`` in place,
    ``out = bf16(x / rms(x) * (1 + norm_w))``. ``d: [T * k, H]`` bf16 (``grouped_experts(..., combine=False)``),
    ``experts, weights: [T, k]``, ``x, out: [T, H]`` bf16, ``norm_w: [H]`` fp32 zero-centred (a plain weight as ``w -
    1``); ``live``: rows from ``live[0]`` on add nothing. A row's result depends on that row alone. Returns ``out``."""
    T, H = x.shape
    k = experts.shape[1]
    if tuple(d.shape) != (T * k, H) or tuple(weights.shape) != (T, k) or tuple(out.shape) != (T, H):
        raise ValueError(f"combine_add_norm: d {tuple(d.shape)}, experts {tuple(experts.shape)}, weights "
                         f"{tuple(weights.shape)}, out {tuple(out.shape)} do not fit x [{T}, {H}] and top-{k}")
    if H > 16384:
        raise ValueError(f"combine_add_norm: hidden {H} exceeds the 16384 one program holds")
    ew = experts if experts.stride(1) == 1 else experts.contiguous()
    ww = weights if weights.stride(1) == 1 else weights.contiguous()
    kernels()["combine_norm"][(T,)](d, ew, ww, live if live is not None else ew, x, norm_w, out, H, d.stride(0),
                                    ew.stride(0), ww.stride(0), x.stride(0), out.stride(0), float(eps), KTOP=k,
                                    KP=max(2, _pow2(k)), BLOCK=_pow2(H), HAS_LIVE=live is not None, num_warps=8,
                                    **pdl.launch_kw())
    return out


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, plan: MoePlan | None = None, out: torch.Tensor | None = None,
                    live: torch.Tensor | None = None,
                    blocks: Routed | None = None, combine: bool = True) -> torch.Tensor:
    """See the module docstring. ``x: [T, H]`` bf16 (unit column stride), ``experts: [T, k]`` int32/int64 (each
    in ``0..E-1``), ``weights: [T, k]`` fp32, ``w_gate_up: [E, 2I, H]``, ``w_down: [E, H, I]`` bf16 with unit
    column strides. ``out``: ``[T, H]`` bf16 written in place when given. ``live``: a one-element int32 device
    tensor, the rows that count (a graph step's width past its tree): the rows from ``live[0]`` on run no expert
    and get zeros. ``blocks``: ``route_plan``'s result for these experts, this ``plan`` and ``live`` (its
    sorted pairs and block table are used: the plan kernel is not launched). Returns ``out``; ``combine`` False: the pairs' expert outputs ``d [T * k,
    H]`` bf16 instead (row ``t * k + slot``; those of rows past ``live[0]`` unwritten), for ``combine_add_norm``."""
    T, H = x.shape
    k = experts.shape[1]
    E, I2, Hw = w_gate_up.shape
    I = I2 // 2
    if Hw != H or tuple(w_down.shape) != (E, H, I) or I2 != 2 * I:
        raise ValueError(f"grouped_experts: x [{T}, {H}], w_gate_up {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)} do not fit [E, 2I, H] and [E, H, I]")
    if tuple(experts.shape) != (T, k) or tuple(weights.shape) != (T, k):
        raise ValueError(f"grouped_experts: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} "
                         f"must both be [{T}, k]")
    if x.dtype != torch.bfloat16 or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16:
        raise ValueError("grouped_experts: x, w_gate_up and w_down must be bf16")
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("grouped_experts: x and the weights need a unit column stride")
    p = plan or plan_for(E, I, H)
    dev = x.device
    P = T * k
    maxb = max_blocks(P, E, p.BT)
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    ew = experts if experts.stride(1) == 1 else experts.contiguous()
    ww = weights if weights.stride(1) == 1 else weights.contiguous()
    if blocks is None:
        srt = torch.empty(P, dtype=torch.int32, device=dev)
        blk = torch.empty(3, maxb, dtype=torch.int32, device=dev)
    else:
        srt, blk = blocks.sorted, blocks.table
        if blocks.block_rows != p.BT or tuple(srt.shape) != (P,) or tuple(blk.shape) != (3, maxb):
            raise ValueError(f"grouped_experts: blocks of {blocks.block_rows} pairs, sorted {tuple(srt.shape)} and "
                             f"table {tuple(blk.shape)} are not route_plan's for {T} rows, top-{k} and this plan's "
                             f"blocks of {p.BT} ([{P}] and [3, {maxb}])")
    h = torch.empty(P, I, dtype=torch.bfloat16, device=dev)
    d = torch.empty(P, H, dtype=torch.bfloat16, device=dev)
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    kk, kw = kernels(), pdl.launch_kw()
    BE = max(16, _pow2(E))
    lv = live if live is not None else srt
    if blocks is None:
        kk["plan"][(1,)](flat, lv, srt, blk, P, maxb, KTOP=k, HAS_LIVE=live is not None, BT=p.BT, BE=BE,
                         BQ=max(16, min(128, 8192 // BE)), BB=max(16, min(32, 8192 // BE)), num_warps=4, **kw)
    kk["gate_up"][(math.ceil(I / p.BN_UP), maxb)](
        x, w_gate_up, h, srt, blk, maxb, H, I, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
        KTOP=k, BT=p.BT, BN=p.BN_UP, BK=p.BK, EVEN_K=H % p.BK == 0, num_warps=p.warps, num_stages=p.stages, **kw)
    kk["down"][(math.ceil(H / p.BN_DOWN), maxb)](
        h, w_down, d, srt, blk, maxb, H, I, h.stride(0), w_down.stride(0), w_down.stride(1), d.stride(0),
        BT=p.BT, BN=p.BN_DOWN, BK=p.BK, EVEN_K=I % p.BK == 0, num_warps=p.warps, num_stages=p.stages, **kw)
    if not combine:
        return d
    CB = 1024
    kk["combine"][(T, math.ceil(H / CB))](d, ew, ww, lv, out, H, d.stride(0), out.stride(0), ew.stride(0),
                                          ww.stride(0), KTOP=k, KP=max(2, _pow2(k)), BLOCK=CB,
                                          HAS_LIVE=live is not None, num_warps=4, **kw)
    return out
