"""The grouped expert matmul and the router on CUDA (``tandem_core.ops.triton_moe``) against their plain-torch
references (``tandem_core.ops.moe``); skipped without a CUDA device and Triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA device and Triton (the CPU references are the source of truth)")

# (E, I, H, k): LFM2.5-24B-A2B, LFM2-8B-A1B, a Flash-Next-like router, a small odd one (K not a multiple of BK)
SHAPES = [(64, 1536, 2048, 4), (32, 1792, 2048, 4), (512, 640, 2048, 10), (6, 72, 200, 2)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _mm64(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # the reference's matmuls exact before their bf16 rounding (what the kernel's fp32 accumulation approaches)
    return (x.double() @ w.double().t()).to(x.dtype)


def _case(T, E, I, H, k, seed=0, shared=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w_gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    w_down = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    experts = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    if shared and T > 2:
        experts[: T // 2] = experts[0]                  # many rows on one expert: blocks of more than one row
    weights = torch.rand(T, k, device="cuda", generator=g)
    return x, experts, weights, w_gate_up, w_down


@pytest.mark.parametrize("E,I,H,k", SHAPES, ids=[f"E{e}-I{i}-H{h}-k{k}" for e, i, h, k in SHAPES])
@pytest.mark.parametrize("T", [1, 16, 64])
def test_grouped_experts_equals_the_reference(T, E, I, H, k):
    from tandem_core.ops import moe
    from tandem_core.ops import triton_moe as tm

    x, experts, weights, gu, dn = _case(T, E, I, H, k)
    y = tm.grouped_experts(x, experts, weights, gu, dn)
    want = moe.grouped_experts(x, experts, weights, gu, dn, mm=_mm64)
    assert y.shape == (T, H) and y.dtype == torch.bfloat16
    assert rel(y, want) < 4e-3
    # int32 experts (the router's) give the same bits
    assert torch.equal(tm.grouped_experts(x, experts.int(), weights, gu, dn), y)


@pytest.mark.parametrize("E,I,H,k", SHAPES[:3], ids=[f"E{e}-I{i}" for e, i, h, k in SHAPES[:3]])
def test_a_row_does_not_depend_on_the_rows_beside_it(E, I, H, k):
    from tandem_core.ops import triton_moe as tm

    x, experts, weights, gu, dn = _case(64, E, I, H, k, seed=1)
    wide = tm.grouped_experts(x, experts, weights, gu, dn)
    for t in (0, 1, 31, 63):                           # the decode row alone equals its row in every width
        alone = tm.grouped_experts(x[t:t + 1], experts[t:t + 1], weights[t:t + 1], gu, dn)
        assert torch.equal(alone[0], wide[t])
        part = tm.grouped_experts(x[: t + 1], experts[: t + 1], weights[: t + 1], gu, dn)
        assert torch.equal(part[t], wide[t])


def test_grouped_experts_replays_in_a_cuda_graph_with_new_routes():
    from tandem_core.ops import moe
    from tandem_core.ops import triton_moe as tm

    E, I, H, k, T = 64, 1536, 2048, 4, 16
    x, experts, weights, gu, dn = _case(T, E, I, H, k, seed=2)
    xs, es, ws = x.clone(), experts.clone(), weights.clone()
    tm.grouped_experts(xs, es, ws, gu, dn)             # builds the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = tm.grouped_experts(xs, es, ws, gu, dn)
    for seed in (3, 4):
        x2, e2, w2, _, _ = _case(T, E, I, H, k, seed=seed, shared=seed == 3)
        xs.copy_(x2)
        es.copy_(e2)
        ws.copy_(w2)
        graph.replay()
        assert torch.equal(ys, tm.grouped_experts(x2, e2, w2, gu, dn))
        assert rel(ys, moe.grouped_experts(x2, e2, w2, gu, dn, mm=_mm64)) < 4e-3


@pytest.mark.parametrize("scoring,E,k,bias", [("sigmoid", 64, 4, True), ("sigmoid", 32, 4, False),
                                               ("softmax", 512, 10, False)])
def test_route_equals_the_reference(scoring, E, k, bias):
    from tandem_core.ops import moe
    from tandem_core.ops import triton_moe as tm

    g = torch.Generator(device="cuda").manual_seed(E)
    logits = torch.randn(64, E, device="cuda", generator=g).bfloat16()
    b = torch.randn(E, device="cuda", generator=g) * 0.05 if bias else None
    experts, weights = tm.route(logits, b, k, scoring, renorm=True, scale=2.5)
    want_e, want_w = moe.route(logits, b, k, scoring, renorm=True, scale=2.5)
    assert torch.equal(experts.long(), want_e)
    assert float((weights - want_w).abs().max()) < 1e-5
    one_e, one_w = tm.route(logits[5:6], b, k, scoring, renorm=True, scale=2.5)
    assert torch.equal(one_e[0], experts[5]) and torch.equal(one_w[0], weights[5])


def test_rows_past_live_run_no_expert():
    from tandem_core.ops import triton_moe as tm

    x, experts, weights, gu, dn = _case(16, 64, 1536, 2048, 4, seed=5)
    full = tm.grouped_experts(x, experts, weights, gu, dn)
    live = torch.tensor([10], dtype=torch.int32, device="cuda")
    part = tm.grouped_experts(x, experts, weights, gu, dn, live=live)
    assert torch.equal(part[:10], full[:10]) and not part[10:].any()


# -- route_plan: the router's top-k and the experts' plan in one program, from the router matmul's partials ----
def _plan_reference(experts: torch.Tensor, live: int, BT: int, maxb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan kernel's contract in torch: the live pairs ``t * k + slot`` sorted by expert (stable), and blocks of
    at most ``BT`` pairs of one expert, ``(expert or -1, first sorted pair, pairs)`` a column."""
    flat = experts[:live].reshape(-1).long().cpu()
    order = torch.sort(flat, stable=True).indices
    table = torch.zeros(3, maxb, dtype=torch.int32)
    table[0] = -1
    b = 0
    for e in torch.unique(flat).tolist():
        idx = (flat[order] == e).nonzero().reshape(-1)
        for j in range(0, len(idx), BT):
            table[:, b] = torch.tensor([e, int(idx[0]) + j, min(BT, len(idx) - j)])
            b += 1
    return order.int(), table


@pytest.mark.parametrize("E,k,H", [(64, 4, 2048), (32, 4, 2048), (6, 3, 200)], ids=["E64-k4", "E32-k4", "E6-k3"])
@pytest.mark.parametrize("T", [1, 3, 16, 64, 128])
def test_route_plan_from_partials_equals_route_and_the_plan(T, E, k, H):
    from tandem_core.ops import moe
    from tandem_core.ops import triton_matmul as tmm
    from tandem_core.ops import triton_moe as tm

    g = torch.Generator(device="cuda").manual_seed(T + E)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    router = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    # the LFM step's router plan: K cut in one-step parts (16 at H = 2048), fp32 partials [S, T, E]
    plan = tmm.MatmulPlan(64, 128, max(1, H // 128), 4, 3, "wy")
    parts = tmm.skinny_matmul(x, router, plan)
    logits = tmm.reduce_parts(parts).bfloat16() if parts.dim() == 3 else parts
    mp = tm.MoePlan()
    for live_n in sorted({T, max(1, T - 3)}):
        live = torch.tensor([live_n], dtype=torch.int32, device="cuda")
        r = tm.route_plan(parts, bias, k, mp, renorm=True, scale=2.5, live=live)
        want_e, want_w = moe.route(logits, bias, k, "sigmoid", renorm=True, scale=2.5)
        assert torch.equal(r.experts.long(), want_e)
        assert float((r.weights - want_w).abs().max()) < 1e-5
        srt, table = _plan_reference(r.experts, live_n, mp.BT, tm.max_blocks(T * k, E, mp.BT))
        assert torch.equal(r.sorted[: live_n * k].cpu(), srt) and torch.equal(r.table.cpu(), table)
        # the bf16 logits give the same bits as their partials (the sorted pairs past the live ones are not written)
        r2 = tm.route_plan(logits, bias, k, mp, renorm=True, scale=2.5, live=live)
        assert torch.equal(r.experts, r2.experts) and torch.equal(r.weights, r2.weights)
        assert torch.equal(r.sorted[: live_n * k], r2.sorted[: live_n * k]) and torch.equal(r.table, r2.table)
    for t in sorted({0, T // 2, T - 1}):                 # a row alone routes with the same bits
        one = tm.route_plan(tmm.skinny_matmul(x[t:t + 1], router, plan), bias, k, mp, renorm=True, scale=2.5)
        assert torch.equal(one.experts[0], r.experts[t]) and torch.equal(one.weights[0], r.weights[t])


@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_grouped_experts_on_route_plans_blocks_equals_the_plan_kernel(T):
    from tandem_core.ops import triton_moe as tm

    E, I, H, k = 64, 1536, 2048, 4
    x, _, _, gu, dn = _case(T, E, I, H, k, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, E, device="cuda", generator=g).bfloat16()
    logits[: T // 2] = logits[0]                       # rows sharing their experts: blocks of several rows
    live = torch.tensor([max(1, T - 1)], dtype=torch.int32, device="cuda")
    plan = tm.plan_for(E, I, H)
    r = tm.route_plan(logits, None, k, plan, live=live)
    y = tm.grouped_experts(x, r.experts, r.weights, gu, dn, plan=plan, live=live, blocks=r)
    want = tm.grouped_experts(x, r.experts, r.weights, gu, dn, plan=plan, live=live)
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match="blocks"):
        tm.grouped_experts(x, r.experts, r.weights, gu, dn, plan=tm.MoePlan(BT=32), live=live, blocks=r)


def test_route_plan_replays_in_a_cuda_graph():
    from tandem_core.ops import triton_moe as tm

    E, I, H, k, T = 64, 1536, 2048, 4, 16
    x, _, _, gu, dn = _case(T, E, I, H, k, seed=7)
    lg = torch.zeros(8, T, E, device="cuda")
    live = torch.tensor([T], dtype=torch.int32, device="cuda")
    plan = tm.plan_for(E, I, H)

    def step():
        r = tm.route_plan(lg, None, k, plan, live=live)
        return tm.grouped_experts(x, r.experts, r.weights, gu, dn, plan=plan, live=live, blocks=r)

    step()                                             # builds the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = step()
    for seed in (8, 9):
        g = torch.Generator(device="cuda").manual_seed(seed)
        lg.copy_(torch.randn(8, T, E, device="cuda", generator=g))
        live.fill_(T - seed + 7)
        graph.replay()
        assert torch.equal(ys, step())


@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_combine_add_norm_equals_the_combine_then_the_add_norm(T):
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_moe as tm

    E, I, H, k = 64, 1536, 2048, 4
    x, experts, weights, gu, dn = _case(T, E, I, H, k, seed=20 + T)
    g = torch.Generator(device="cuda").manual_seed(T)
    res = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    nw = torch.randn(H, device="cuda", generator=g) * 0.1
    live = torch.tensor([max(1, T - 1)], dtype=torch.int32, device="cuda")
    y = tm.grouped_experts(x, experts.int(), weights, gu, dn, live=live)
    xa, ha = res.clone(), torch.empty_like(res)
    tf.add_rms_norm_1p(xa, y, nw, 1e-5, ha)
    d = tm.grouped_experts(x, experts.int(), weights, gu, dn, live=live, combine=False)
    assert d.shape == (T * k, H)
    xb, hb = res.clone(), torch.empty_like(res)
    tm.combine_add_norm(d, experts.int(), weights, xb, nw, 1e-5, hb, live=live)
    # the same arithmetic in one program: equal but for a contraction the compiler may choose differently
    assert rel(xb, xa) < 1e-3 and rel(hb, ha) < 1e-3
    assert torch.equal(xb[live.item():], res[live.item():])          # rows past live add nothing
    for t in sorted({0, T - 1}):                                     # a row alone gives the same bits
        d1 = tm.grouped_experts(x[t:t + 1], experts[t:t + 1].int(), weights[t:t + 1], gu, dn, combine=False)
        x1, h1 = res[t:t + 1].clone(), torch.empty_like(res[:1])
        tm.combine_add_norm(d1, experts[t:t + 1].int(), weights[t:t + 1], x1, nw, 1e-5, h1)
        if t < live.item():
            assert torch.equal(x1[0], xb[t]) and torch.equal(h1[0], hb[t])
