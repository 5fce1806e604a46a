"""Small kernels of the decode/verify step folded into their neighbours (Triton), bit for bit.

A CUDA graph step of the 27B is some 650 launches; each small kernel costs its own time
plus about a microsecond of dependency latency before the next one starts. Three of them
fold into their neighbour here without changing a single bit of what the step computes:

- ``silu_mul_matmul(gu, w, plan)``: ``skinny_matmul(silu_mul(gu), w, plan)``, the MLP's
  down projection reading the gate/up projection's output directly. It is
  ``triton_matmul``'s kernel (every layout, the same plan: tiles, split of K, K order,
  dot shapes, warps and stages) whose x operand is made on load by ``silu_mul``'s own
  arithmetic: ``bf16(bf16(silu(gate)) * up)``, fp32 inside, then the same bf16 dot. The
  activation is made once per (column tile, K step), i.e. again in every column tile of
  the weight: cheap at decode (the weight stream bounds the kernel), more so as the tile
  widens with the rows (``CudaRunner``'s ``fuse_rows`` keeps wide verifies on the pair).
- ``conv_gdn_tree(...)``: ``conv_tree`` then ``gdn_tree`` of one layer in one launch. Each
  tree program (value head ``h``, ``BV`` value columns) first runs ``conv_tree``'s
  arithmetic, node by node, for the channels it reads: the q and k heads of its key head
  (``h // G``; conv, silu, bf16 rounding, L2 norm over the head, ``conv_tree``'s 1-D code at
  its block size and warp count) and its own ``BV`` value channels (conv, silu, rounding: no
  norm, so any subset of a group is exact), a node's loads all before its stores. It stores
  them where ``conv_tree`` does (``qkv``, which the commit replays later), waits for its CTA
  (the rows it reads back were written by its own threads; programs sharing a key head
  write the same values) and then runs ``tree_kernel``'s recurrence unchanged. The
  prologue walks the nodes one after another, so it pays at decode (one node) and costs
  at wide verifies (``CudaRunner``'s ``fuse_conv_rows``). With ``TREE_WARPS != 1`` the
  launcher runs the pair (the q/k norm's sum order is ``conv_tree``'s only at one warp).
- ``embed_rms_norm_1p(embed, ids, x, w, eps, out)``: the step's embedding gather
  (``index_select`` into the residual rows) and the first layer's input norm
  (``add_rms_norm_1p`` without parts) in one launch: ``add_norm``'s kernel whose row is loaded
  from the embedding table (and stored as the residual row) instead of from the residual.

Why nothing else of the step folds the same way: ``gated_norm`` needs the L2 norm of a
whole value head, which the tree kernel spreads over ``Dv / BV`` programs; ``add_norm``,
``qk_post`` and attention's ``combine`` end in reductions whose order is fixed by their own
kernel's layout (warps, block), which a neighbour with another layout would not reproduce.

Bit equality rests on the compiler lowering the same expression the same way in both
kernels (the same ``tl`` ops on the same dtypes; fp contraction applies to the same
expression trees). The interpreter proves the dataflow (``tests/test_gpu_fused_mm.py`` run
with ``TRITON_INTERPRET=1``); the device proves the lowering (the same file on CUDA, and the
runner's fused-against-unfused logits in ``plugins/qwen38_27b/tests/test_qwen38_gpu_fused.py``).

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem_core.ops import triton_matmul as tm
from tandem_core.ops import triton_pdl as pdl
from tandem_core.ops.triton_fused import next_pow2

__all__ = ["kernels", "silu_mul_matmul", "conv_gdn_tree", "embed_rms_norm_1p"]

tl: Any = None
_K: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    # -- the down projection over silu(gate) * up ---------------------------------------------------------
    @triton.jit
    def _act(g_ptrs, mask, I):
        # triton_fused.silu_mul_kernel's arithmetic on one tile: x = bf16(bf16(silu(g)) * u), g and u widened
        # from bf16 to fp32 on load (masked lanes: g = u = 0, x = 0, what a masked load of silu_mul's output
        # gives)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        return (a * u).to(tl.bfloat16)

    globals().update(_act=_act)

    @triton.jit
    def _mmt_act_step(w, xT_ptrs, t_ok, k_ok, acc, I, EVEN_K: tl.constexpr):
        if EVEN_K:
            xt = _act(xT_ptrs, t_ok[None, :], I)                                             # [BK, BT]
        else:
            xt = _act(xT_ptrs, t_ok[None, :] & k_ok[:, None], I)
        return tl.dot(w, xt, acc)

    @triton.jit
    def _mmt_store(o_ptrs, acc, ok, OUT_F32: tl.constexpr):
        if OUT_F32:
            tl.store(o_ptrs, acc, mask=ok)
        else:
            tl.store(o_ptrs, acc.to(tl.bfloat16), mask=ok)

    globals().update(_mmt_act_step=_mmt_act_step, _mmt_store=_mmt_store)

    @triton.jit(do_not_specialize=["M"])
    def mmt_silu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om,
                        BT: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, PDL: tl.constexpr):
        # triton_matmul.mmt_kernel with x = silu_mul(gu) made on load: x_ptr is gu [M, 2K] (gate | up), K = I
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
            acc0 = _mmt_act_step(w, x_ptrs, offs_t < M, k_ok, acc0, K, EVEN_K)
            if MT > 1:
                acc1 = _mmt_act_step(w, x_ptrs + step, BT + offs_t < M, k_ok, acc1, K, EVEN_K)
            if MT > 2:
                acc2 = _mmt_act_step(w, x_ptrs + 2 * step, 2 * BT + offs_t < M, k_ok, acc2, K, EVEN_K)
                acc3 = _mmt_act_step(w, x_ptrs + 3 * step, 3 * BT + offs_t < M, k_ok, acc3, K, EVEN_K)
            if MT > 4:
                acc4 = _mmt_act_step(w, x_ptrs + 4 * step, 4 * BT + offs_t < M, k_ok, acc4, K, EVEN_K)
                acc5 = _mmt_act_step(w, x_ptrs + 5 * step, 5 * BT + offs_t < M, k_ok, acc5, K, EVEN_K)
                acc6 = _mmt_act_step(w, x_ptrs + 6 * step, 6 * BT + offs_t < M, k_ok, acc6, K, EVEN_K)
                acc7 = _mmt_act_step(w, x_ptrs + 7 * step, 7 * BT + offs_t < M, k_ok, acc7, K, EVEN_K)
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

    @triton.jit(do_not_specialize=["M"])
    def mm_silu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om,
                       BM: tl.constexpr, MT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, OUT_F32: tl.constexpr, PDL: tl.constexpr):
        # triton_matmul.mm_kernel (layout "xw") with x = silu_mul(gu) made on load: x_ptr is gu [M, 2K], K = I
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
                x0 = _act(x_ptrs, m0_ok, K)                                                 # x0: [BM, BK]
            else:
                k_ok = (k_lo + kr * BK + offs_k < K) & (kr * BK + offs_k < K_SPLIT)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x0 = _act(x_ptrs, m0_ok & k_ok[None, :], K)
            wt = tl.trans(w)                                                              # wt: [BK, BN]
            acc0 = tl.dot(x0, wt, acc0)
            if MT > 1:
                if EVEN_K:
                    x1 = _act(x_ptrs + BM * stride_xm, m1_ok, K)
                else:
                    x1 = _act(x_ptrs + BM * stride_xm, m1_ok & k_ok[None, :], K)
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

    # -- conv_tree in the tree kernel's prologue -----------------------------------------------------------
    # triton_fused.conv_tree_kernel's arithmetic, per channel, split in pieces so that a node's loads (its
    # window, for the q head, the k head and the value columns at once) are all issued before its stores:
    # y = x_0 w_0, y = y + x_k w_k (k < KW - 1), y = y + x_self w_{KW-1}; silu, rounded to bf16; over a q or k
    # head (group g < QK_HEADS) divided by its L2 norm
    @triton.jit
    def _conv_x(raw_ptr, tail_ptr, c, ok, src, stride_raw, KW: tl.constexpr):
        # x_k of channels c: the tail column src (src < KW-1) or the raw row src - (KW-1)
        from_tail = src < KW - 1
        row = tl.where(from_tail, 0, src - (KW - 1))
        col = tl.where(from_tail, src, 0)
        xt = tl.load(tail_ptr + c * (KW - 1) + col, mask=ok & from_tail, other=0.0).to(tl.float32)
        xr = tl.load(raw_ptr + row * stride_raw + c, mask=ok & (src >= KW - 1), other=0.0).to(tl.float32)
        return tl.where(from_tail, xt, xr)

    @triton.jit
    def _conv_end(y, xi, wl, ok, g, QK_HEADS, eps):
        y = y + xi.to(tl.float32) * wl
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32)    # the reference rounds the conv output
        if g < QK_HEADS:
            y = y / tl.sqrt(tl.sum(tl.where(ok, y * y, 0.0), 0) + eps)
        return y

    globals().update(_conv_x=_conv_x, _conv_end=_conv_end)

    @triton.jit
    def _conv_node(raw_ptr, tail_ptr, w_ptr, win_ptr, out_ptr, i, gq, gk, cq, ck, cv, q_ok, k_ok, v_ok,
                   QK_HEADS, stride_raw, stride_out, eps, KW: tl.constexpr, CB: tl.constexpr,
                   BV: tl.constexpr):
        # node i: q head channels cq (group gq), k head channels ck (group gk), value channels cv
        xiq = tl.load(raw_ptr + i * stride_raw + cq, mask=q_ok, other=0.0)                  # bf16
        xik = tl.load(raw_ptr + i * stride_raw + ck, mask=k_ok, other=0.0)
        xiv = tl.load(raw_ptr + i * stride_raw + cv, mask=v_ok, other=0.0)
        yq = tl.zeros((CB,), dtype=tl.float32)
        yk = tl.zeros((CB,), dtype=tl.float32)
        yv = tl.zeros((BV,), dtype=tl.float32)
        for k in tl.static_range(KW - 1):
            src = tl.load(win_ptr + i * (KW - 1) + k)
            xq = _conv_x(raw_ptr, tail_ptr, cq, q_ok, src, stride_raw, KW)
            xk = _conv_x(raw_ptr, tail_ptr, ck, k_ok, src, stride_raw, KW)
            xv = _conv_x(raw_ptr, tail_ptr, cv, v_ok, src, stride_raw, KW)
            wq = tl.load(w_ptr + cq * KW + k, mask=q_ok, other=0.0)
            wk = tl.load(w_ptr + ck * KW + k, mask=k_ok, other=0.0)
            wv = tl.load(w_ptr + cv * KW + k, mask=v_ok, other=0.0)
            if k == 0:
                yq = xq * wq
                yk = xk * wk
                yv = xv * wv
            else:
                yq = yq + xq * wq
                yk = yk + xk * wk
                yv = yv + xv * wv
        wlq = tl.load(w_ptr + cq * KW + (KW - 1), mask=q_ok, other=0.0)
        wlk = tl.load(w_ptr + ck * KW + (KW - 1), mask=k_ok, other=0.0)
        wlv = tl.load(w_ptr + cv * KW + (KW - 1), mask=v_ok, other=0.0)
        yq = _conv_end(yq, xiq, wlq, q_ok, gq, QK_HEADS, eps)
        yk = _conv_end(yk, xik, wlk, k_ok, gk, QK_HEADS, eps)
        yv = _conv_end(yv, xiv, wlv, v_ok, QK_HEADS, QK_HEADS, eps)                     # no norm
        tl.store(out_ptr + i * stride_out + cq, yq, mask=q_ok)
        tl.store(out_ptr + i * stride_out + ck, yk, mask=k_ok)
        tl.store(out_ptr + i * stride_out + cv, yv, mask=v_ok)

    globals().update(_conv_node=_conv_node)

    @triton.jit(do_not_specialize=["write_out", "final_store"])
    def conv_tree_gdn_kernel(raw_ptr, tail_ptr, cw_ptr, win_ptr, C, QK_HEADS, stride_raw, conv_eps,
                             qkv_ptr, ab_ptr, alog_ptr, dtb_ptr, S_ptr, scratch_ptr, o_ptr, plan_ptr, n_ptr,
                             write_out, final_store, col_b, col_a, scale,
                             stride_qkv_l, stride_qkv_r, stride_ab_l, stride_ab_r, stride_S_l, stride_o_r,
                             stride_scratch, stride_par_l, HV, G,
                             DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             NP: tl.constexpr, CB: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr):
        # one layer: the prologue writes qkv (conv_tree's output) for the channels this program reads, nodes
        # 0..n-1 (raw: the projection [rows, >= C] bf16; tail [C, KW-1] bf16; cw [C, KW] fp32; win
        # [rows, KW-1] int32), then triton_gdn.tree_kernel's body, line for line
        pdl_wait(PDL)
        h = tl.program_id(0)
        vb = tl.program_id(1)
        lyr = tl.program_id(2)
        hk = h // G
        n = tl.load(n_ptr)
        # -- triton_gdn.tree_kernel's setup first (the state slice's load is in flight during the prologue)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        k_ok = offs_k < DK
        v_ok = offs_v < DV
        kv_ok = v_ok[:, None] & k_ok[None, :]
        pi = tl.arange(0, NP)
        p_ok = pi < n
        rows = tl.load(plan_ptr + pi, mask=p_ok, other=0)
        s_off = offs_v[:, None] + offs_k[None, :] * DV
        S_base = S_ptr + lyr * stride_S_l + h * DK * DV
        St = tl.load(S_base + s_off, mask=kv_ok, other=0.0)
        qkv_l = qkv_ptr + lyr * stride_qkv_l
        ab_l = ab_ptr + lyr * stride_ab_l
        sc_base = scratch_ptr + lyr * stride_par_l + h * DK * DV
        alog = tl.load(alog_ptr + lyr * HV + h)
        dtb = tl.load(dtb_ptr + lyr * HV + h)
        # -- prologue: conv_tree for q head hk, k head hk (groups hk and HV // G + hk of DK channels) and the
        # value columns vb*BV .. of head h, nodes 0..n-1
        offs_c = tl.arange(0, CB)
        c_ok = offs_c < DK
        cq = hk * DK + offs_c
        ck = (HV // G) * DK + hk * DK + offs_c
        cv = 2 * (HV // G) * DK + h * DV + vb * BV + tl.arange(0, BV)
        cv_ok = (vb * BV + tl.arange(0, BV) < DV) & (cv < C)
        for i in range(0, n):
            _conv_node(raw_ptr, tail_ptr, cw_ptr, win_ptr, qkv_l, i, hk, HV // G + hk, cq, ck, cv,
                       c_ok & (cq < C), c_ok & (ck < C), cv_ok, QK_HEADS, stride_raw, stride_qkv_r, conv_eps,
                       KW, CB, BV)
        tl.debug_barrier()          # the rows read below were written by this CTA's threads
        # -- triton_gdn.tree_kernel's body
        q_col = hk * DK + offs_k
        k_col = (HV // G) * DK + hk * DK + offs_k
        v_col = 2 * (HV // G) * DK + h * DV + offs_v
        row = tl.sum(tl.where(pi == 0, rows, 0), 0)
        r = qkv_l + row * stride_qkv_r
        q = tl.load(r + q_col, mask=k_ok, other=0.0)
        k = tl.load(r + k_col, mask=k_ok, other=0.0)
        v = tl.load(r + v_col, mask=v_ok, other=0.0)
        b = tl.load(ab_l + row * stride_ab_r + col_b + h).to(tl.float32)
        a = tl.load(ab_l + row * stride_ab_r + col_a + h).to(tl.float32)
        for i in range(0, n):
            ld = tl.load(plan_ptr + n + i)
            sv = tl.load(plan_ptr + 2 * n + i)
            nrow = tl.sum(tl.where(pi == i + 1, rows, 0), 0)
            nr = qkv_l + nrow * stride_qkv_r
            q_n = tl.load(nr + q_col, mask=k_ok, other=0.0)
            k_n = tl.load(nr + k_col, mask=k_ok, other=0.0)
            v_n = tl.load(nr + v_col, mask=v_ok, other=0.0)
            b_n = tl.load(ab_l + nrow * stride_ab_r + col_b + h).to(tl.float32)
            a_n = tl.load(ab_l + nrow * stride_ab_r + col_a + h).to(tl.float32)
            if ld == -2:
                St = tl.load(S_base + s_off, mask=kv_ok, other=0.0)
            elif ld >= 0:
                St = tl.load(sc_base + ld * stride_scratch + s_off, mask=kv_ok, other=0.0)
            beta = 1.0 / (1.0 + tl.exp(-b))
            x = a + dtb
            e = tl.exp(tl.minimum(x, 20.0))
            u1 = 1.0 + e
            sp = tl.where(u1 == 1.0, e, tl.log(u1) * (e / tl.where(u1 == 1.0, 1.0, u1 - 1.0)))
            sp = tl.where(x > 20.0, x, sp)
            g = -tl.exp(alog) * sp
            St = St * tl.exp(g)
            pred = tl.sum(St * k[None, :], 1)                      # [BV] = S^T k
            u = (v - pred) * beta
            St = St + u[:, None] * k[None, :]
            if write_out != 0:
                o = tl.sum(St * q[None, :], 1) * scale
                tl.store(o_ptr + row * stride_o_r + h * DV + offs_v, o, mask=v_ok)
            if sv >= 0:
                tl.store(sc_base + sv * stride_scratch + s_off, St, mask=kv_ok)
            row, q, k, v, b, a = nrow, q_n, k_n, v_n, b_n, a_n
        if final_store != 0:
            tl.store(S_base + s_off, St, mask=kv_ok)

    # -- the embedding gather into the first norm ---------------------------------------------------------
    @triton.jit
    def embed_norm_kernel(emb_ptr, ids_ptr, x_ptr, w_ptr, out_ptr, H, stride_e, stride_x, stride_o, eps,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one row: x <- embed[ids[r]]; out = bf16(x / rms(x) * (1 + w)) (triton_fused.add_norm_kernel, NP = 0)
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        tok = tl.load(ids_ptr + r)
        xb = tl.load(emb_ptr + tok * stride_e + offs, mask=ok, other=0.0)
        tl.store(x_ptr + r * stride_x + offs, xb, mask=ok)
        x = xb.to(tl.float32)
        ms = tl.sum(x * x, 0) / H
        inv = 1.0 / tl.sqrt(ms + eps)
        tl.store(out_ptr + r * stride_o + offs, (x * inv * (1.0 + w)).to(tl.bfloat16), mask=ok)

    return {"mmt_silu": mmt_silu_kernel, "mm_silu": mm_silu_kernel, "conv_tree_gdn": conv_tree_gdn_kernel,
            "embed_norm": embed_norm_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


# -- launchers ---------------------------------------------------------------------------------------------
def silu_mul_matmul(gu: torch.Tensor, w: torch.Tensor, plan: tm.MatmulPlan | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``skinny_matmul(silu_mul(gu), w, plan, out)`` in one launch, bit for bit: ``gu: [M, 2I]`` bf16 (gate
    then up; row stride free, unit column stride), ``w: [N, I]`` contiguous rows. Returns what
    ``skinny_matmul`` returns for that plan: ``[M, N]`` bf16 (no split of K) or fp32 partials
    ``[split, M, N]``."""
    M, K2 = gu.shape
    N, K = w.shape
    if K2 != 2 * K:
        raise ValueError(f"silu_mul_matmul: gu has {K2} columns, the weight {K} "
                         f"(gu holds gate and up: 2 x {K})")
    if M > tm.MAX_ROWS:
        raise ValueError(f"silu_mul_matmul: {M} rows exceed the row-invariant path's {tm.MAX_ROWS}")
    if gu.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("silu_mul_matmul: gu and w need a unit column stride")
    p = plan or tm.plan_for(N, K)
    ks = p.k_split(K)
    split = int(math.ceil(K / ks))
    f32 = split > 1
    if out is None:
        out = torch.empty((split, M, N) if f32 else (M, N), dtype=torch.float32 if f32 else gu.dtype,
                          device=gu.device)
    stride_os = out.stride(0) if f32 else 0
    stride_om = out.stride(1) if f32 else out.stride(0)
    grid = (math.ceil(N / p.BN), split)
    even = ks * split == K and ks % p.BK == 0
    kw = pdl.launch_kw()
    if p.layout in ("wx", "wy"):
        mt = 1 if M <= tm.BT else 2 if M <= 2 * tm.BT else 4 if M <= 4 * tm.BT else 8
        bt, mt = (tm.BT * mt, 1) if p.layout == "wy" else (tm.BT, mt)
        kernels()["mmt_silu"][grid](gu, w, out, M, N, K, ks, gu.stride(0), w.stride(0), stride_os, stride_om,
                                    BT=bt, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32,
                                    num_warps=p.warps, num_stages=p.stages, **kw)
    elif p.layout == "xw":
        mt = 1 if M <= tm.BM else 2
        kernels()["mm_silu"][grid](gu, w, out, M, N, K, ks, gu.stride(0), w.stride(0), stride_os, stride_om,
                                   BM=tm.BM, MT=mt, BN=p.BN, BK=p.BK, EVEN_K=even, OUT_F32=f32,
                                   num_warps=p.warps, num_stages=p.stages, **kw)
    else:
        raise ValueError(f"silu_mul_matmul: plan layout {p.layout!r} (known: xw, wx, wy)")
    return out


def conv_gdn_tree(raw: torch.Tensor, tail: torch.Tensor, conv_w: torch.Tensor, win: torch.Tensor,
                  qkv: torch.Tensor, ab: torch.Tensor, col_b: int, col_a: int, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, S: torch.Tensor, scratch: torch.Tensor, o: torch.Tensor,
                  plan: torch.Tensor, n: torch.Tensor, *, write_out: bool, final_store: bool, scale: float,
                  num_k_heads: int, head_dim: int, qk_heads: int, eps: float = 1e-6, BV: int = 16) -> None:
    """``triton_fused.conv_tree(raw, tail, conv_w, win, n, qkv[0], head_dim, qk_heads, rows)`` then
    ``triton_gdn.gdn_tree(qkv, ab, ..., layers=1)`` in one launch, bit for bit (both results: ``qkv`` rows
    ``< n[0]`` and what the tree writes).

    ``raw: [rows, >= C]`` bf16 (the projection, row-strided); ``tail: [C, K-1]`` bf16; ``conv_w: [C, K]``
    fp32; ``win: [rows, K-1]`` int32; ``qkv: [1, rows, C]`` fp32 (written, then read by the recurrence);
    the rest as ``gdn_tree``. The channel groups must be the heads: ``head_dim == Dk`` and
    ``qk_heads == 2 * num_k_heads`` (q heads, then k heads, then the value heads). With ``TREE_WARPS != 1``
    (the conv's q/k norm would sum in another order than ``conv_tree``'s one warp) it runs the pair."""
    Ly, Hv, Dk, Dv = S.shape
    C, KW = conv_w.shape
    if Ly != 1 or qkv.dim() != 3 or qkv.shape[0] != 1 or ab.dim() != 3 or ab.shape[0] != 1:
        raise ValueError("conv_gdn_tree: one layer (S, qkv and ab with a leading dimension of 1)")
    if head_dim != Dk or qk_heads != 2 * num_k_heads or C != 2 * num_k_heads * Dk + Hv * Dv:
        raise ValueError(f"conv_gdn_tree: conv groups of {head_dim} with {qk_heads} q/k groups over {C} "
                         f"channels are not the heads ({num_k_heads} key heads of {Dk}, {Hv} value heads of "
                         f"{Dv})")
    if qkv.stride(2) != 1 or raw.stride(1) != 1:
        raise ValueError("conv_gdn_tree: qkv and raw need a unit column stride")
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_gdn as tg

    rows = int(raw.shape[0])
    if tg.TREE_WARPS != 1:
        # the prologue's q/k norm is conv_tree's sum only at conv_tree's one warp: the pair, unfused
        tf.conv_tree(raw, tail, conv_w, win, n, qkv[0], head_dim, qk_heads, rows, eps)
        tg.gdn_tree(qkv, ab, col_b, col_a, A_log, dt_bias, S, scratch, o, plan, n, write_out=write_out,
                    final_store=final_store, scale=scale, num_k_heads=num_k_heads, BV=BV)
        return
    G = Hv // num_k_heads
    grid = (Hv, math.ceil(Dv / BV), 1)
    NP = max(16, next_pow2(plan.numel() // 3))
    kernels()["conv_tree_gdn"][grid](raw, tail, conv_w, win, C, qk_heads, raw.stride(0), float(eps),
                                     qkv, ab, A_log, dt_bias, S, scratch, o, plan, n, int(write_out),
                                     int(final_store), col_b, col_a, float(scale), qkv.stride(0),
                                     qkv.stride(1), ab.stride(0), ab.stride(1), S.stride(0), o.stride(0),
                                     scratch.stride(0) if scratch.dim() == 4 else 0, 0, Hv, G,
                                     DK=Dk, DV=Dv, BK=next_pow2(Dk), BV=BV, NP=NP, CB=next_pow2(head_dim),
                                     KW=KW, num_warps=tg.TREE_WARPS, **pdl.launch_kw())


def embed_rms_norm_1p(embed: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                      out: torch.Tensor) -> torch.Tensor:
    """``torch.index_select(embed, 0, ids, out=x)`` then ``add_rms_norm_1p(x, None, w, eps, out)`` in one
    launch, bit for bit: ``embed: [V, H]`` bf16 rows, ``ids: [R]`` integer, ``x, out: [R, H]`` bf16 (unit
    column stride; ``x`` gets the embedding rows), ``w: [H]`` fp32 zero-centred."""
    R, H = x.shape
    if embed.shape[1] != H or out.shape != x.shape or ids.shape != (R,):
        raise ValueError(f"embed_rms_norm_1p: embed {tuple(embed.shape)}, ids {tuple(ids.shape)}, x "
                         f"{tuple(x.shape)}, out {tuple(out.shape)}: need [V, H], [R], [R, H], [R, H]")
    if embed.stride(1) != 1 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("embed_rms_norm_1p: embed, x and out need a unit column stride")
    kernels()["embed_norm"][(R,)](embed, ids, x, w, out, H, embed.stride(0), x.stride(0), out.stride(0),
                                  float(eps), BLOCK=next_pow2(H), num_warps=8, **pdl.launch_kw())
    return out
