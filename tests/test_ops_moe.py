"""The mixture-of-experts references (``tandem_core.ops.moe``) against a row-at-a-time loop and LFM2's router."""

from __future__ import annotations

import pytest
import torch

from tandem_core import ops
from tandem_core.ops import moe


def _naive(x, experts, weights, w_gate_up, w_down):
    # one row at a time, its experts in increasing index: transformers' Lfm2MoeSparseMoeBlock / Qwen MoE order
    I = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in sorted(range(experts.shape[1]), key=lambda j: (int(experts[t, j]), j)):
            e = int(experts[t, slot])
            gu = w_gate_up[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += float(weights[t, slot]) * (w_down[e].double() @ h)
    return out


@pytest.mark.parametrize("T,k,E,H,I", [(1, 4, 8, 32, 16), (7, 2, 5, 24, 12), (16, 4, 6, 16, 40)])
def test_grouped_experts_equals_the_row_loop(T, k, E, H, I):
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])     # unsorted along k
    experts[: T // 2] = experts[0]                                                     # rows sharing experts
    weights = torch.rand(T, k, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w_down = torch.randn(E, H, I, generator=g) * 0.2
    y = moe.grouped_experts(x, experts, weights, w_gate_up, w_down)
    want = _naive(x, experts, weights, w_gate_up, w_down)
    assert y.dtype == torch.float32
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_grouped_experts_runs_each_selected_expert_once():
    T, k, E, H, I = 9, 3, 7, 8, 4
    x = torch.randn(T, H)
    experts = torch.tensor([[0, 2, 5]] * 4 + [[5, 1, 2]] * 5)
    calls: list[int] = []

    def mm(w, rows):
        calls.append(rows.shape[0])
        return rows @ w.t()

    moe.grouped_experts(x, experts, torch.rand(T, k), torch.randn(E, 2 * I, H), torch.randn(E, H, I), mm=mm)
    # experts 0, 1, 2, 5: two matmuls each, over the rows that chose it
    assert sorted(calls) == sorted([4, 4, 5, 5, 9, 9, 9, 9])


def test_route_equals_lfm2s_router():
    from tandem_lfm25 import moe as lfm

    from tandem_core.ops.act import sigmoid

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 16, generator=g)
    logits[2, 3] = logits[2, 9]                                     # a tie: the lower expert wins
    bias = torch.randn(16, generator=g) * 0.1
    experts, weights = moe.route(logits, bias, 4, "sigmoid", True, 2.5)
    want = lfm.route(logits, bias, 4, True, 2.5, sigmoid)
    assert torch.equal(experts, want.experts) and torch.equal(weights, want.weights)


def test_softmax_route_is_top_k_of_the_softmax():
    logits = torch.randn(5, 12)
    experts, weights = moe.route(logits, None, 3, "softmax", renorm=False)
    p = torch.softmax(logits.double(), -1)
    top = torch.topk(p, 3, dim=-1)
    assert torch.equal(experts, torch.sort(top.indices, -1).values)
    assert torch.allclose(weights.double(), p.gather(1, experts), atol=1e-7)
    with pytest.raises(ValueError, match="scoring 'relu'"):
        moe.route(logits, None, 3, "relu")


def test_the_ops_are_defined_with_their_references():
    assert ops.get("grouped_experts", "cpu") is moe.grouped_experts
    assert ops.get("moe_route", "cpu") is moe.route
