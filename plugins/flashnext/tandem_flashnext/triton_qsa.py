"""Flash-Next's own row-invariant kernels on CUDA (Triton), each beside its plain-torch reference.

    group_norm1p(x [R, G*D], w [G*D] fp32, eps, out)         zero-centred RMS norm of each of G groups of a row
    head_scores(q [R, Hq, D], keys, nvalid [R], div, relu)   sum over heads of f(q_h . key_b) / div  -> [R, B]
    gathered_attention(q, K, V, slots [R, M], scale)          attention of each row over its own cache slots

``group_norm1p``: one program a (row, group), ``x / rms(x) * (1 + w)`` in fp32, rounded once (the
hyper-connection stream norms, the q / k / indexer norms, the PLE norms).

``head_scores``: one program a (row, ``BB`` keys): ``s[r, b] = (sum over h in order of f(q[r, h] .
keys[r, b])) / div`` in fp32, ``f`` relu (the QSA indexer's block scores) or the identity (the PLE gate:
one head, one key a row); keys past ``nvalid[r]`` score ``-1``. ``keys`` is ``[B, D]`` shared by every row
(``key_node_stride`` 0: the committed blocks' keys) or ``[R, B, D]`` (each row its own).

The hyper-connections' elementwise pieces, one launch each (rows alone, so row invariant):

    act(x, scale, mul, kind)              bf16(mul * act(scale * x)), x a bf16 [R, N] or the fp32 partials
                                          [S, R, N] of a split matmul (added in index order), act silu / sigmoid
    hyper_combine(up [R, n*H], normed)    sum over the streams of bf16(sigmoid(up_s)) * normed_s, over n
    inject_add(x [R, n*H], d [R, H], w)   x_s += bf16(d * w[:, s]) for every stream, in place

``gathered_attention``: program (row, KV head, split): online softmax over the row's slots
``slots[r, s*chunk .. (s+1)*chunk - 1]`` (``-1``: none), the ``G = Hq/Hkv`` query heads of the KV head at
once; the ``SPLIT`` partial results are merged in split order (one program a row and KV head; ``combine`` is
that merge in torch). Chunks, tiles and splits
depend on ``M`` and the head shape only, so a row's output does not depend on the rows beside it: a
verified row equals the decode row bit for bit.

Triton is imported when a kernel is first built, never at import.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem_core.ops import triton_pdl as pdl

__all__ = ["SPLIT", "act", "act_ref", "gathered_attention", "gathered_attention_ref", "group_norm1p",
           "group_norm1p_ref", "head_scores", "head_scores_ref", "hyper_combine", "hyper_combine_ref", "inject_add",
           "inject_add_ref", "kernels", "slots", "slots_ref"]

SPLIT = 8          # programs a (row, KV head) of the gathered attention
BN = 32            # slots a step of a program
BB = 64            # keys a program of head_scores (fewer for wide rows: at most 8192 elements a tile)

tl: Any = None
_K: dict[str, Any] = {}


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _build() -> dict[str, Any]:
    triton = pdl.bind(globals())

    @triton.jit
    def group_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0)
        g = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(x_ptr + r * stride_x + g * D + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + g * D + offs, mask=ok, other=0.0)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        tl.store(out_ptr + r * stride_o + g * D + offs, (x * inv * (1.0 + w)).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def scores_kernel(q_ptr, k_ptr, nv_ptr, out_ptr, B, D, stride_qr, stride_qh, stride_kr, stride_kb,
                      stride_o, div, HEADS: tl.constexpr, RELU: tl.constexpr, BB: tl.constexpr,
                      BD: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0)
        offs_b = tl.program_id(1) * BB + tl.arange(0, BB)
        offs_d = tl.arange(0, BD)
        nv = tl.load(nv_ptr + r)
        live = offs_b < nv
        d_ok = offs_d < D
        keys = tl.load(k_ptr + r * stride_kr + offs_b[:, None].to(tl.int64) * stride_kb + offs_d[None, :],
                       mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)        # [BB, BD]
        acc = tl.zeros((BB,), dtype=tl.float32)
        for h in tl.static_range(HEADS):
            q = tl.load(q_ptr + r * stride_qr + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            s = tl.sum(keys * q[None, :], 1)
            if RELU:
                s = tl.maximum(s, 0.0)
            acc = acc + s
        acc = tl.where(live, acc / div, -1.0)
        tl.store(out_ptr + r * stride_o + offs_b, acc, mask=offs_b < B)

    @triton.jit
    def gathered_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, M, CHUNK, NSTEP, stride_q, stride_kh,
                        stride_ks, stride_vh, stride_vs, stride_sl, scale, HKV: tl.constexpr, G: tl.constexpr,
                        BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                        SPLIT: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        offs_g = tl.arange(0, BG)
        offs_d = tl.arange(0, BD)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q = tl.load(q_ptr + r * stride_q + (h * G + offs_g)[:, None] * D + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)                           # [BG, BD] bf16
        m_i = tl.full((BG,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, BD), dtype=tl.float32)
        lo = s * CHUNK
        for it in range(NSTEP):
            offs_n = lo + it * BN + tl.arange(0, BN)
            sl = tl.load(slots_ptr + r * stride_sl + offs_n, mask=offs_n < M, other=-1)
            ok = sl >= 0
            row = tl.where(ok, sl, 0).to(tl.int64)
            kk = tl.load(k_ptr + h * stride_kh + row[:, None] * stride_ks + offs_d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0)                         # [BN, BD]
            sc = tl.dot(q, tl.trans(kk)) * scale                                              # [BG, BN] fp32
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v_ptr + h * stride_vh + row[:, None] * stride_vs + offs_d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            m_i = m_new
        base = (r * HKV + h) * SPLIT + s
        tl.store(m_ptr + base * BG + offs_g, m_i)
        tl.store(l_ptr + base * BG + offs_g, l_i)
        tl.store(acc_ptr + (base * BG + offs_g)[:, None] * BD + offs_d[None, :], acc)

    @triton.jit
    def act_kernel(x_ptr, out_ptr, N, stride_ps, stride_pm, stride_o, scale, mul, NP: tl.constexpr,
                   ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one row: y = bf16(mul * act(scale * bf16(sum_s parts[s]))); NP 0: x bf16 [R, N] itself
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        if NP == 0:
            v = tl.load(x_ptr + r * stride_pm + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            v = tl.load(x_ptr + r * stride_pm + offs, mask=ok, other=0.0)
            for s in tl.static_range(1, NP):
                v += tl.load(x_ptr + s * stride_ps + r * stride_pm + offs, mask=ok, other=0.0)
            v = v.to(tl.bfloat16).to(tl.float32)
        v = v * scale
        if ACT == 0:
            y = v / (1.0 + tl.exp(-v))
        else:
            y = 1.0 / (1.0 + tl.exp(-v))
        tl.store(out_ptr + r * stride_o + offs, (y * mul).to(tl.bfloat16), mask=ok)

    @triton.jit
    def combine_kernel(up_ptr, normed_ptr, out_ptr, H, stride_u, stride_n, stride_o, inv_n, NS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one row: out = bf16(sum_s bf16(sigmoid(up_s)) * normed_s / n), the streams in order
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(NS):
            u = tl.load(up_ptr + r * stride_u + s * H + offs, mask=ok, other=0.0).to(tl.float32)
            g = (1.0 / (1.0 + tl.exp(-u))).to(tl.bfloat16).to(tl.float32)
            x = tl.load(normed_ptr + r * stride_n + s * H + offs, mask=ok, other=0.0).to(tl.float32)
            acc += g * x
        tl.store(out_ptr + r * stride_o + offs, (acc * inv_n).to(tl.bfloat16), mask=ok)

    @triton.jit
    def inject_kernel(x_ptr, d_ptr, w_ptr, H, stride_x, stride_ds, stride_d, stride_w, NS: tl.constexpr,
                      NP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one row: x[s] <- bf16(x[s] + bf16(d * w[s])) for every stream s, in place; d = bf16(sum of NP fp32
        # partials) (NP 0: d bf16 itself)
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        if NP == 0:
            d = tl.load(d_ptr + r * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            d = tl.load(d_ptr + r * stride_d + offs, mask=ok, other=0.0)
            for p in tl.static_range(1, NP):
                d += tl.load(d_ptr + p * stride_ds + r * stride_d + offs, mask=ok, other=0.0)
            d = d.to(tl.bfloat16).to(tl.float32)
        for s in tl.static_range(NS):
            w = tl.load(w_ptr + r * stride_w + s).to(tl.float32)
            x = tl.load(x_ptr + r * stride_x + s * H + offs, mask=ok, other=0.0).to(tl.float32)
            y = x + (d * w).to(tl.bfloat16).to(tl.float32)
            tl.store(x_ptr + r * stride_x + s * H + offs, y.to(tl.bfloat16), mask=ok)

    @triton.jit
    def merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_o, HKV: tl.constexpr, G: tl.constexpr,
                     BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (row, KV head): the splits' partials merged in split order (``combine``'s arithmetic)
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_g = tl.arange(0, BG)
        offs_d = tl.arange(0, BD)
        base = (r * HKV + h) * SPLIT
        top = tl.load(m_ptr + base * BG + offs_g)
        for s in tl.static_range(1, SPLIT):
            top = tl.maximum(top, tl.load(m_ptr + (base + s) * BG + offs_g))
        safe = tl.where(top == float("-inf"), 0.0, top)
        num = tl.zeros((BG, BD), dtype=tl.float32)
        den = tl.zeros((BG,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            w = tl.exp(tl.load(m_ptr + (base + s) * BG + offs_g) - safe)
            num += tl.load(acc_ptr + ((base + s) * BG + offs_g)[:, None] * BD + offs_d[None, :]) * w[:, None]
            den += tl.load(l_ptr + (base + s) * BG + offs_g) * w
        o = num / tl.where(den > 0, den, 1.0)[:, None]
        ok = (offs_g < G)[:, None] & (offs_d < D)[None, :]
        tl.store(out_ptr + r * stride_o + (h * G + offs_g)[:, None] * D + offs_d[None, :], o.to(tl.bfloat16),
                 mask=ok)

    @triton.jit
    def slots_kernel(topv_ptr, topi_ptr, head_ptr, pos_ptr, anc_ptr, out_ptr, KSEL, NB, W, stride_t, stride_a,
                     stride_o, R: tl.constexpr, RP: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # one (row i, BJ selections): each selected block's R tokens, then (j == KSEL) the row's tail, as cache
        # slots (committed positions as they are, the row's path nodes at L + node; -1: not attended)
        i = tl.program_id(0)
        j = tl.program_id(1) * BJ + tl.arange(0, BJ)
        t = tl.arange(0, RP)
        L = tl.load(head_ptr).to(tl.int64)
        p = tl.load(pos_ptr + i)
        nbc = L // R
        nb = (p + 1) // R
        sel = j < KSEL
        col = tl.load(topi_ptr + i * stride_t + j, mask=sel, other=0)
        val = tl.load(topv_ptr + i * stride_t + j, mask=sel, other=-1)
        block = tl.where(col < NB, col, nbc + col - NB)
        block = tl.where(sel, block, nb)                                      # j == KSEL: the tail
        tok = block[:, None] * R + t[None, :]                                 # [BJ, RP]
        keep = tl.where(sel[:, None], val[:, None] >= 0, tok <= p) & (t[None, :] < R)
        d = tl.minimum(tl.maximum(tok - L, 0), W - 1)
        a = tl.load(anc_ptr + i * stride_a + d, mask=keep & (tok >= L), other=0).to(tl.int64)
        slot = tl.where(tok < L, tok, L + a)
        out = tl.where(keep, slot, -1).to(tl.int32)
        ok = (j[:, None] <= KSEL) & (t[None, :] < R)
        tl.store(out_ptr + i * stride_o + j[:, None] * R + t[None, :], out, mask=ok)

    return {"group_norm": group_norm_kernel, "scores": scores_kernel, "gathered": gathered_kernel,
            "merge": merge_kernel, "slots": slots_kernel,
            "act": act_kernel, "combine": combine_kernel, "inject": inject_kernel}


def kernels() -> dict[str, Any]:
    if not _K:
        _K.update(_build())
    return _K


# -- group_norm1p ----------------------------------------------------------------------------------------------
def group_norm1p_ref(x: torch.Tensor, w: torch.Tensor, eps: float, groups: int) -> torch.Tensor:
    """``x: [R, G*D]`` -> each group ``x / rms(x) * (1 + w_g)`` in fp32, in ``x``'s dtype."""
    R = x.shape[0]
    xf = x.float().view(R, groups, -1)
    inv = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (xf * inv * (1.0 + w.float().view(groups, -1))).to(x.dtype).view(R, -1)


def group_norm1p(x: torch.Tensor, w: torch.Tensor, eps: float, groups: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``group_norm1p_ref`` on CUDA: ``x: [R, G*D]`` unit column stride, ``w: [G*D]`` fp32 contiguous."""
    R, C = x.shape
    D = C // groups
    if out is None:
        out = torch.empty(R, C, dtype=x.dtype, device=x.device)
    kernels()["group_norm"][(R, groups)](x, w, out, D, x.stride(0), out.stride(0), float(eps), BLOCK=_p2(D),
                                         num_warps=4 if D >= 1024 else 2 if D >= 256 else 1, **pdl.launch_kw())
    return out


# -- head_scores -----------------------------------------------------------------------------------------------
def head_scores_ref(q: torch.Tensor, keys: torch.Tensor, nvalid: torch.Tensor, div: float,
                    relu: bool) -> torch.Tensor:
    """``q: [R, Hq, D]``, ``keys: [B, D]`` (every row's) or ``[R, B, D]``, ``nvalid: [R]`` -> ``[R, B]`` fp32."""
    kf = keys.float() if keys.dim() == 3 else keys.float()[None]                  # [R or 1, B, D]
    qf = q.float()
    acc = None
    for h in range(q.shape[1]):
        s = (qf[:, h, None, :] * kf).sum(-1)                                       # [R, B]
        if relu:
            s = torch.relu(s)
        acc = s if acc is None else acc + s
    assert acc is not None
    B = acc.shape[1]
    live = torch.arange(B, device=q.device)[None, :] < nvalid[:, None]
    return torch.where(live, acc / div, torch.full_like(acc, -1.0))


def head_scores(q: torch.Tensor, keys: torch.Tensor, nvalid: torch.Tensor, div: float, relu: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``head_scores_ref`` on CUDA. ``q``'s and ``keys``' last axes unit-strided; ``nvalid`` int32."""
    R, Hq, D = q.shape
    if keys.dim() == 2:
        B, skr, skb = keys.shape[0], 0, keys.stride(0)
    else:
        B, skr, skb = keys.shape[1], keys.stride(0), keys.stride(1)
    if out is None:
        out = torch.empty(R, B, dtype=torch.float32, device=q.device)
    BD = _p2(D)
    bb = max(1, min(BB, 8192 // BD))
    kernels()["scores"][(R, (B + bb - 1) // bb)](q, keys, nvalid, out, B, D, q.stride(0), q.stride(1), skr, skb,
                                                 out.stride(0), float(div), HEADS=Hq, RELU=bool(relu), BB=bb,
                                                 BD=BD, num_warps=4, **pdl.launch_kw())
    return out


# -- gathered attention ----------------------------------------------------------------------------------------
def gathered_attention_ref(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, slots: torch.Tensor,
                           scale: float, hkv: int) -> torch.Tensor:
    """``q: [R, Hq*D]``, ``K, V: [Hkv, S, D]``, ``slots: [R, M]`` (-1: none) -> ``[R, Hq*D]`` in q's dtype: each
    row's softmax attention over the keys at its own slots (zeros for a row without any)."""
    R = q.shape[0]
    D = K.shape[-1]
    hq = q.shape[1] // D
    G = hq // hkv
    ok = slots >= 0
    idx = slots.clamp_min(0).long()
    k = K[:, idx].float()                                                         # [Hkv, R, M, D]
    v = V[:, idx].float()
    qf = q.float().view(R, hkv, G, D).transpose(0, 1)                            # [Hkv, R, G, D]
    s = torch.einsum("hrgd,hrmd->hrgm", qf, k) * scale
    s = s.masked_fill(~ok[None, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.einsum("hrgm,hrmd->hrgd", p, v)                                     # [Hkv, R, G, D]
    return o.transpose(0, 1).reshape(R, hq * D).to(q.dtype)


class AttnParts:
    """The split partials of ``gathered_attention`` for up to ``rows`` rows (static: a graph's buffers)."""

    def __init__(self, rows: int, hq: int, hkv: int, D: int, device: torch.device) -> None:
        G = hq // hkv
        self.BG, self.BD = max(16, _p2(G)), _p2(D)
        self.m = torch.zeros(rows, hkv, SPLIT, self.BG, dtype=torch.float32, device=device)
        self.l = torch.zeros_like(self.m)
        self.acc = torch.zeros(rows, hkv, SPLIT, self.BG, self.BD, dtype=torch.float32, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.m, self.l, self.acc]


def combine(parts: AttnParts, R: int, hkv: int, G: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The splits' partials ``-> [R, Hkv*G*D]``: the largest running max, then the splits added in order."""
    m, l, acc = parts.m[:R, :, :, :G], parts.l[:R, :, :, :G], parts.acc[:R, :, :, :G, :D]
    top = m[:, :, 0]
    for s in range(1, SPLIT):
        top = torch.maximum(top, m[:, :, s])
    safe = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    num = None
    den = None
    for s in range(SPLIT):
        w = torch.exp(m[:, :, s] - safe)                                          # [R, Hkv, G]
        a = acc[:, :, s] * w[..., None]
        b = l[:, :, s] * w
        num = a if num is None else num + a
        den = b if den is None else den + b
    assert num is not None and den is not None
    o = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return o.reshape(R, hkv * G * D).to(dtype)


def gathered_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, slots: torch.Tensor, scale: float,
                       hkv: int, parts: AttnParts) -> torch.Tensor:
    """``gathered_attention_ref`` on CUDA: ``q: [R, Hq*D]`` bf16 contiguous rows, ``K, V: [Hkv, S, D]`` bf16 (unit
    last stride), ``slots: [R, M]`` int32."""
    R, M = slots.shape
    D = K.shape[-1]
    hq = q.shape[1] // D
    G = hq // hkv
    chunk = ((M + SPLIT - 1) // SPLIT + BN - 1) // BN * BN
    kernels()["gathered"][(R, hkv, SPLIT)](q, K, V, slots, parts.m, parts.l, parts.acc, M, chunk, chunk // BN,
                                           q.stride(0),
                                           K.stride(0), K.stride(1), V.stride(0), V.stride(1), slots.stride(0),
                                           float(scale), HKV=hkv, G=G, BG=parts.BG, D=D, BD=parts.BD, BN=BN,
                                           SPLIT=SPLIT, num_warps=4, **pdl.launch_kw())
    out = torch.empty(R, hq * D, dtype=torch.bfloat16, device=q.device)
    kernels()["merge"][(R, hkv)](parts.m, parts.l, parts.acc, out, out.stride(0), HKV=hkv, G=G, BG=parts.BG, D=D,
                                 BD=parts.BD, SPLIT=SPLIT, num_warps=4, **pdl.launch_kw())
    return out


# -- the hyper-connections' elementwise pieces -----------------------------------------------------------------
_ACTS = {"silu": 0, "sigmoid": 1}


def act_ref(x: torch.Tensor, scale: float, mul: float, kind: str) -> torch.Tensor:
    """``x``: bf16 ``[R, N]`` or fp32 partials ``[S, R, N]`` -> ``bf16(mul * act(scale * x))`` ``[R, N]``."""
    if x.dim() == 3:
        acc = x[0].clone()
        for s in range(1, x.shape[0]):
            acc += x[s]
        x = acc.to(torch.bfloat16)
    v = x.float() * scale
    y = v * torch.sigmoid(v) if kind == "silu" else torch.sigmoid(v)
    return (y * mul).to(torch.bfloat16)


def act(x: torch.Tensor, scale: float, mul: float, kind: str) -> torch.Tensor:
    """``act_ref`` on CUDA (one program a row and 1024 columns)."""
    if x.dim() == 3:
        S, R, N = x.shape
        np_, sps, spm = S, x.stride(0), x.stride(1)
    else:
        R, N = x.shape
        np_, sps, spm = 0, 0, x.stride(0)
    out = torch.empty(R, N, dtype=torch.bfloat16, device=x.device)
    B = min(1024, _p2(N))
    kernels()["act"][(R, (N + B - 1) // B)](x, out, N, sps, spm, out.stride(0), float(scale), float(mul), NP=np_,
                                            ACT=_ACTS[kind], BLOCK=B, num_warps=4, **pdl.launch_kw())
    return out


def hyper_combine_ref(up: torch.Tensor, normed: torch.Tensor, n: int) -> torch.Tensor:
    R = up.shape[0]
    g = torch.sigmoid(up.float().view(R, n, -1)).to(torch.bfloat16).float()
    acc = None
    for s in range(n):
        t = g[:, s] * normed.float().view(R, n, -1)[:, s]
        acc = t if acc is None else acc + t
    assert acc is not None
    return (acc * (1.0 / n)).to(torch.bfloat16)


def hyper_combine(up: torch.Tensor, normed: torch.Tensor, n: int) -> torch.Tensor:
    """``hyper_combine_ref`` on CUDA: ``up, normed: [R, n*H]`` bf16 (unit column stride) -> ``[R, H]`` bf16."""
    R, C = up.shape
    H = C // n
    out = torch.empty(R, H, dtype=torch.bfloat16, device=up.device)
    B = min(1024, _p2(H))
    kernels()["combine"][(R, (H + B - 1) // B)](up, normed, out, H, up.stride(0), normed.stride(0), out.stride(0),
                                                1.0 / n, NS=n, BLOCK=B, num_warps=4, **pdl.launch_kw())
    return out


def inject_add_ref(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    R, n = w.shape
    if d.dim() == 3:                                      # fp32 partials, added in index order
        acc = d[0].clone()
        for s in range(1, d.shape[0]):
            acc += d[s]
        d = acc.to(torch.bfloat16)
    y = x.float().view(R, n, -1) + (d.float()[:, None, :] * w.float()[:, :, None]).to(torch.bfloat16).float()
    return y.to(torch.bfloat16).view(R, -1)


def inject_add(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``inject_add_ref`` on CUDA, ``x`` updated in place (and returned): ``x: [R, n*H]``, ``d: [R, H]`` bf16 or
    the fp32 partials ``[S, R, H]`` of a split matmul, ``w: [R, n]`` bf16."""
    R, n = w.shape
    H = d.shape[-1]
    np_, sds = (d.shape[0], d.stride(0)) if d.dim() == 3 else (0, 0)
    sd = d.stride(-2)
    B = min(1024, _p2(H))
    kernels()["inject"][(R, (H + B - 1) // B)](x, d, w, H, x.stride(0), sds, sd, w.stride(0), NS=n, NP=np_,
                                               BLOCK=B, num_warps=4, **pdl.launch_kw())
    return x


# -- the attended slots ------------------------------------------------------------------------------------------
def slots_ref(topv: torch.Tensor, topi: torch.Tensor, head: torch.Tensor, pos: torch.Tensor, anc: torch.Tensor,
              NB: int, r: int) -> torch.Tensor:
    """The cache slots each row attends to: ``topv, topi: [W, k]`` the top-k keys (``>= 0``: a complete block)
    and columns (below ``NB`` a committed block, else frontier block ``nbc + col - NB``), then the row's tail
    (positions ``nb * r .. p``); a position below ``L = head[0]`` is its own slot, a later one the row's path node
    at that depth, ``L + anc[i, depth]``. ``[W, k*r + r]`` int32, ``-1`` where nothing is attended."""
    W, k = topi.shape
    L = head[0:1].long()
    p = pos.long()
    nbc = L // r
    nb = (p + 1) // r
    block = torch.where(topi < NB, topi, nbc + topi - NB)                        # [W, k]
    block = torch.cat([block, nb[:, None]], dim=1)                               # the tail last
    tok = (block[:, :, None] * r + torch.arange(r, device=pos.device)).reshape(W, -1)
    keep = torch.cat([(topv >= 0)[:, :, None].expand(W, k, r).reshape(W, -1),
                      tok[:, k * r:] <= p[:, None]], dim=1)
    d = (tok - L).clamp(0, W - 1)
    slot = torch.where(tok < L, tok, L + anc.long().gather(1, d))
    return torch.where(keep, slot, torch.full_like(slot, -1)).to(torch.int32)


def slots(topv: torch.Tensor, topi: torch.Tensor, head: torch.Tensor, pos: torch.Tensor, anc: torch.Tensor,
          NB: int, r: int) -> torch.Tensor:
    """``slots_ref`` on CUDA: one launch (``topv``/``topi`` int64 ``[W, k]`` contiguous, ``head`` int32, ``pos``
    int64 ``[W]``, ``anc`` int32 ``[W, W]``)."""
    W, k = topi.shape
    out = torch.empty(W, k * r + r, dtype=torch.int32, device=topi.device)
    BJ = 64
    kernels()["slots"][(W, (k + 1 + BJ - 1) // BJ)](topv, topi, head, pos, anc, out, k, NB, W, topi.stride(0),
                                                     anc.stride(0), out.stride(0), R=r, RP=_p2(r), BJ=BJ,
                                                     num_warps=4, **pdl.launch_kw())
    return out
