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

Chunked prefill (``gdn_chunk``): ``chunk_prep`` solves each 64-token chunk's unit
lower-triangular system (block forward substitution on 16x16 diagonal blocks, then the
exact block-nilpotent correction) in parallel over chunks; ``chunk_scan`` runs the chunks
in order per (head, value block), the state in registers.

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
tl: Any = None
_K: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    global tl
    import triton
    import triton.language as _tl

    tl = _tl

    pdl_wait = pdl.jit_helpers()["pdl_wait"]
    globals()["pdl_wait"] = pdl_wait              # Triton resolves a kernel's callees in the module globals

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
    def chunk_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, kc_ptr, qin_ptr, kend_ptr, qk_ptr, dec_ptr,
                          T, HV, G, scale, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                          BVF: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
        # one (value head h, chunk n), everything that does not need the running state:
        #   c = cumsum(g); A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i); Tinv = (I + A)^-1
        #   W = Tinv (beta v); Kc = Tinv (beta exp(c) k); q_in = scale q exp(c); k_end = k exp(c_last - c)
        #   qk = scale (q k^T) exp(c_i - c_j) (j <= i); dec = exp(c_last)
        # q, k: [T, Hk, DK] fp32, v: [T, HV, DV] fp32, g, beta: [T, HV] fp32; outputs [HV, T, .] and dec [HV, N]
        h = tl.program_id(0)
        nc = tl.program_id(1)
        hk = h // G
        HK = HV // G
        t = nc * C + tl.arange(0, C)
        t_ok = t < T
        offs_k = tl.arange(0, BK)
        offs_v = tl.arange(0, BVF)
        tk_ok = t_ok[:, None] & (offs_k[None, :] < DK)
        kk = tl.load(k_ptr + t[:, None] * (HK * DK) + hk * DK + offs_k[None, :], mask=tk_ok, other=0.0)  # [C, BK]
        g = tl.load(g_ptr + t * HV + h, mask=t_ok, other=0.0)
        beta = tl.load(beta_ptr + t * HV + h, mask=t_ok, other=0.0)
        c = tl.cumsum(g, 0)                                                                  # [C]
        c_last = tl.sum(tl.where(t == tl.minimum(nc * C + C, T) - 1, c, 0.0), 0)
        ri = tl.arange(0, C)
        lower = ri[:, None] > ri[None, :]
        rel = tl.exp(tl.where(lower, c[:, None] - c[None, :], -float("inf")))
        kkt = tl.dot(kk, tl.trans(kk), input_precision=PREC)                                  # [C, C]
        A = tl.where(lower, beta[:, None] * kkt * rel, 0.0)
        # block-diagonal part D (16x16 blocks), inverted by forward substitution on all blocks at once
        blk = (ri[:, None] // 16) == (ri[None, :] // 16)
        Ad = tl.where(blk, A, 0.0)
        eye = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
        X = eye
        for s in tl.static_range(1, 16):
            # rows with (row % 16) == s: X[r, :] = e_r - sum_{j<r in block} A[r, j] X[j, :]
            sel = (ri % 16) == s
            upd = eye - tl.dot(Ad, X, input_precision=PREC)
            X = tl.where(sel[:, None], upd, X)
        # (D + N)^-1 = (I - M + M^2 - M^3) D^-1 with M = D^-1 N (N strictly block-lower: M^4 = 0)
        Nb = A - Ad
        M1 = tl.dot(X, Nb, input_precision=PREC)
        M2 = tl.dot(M1, M1, input_precision=PREC)
        M3 = tl.dot(M2, M1, input_precision=PREC)
        Tinv = tl.dot(eye - M1 + M2 - M3, X, input_precision=PREC)
        out_k = h * T * DK + t[:, None] * DK + offs_k[None, :]
        Kc = tl.dot(Tinv, kk * (beta * tl.exp(c))[:, None], input_precision=PREC)
        tl.store(kc_ptr + out_k, Kc, mask=tk_ok)
        tl.store(kend_ptr + out_k, kk * tl.where(t_ok, tl.exp(c_last - c), 0.0)[:, None], mask=tk_ok)
        vv = tl.load(v_ptr + t[:, None] * (HV * DV) + h * DV + offs_v[None, :],
                     mask=t_ok[:, None] & (offs_v[None, :] < DV), other=0.0)               # [C, BVF]
        W = tl.dot(Tinv, vv * beta[:, None], input_precision=PREC)
        tl.store(w_ptr + h * T * DV + t[:, None] * DV + offs_v[None, :], W,
                 mask=t_ok[:, None] & (offs_v[None, :] < DV))
        q = tl.load(q_ptr + t[:, None] * (HK * DK) + hk * DK + offs_k[None, :], mask=tk_ok, other=0.0) * scale
        tl.store(qin_ptr + out_k, q * tl.exp(c)[:, None], mask=tk_ok)
        causal = ri[:, None] >= ri[None, :]
        qk = tl.dot(q, tl.trans(kk), input_precision=PREC) * tl.exp(tl.where(causal, c[:, None] - c[None, :],
                                                                                -float("inf")))
        tl.store(qk_ptr + h * T * C + t[:, None] * C + ri[None, :], qk, mask=t_ok[:, None])
        tl.store(dec_ptr + h * tl.cdiv(T, C) + nc, tl.exp(c_last))

    @triton.jit
    def chunk_scan_kernel(w_ptr, kc_ptr, qin_ptr, kend_ptr, qk_ptr, dec_ptr, S_ptr, o_ptr, T, HV,
                          DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          C: tl.constexpr, PREC: tl.constexpr):
        # one (value head h, BV value columns): the chunks in order, S[:, cols] in registers:
        #   U = W - Kc S;  o = q_in S + qk U;  S <- dec S + k_end^T U
        h = tl.program_id(0)
        vb = tl.program_id(1)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        k_ok = offs_k < DK
        v_ok = offs_v < DV
        S_base = S_ptr + h * DK * DV
        S = tl.load(S_base + offs_k[:, None] * DV + offs_v[None, :], mask=k_ok[:, None] & v_ok[None, :],
                    other=0.0)                                                               # [BK, BV]
        ri = tl.arange(0, C)
        n_chunks = tl.cdiv(T, C)
        for nc in range(0, n_chunks):
            t = nc * C + ri
            t_ok = t < T
            tk = h * T * DK + t[:, None] * DK + offs_k[None, :]
            tk_ok = t_ok[:, None] & k_ok[None, :]
            tv = h * T * DV + t[:, None] * DV + offs_v[None, :]
            tv_ok = t_ok[:, None] & v_ok[None, :]
            Kc = tl.load(kc_ptr + tk, mask=tk_ok, other=0.0)                                  # [C, BK]
            U = tl.load(w_ptr + tv, mask=tv_ok, other=0.0) - tl.dot(Kc, S, input_precision=PREC)   # [C, BV]
            qin = tl.load(qin_ptr + tk, mask=tk_ok, other=0.0)
            o = tl.dot(qin, S, input_precision=PREC)
            qk = tl.load(qk_ptr + h * T * C + t[:, None] * C + ri[None, :], mask=t_ok[:, None], other=0.0)
            o = o + tl.dot(qk, U, input_precision=PREC)
            tl.store(o_ptr + t[:, None] * (HV * DV) + h * DV + offs_v[None, :], o, mask=tv_ok)
            kend = tl.load(kend_ptr + tk, mask=tk_ok, other=0.0)
            S = S * tl.load(dec_ptr + h * n_chunks + nc) + tl.dot(tl.trans(kend), U, input_precision=PREC)
        tl.store(S_base + offs_k[:, None] * DV + offs_v[None, :], S, mask=k_ok[:, None] & v_ok[None, :])

    return {"tree": tree_kernel, "chunk_prep": chunk_prep_kernel, "chunk_scan": chunk_scan_kernel}


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


def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, *, scale: float, chunk: int = CHUNK, precision: str = "tf32",
              BV: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ``gdn_chunk``'s contract on CUDA: ``q, k: [T, Hk, Dk]``, ``v: [T, Hv, Dv]``, ``g, beta:
    [T, Hv]``, ``state: [Hv, Dk, Dv]`` fp32 -> ``(o [T, Hv, Dv] fp32, new_state [Hv, Dk, Dv] fp32)``; nothing
    mutated. Chunks are always 64 tokens here (``chunk`` is the reference's knob and does not change the result
    beyond fp32 rounding)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    G = Hv // Hk
    dev = q.device
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    S = state.float().contiguous().clone()
    C = CHUNK
    n_chunks = math.ceil(T / C)
    f32 = dict(dtype=torch.float32, device=dev)
    W = torch.empty(Hv, T, Dv, **f32)
    Kc, q_in, k_end = (torch.empty(Hv, T, Dk, **f32) for _ in range(3))
    qk = torch.empty(Hv, T, C, **f32)
    dec = torch.empty(Hv, n_chunks, **f32)
    o = torch.empty(T, Hv, Dv, **f32)
    K = kernels()
    K["chunk_prep"][(Hv, n_chunks)](q, k, v, g, beta, W, Kc, q_in, k_end, qk, dec, T, Hv, G, float(scale), DK=Dk,
                                    DV=Dv, BK=_p2(Dk), BVF=_p2(Dv), C=C, PREC=precision, num_warps=8,
                                    num_stages=1)
    BV = min(BV, _p2(Dv))
    K["chunk_scan"][(Hv, math.ceil(Dv / BV))](W, Kc, q_in, k_end, qk, dec, S, o, T, Hv, DK=Dk, DV=Dv, BK=_p2(Dk),
                                              BV=BV, C=C, PREC=precision, num_warps=8, num_stages=1)
    return o, S
