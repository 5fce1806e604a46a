"""The CUDA kernels against their plain-torch references (skipped without a CUDA device and Triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA device and Triton (the CPU references are the source of truth)")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("layout", ["xw", "wx", "wy"])
@pytest.mark.parametrize("M", [1, 7, 17, 64, 100])
def test_skinny_matmul_rows_are_invariant(M, layout):
    from tandem_core.ops import triton_matmul as tm

    x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
    plan = tm.MatmulPlan(64, 128, 2, layout=layout)
    y = tm.reduce_parts(tm.skinny_matmul(x, w, plan))
    assert rel(y, x.double() @ w.double().T) < 1e-5
    one = tm.reduce_parts(tm.skinny_matmul(x[:1], w, plan))
    assert torch.equal(one[0], y[0])


@pytest.mark.parametrize("layout", ["xw", "wy"])
def test_the_glu_matmul_is_silu_mul_then_the_matmul_bit_for_bit(layout):
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_matmul as tm

    I = 1024
    gu = torch.randn(64, 2 * I, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(768, I, device="cuda", dtype=torch.bfloat16)
    act = tf.silu_mul(gu, torch.empty(64, I, device="cuda", dtype=torch.bfloat16))
    ref = act.float() - (torch.nn.functional.silu(gu[:, :I].float()).bfloat16().float() * gu[:, I:].float())
    assert float(ref.abs().max()) < 0.02 * float(act.float().abs().max())
    plan = tm.MatmulPlan(64, 128, 2, layout=layout)
    for M in (1, 17, 64):
        assert torch.equal(tm.skinny_matmul(gu[:M], w, plan, glu=True), tm.skinny_matmul(act[:M], w, plan))


@pytest.mark.parametrize("split", [1, 4])
def test_the_fused_residual_add_and_norm_match_the_separate_kernels(split):
    # the producer's epilogue adds its K parts to the residual exactly as add_rms_norm_1p does, its tile sums
    # of squares are exact, and the consumer's normalised product is the reference's; all row-invariant
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_matmul as tm

    H, K, W = 1024, 2048, 64
    dev = dict(device="cuda")
    res0 = (torch.randn(W, H, **dev) * 4).bfloat16()
    a = torch.randn(W, K, **dev).bfloat16()
    w = torch.randn(H, K, **dev).bfloat16() / 40
    wc = torch.randn(768, H, **dev).bfloat16()
    nw = torch.randn(H, **dev) * 0.2
    p = tm.MatmulPlan(64, 128, split, layout="wy")
    pc = tm.MatmulPlan(64, 128, 1, layout="wy")
    got = {}
    for M in (1, 17, 64):
        res = res0[:M].clone()
        ssq = torch.zeros(H // 64, W, dtype=torch.float64, **dev)
        cnt = torch.zeros(H // 64, dtype=torch.int32, **dev)
        parts = torch.zeros(split, W, H, **dev)
        tm.fused_matmul(a[:M], w, p, add=tm.AddOut(res, ssq, cnt, parts[:, :M]))
        # the separate path: K parts, then add + norm in one kernel
        ref_x = res0[:M].clone()
        h = torch.empty_like(ref_x)
        y = tm.skinny_matmul(a[:M], w, p)
        tf.add_rms_norm_1p(ref_x, y, nw, 1e-6, h)
        assert torch.equal(res, ref_x)
        assert int(cnt.abs().sum()) == 0
        exact = (res.double() ** 2).sum(1)
        assert float(((ssq[:, :M].sum(0) - exact) / exact).abs().max()) < 1e-12
        out = tm.fused_matmul(res, wc, pc, norm=tm.NormIn(ssq, H // 64, nw, 1e-6))
        assert rel(out, h.double() @ wc.double().T) < 2e-2
        got[M] = (res, ssq[:, :M].clone(), out)
    for M in (1, 17):
        assert torch.equal(got[M][0], got[64][0][:M])
        assert torch.equal(got[M][1], got[64][1][:, :M])
        assert torch.equal(got[M][2], got[64][2][:M])


def test_gdn_chunk_and_tree_match_the_recurrent_reference():
    from tandem_core.ops import gdn as ref
    from tandem_core.ops import triton_gdn as tg

    T, Hk, Hv, Dk, Dv = 200, 2, 4, 64, 64
    nrm = torch.nn.functional.normalize
    q, k = (nrm(torch.randn(T, Hk, Dk, device="cuda"), dim=-1) for _ in range(2))
    v = torch.randn(T, Hv, Dv, device="cuda")
    g, beta = -torch.rand(T, Hv, device="cuda") * 0.3, torch.rand(T, Hv, device="cuda")
    S0 = torch.randn(Hv, Dk, Dv, device="cuda") * 0.1
    o_r, S_r = ref.gdn_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), S0.cpu(), scale=Dk ** -0.5)
    o_c, S_c = tg.gdn_chunk(q, k, v, g, beta, S0, scale=Dk ** -0.5)
    assert rel(o_c.cpu(), o_r) < 5e-3 and rel(S_c.cpu(), S_r) < 5e-3
