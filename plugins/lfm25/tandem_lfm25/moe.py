"""The LFM2 mixture of experts: the router and the selected experts, grouped by expert.

    route(logits, expert_bias, top_k, norm_topk_prob, scale) -> Routes(experts [T, k], weights [T, k])
    experts_grouped(x, routes, gate_up, down, mm, silu) -> y [T, H]

Routing, as the reference (transformers 5.24.0 ``Lfm2MoeTopKRouter``) computes it:
``p = sigmoid(router(x))``; the experts are the ``top_k`` largest ``p + expert_bias``
(the bias moves the selection only); their weights are ``p`` at those experts,
divided by their sum plus 1e-6 when ``norm_topk_prob``, times
``routed_scaling_factor``. Each row is ranked on its own with a stable sort
(equal scores go to the lower expert index), so a row's experts never depend
on the rows beside it.

The experts: only the selected ones run, each once a call, over the rows that
chose it (in a verify, the union of the nodes' experts). ``y[t] = sum over the
row's experts e, in increasing e, of weight * down_e(silu(gate_e x) * up_e x)``,
accumulated in fp32 from zero, as the reference's ``index_add_`` in increasing
expert order does. Row invariance: the row's experts and their order come from
the row alone, and every matmul goes through ``mm`` — the decode step's and a
verify's ``linear_rows``, under which a row's product does not depend on how
many rows share its expert group — so a verified row equals the decode step's
bit for bit whatever else the tree routed to the same experts.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Routes", "route", "experts_grouped", "groups"]

Matmul = Callable[[Any, torch.Tensor], torch.Tensor]


class Routes(NamedTuple):
    """Per row, the selected experts in increasing index and their routing weights."""

    experts: torch.Tensor   # [T, k] int64, ascending along k
    weights: torch.Tensor   # [T, k] fp32


def route(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, norm_topk_prob: bool,
          scale: float, sigmoid: Callable[[torch.Tensor], torch.Tensor]) -> Routes:
    """``logits: [T, E]`` (the router's output) -> ``Routes`` of ``top_k`` experts a row. Mutates nothing."""
    p = sigmoid(logits)                                                   # p: [T, E] fp32
    scores = p if expert_bias is None else p + expert_bias.float()
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]    # [T, k]
    experts = torch.sort(order, dim=-1).values                            # [T, k] ascending: the add order
    w = p.gather(1, experts)                                              # w: [T, k] fp32
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
    return Routes(experts, w * scale)


def groups(routes: Routes) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(expert, rows, slots)`` for every expert some row selected, in increasing expert index: the rows
    that chose it ([G] int64, ascending) and where in their ``k`` it sits."""
    flat = routes.experts.reshape(-1)
    k = routes.experts.shape[1]
    out = []
    for e in torch.unique(flat).tolist():                                 # sorted
        hit = (flat == e).nonzero().reshape(-1)                           # a row selects an expert at most once
        out.append((int(e), hit // k, hit % k))
    return out


def experts_grouped(x: torch.Tensor, routes: Routes, gate_up: tuple[Any, ...], down: tuple[Any, ...],
                    mm: Matmul, silu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x: [T, H]`` -> ``[T, H]`` in x's dtype: each selected expert once, over the rows that chose it.

    ``gate_up[e]``: ``Linear [2I, H]`` (gate rows, then up rows); ``down[e]``: ``Linear [H, I]``;
    ``mm(lin, rows)`` multiplies rows by a weight (``linear_rows`` for a row-invariant call).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)     # out: [T, H] fp32
    for e, rows, slots in groups(routes):
        xs = x.index_select(0, rows)                                      # xs: [G, H]
        gu = mm(gate_up[e], xs)                                           # gu: [G, 2I]
        half = gu.shape[-1] // 2
        h = silu(gu[:, :half]).to(x.dtype) * gu[:, half:]                 # h: [G, I]
        y = mm(down[e], h)                                                # y: [G, H]
        w = routes.weights[rows, slots]                                   # w: [G] fp32
        out[rows] = out[rows] + y.float() * w[:, None]
    return out.to(x.dtype)
