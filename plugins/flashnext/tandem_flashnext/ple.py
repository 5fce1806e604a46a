"""The PLE module of a layer: hashed n-gram embeddings injected into every residual stream.

For a token with n-gram embedding ``e: [E]`` (its ``heads`` table rows side by side,
``tandem_flashnext.ngram``) and streams ``x: [n, H]``:

    key    = norm_key(key_proj(e))                [n, H]   (RMS per stream, zero-centred)
    value  = value_proj(e)                        [H]
    query  = norm_query(x)                        [n, H]
    gate_s = signed_sqrt(key_s . query_s / sqrt(H))          signed_sqrt(a) = sign(a) sqrt(max(|a|, 1e-6))
    u_s    = sigmoid(gate_s) * value              [n, H]
    out    = u + silu(conv(norm_conv(u)))         [n*H]

``conv`` is a depthwise causal conv of ``K = ple_conv_kernel_size`` taps at dilation
``d = ngram_size`` over the normed ``u`` (``n*H`` channels): tap ``k`` of output ``t``
reads the input ``(K - 1 - k) * d`` tokens back. It keeps the last ``(K - 1) * d``
inputs as its state (section ``ple.conv``). The layer adds ``out`` to its streams
before the attention hyper-connection.

``dilated_conv`` and ``dilated_conv_tree`` are ``tandem_core.ops.conv``'s
``causal_conv`` / ``causal_conv_tree`` with a dilation (taps summed in the same fixed
order in fp32): a tree node reads the inputs of its own path, so its row equals the
decode row bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from tandem_core.engine import TreeStep
from tandem_core.ops._tree import ancestors, as_parents

from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.ngram import tree_windows, windows
from tandem_flashnext.steps import MatMul
from tandem_flashnext.weights import PLEWeights

__all__ = ["ple", "dilated_conv", "dilated_conv_tree"]

Ops = dict[str, Callable[..., Any]]


def dilated_conv(op: Ops, x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, dilation: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, C]`` the new inputs, ``tail: [C, W]`` the ``W = (K-1)*dilation`` inputs before them (oldest
    first), ``weight: [C, K]`` -> ``(silu(y) [T, C] in x's dtype, new tail [C, W] in tail's dtype)``. Mutates
    nothing."""
    T, K = x.shape[0], weight.shape[1]
    xx = torch.cat([tail.t().to(x.dtype), x], dim=0)                           # xx: [W+T, C]
    xf, w = xx.float(), weight.float()
    y = xf[0:T] * w[:, 0]
    for k in range(1, K):
        y = y + xf[k * dilation:k * dilation + T] * w[:, k]
    return op["silu"](y).to(x.dtype), xx[T:].t().to(tail.dtype)


def dilated_conv_tree(op: Ops, x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, dilation: int,
                      parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``dilated_conv`` over a token tree: node ``i`` reads the ``W`` inputs before it on its own path (its
    ancestors, then the committed ``tail``) and its own. ``[N, C]``; mutates nothing."""
    par = as_parents(parents)
    K, W = weight.shape[1], tail.shape[1]
    # src: [W+N, C]; tail rows first
    src = torch.cat([tail.t().to(x.dtype), x], dim=0).float()
    index = []
    for i in range(len(par)):
        anc = ancestors(par, i, W)                                             # nearest first
        path = [W + a for a in reversed(anc)] + [W + i]
        index.append(list(range(len(path) - 1, W)) + path)                     # the window, oldest first
    idx = torch.tensor(index, dtype=torch.long, device=x.device)               # idx: [N, W+1] rows of src
    w = weight.float()
    y = src[idx[:, 0]] * w[:, 0]
    for k in range(1, K):
        y = y + src[idx[:, k * dilation]] * w[:, k]
    return op["silu"](y).to(x.dtype)


def ple(op: Ops, mm: MatMul, x: torch.Tensor, ids: torch.Tensor, w: PLEWeights, cfg: FlashNextConfig,
        step: Any, conv: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, n*H]`` the streams, ``ids: [T]`` the step's tokens, ``ctx: [ngram_size - 1]`` the tokens
    before the step -> ``(what the module adds to the streams [T, n*H], the conv inputs [T, n*H])``. A
    ``Step`` advances ``conv`` ([n*H, (K-1)*d]) in place; a ``TreeStep`` mutates nothing (the caller keeps
    the conv inputs for the commit)."""
    n, H, act = cfg.hc_count, cfg.hidden_size, x.dtype
    T = x.shape[0]
    tree = isinstance(step, TreeStep)
    win = tree_windows(ctx, ids, step.parents) if tree else windows(ctx, ids)  # win: [T, ngram_size]
    rows = w.hash.ids(win)                                                     # rows: [T, heads]
    # emb: [T, E], gathered on the host
    emb = w.table.gather(rows, act).reshape(T, -1).to(x.device)
    key = op["rms_norm_1p"](mm(w.key, emb).view(T, n, H), w.norm_key.view(n, H), cfg.rms_norm_eps)
    query = op["rms_norm_1p"](x.view(T, n, H), w.norm_query.view(n, H), cfg.rms_norm_eps)
    value = mm(w.value, emb)                                                   # value: [T, H]
    gate = (key.float() * query.float()).sum(dim=-1) / math.sqrt(H)           # gate: [T, n]
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    u = op["sigmoid"](gate).to(act)[:, :, None] * value[:, None, :]            # u: [T, n, H]
    normed = op["rms_norm_1p"](u, w.norm_conv.view(n, H), cfg.rms_norm_eps).reshape(T, n * H)
    d = cfg.ple_conv_dilation
    if tree:
        y = dilated_conv_tree(op, normed, conv, w.conv, d, step.parents)
    else:
        y, tail = dilated_conv(op, normed, conv, w.conv, d)
        conv.copy_(tail)
    return u.reshape(T, n * H) + y, normed
