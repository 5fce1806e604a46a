"""A mixture of experts' routing and grouped expert matmul, in plain torch (the references of the CUDA kernels in
``tandem_core.ops.triton_moe``). Family-neutral: LFM2's sigmoid router with an expert bias and Qwen-style softmax
routers both fit.

    route(logits [T, E], bias [E] | None, top_k, scoring, renorm, scale, eps)
        -> (experts [T, k] int64 ascending along k, weights [T, k] fp32)
    grouped_experts(x [T, H], experts [T, k] int, weights [T, k] fp32, w_gate_up [E, 2I, H], w_down [E, H, I])
        -> y [T, H] in x's dtype

Routing: ``p = sigmoid(logits)`` or ``softmax(logits)`` (fp32, ``tandem_core.ops.act``); the experts are the
``top_k`` largest ``p + bias`` (the bias moves the selection only; equal scores go to the lower expert index: a
stable sort, each row on its own); their weights are ``p`` there, divided by their sum plus ``eps`` when
``renorm``, times ``scale``.

The experts: only the selected ones run, each once a call over the union of the rows that chose it (its weights
read once), as ``h = bf16(silu(bf16(gate_e x))) * bf16(up_e x)`` (``w_gate_up[e]``: the gate rows, then the up
rows), ``d = bf16(down_e h)``; then ``y[t] = sum over the row's experts e, in increasing e, of weight * d``,
accumulated in fp32 from zero and rounded to x's dtype once. A row's experts need not come sorted (the add order is
by expert index, equal experts by slot); a row lists an expert at most once in practice (top-k).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem_core.ops.act import sigmoid, silu, softmax

__all__ = ["SCORINGS", "add_order", "grouped_experts", "route"]

SCORINGS = ("sigmoid", "softmax")

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _mm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str = "sigmoid",
          renorm: bool = True, scale: float = 1.0, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits: [T, E]`` -> ``(experts [T, top_k] int64 ascending, weights [T, top_k] fp32)``. Mutates nothing."""
    if scoring not in SCORINGS:
        raise ValueError(f"route: scoring {scoring!r} is not one of {SCORINGS}")
    p = sigmoid(logits) if scoring == "sigmoid" else softmax(logits)        # p: [T, E] fp32
    scores = p if bias is None else p + bias.float()
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]    # [T, k]
    experts = torch.sort(order, dim=-1).values                              # [T, k] ascending
    w = p.gather(1, experts)
    if renorm:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    return experts, w * scale


def add_order(experts: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` -> the slots of each row in the order their terms are added: by expert index, then slot."""
    return torch.sort(experts, dim=-1, stable=True).indices


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, mm: Matmul = _mm) -> torch.Tensor:
    """See the module docstring. ``mm(w [N, K], rows [G, K]) -> [G, N]`` in the rows' dtype (default ``rows @
    w.T``). Mutates nothing."""
    T, H = x.shape
    k = experts.shape[1]
    I = w_gate_up.shape[1] // 2
    flat = experts.reshape(-1).long()                                       # pair p = t * k + slot
    d = torch.zeros(T * k, H, dtype=x.dtype, device=x.device)               # d: [P, H] each pair's expert output
    for e in torch.unique(flat).tolist():                                   # each selected expert once
        pairs = (flat == e).nonzero().reshape(-1)
        xs = x.index_select(0, pairs // k)                                  # xs: [G, H]
        gu = mm(w_gate_up[e], xs)                                           # gu: [G, 2I]
        h = silu(gu[:, :I]).to(x.dtype) * gu[:, I:]                         # h: [G, I]
        d[pairs] = mm(w_down[e], h)
    order = add_order(experts)                                              # [T, k]
    rows = torch.arange(T, device=x.device)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for j in range(k):
        slot = order[:, j]
        out = out + d[rows * k + slot].float() * weights[rows, slot].float()[:, None]
    return out.to(x.dtype)
