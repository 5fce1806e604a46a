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


def test_the_prefill_chain_conv_equals_the_tree_conv_on_a_chain():
    from tandem_core.ops import triton_fused as tf

    T, C, KW, DH = 300, 1024, 4, 128
    raw = torch.randn(T, C + 96, device="cuda").bfloat16()
    tail = torch.randn(C, KW - 1, device="cuda").bfloat16()
    w = torch.randn(C, KW, device="cuda")
    chain = torch.arange(T, dtype=torch.int32, device="cuda")
    win = (chain[:, None] + torch.arange(KW - 1, dtype=torch.int32, device="cuda")[None, :]).contiguous()
    a = torch.zeros(T, C, device="cuda")
    b = torch.zeros(T, C, device="cuda")
    tf.conv_tree(raw, tail, w, win, torch.tensor([T], dtype=torch.int32, device="cuda"), a, DH, 4, T)
    tf.conv_chain(raw, tail, w, b, DH, 4)
    # the same arithmetic, but the compiler may contract the taps and order the q/k norm's sum differently: a
    # value can round to the neighbouring bf16 (the reference rounds the conv output), nothing more
    assert torch.allclose(a, b, rtol=1e-2, atol=1e-4)
