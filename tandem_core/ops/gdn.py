"""The gated delta rule (Gated DeltaNet's token mixer), chunked for prefill and recurrent for decode.

Per value head, with state ``S: [Dk, Dv]``, for each token t:

    S   <- exp(g_t) * S                          decay
    u_t  = beta_t * (v_t - S^T k_t)              the part of v_t the state does not predict yet
    S   <- S + k_t u_t^T                         delta-rule write
    o_t  = scale * S^T q_t                       read

Shapes (one sequence):
    q, k:  [T, Hk, Dk]   (already L2-normalised by the caller)
    v:     [T, Hv, Dv]
    g:     [T, Hv]       log-decay, <= 0
    beta:  [T, Hv]       write strength in (0, 1)
    state: [Hv, Dk, Dv]  fp32, the state before the first token
Key heads are grouped: value head h reads key head ``h // (Hv // Hk)``.
Both return ``(o [T, Hv, Dv] fp32, new_state [Hv, Dk, Dv] fp32)`` and mutate nothing.

The chunked form computes the same recurrence C tokens at a time. Inside a
chunk, with cumulative log-decay ``c_i = g_1 + ... + g_i`` and the chunk's
starting state ``S0``, the writes solve a unit lower-triangular system

    (I + A) U = beta*V - beta*exp(c)*K S0,   A_ij = beta_i exp(c_i - c_j) k_i.k_j  (j < i)

and then ``o_i = exp(c_i) q_i S0 + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j`` and
``S_C = exp(c_C) S0 + sum_j exp(c_C - c_j) k_j u_j^T``. Every exponent is <= 0.

``gdn_recurrent`` over T tokens is, token by token, its one-token call (the
decode step): the same operations on the same shapes, so its outputs and state
equal T chained one-token calls bit for bit. A kernel registered for it keeps
that; the tree form and the commit of a path rely on it.

``gdn_tree(q, k, v, g, beta, state, parents)`` runs the rule over a token tree:
node ``i`` starts from its parent's state (``state`` for a node whose parent is
-1), never from the node before it in index order, through the device's
``gdn_recurrent``, so a node's output equals the decode step's bit for bit. It
returns the outputs only: a caller that commits a path recomputes the state
along it (a per-node state for every layer would cost N states a layer).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from tandem_core.ops._tree import as_parents

__all__ = ["gdn_chunk", "gdn_recurrent", "gdn_tree"]


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q, k: [T, Hk, Dk] -> [T, Hv, Dk] (each key head serves Hv // Hk consecutive value heads)
    hk, hv = q.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads are not a multiple of {hk} key heads")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    return q, k


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time (decode; also the definition the chunked form must equal)."""
    q, k = _grouped(q.float(), k.float(), v)
    v, g, beta = v.float(), g.float(), beta.float()
    S = state.float().clone()                                  # S: [Hv, Dk, Dv]
    out = torch.empty_like(v)                                  # out: [T, Hv, Dv]
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        pred = (S * k[t][:, :, None]).sum(dim=1)               # pred: [Hv, Dv] = S^T k
        u = (v[t] - pred) * beta[t][:, None]                   # u: [Hv, Dv]
        S = S + k[t][:, :, None] * u[:, None, :]
        out[t] = (S * q[t][:, :, None]).sum(dim=1) * scale     # out[t]: [Hv, Dv] = scale * S^T q
    return out, S


def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, *, scale: float, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk`` tokens at a time (prefill). Equals ``gdn_recurrent`` within fp32 rounding."""
    T = q.shape[0]
    chunk = max(1, min(chunk, T))                              # a short input is one chunk, unpadded
    q, k = _grouped(q.float(), k.float(), v)
    # head-major: [Hv, T, D]; padded to whole chunks with g = 0, beta = 0, k = 0 (no decay, no write)
    pad = (-T) % chunk
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (g, beta))
    H, N = q.shape[0], (T + pad) // chunk
    q = q.reshape(H, N, chunk, -1) * scale                     # q: [H, N, C, Dk]
    k = k.reshape(H, N, chunk, -1)                             # k: [H, N, C, Dk]
    v = v.reshape(H, N, chunk, -1)                             # v: [H, N, C, Dv]
    beta = beta.reshape(H, N, chunk)
    c = g.reshape(H, N, chunk).cumsum(-1)                      # c: [H, N, C] cumulative log-decay

    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()   # j <= i
    rel = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # rel: [H, N, C, C]
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2))) * rel.tril(-1)                    # A: [H, N, C, C]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + A
    W = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    Kc = torch.linalg.solve_triangular(system, (beta * c.exp())[..., None] * k, upper=False,
                                       unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * rel                       # qk: [H, N, C, C]
    q_in = q * c.exp()[..., None]                              # reads of the chunk's starting state
    to_end = (c[..., -1:] - c).exp()[..., None]                # to_end: [H, N, C, 1] decay to the chunk's end
    k_end = k * to_end
    chunk_decay = c[..., -1].exp()[..., None, None]            # chunk_decay: [H, N, 1, 1]

    S = state.float().clone()                                  # S: [H, Dk, Dv]
    out = torch.empty_like(v)                                  # out: [H, N, C, Dv]
    for n in range(N):
        U = W[:, n] - Kc[:, n] @ S                             # U: [H, C, Dv]
        out[:, n] = q_in[:, n] @ S + qk[:, n] @ U
        S = S * chunk_decay[:, n] + k_end[:, n].transpose(-1, -2) @ U
    out = out.reshape(H, N * chunk, -1)[:, :T].transpose(0, 1).contiguous()   # out: [T, H, Dv]
    return out, S


def gdn_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, parents: torch.Tensor | Sequence[int], *, scale: float) -> torch.Tensor:
    """Node ``i`` of ``N`` (inputs ``[N, ...]`` as ``gdn_recurrent``'s) from its parent's state.

    ``parents: [N]``, ``parents[i] < i`` or -1 (from ``state``). Returns ``o [N, Hv, Dv]`` fp32; mutates
    nothing. A run of nodes each the only child of the one before (a chain, or a stretch of one) is one
    ``gdn_recurrent`` call over those tokens, which equals their one-token calls bit for bit (the
    recurrent form's contract: token t's arithmetic is the one-token call's). A node's state is dropped
    once its last child has run.
    """
    from tandem_core import ops

    step = ops.get("gdn_recurrent", q.device)
    par = as_parents(parents)
    N = len(par)
    left = [0] * N                              # children still to run, per node
    for p in par:
        if p >= 0:
            left[p] += 1
    states: dict[int, torch.Tensor] = {}
    outs = []
    i = 0
    while i < N:
        j = i                                   # the run i..j: each the only child of the one before
        while j + 1 < N and par[j + 1] == j and left[j] == 1:
            j += 1
        p = par[i]
        o, S = step(q[i:j + 1], k[i:j + 1], v[i:j + 1], g[i:j + 1], beta[i:j + 1],
                    state if p < 0 else states[p], scale=scale)
        outs.append(o)
        if p >= 0:
            left[p] -= 1
            if not left[p]:
                del states[p]
        if left[j]:
            states[j] = S
        i = j + 1
    return torch.cat(outs)
