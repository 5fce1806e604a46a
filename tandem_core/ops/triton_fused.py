"""Fused row-wise kernels for CUDA (Triton): norms, the MLP gate, the Gated DeltaNet conv over a token tree,
the attention layer's query/key post-processing, and the commit of a verified path.

Every kernel works one row (token) at a time with a fixed block layout, so a row's
result never depends on how many rows a call carries (decode rows equal verify rows).
Each mirrors its plain-torch reference's dtype flow (``tandem_core.ops.norm``,
``conv``, ``rope``, ``act``): fp32 inside, rounded to bf16 where the reference rounds.

    add_rms_norm_1p(x, parts, w, eps, out)   x <- bf16(x + bf16(sum parts)); out = bf16(rms_norm_1p(x))
    silu_mul(gu, out)                        out = bf16(bf16(silu(gate)) * up), gu = [gate | up]
    gated_rms_norm(o, z, w, eps, out)        out = bf16(rms(o) * w * silu(z)) per value head
    conv_tree(...)                           causal conv + silu (+ l2 norm of q/k heads) for each node
                                             of a tree, its window through its ancestors and the tail
    conv_chain(...)                          the same for a chain of prefill tokens, a block of them a program
    qk_post(...)                             q/k zero-centred norm + rope; k, v into the cache slots
    conv_commit / kv_commit                  the tails and cache rows after a committed path

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["kernels", "add_rms_norm_1p", "silu_mul", "gated_rms_norm", "conv_tree", "conv_chain", "qk_post", "conv_commit",
           "kv_commit", "next_pow2"]

tl: Any = None
_K: dict[str, Any] = {}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())                # tl and pdl_wait, where the kernels look them up

    @triton.jit
    def add_norm_kernel(x_ptr, parts_ptr, w_ptr, out_ptr, H, stride_x, stride_ps, stride_pm,
                        stride_o, eps, NP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one row: x <- bf16(x + bf16(sum_s parts[s])) (NP may be 0); out = bf16(x / rms(x) * (1 + w))
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)             # first: the store to x below would keep it back
        x = tl.load(x_ptr + r * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        if NP > 0:
            # the parts unrolled: every load is in flight at once (a loop would wait on each in turn)
            d = tl.load(parts_ptr + r * stride_pm + offs, mask=ok, other=0.0).to(tl.float32)
            for s in tl.static_range(1, NP):
                d += tl.load(parts_ptr + s * stride_ps + r * stride_pm + offs, mask=ok, other=0.0).to(tl.float32)
            x = (x + d.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
            tl.store(x_ptr + r * stride_x + offs, x.to(tl.bfloat16), mask=ok)
        ms = tl.sum(x * x, 0) / H
        inv = 1.0 / tl.sqrt(ms + eps)
        tl.store(out_ptr + r * stride_o + offs, (x * inv * (1.0 + w)).to(tl.bfloat16), mask=ok)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(gu_ptr + r * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r * stride_gu + I + offs, mask=ok, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        tl.store(out_ptr + r * stride_o + offs, (a * u).to(tl.bfloat16), mask=ok)

    @triton.jit
    def gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, D, stride_or, stride_zr, stride_outr, eps,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (row, value head): out = bf16(o / rms(o) * w * silu(z)); o fp32 [R, Hv, D], z bf16 row-strided
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        o = tl.load(o_ptr + r * stride_or + h * D + offs, mask=ok, other=0.0)
        z = tl.load(z_ptr + r * stride_zr + h * D + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        inv = 1.0 / tl.sqrt(tl.sum(o * o, 0) / D + eps)
        y = o * inv * w * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + r * stride_outr + h * D + offs, y.to(tl.bfloat16), mask=ok)

    @triton.jit
    def conv_tree_kernel(raw_ptr, tail_ptr, w_ptr, win_ptr, out_ptr, n_ptr, C, QK_HEADS,
                         stride_raw, stride_out, eps,
                         KW: tl.constexpr, DH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (node i, head-sized channel group g): y = silu(sum_k w[c,k] * x_k) over the node's window
        # x_0..x_{KW-2} = win[i, k] < KW-1 ? tail[c, win] : raw[win - (KW-1), c]; x_{KW-1} = raw[i, c]
        i = tl.program_id(0)
        g = tl.program_id(1)
        n = tl.load(n_ptr)
        if i < n:
            offs = tl.arange(0, BLOCK)
            c = g * DH + offs
            ok = (offs < DH) & (c < C)
            xi = tl.load(raw_ptr + i * stride_raw + c, mask=ok, other=0.0)                  # bf16
            y = tl.zeros((BLOCK,), dtype=tl.float32)
            for k in tl.static_range(KW - 1):
                src = tl.load(win_ptr + i * (KW - 1) + k)
                from_tail = src < KW - 1
                row = tl.where(from_tail, 0, src - (KW - 1))
                col = tl.where(from_tail, src, 0)
                xt = tl.load(tail_ptr + c * (KW - 1) + col, mask=ok & from_tail, other=0.0).to(tl.float32)
                xr = tl.load(raw_ptr + row * stride_raw + c, mask=ok & (src >= KW - 1), other=0.0).to(tl.float32)
                x = tl.where(from_tail, xt, xr)
                wk = tl.load(w_ptr + c * KW + k, mask=ok, other=0.0)
                if k == 0:
                    y = x * wk
                else:
                    y = y + x * wk
            y = y + xi.to(tl.float32) * tl.load(w_ptr + c * KW + (KW - 1), mask=ok, other=0.0)
            y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32)    # the reference rounds the conv output
            if g < QK_HEADS:
                y = y / tl.sqrt(tl.sum(tl.where(ok, y * y, 0.0), 0) + eps)
            tl.store(out_ptr + i * stride_out + c, y, mask=ok)

    @triton.jit
    def conv_chain_kernel(raw_ptr, tail_ptr, w_ptr, out_ptr, T, C, QK_HEADS, stride_raw, stride_out, eps,
                          KW: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr):
        # prefill: BT tokens of a chain x one head-sized channel group g, y = silu(sum_k w[c,k] x_k) with x_k
        # column t + k of [tail ; raw] (the last is the token's own row): conv_tree's arithmetic for a chain,
        # many tokens a program (each loaded row serves KW of them)
        tb = tl.program_id(0)
        g = tl.program_id(1)
        t = tb * BT + tl.arange(0, BT)
        offs = tl.arange(0, BLOCK)
        c = g * DH + offs
        c_ok = (offs < DH) & (c < C)
        t_ok = t < T
        y = tl.zeros((BT, BLOCK), dtype=tl.float32)
        for k in tl.static_range(KW):
            src = t + k
            from_tail = src < KW - 1
            row = tl.where(from_tail, 0, src - (KW - 1))
            xr = tl.load(raw_ptr + row[:, None] * stride_raw + c[None, :],
                         mask=(t_ok & (src >= KW - 1))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            xt = tl.load(tail_ptr + c[None, :] * (KW - 1) + tl.where(from_tail, src, 0)[:, None],
                         mask=(t_ok & from_tail)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            x = tl.where(from_tail[:, None], xt, xr)
            wk = tl.load(w_ptr + c * KW + k, mask=c_ok, other=0.0)
            if k == 0:
                y = x * wk[None, :]
            else:
                y = y + x * wk[None, :]
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32)        # the reference rounds the conv output
        if g < QK_HEADS:
            y = y / tl.sqrt(tl.sum(tl.where(c_ok[None, :], y * y, 0.0), 1) + eps)[:, None]
        tl.store(out_ptr + t[:, None] * stride_out + c[None, :], y, mask=t_ok[:, None] & c_ok[None, :])

    @triton.jit
    def conv_commit_kernel(tail_ptr, keep_ptr, path_ptr, d_ptr, C, stride_tail_l, stride_keep_l, stride_keep_r,
                           KW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (layer, channel block): tail <- the last KW-1 of [tail, keep[path[0]], ..., keep[path[d-1]]]
        lyr = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < C
        d = tl.load(d_ptr)
        tail = tail_ptr + lyr * stride_tail_l
        keep = keep_ptr + lyr * stride_keep_l
        # element j of the new tail is element d + j of [tail ; path]; in increasing j a source (d + j >= j)
        # is read before anything overwrites it
        for j in tl.static_range(KW - 1):
            e = d + j
            from_tail = e < KW - 1
            node = tl.load(path_ptr + tl.where(from_tail, 0, e - (KW - 1)))
            xt = tl.load(tail + c * (KW - 1) + tl.where(from_tail, e, 0), mask=ok & from_tail, other=0.0)
            xr = tl.load(keep + node * stride_keep_r + c, mask=ok & (e >= KW - 1), other=0.0)
            tl.store(tail + c * (KW - 1) + j, tl.where(from_tail, xt, xr), mask=ok)

    @triton.jit
    def _raw_f32(ptrs, stride_s, mask, NP: tl.constexpr):
        # projection values in fp32: the bf16 row (NP 0), or NP fp32 partials added in index order and rounded
        # to bf16 (the bits of bf16(reduce_parts))
        if NP == 0:
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
            for s in tl.static_range(1, NP):
                v += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
            v = v.to(tl.bfloat16).to(tl.float32)
        return v

    globals().update(_raw_f32=_raw_f32)

    @triton.jit
    def qk_post_kernel(raw_ptr, qn_ptr, kn_ptr, freq_ptr, pos_ptr, meta_ptr, q_out_ptr, K_ptr, V_ptr,
                       stride_raw, stride_qo_r, stride_kh, stride_ks, HQ, HKV, eps,
                       D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, QS: tl.constexpr, PDL: tl.constexpr,
                       stride_s=0, NP: tl.constexpr = 0):
        # NP > 0: raw is NP fp32 partials [NP, rows, ...] (stride_s apart), added in index order, rounded to bf16
        pdl_wait(PDL)
        # one (row j, head): heads 0..HQ-1 queries, HQ..HQ+HKV-1 keys, then HKV values.
        # raw row (QS = 2, gated): [q_0 | gate_0 | q_1 | gate_1 | ... | k (HKV*D) | v (HKV*D)];
        # QS = 1 (no output gate): [q_0 | q_1 | ... | k | v]
        j = tl.program_id(0)
        h = tl.program_id(1)
        L = tl.load(meta_ptr)
        n = tl.load(meta_ptr + 1)
        if j < n:
            offs = tl.arange(0, BLOCK)
            ok = offs < D
            slot = L + j
            if h < HQ + HKV:
                is_q = h < HQ
                base = tl.where(is_q, h * QS * D, HQ * QS * D + (h - HQ) * D)
                x = _raw_f32(raw_ptr + j * stride_raw + base + offs, stride_s, ok, NP)
                partner = tl.where(offs < R // 2, offs + R // 2, tl.where(offs < R, offs - R // 2, offs))
                xp = _raw_f32(raw_ptr + j * stride_raw + base + partner, stride_s, ok, NP)
                if is_q:
                    w = tl.load(qn_ptr + offs, mask=ok, other=0.0)
                    wp = tl.load(qn_ptr + partner, mask=ok, other=0.0)
                else:
                    w = tl.load(kn_ptr + offs, mask=ok, other=0.0)
                    wp = tl.load(kn_ptr + partner, mask=ok, other=0.0)
                inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
                y = (x * inv * (1.0 + w)).to(tl.bfloat16).to(tl.float32)
                yp = (xp * inv * (1.0 + wp)).to(tl.bfloat16).to(tl.float32)
                pos = tl.load(pos_ptr + j).to(tl.float32)
                f = tl.load(freq_ptr + (offs % (R // 2)), mask=offs < R, other=0.0)
                ang = pos * f
                rot = tl.where(offs < R // 2, -yp, yp)
                y = tl.where(offs < R, y * tl.cos(ang) + rot * tl.sin(ang), y).to(tl.bfloat16)
                if is_q:
                    tl.store(q_out_ptr + j * stride_qo_r + h * D + offs, y, mask=ok)
                else:
                    tl.store(K_ptr + (h - HQ) * stride_kh + slot * stride_ks + offs, y, mask=ok)
            else:
                hv = h - HQ - HKV
                v_ptrs = raw_ptr + j * stride_raw + HQ * QS * D + HKV * D + hv * D + offs
                if NP == 0:
                    v = tl.load(v_ptrs, mask=ok, other=0.0)
                else:
                    v = _raw_f32(v_ptrs, stride_s, ok, NP).to(tl.bfloat16)
                tl.store(V_ptr + hv * stride_kh + slot * stride_ks + offs, v, mask=ok)

    @triton.jit
    def kv_commit_kernel(K_ptr, V_ptr, meta_ptr, path_ptr, d_ptr, stride_l, stride_h, stride_s,
                         D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (layer, head, channel block): rows L + path[i] -> L + i, in increasing i (path[i] >= i: no overlap)
        lyr = tl.program_id(0)
        hh = tl.program_id(1)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        L = tl.load(meta_ptr)
        d = tl.load(d_ptr)
        # 64-bit offsets: a layer's stride times the layer index passes 2**31 elements at long contexts
        # (16 layers x 4 heads x 140K positions x 256: the int32 product overflowed and the commit wrote wild)
        base_k = K_ptr + lyr.to(tl.int64) * stride_l + hh.to(tl.int64) * stride_h
        base_v = V_ptr + lyr.to(tl.int64) * stride_l + hh.to(tl.int64) * stride_h
        for i in range(0, d):
            src = (L + tl.load(path_ptr + i)).to(tl.int64)
            dst = (L + i).to(tl.int64)
            kv = tl.load(base_k + src * stride_s + offs, mask=ok)
            vv = tl.load(base_v + src * stride_s + offs, mask=ok)
            tl.store(base_k + dst * stride_s + offs, kv, mask=ok)
            tl.store(base_v + dst * stride_s + offs, vv, mask=ok)

    return {"add_norm": add_norm_kernel, "silu_mul": silu_mul_kernel, "gated_norm": gated_norm_kernel,
            "conv_tree": conv_tree_kernel, "conv_chain": conv_chain_kernel, "conv_commit": conv_commit_kernel,
            "qk_post": qk_post_kernel, "kv_commit": kv_commit_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


# -- launchers ---------------------------------------------------------------------------------------------
def add_rms_norm_1p(x: torch.Tensor, parts: torch.Tensor | None, w: torch.Tensor, eps: float,
                    out: torch.Tensor) -> torch.Tensor:
    """``x: [R, H]`` bf16 residual (updated in place when ``parts`` is given); ``parts``: ``[S, R, H]`` fp32
    partials, ``[R, H]`` bf16, or None; ``w: [H]`` fp32 zero-centred; ``out: [R, H]`` bf16."""
    R, H = x.shape
    if parts is None:
        n_parts, pp, sps, spm = 0, x, 0, 0
    elif parts.dim() == 2:
        n_parts, pp, sps, spm = 1, parts, 0, parts.stride(0)
    else:
        n_parts, pp, sps, spm = parts.shape[0], parts, parts.stride(0), parts.stride(1)
    kernels()["add_norm"][(R,)](x, pp, w, out, H, x.stride(0), sps, spm, out.stride(0), float(eps),
                                NP=n_parts, BLOCK=next_pow2(H), num_warps=8, **pdl.launch_kw())
    return out


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``gu: [R, 2I]`` bf16 (gate then up) -> ``out: [R, I]`` bf16."""
    R, I = out.shape
    BLOCK = 1024
    kernels()["silu_mul"][(R, (I + BLOCK - 1) // BLOCK)](gu, out, I, gu.stride(0), out.stride(0), BLOCK=BLOCK,
                                                         num_warps=4, **pdl.launch_kw())
    return out


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``o: [R, Hv, D]`` fp32 contiguous; ``z``: ``[R, >= Hv*D]`` bf16 (row-strided); ``out: [R, Hv*D]`` bf16."""
    R, Hv, D = o.shape
    kernels()["gated_norm"][(R, Hv)](o, z, w, out, D, o.stride(0), z.stride(0), out.stride(0), float(eps),
                                     BLOCK=next_pow2(D), num_warps=1, **pdl.launch_kw())
    return out


def conv_tree(raw: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, win: torch.Tensor, n: torch.Tensor,
              out: torch.Tensor, head_dim: int, qk_heads: int, rows: int,
              eps: float = 1e-6) -> torch.Tensor:
    """Conv + silu for ``rows`` nodes (those ``< n[0]`` computed). ``raw: [rows, >= C]`` bf16 (the projection's
    output, row-strided), ``tail: [C, K-1]`` bf16, ``weight: [C, K]`` fp32, ``win: [rows, K-1]`` int32 (each
    entry ``< K-1``: a tail column; else ``K-1 + node``), ``out: [rows, C]`` fp32 (q and k heads L2-normalised:
    the first ``qk_heads`` groups of ``head_dim`` channels)."""
    C, KW = weight.shape
    groups = (C + head_dim - 1) // head_dim
    kernels()["conv_tree"][(rows, groups)](raw, tail, weight, win, out, n, C, qk_heads, raw.stride(0),
                                           out.stride(0), float(eps), KW=KW, DH=head_dim,
                                           BLOCK=next_pow2(head_dim), num_warps=1, **pdl.launch_kw())
    return out


def conv_chain(raw: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, head_dim: int,
               qk_heads: int, eps: float = 1e-6, BT: int = 16) -> torch.Tensor:
    """``conv_tree`` for a chain of ``T`` tokens after the tail (prefill), ``BT`` tokens a program: ``raw: [T, >=
    C]`` bf16 row-strided, ``tail: [C, K-1]`` bf16, ``weight: [C, K]`` fp32 -> ``out: [T, C]`` fp32."""
    T = raw.shape[0]
    C, KW = weight.shape
    groups = (C + head_dim - 1) // head_dim
    kernels()["conv_chain"][((T + BT - 1) // BT, groups)](raw, tail, weight, out, T, C, qk_heads, raw.stride(0),
                                                          out.stride(0), float(eps), KW=KW, DH=head_dim, BT=BT,
                                                          BLOCK=next_pow2(head_dim), num_warps=4)
    return out


def conv_commit(tails: torch.Tensor, keep: torch.Tensor, path: torch.Tensor, d: torch.Tensor) -> None:
    """``tails: [L, C, K-1]`` bf16, ``keep: [L, rows, >= C]`` bf16 (each layer's raw conv inputs, row-strided),
    ``path: [>= d]`` int32 node indices,
    ``d: [1]`` int32 (path length): every layer's tail moves along the committed path."""
    Ly, C, K1 = tails.shape
    BLOCK = 512
    kernels()["conv_commit"][(Ly, (C + BLOCK - 1) // BLOCK)](tails, keep, path, d, C, tails.stride(0),
                                                              keep.stride(0), keep.stride(1), KW=K1 + 1,
                                                              BLOCK=BLOCK, num_warps=4, **pdl.launch_kw())


def qk_post(raw: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, freqs: torch.Tensor, pos: torch.Tensor,
            meta: torch.Tensor, q_out: torch.Tensor, K: torch.Tensor, V: torch.Tensor, hq: int, hkv: int,
            head_dim: int, rotary_dim: int, eps: float, rows: int, gated: bool = True) -> None:
    """Rows ``j < meta[1]``: q -> bf16(rope(norm(q))) into ``q_out [rows, Hq*D]``; k likewise and v raw into the
    cache ``K, V: [Hkv, S, D]`` at slot ``meta[0] + j``. ``pos: [rows]`` int32 positions; ``freqs: [R/2]``.
    ``gated``: each query head is followed by its output gate in ``raw`` (Qwen's gated attention); else the
    query heads are side by side (Llama, LFM2). The norm is ``x / rms(x) * (1 + w)``: a plain weight is passed as
    ``w - 1``. ``raw`` may also be the projection's fp32 partials ``[S, rows, ...]`` (K cut in ``S`` parts): added
    in index order and rounded to bf16 where they are read, the bits of ``bf16(reduce_parts(raw))``."""
    extra: dict[str, Any] = {"stride_s": 0, "NP": 0}
    if raw.dim() == 3:
        if raw.dtype != torch.float32:
            raise ValueError(f"qk_post: partials [S, rows, N] must be fp32, got {raw.dtype}")
        extra = {"stride_s": raw.stride(0), "NP": int(raw.shape[0])}
    stride_raw = raw.stride(-2)
    kernels()["qk_post"][(rows, hq + 2 * hkv)](raw, q_norm, k_norm, freqs, pos, meta, q_out, K, V, stride_raw,
                                               q_out.stride(0), K.stride(0), K.stride(1), hq, hkv, float(eps),
                                               D=head_dim, R=rotary_dim, BLOCK=next_pow2(head_dim), QS=2 if gated else 1,
                                               num_warps=2, **extra, **pdl.launch_kw())


def kv_commit(K: torch.Tensor, V: torch.Tensor, meta: torch.Tensor, path: torch.Tensor, d: torch.Tensor) -> None:
    """``K, V: [L, Hkv, S, D]``: rows ``meta[0] + path[i]`` move to ``meta[0] + i`` for ``i < d[0]``."""
    Ly, Hkv, S, D = K.shape
    BLOCK = min(256, next_pow2(D))
    kernels()["kv_commit"][(Ly, Hkv, (D + BLOCK - 1) // BLOCK)](K, V, meta, path, d, K.stride(0), K.stride(1),
                                                                K.stride(2), D=D, BLOCK=BLOCK, num_warps=2, **pdl.launch_kw())
