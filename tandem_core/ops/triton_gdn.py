"""The gated delta rule on CUDA (Triton): a token tree (decode, verify, commit replay) and chunked prefill.

Tree kernel (``gdn_tree``): one program per (value head, ``BV`` value columns, layer) keeps its
slice of the state ``S[:, cols]`` in registers and walks the nodes in index order. A node
whose parent is the node before it continues from the registers; a node with another
parent loads that parent's state from a scratch slot, saved only by nodes that have a
child other than the next node (branch points); a child of the committed sequence
reloads the committed state. So a chain touches no scratch, and a tree writes one
state per branch point, never one per node. The same binary serves

- decode:  one node, output written, the state stored back in place (``final_store``);
- verify:  the tree, outputs written, the committed state left as it was;
- commit:  the accepted path replayed from the committed state (``final_store``, no
           output), every layer in one launch.

Each step's arithmetic is the same code on the same registers in all three, so a verified
row equals the decode row bit for bit, and the replayed state equals the decoded one.

Per step (value head h, key head h // (Hv/Hk)), as the reference ``tandem_core.ops.gdn``:

    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = scale S^T q

Chunked prefill (``gdn_chunk``), 64-token chunks in three launches (the reference's algebra; on
an H200 at the 27B shape, 4096 tokens: about 0.22 + 0.26 + 0.15 ms):

- ``chunk_prep``, one program per (value head, chunk), all chunks at once: the chunk's cumulative
  log-decay c, A = beta_i exp(c_i - c_j) k_i.k_j (j < i) and (I + A)^-1: the four 16x16 diagonal
  blocks inverted exactly in fp32 by forward substitution (one row of every block a step, the
  rows read back from a small scratch), then the block-nilpotent correction
  (I - M + M^2 - M^3) D^-1 in four dots. It stores W = (I + A)^-1 beta v, -Kc =
  -(I + A)^-1 beta exp(c) k, k^T (once per key head), c, exp(c_last - c) and exp(c_last).
- ``chunk_state``, one program per (value head, ``BV`` value columns), the chunks in order, the
  state slice in registers, only what the recurrence needs: the chunk's starting state is stored,
  U = W - Kc S (stored over W), S <- exp(c_last) S + k^T (exp(c_last - c) U); two dots a step,
  the next chunk's operands fetched ahead.
- ``chunk_out``, one program per (value head, chunk), all chunks at once:
  o = scale exp(c) q S_start + (scale (q k^T) exp(c_i - c_j), j <= i) U.

q, k, v, g, beta and the state are read in place (row strides, their own float dtype). Every
operand a tf32 dot reads from memory is stored K-major (W, U, the chunk states and k^T are kept
transposed), so it reaches shared memory in 16-byte asynchronous copies.

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["kernels", "gdn_tree", "gdn_chunk", "tree_plan", "TreePlan", "CHUNK"]

CHUNK = 64
TREE_WARPS = 1     # warps per program of the tree kernel, one value for decode, verify and commit alike (H200, 48
                   # layers at 64 nodes: 1 warp 2.72 ms, 2 warps 3.52, 4 warps 3.83)
# gdn_chunk's launch defaults, measured on an H200 at the 27B shape, 4096 tokens (chunk solve 0.22 ms, state
# 0.26 ms, output 0.15 ms; state BV 32: 0.64 ms the call, BV 16: 0.78)
SCAN_BV, SCAN_WARPS, SCAN_STAGES = 64, 8, 2    # a state-kernel program: value columns, warps, pipeline stages
OUT_BV, OUT_WARPS, OUT_STAGES = 32, 4, 3       # an output-kernel program
PREP_WARPS, PREP_COLS = 4, 32                  # a chunk-solve program: warps, columns of W and Kc made at a time
tl: Any = None
_K: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    @triton.jit(do_not_specialize=["write_out", "final_store"])
    def tree_kernel(qkv_ptr, ab_ptr, alog_ptr, dtb_ptr, S_ptr, scratch_ptr, o_ptr, plan_ptr, n_ptr,
                    write_out, final_store, col_b, col_a, scale,
                    stride_qkv_l, stride_qkv_r, stride_ab_l, stride_ab_r, stride_S_l, stride_o_r,
                    stride_scratch, stride_par_l, HV, G,
                    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    NP: tl.constexpr, PDL: tl.constexpr):
        # qkv: [layers, rows, 2*Hk*DK + HV*DV] fp32 (q, k L2-normalised); ab: [layers, rows, ...] bf16 (b at
        # col_b + h, a at col_a + h); S: [layers, HV, DK, DV] fp32; plan: [3, n] int32 (row, load, save), n <= NP
        pdl_wait(PDL)
        h = tl.program_id(0)
        vb = tl.program_id(1)
        lyr = tl.program_id(2)
        hk = h // G
        n = tl.load(n_ptr)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        k_ok = offs_k < DK
        v_ok = offs_v < DV
        kv_ok = v_ok[:, None] & k_ok[None, :]
        # the whole plan in registers: a node's inputs can be fetched before the node before it is done
        pi = tl.arange(0, NP)
        p_ok = pi < n
        rows = tl.load(plan_ptr + pi, mask=p_ok, other=0)
        # the state slice, transposed: St[v, k] = S[k, v]  (St: [BV, BK])
        s_off = offs_v[:, None] + offs_k[None, :] * DV
        S_base = S_ptr + lyr * stride_S_l + h * DK * DV
        St = tl.load(S_base + s_off, mask=kv_ok, other=0.0)
        qkv_l = qkv_ptr + lyr * stride_qkv_l
        ab_l = ab_ptr + lyr * stride_ab_l
        sc_base = scratch_ptr + lyr * stride_par_l + h * DK * DV
        alog = tl.load(alog_ptr + lyr * HV + h)
        dtb = tl.load(dtb_ptr + lyr * HV + h)
        q_col = hk * DK + offs_k
        k_col = (HV // G) * DK + hk * DK + offs_k
        v_col = 2 * (HV // G) * DK + h * DV + offs_v
        # node 0's inputs
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
            # the next node's inputs, issued before this node's arithmetic (its row from the registers)
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

    @triton.jit
    def chunk_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, kn_ptr, kt_ptr, c_ptr, e_ptr, scr_ptr,
                          T, NCH, G, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_g_h,
                          stride_b_t, stride_b_h,
                          DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, DVP: tl.constexpr,
                          RB: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
        # one (value head h, chunk n), everything that does not need the running state:
        #   c = cumsum(g); A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i); Tinv = (I + A)^-1
        #   W = Tinv (beta v) -> w (transposed);  -Kc = -Tinv (beta exp(c) k) -> kn;  c -> c;
        #   exp(c_last - c), exp(c_last) -> e;  k^T -> kt (per key head, by its first value head)
        # k: [T, Hk, DK] (rows strided), v: [T, HV, DV], g, beta: [T, HV], any float dtype. Per (h, n), fp32:
        # w: [DVP, C], kn: [C, BK], c: [C], e: [C + 1]; per (h // G, n): kt: [BK, C]; scr: [2, C, 16] scratch.
        # Rows past T have g = beta = k = v = 0: their w, kn, kt are 0 and c stays at the last token's.
        # W and Kc are made RB columns at a time (fewer registers live).
        h = tl.program_id(0)
        nc = tl.program_id(1)
        hk = h // G
        hn = h * NCH + nc
        ri = tl.arange(0, C)
        t = nc * C + ri
        t_ok = t < T
        offs_k = tl.arange(0, BK)
        g = tl.load(g_ptr + t * stride_g_t + h * stride_g_h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_b_t + h * stride_b_h, mask=t_ok, other=0.0).to(tl.float32)
        c = tl.cumsum(g, 0)                                                                  # [C]
        c_last = tl.sum(tl.where(ri == C - 1, c, 0.0), 0)
        tl.store(c_ptr + hn * C + ri, c)
        tl.store(e_ptr + hn * (C + 1) + ri, tl.exp(c_last - c))
        tl.store(e_ptr + hn * (C + 1) + C, tl.exp(c_last))
        k_rows = k_ptr + t[:, None] * stride_k_t + hk * stride_k_h
        kk = tl.load(k_rows + offs_k[None, :], mask=t_ok[:, None] & (offs_k < DK)[None, :],
                     other=0.0).to(tl.float32)                                              # [C, BK]
        if h % G == 0:
            tl.store(kt_ptr + (hk * NCH + nc) * (BK * C) + offs_k[None, :] * C + ri[:, None], kk)
        lower = ri[:, None] > ri[None, :]
        rel = tl.exp(tl.where(lower, c[:, None] - c[None, :], -float("inf")))
        A = beta[:, None] * tl.dot(kk, tl.trans(kk), input_precision=PREC) * rel             # [C, C], strictly lower
        # the 16x16 diagonal blocks L_b of A, inverted in fp32 by forward substitution, all blocks at once, on
        # Y: [C, 16], Y[16b + col, j] = X_b[j, col] (X_b = (I + L_b)^-1): step s needs row s of each L_b, read
        # back from the scratch, and sums along Y's rows (within a warp)
        scr = scr_ptr + hn * (2 * C * 16)
        blk = ri // 16
        j16 = tl.arange(0, 16)
        diag = blk[:, None] == blk[None, :]
        tl.store(scr + ri[:, None] * 16 + (ri % 16)[None, :], A, mask=diag)                # [C, 16]: L_b rows
        tl.debug_barrier()
        Y = tl.where((ri % 16)[:, None] == j16[None, :], 1.0, 0.0)                          # [C, 16]
        for s in tl.static_range(1, 16):
            Ls = tl.load(scr + (blk * 16 + s)[:, None] * 16 + j16[None, :])                # L_b[s, :] per row
            Y = tl.where(j16[None, :] == s, Y - tl.sum(Ls * Y, axis=1)[:, None], Y)
        tl.store(scr + C * 16 + ri[:, None] * 16 + j16[None, :], Y)
        tl.debug_barrier()
        # D^-1 = blockdiag(X_b): D^-1[m, n] = Y[16 (m // 16) + n % 16, m % 16]
        Xd = tl.load(scr + C * 16 + (blk[:, None] * 16 + (ri % 16)[None, :]) * 16 + (ri % 16)[:, None],
                     mask=diag, other=0.0)                                                   # [C, C]
        # (I + A)^-1 = (I + M)^-1 D^-1 = (I - M + M^2 - M^3) D^-1, M = D^-1 N (N strictly block-lower: M^4 = 0)
        eye = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
        M = tl.dot(Xd, tl.where(blk[:, None] > blk[None, :], A, 0.0), input_precision=PREC)
        P = eye - M
        P = eye - tl.dot(M, P, input_precision=PREC)
        P = eye - tl.dot(M, P, input_precision=PREC)
        Tinv = tl.dot(P, Xd, input_precision=PREC)
        for cb in range(DVP // RB):
            offs_v = cb * RB + tl.arange(0, RB)
            vv = tl.load(v_ptr + t[:, None] * stride_v_t + h * stride_v_h + offs_v[None, :],
                         mask=t_ok[:, None] & (offs_v < DV)[None, :], other=0.0).to(tl.float32)  # [C, RB]
            W = tl.dot(Tinv, vv * beta[:, None], input_precision=PREC)
            tl.store(w_ptr + hn * (DVP * C) + offs_v[None, :] * C + ri[:, None], W)
        kb = -beta * tl.exp(c)
        for cb in range(BK // RB):
            offs_c = cb * RB + tl.arange(0, RB)
            kc = tl.load(k_rows + offs_c[None, :], mask=t_ok[:, None] & (offs_c < DK)[None, :],
                         other=0.0).to(tl.float32)                                          # [C, RB]
            Kn = tl.dot(Tinv, kc * kb[:, None], input_precision=PREC)
            tl.store(kn_ptr + hn * (C * BK) + ri[:, None] * BK + offs_c[None, :], Kn)

    @triton.jit
    def chunk_state_kernel(w_ptr, kn_ptr, kt_ptr, e_ptr, s0_ptr, sc_ptr, s1_ptr, NCH, G,
                           stride_s_h, stride_s_k, stride_s_v,
                           DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, DVP: tl.constexpr,
                           BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
        # one (BV value columns, value head h): the chunks in order, S[:, cols] in registers; per chunk n
        #   sc <- S (the chunk's starting state, transposed);  U = W - Kc S -> w (in place);
        #   S <- exp(c_last) S + k^T (exp(c_last - c) U)
        # s0: [HV, DK, DV] (strided, any float dtype); sc: [HV, NCH, DVP, BK] fp32; s1: [HV, DK, DV] fp32
        vb = tl.program_id(0)
        h = tl.program_id(1)
        ri = tl.arange(0, C)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        kv_ok = (offs_k < DK)[:, None] & (offs_v < DV)[None, :]
        S = tl.load(s0_ptr + h * stride_s_h + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v,
                    mask=kv_ok, other=0.0).to(tl.float32)                                   # [BK, BV]
        w_off = offs_v[None, :] * C + ri[:, None]                                            # [C, BV] of w's [DVP, C]
        sc_off = offs_v[None, :] * BK + offs_k[:, None]                                      # [BK, BV] of sc's [DVP, BK]
        hn = h * NCH
        kt_base = kt_ptr + (h // G) * NCH * (BK * C)
        w_next = tl.load(w_ptr + hn * (DVP * C) + w_off)
        e_next = tl.load(e_ptr + hn * (C + 1) + ri)
        d_next = tl.load(e_ptr + hn * (C + 1) + C)
        for nc in range(NCH):
            w_cur = w_next
            e = e_next
            d = d_next
            nx = hn + tl.minimum(nc + 1, NCH - 1)                       # the next chunk's W and decays, early
            w_next = tl.load(w_ptr + nx * (DVP * C) + w_off)
            e_next = tl.load(e_ptr + nx * (C + 1) + ri)
            d_next = tl.load(e_ptr + nx * (C + 1) + C)
            tl.store(sc_ptr + (hn + nc) * (DVP * BK) + sc_off, S)
            kn = tl.load(kn_ptr + (hn + nc) * (C * BK) + ri[:, None] * BK + offs_k[None, :])     # [C, BK]
            U = tl.dot(kn, S, acc=w_cur, input_precision=PREC)                                   # [C, BV]
            tl.store(w_ptr + (hn + nc) * (DVP * C) + w_off, U)
            kt = tl.load(kt_base + nc * (BK * C) + offs_k[:, None] * C + ri[None, :])            # [BK, C]
            S = tl.dot(kt, U * e[:, None], acc=S * d, input_precision=PREC)
        tl.store(s1_ptr + h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :], S, mask=kv_ok)

    @triton.jit
    def chunk_out_kernel(q_ptr, k_ptr, u_ptr, c_ptr, sc_ptr, o_ptr, T, NCH, G, HV, scale,
                         stride_q_t, stride_q_h, stride_k_t, stride_k_h,
                         DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, DVP: tl.constexpr,
                         BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
        # one (value head h, chunk n), all chunks at once, BV value columns at a time:
        #   o = scale exp(c) q Sc + (scale (q k^T) exp(c_i - c_j), j <= i) U;  o: [T, HV, DV] fp32
        h = tl.program_id(0)
        nc = tl.program_id(1)
        hk = h // G
        hn = h * NCH + nc
        ri = tl.arange(0, C)
        t = nc * C + ri
        t_ok = t < T
        offs_k = tl.arange(0, BK)
        tk_ok = t_ok[:, None] & (offs_k < DK)[None, :]
        q = tl.load(q_ptr + t[:, None] * stride_q_t + hk * stride_q_h + offs_k[None, :], mask=tk_ok,
                    other=0.0).to(tl.float32)                                               # [C, BK]
        kk = tl.load(k_ptr + t[:, None] * stride_k_t + hk * stride_k_h + offs_k[None, :], mask=tk_ok,
                     other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + hn * C + ri)
        causal = ri[:, None] >= ri[None, :]
        qk = tl.dot(q, tl.trans(kk), input_precision=PREC) * (
            scale * tl.exp(tl.where(causal, cc[:, None] - cc[None, :], -float("inf"))))      # [C, C]
        qs = q * (scale * tl.exp(cc))[:, None]
        for vb in range(DVP // BV):
            offs_v = vb * BV + tl.arange(0, BV)
            S = tl.load(sc_ptr + hn * (DVP * BK) + offs_v[None, :] * BK + offs_k[:, None])      # [BK, BV]
            U = tl.load(u_ptr + hn * (DVP * C) + offs_v[None, :] * C + ri[:, None])             # [C, BV]
            o = tl.dot(qk, U, acc=tl.dot(qs, S, input_precision=PREC), input_precision=PREC)
            tl.store(o_ptr + t[:, None] * (HV * DV) + h * DV + offs_v[None, :], o,
                     mask=t_ok[:, None] & (offs_v < DV)[None, :])

    return {"tree": tree_kernel, "chunk_prep": chunk_prep_kernel, "chunk_state": chunk_state_kernel,
            "chunk_out": chunk_out_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# -- the tree plan -----------------------------------------------------------------------------------------
class TreePlan:
    """Per node, in index order: ``row`` (which input row), ``load`` (-1: continue from the registers, -2: the
    committed state, s >= 0: scratch slot s) and ``save`` (scratch slot to save to, or -1); ``slots`` used."""

    def __init__(self, row: list[int], load: list[int], save: list[int], slots: int) -> None:
        self.row, self.load, self.save, self.slots = row, load, save, slots

    def packed(self) -> list[int]:
        return [*self.row, *self.load, *self.save]


def tree_plan(parents: list[int]) -> TreePlan:
    """The plan of a tree (``parents[i] < i``, -1 for a child of the committed sequence)."""
    n = len(parents)
    needs_save = [False] * n
    for i, p in enumerate(parents):
        if p >= 0 and p != i - 1:
            needs_save[p] = True
    slot = [-1] * n
    slots = 0
    for i in range(n):
        if needs_save[i]:
            slot[i] = slots
            slots += 1
    load = []
    for i, p in enumerate(parents):
        if p == -1:
            load.append(-1 if i == 0 else -2)
        elif p == i - 1:
            load.append(-1)
        else:
            load.append(slot[p])
    return TreePlan(list(range(n)), load, slot, slots)


# -- launchers ---------------------------------------------------------------------------------------------
def gdn_tree(qkv: torch.Tensor, ab: torch.Tensor, col_b: int, col_a: int, A_log: torch.Tensor,
             dt_bias: torch.Tensor, S: torch.Tensor, scratch: torch.Tensor, o: torch.Tensor, plan: torch.Tensor,
             n: torch.Tensor, *, write_out: bool, final_store: bool, scale: float, num_k_heads: int,
             layers: int = 1, BV: int = 16) -> None:
    """The tree kernel over ``layers`` layers (commit replay) or one.

    ``qkv: [layers, rows, 2*Hk*Dk + Hv*Dv]`` fp32; ``ab: [layers, rows, >= col + Hv]`` bf16; ``A_log, dt_bias:
    [layers, Hv]`` fp32; ``S: [layers, Hv, Dk, Dv]`` fp32 (the committed state: read, and written when
    ``final_store``); ``scratch: [slots, Hv, Dk, Dv]`` fp32 (branch states; one layer at a time);
    ``o: [rows, Hv, Dv]`` fp32; ``plan: [3 * n]`` int32 (``TreePlan.packed``), ``n: [1]`` int32."""
    Ly, Hv, Dk, Dv = S.shape
    G = Hv // num_k_heads
    grid = (Hv, math.ceil(Dv / BV), layers)
    NP = max(16, _p2(plan.numel() // 3))
    kernels()["tree"][grid](qkv, ab, A_log, dt_bias, S, scratch, o, plan, n, int(write_out), int(final_store),
                            col_b, col_a, float(scale), qkv.stride(0), qkv.stride(1), ab.stride(0), ab.stride(1),
                            S.stride(0), o.stride(0), scratch.stride(0) if scratch.dim() == 4 else 0,
                            0, Hv, G, DK=Dk, DV=Dv, BK=_p2(Dk), BV=BV, NP=NP, num_warps=TREE_WARPS,
                            **pdl.launch_kw())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous (any float dtype: the kernels load and widen it), else a
    copy that is."""
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, *, scale: float, chunk: int = CHUNK, precision: str = "tf32",
              BV: int = SCAN_BV, scan_warps: int = SCAN_WARPS, scan_stages: int = SCAN_STAGES,
              out_bv: int = OUT_BV, out_warps: int = OUT_WARPS, out_stages: int = OUT_STAGES,
              prep_warps: int = PREP_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ``gdn_chunk``'s contract on CUDA: ``q, k: [T, Hk, Dk]``, ``v: [T, Hv, Dv]``, ``g, beta:
    [T, Hv]``, ``state: [Hv, Dk, Dv]`` -> ``(o [T, Hv, Dv] fp32, new_state [Hv, Dk, Dv] fp32)``; nothing
    mutated. Inputs of any float dtype and any strides are read in place (a copy only where a last dimension is
    not contiguous), e.g. views of the engine's ``[T, C]`` fp32 rows. Chunks are always 64 tokens here
    (``chunk`` is the reference's knob and does not change the result beyond fp32 rounding).

    Knobs (speed only): ``BV``, ``scan_warps``, ``scan_stages``: value columns, warps and pipeline stages of a
    program of the sequential state kernel; ``out_bv``, ``out_warps``: the output kernel's; ``prep_warps``: the
    chunk solve's; ``precision``: the dots' ``input_precision``."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    G = Hv // Hk
    dev = q.device
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    C = CHUNK
    N = math.ceil(T / C)
    BK, DVP = max(16, _p2(Dk)), max(16, _p2(Dv))
    f32 = {"dtype": torch.float32, "device": dev}
    W = torch.empty(Hv, N, DVP, C, **f32)              # W, then U in place (transposed per chunk)
    Kn = torch.empty(Hv, N, C, BK, **f32)
    Kt = torch.empty(Hk, N, BK, C, **f32)
    c = torch.empty(Hv, N, C, **f32)
    e = torch.empty(Hv, N, C + 1, **f32)
    scr = torch.empty(Hv, N, 2, C, 16, **f32)
    Sc = torch.empty(Hv, N, DVP, BK, **f32)            # each chunk's starting state, transposed
    S1 = torch.empty(Hv, Dk, Dv, **f32)
    o = torch.empty(T, Hv, Dv, **f32)
    K = kernels()
    K["chunk_prep"][(Hv, N)](k, v, g, beta, W, Kn, Kt, c, e, scr, T, N, G, k.stride(0), k.stride(1),
                             v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
                             DK=Dk, DV=Dv, BK=BK, DVP=DVP, RB=min(PREP_COLS, BK, DVP), C=C, PREC=precision,
                             num_warps=prep_warps, num_stages=1)
    BV = min(BV, DVP)
    K["chunk_state"][(DVP // BV, Hv)](W, Kn, Kt, e, state, Sc, S1, N, G, state.stride(0), state.stride(1),
                                      state.stride(2), DK=Dk, DV=Dv, BK=BK, DVP=DVP, BV=BV, C=C, PREC=precision,
                                      num_warps=scan_warps, num_stages=scan_stages)
    out_bv = min(out_bv, DVP)
    K["chunk_out"][(Hv, N)](q, k, W, c, Sc, o, T, N, G, Hv, float(scale), q.stride(0), q.stride(1), k.stride(0),
                            k.stride(1), DK=Dk, DV=Dv, BK=BK, DVP=DVP, BV=out_bv, C=C, PREC=precision,
                            num_warps=out_warps, num_stages=out_stages)
    return o, S1
