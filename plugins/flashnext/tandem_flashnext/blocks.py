"""Hyper-connections, the Gated DeltaNet mixer and the mixture of experts, in their three forms.

Shapes: ``T`` rows; ``n = hc_count`` residual streams of ``H`` features, side by side
(``x: [T, n*H]``). ``mm(lin, x)`` is the form's product (``steps.batched`` for a
prefill, ``linear_rows`` for a decode step and a verify). ``op`` maps op names to the
device's ops (``tandem_core.ops.get``).

Row invariance (decode and verify rows equal bit for bit): every product goes through
``mm``; the norms reduce the last axis (row invariant, ``tandem_core.ops.rows``); the
streams are summed by explicit adds, not a reduction over a middle axis; a token's
experts are added to its row in ascending expert order whichever rows share an expert.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core.engine import TreeStep

from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.steps import MatMul
from tandem_flashnext.weights import ExpertWeights, GDNWeights, HyperWeights, LayerWeights, MoEWeights

__all__ = ["hyper_mix", "hyper_inject", "stream_norm", "decoder_block", "RuleRows", "gated_deltanet", "moe",
           "route"]

Ops = dict[str, Callable[..., Any]]


# -- hyper-connections -------------------------------------------------------------------------------
def stream_norm(op: Ops, x: torch.Tensor, weight: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """RMS norm of each stream on its own (one group of ``H`` a stream), zero-centred weight ``[n*H]``."""
    T = x.shape[0]
    return op["rms_norm_1p"](x.view(T, n, -1), weight.view(n, -1), eps).reshape(T, -1)


def hyper_mix(op: Ops, mm: MatMul, x: torch.Tensor, w: HyperWeights, cfg: FlashNextConfig
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The streams ``x: [T, n*H]`` -> the block's input ``[T, H]`` and the weights ``[T, n]`` that inject
    the block's output back into each stream (None for the final mixer)."""
    n, act = cfg.hc_count, x.dtype
    T = x.shape[0]
    normed = stream_norm(op, x, w.norm, n, cfg.rms_norm_eps)                   # normed: [T, n*H]
    mix = op["silu"](mm(w.down, normed) / n).to(act)                           # mix: [T, R]
    mix = op["sigmoid"](mm(w.up, mix)).to(act).view(T, n, -1)                  # mix: [T, n, H]
    gated = mix * normed.view(T, n, -1)
    mixed = gated[:, 0]
    for s in range(1, n):
        mixed = mixed + gated[:, s]
    mixed = mixed / n                                                          # mixed: [T, H]
    if w.inject is None:
        return mixed, None
    inject = (2 * op["sigmoid"](mm(w.inject, normed) / n)).to(act)             # inject: [T, n]
    return mixed, inject


def hyper_inject(x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """Each stream gets the block's output ``out: [T, H]`` times its weight: ``x + out * inject[:, s]``."""
    T = x.shape[0]
    return x + (out[:, None, :] * inject[:, :, None]).reshape(T, -1)


def decoder_block(op: Ops, mm: MatMul, x: torch.Tensor, layer: LayerWeights, cfg: FlashNextConfig,
                  mixer: Callable[[torch.Tensor], torch.Tensor], capture: list | None = None,
                  name: str = "",
                  experts: Callable[[torch.Tensor, MoEWeights], torch.Tensor] | None = None) -> torch.Tensor:
    """One decoder layer on the streams ``x: [T, n*H]`` (after its PLE, if any): the attention
    hyper-connection around ``mixer`` (``[T, H] -> [T, H]``: the layer's Gated DeltaNet or attention), then
    the MLP hyper-connection around the MoE. ``capture`` gets each block's output ``[T, H]`` (``name``
    mixer / mlp): a row that differs there differs in that block. ``experts(h, w)``: the MoE's form (default
    ``moe``; a CUDA runner's prefill hands its grouped kernel)."""
    h, inject = hyper_mix(op, mm, x, layer.attn_hc, cfg)                       # h: [T, H]
    assert inject is not None
    out = mixer(h)
    if capture is not None:
        capture.append((f"{name} {layer.kind} mixer", out.clone()))
    x = hyper_inject(x, out, inject)
    h, inject = hyper_mix(op, mm, x, layer.mlp_hc, cfg)
    assert inject is not None
    out = moe(op, mm, h, layer.moe, cfg.num_experts_per_tok) if experts is None else experts(h, layer.moe)
    if capture is not None:
        capture.append((f"{name} mlp", out.clone()))
    return hyper_inject(x, out, inject)


# -- the Gated DeltaNet mixer ------------------------------------------------------------------------
class RuleRows(NamedTuple):
    """Per Gated DeltaNet slot, one row a token: what re-running the decode step's state update needs."""

    conv_in: torch.Tensor   # [T, conv_dim] act   the conv inputs (the tail is the last K-1 of them)
    q: torch.Tensor         # [T, Hk, Dk] fp32    after the conv and the L2 norm
    k: torch.Tensor         # [T, Hk, Dk] fp32
    v: torch.Tensor         # [T, Hv, Dv] act
    g: torch.Tensor         # [T, Hv] fp32        log-decay
    beta: torch.Tensor      # [T, Hv] fp32

    def take(self, idx: torch.Tensor) -> "RuleRows":
        return RuleRows(*(t.index_select(0, idx) for t in self))

    def head(self, n: int) -> "RuleRows":
        return RuleRows(*(t[:n] for t in self))

    @staticmethod
    def cat(parts: Sequence["RuleRows"]) -> "RuleRows":
        return RuleRows(*(torch.cat(ts) for ts in zip(*parts)))


def gated_deltanet(op: Ops, mm: MatMul, x: torch.Tensor, w: GDNWeights, cfg: FlashNextConfig,
                   step: Any, S: torch.Tensor, conv: torch.Tensor, gdn_chunk: int
                   ) -> tuple[torch.Tensor, RuleRows | None]:
    """``x: [T, H] -> [T, H]``. A ``Step`` advances ``S`` ([Hv, Dk, Dv]) and ``conv`` ([conv_dim, K-1]) in
    place by T tokens (chunked rule for several rows, recurrent for one); a ``TreeStep`` mutates
    nothing and returns the nodes' rule rows (what a commit replays)."""
    T, hk, hv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv_in = mm(w.in_qkv, x)                                                   # qkv_in: [T, conv_dim]
    z = mm(w.in_z, x).view(T, hv, dv)                                          # z: [T, Hv, Dv]
    b = mm(w.in_b, x)                                                          # b: [T, Hv]
    a = mm(w.in_a, x)                                                          # a: [T, Hv]

    tree = isinstance(step, TreeStep)
    if tree:                                                                   # each node over its path
        qkv = op["causal_conv_tree"](qkv_in, conv, w.conv, step.parents)
    else:
        qkv, tail = op["causal_conv"](qkv_in, conv, w.conv)                    # silu(conv); tail [C, K-1]
        conv.copy_(tail)
    q, k, v = torch.split(qkv, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
    q = op["l2_norm"](q.reshape(T, hk, dk))                                    # q: [T, Hk, Dk] fp32
    k = op["l2_norm"](k.reshape(T, hk, dk))                                    # k: [T, Hk, Dk] fp32
    v = v.reshape(T, hv, dv)                                                   # v: [T, Hv, Dv]
    beta = op["sigmoid"](b)                                                    # beta: [T, Hv] fp32
    g = -w.A_log.exp() * op["softplus"](a.float() + w.dt_bias)                 # g: [T, Hv] fp32 log-decay

    scale, rule = dk ** -0.5, None
    if tree:
        o = op["gdn_tree"](q, k, v, g, beta, S, step.parents, scale=scale)
        rule = RuleRows(qkv_in, q, k, v, g, beta)
    else:
        if step.count == 1:
            o, new = op["gdn_recurrent"](q, k, v, g, beta, S, scale=scale)
        else:
            o, new = op["gdn_chunk"](q, k, v, g, beta, S, scale=scale, chunk=gdn_chunk)
        S.copy_(new)                                                           # o: [T, Hv, Dv] fp32
    if cfg.output_gate == "silu":
        o = op["gated_rms_norm"](o, z, w.norm, cfg.rms_norm_eps)               # o: [T, Hv, Dv]
    else:                                                                      # norm, then a sigmoid gate
        o = op["rms_norm"](o, w.norm, cfg.rms_norm_eps) * op["sigmoid"](z)
    return mm(w.out, o.reshape(T, hv * dv).to(x.dtype)), rule


# -- the mixture of experts --------------------------------------------------------------------------
def route(op: Ops, mm: MatMul, x: torch.Tensor, w: MoEWeights,
          top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert, the top ``top_k``, renormalised: ``(weights [T, k] in x's dtype,
    experts [T, k] int64)``."""
    probs = op["softmax"](mm(w.router, x))                                     # probs: [T, E] fp32
    top, experts = probs.topk(top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), experts


def _expert(op: Ops, mm: MatMul, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    # x: [m, H] -> [m, H]: down(silu(gate(x)) * up(x))
    return mm(w.down, op["silu"](mm(w.gate, x)).to(x.dtype) * mm(w.up, x))


def moe(op: Ops, mm: MatMul, x: torch.Tensor, w: MoEWeights, top_k: int) -> torch.Tensor:
    """``x: [T, H] -> [T, H]``: each row's top-k experts (only the selected ones run, each expert once for
    all the rows routed to it) plus the shared expert under its sigmoid gate."""
    weights, experts = route(op, mm, x, w, top_k)                              # [T, k] each
    out = torch.zeros_like(x)                                                  # out: [T, H]
    for e in torch.unique(experts).tolist():                                   # ascending expert order
        rows, rank = torch.nonzero(experts == e, as_tuple=True)                # the rows routed to e
        y = _expert(op, mm, x.index_select(0, rows), w.experts[e])             # y: [m, H]
        out.index_add_(0, rows, y * weights[rows, rank, None])
    shared = _expert(op, mm, x, w.shared) * op["sigmoid"](mm(w.shared_gate, x)).to(x.dtype)
    return out + shared
