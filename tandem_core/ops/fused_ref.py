"""Plain-torch references of the CUDA path's fused kernels, with the launchers' own signatures.

``tandem_core.ops.triton_fused`` and ``triton_attention`` fuse several reference ops into one
launch over a round's buffers (the query/key post-processing of an attention layer, the Gated
DeltaNet conv over a token tree, the commit of a verified path's cache rows, attention over the
cache with a tree mask). Each function here computes what its kernel computes from the same
arguments, in plain torch on any device, one row at a time where the kernel is row-wise, so a
kernel is checked against it (``tests/test_gpu_kernels.py``, on a CUDA device) and the reference
itself against the per-op references it fuses (``tests/test_fused_ref.py``, on the CPU).

    qk_post_ref(...)         q/k: the zero-centred RMS norm, rounded to bf16, then rotary on the first
                             ``rotary_dim`` channels (half-split), rounded to bf16; k and v into the
                             cache slots ``meta[0] + j``
    conv_tree_ref(...)       causal conv over each node's window (its ancestors' inputs and the tail),
                             silu, rounded to bf16; the first ``qk_heads`` head groups L2-normalised
    kv_commit_ref(...)       rows ``meta[0] + path[i]`` -> ``meta[0] + i`` of every layer's K and V
    tree_attention_ref(...)  each node over the committed rows and its ancestors' slots, softmax in
                             fp32, rounded to bf16, times ``bf16(sigmoid(gate))``

They mutate their outputs in place, as the kernels do.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["qk_post_ref", "conv_tree_ref", "kv_commit_ref", "tree_attention_ref"]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _norm_rope(x: torch.Tensor, w: torch.Tensor, pos: float, freqs: torch.Tensor, R: int, eps: float
               ) -> torch.Tensor:
    """One head ``x: [D]`` (fp32): ``bf16(x / rms(x) * (1 + w))``, then half-split rotary on ``[:R]``."""
    inv = 1.0 / torch.sqrt((x * x).mean() + eps)
    y = _bf16(x * inv * (1.0 + w))
    half = R // 2
    ang = pos * freqs[:half].float()
    cos, sin = torch.cos(ang), torch.sin(ang)
    out = y.clone()
    a, b = y[:half], y[half:R]
    out[:half] = a * cos - b * sin
    out[half:R] = b * cos + a * sin
    return out


def qk_post_ref(raw: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, freqs: torch.Tensor,
                pos: torch.Tensor, meta: torch.Tensor, q_out: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                hq: int, hkv: int, head_dim: int, rotary_dim: int, eps: float, rows: int) -> None:
    """``triton_fused.qk_post``: rows ``j < meta[1]`` of ``raw`` (``[q_0 | gate_0 | ... | k | v]``) -> the
    queries into ``q_out [rows, Hq*D]``, the keys (normed, rotated) and values into ``K, V [Hkv, S, D]`` at
    slot ``meta[0] + j``."""
    D, L, n = head_dim, int(meta[0]), int(meta[1])
    for j in range(min(n, rows)):
        row = raw[j].float()
        p = float(pos[j])
        for h in range(hq):
            y = _norm_rope(row[h * 2 * D:h * 2 * D + D], q_norm.float(), p, freqs, rotary_dim, eps)
            q_out[j, h * D:(h + 1) * D] = y.to(q_out.dtype)
        kb, vb = hq * 2 * D, hq * 2 * D + hkv * D
        for h in range(hkv):
            y = _norm_rope(row[kb + h * D:kb + (h + 1) * D], k_norm.float(), p, freqs, rotary_dim, eps)
            K[h, L + j] = y.to(K.dtype)
            V[h, L + j] = raw[j, vb + h * D:vb + (h + 1) * D].to(V.dtype)


def conv_tree_ref(raw: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, win: torch.Tensor,
                  n: torch.Tensor, out: torch.Tensor, head_dim: int, qk_heads: int, rows: int,
                  eps: float = 1e-6) -> torch.Tensor:
    """``triton_fused.conv_tree``: node ``i < n[0]``'s conv over ``x_0 .. x_{K-1}`` (``win[i, k] < K-1``: tail
    column ``win``; else the raw row ``win - (K-1)``; ``x_{K-1}`` its own raw row), silu, rounded to bf16;
    the first ``qk_heads`` groups of ``head_dim`` channels divided by their L2 norm. ``out: [rows, C]``."""
    C, KW = weight.shape
    w = weight.float()
    for i in range(min(int(n[0]), rows)):
        xs = []
        for k in range(KW - 1):
            src = int(win[i, k])
            xs.append(tail[:, src].float() if src < KW - 1 else raw[src - (KW - 1), :C].float())
        xs.append(raw[i, :C].float())
        y = xs[0] * w[:, 0]
        for k in range(1, KW):
            y = y + xs[k] * w[:, k]
        y = _bf16(y / (1.0 + torch.exp(-y)))
        groups = y[:qk_heads * head_dim].view(qk_heads, head_dim)
        y[:qk_heads * head_dim] = (groups / torch.sqrt((groups * groups).sum(-1, keepdim=True) + eps)).reshape(-1)
        out[i, :C] = y
    return out


def kv_commit_ref(K: torch.Tensor, V: torch.Tensor, meta: torch.Tensor, path: torch.Tensor,
                  d: torch.Tensor) -> None:
    """``triton_fused.kv_commit``: ``K, V [L, Hkv, S, D]``, rows ``meta[0] + path[i]`` move to ``meta[0] + i``
    for ``i < d[0]``, in increasing ``i``."""
    L0 = int(meta[0])
    for i in range(int(d[0])):
        src = L0 + int(path[i])
        K[:, :, L0 + i] = K[:, :, src]
        V[:, :, L0 + i] = V[:, :, src]


def tree_attention_ref(q: torch.Tensor, raw: torch.Tensor, K: torch.Tensor, V: torch.Tensor, meta: torch.Tensor,
                       pos: torch.Tensor, anc: torch.Tensor, scratch: Any, out: torch.Tensor, *, hq: int,
                       hkv: int, head_dim: int, scale: float, rows: int) -> torch.Tensor:
    """``triton_attention.tree_attention``: node ``j < meta[1]`` at position ``pos[j]`` over the committed slots
    ``0 .. meta[0]-1`` and its path's slots ``meta[0] + anc[j, d]`` (``d <= pos[j] - meta[0]``), grouped queries
    (head ``h`` reads KV head ``h // (hq/hkv)``), ``out = bf16(bf16(attention) * bf16(sigmoid(gate)))`` with the
    gate from ``raw`` (``[q_0 | gate_0 | ...]``). ``scratch`` is the kernel's; unused here."""
    D, L, n, G = head_dim, int(meta[0]), int(meta[1]), hq // hkv
    for j in range(min(n, rows)):
        depth = int(pos[j]) - L
        slots = list(range(L)) + [L + int(anc[j, d]) for d in range(depth + 1)]
        at = torch.tensor(slots, dtype=torch.long, device=K.device)
        for h in range(hq):
            kv = h // G
            qh = q[j, h * D:(h + 1) * D].float()
            k, v = K[kv].index_select(0, at).float(), V[kv].index_select(0, at).float()
            p = torch.softmax((k @ qh) * scale, dim=0)
            o = _bf16(p @ v)
            gate = raw[j, h * 2 * D + D:h * 2 * D + 2 * D].float()
            sg = _bf16(1.0 / (1.0 + torch.exp(-gate)))
            out[j, h * D:(h + 1) * D] = (o * sg).to(out.dtype)
    return out
