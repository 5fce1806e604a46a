"""The fused step kernels (``tandem_core.ops.triton_fused_mm``) against the unfused pairs, bit for bit.

On a CUDA device at the 27B's shapes (hidden 5120, MLP 17408; 48 value heads and 16 key heads of 128, conv
kernel 4), 1, 3, 16 and 64 rows, every matmul layout:

- ``silu_mul_matmul(gu, w, plan)`` equals ``skinny_matmul(silu_mul(gu), w, plan)`` (``torch.equal``: bf16
  output, or every fp32 partial of a split K);
- ``conv_gdn_tree(...)`` equals ``conv_tree`` then ``gdn_tree``: the conv rows it stores, the tree's output
  and the state it stores (decode) or leaves (verify);
- ``embed_rms_norm_1p`` equals the embedding gather then ``add_rms_norm_1p`` without parts: the residual rows
  and the normed rows.

Skipped without CUDA and Triton. With ``TRITON_INTERPRET=1`` (and Triton installed) the same comparisons run
on the CPU in the interpreter, at reduced shapes with the same tile structure (the full ones on the device):
that proves the dataflow (the same values reach the same dots), the device proves the lowering.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tandem_core.testing.kernels import triton_interpreting

INTERPRET = triton_interpreting()
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON or not (torch.cuda.is_available() or INTERPRET),
                                reason="needs a CUDA device and Triton (or TRITON_INTERPRET=1 with Triton)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FULL = DEV == "cuda"
# the 27B (tools/bench_gpu.py SHAPE): hidden, MLP, the linear attention's heads; under the interpreter smaller
# ones with the same tiles (128-wide K steps, a few per part of a split K; heads of 128, fewer of them)
HIDDEN, INTER = (5120, 17408) if FULL else (256, 1536)
HK, HV, DK, DV, KW = (16, 48, 128, 128, 4) if FULL else (2, 6, 128, 128, 4)
ROWS = [1, 3, 16, 64]


def _plans():
    from tandem_core.ops import triton_matmul as tm

    heur = tm.plan_for(HIDDEN, INTER)             # what the runner uses for the down projection untuned
    return [
        pytest.param(heur, id=f"heuristic-{heur.layout}-{heur.BN}-{heur.BK}-s{heur.split}"),
        pytest.param(tm.MatmulPlan(64, 128, 1, 4, 3, "wy"), id="wy-64-128-s1"),
        pytest.param(tm.MatmulPlan(128, 128, 2, 4, 3, "wy"), id="wy-128-128-s2"),
        pytest.param(tm.MatmulPlan(64, 128, 4, 4, 3, "wx"), id="wx-64-128-s4"),
        pytest.param(tm.MatmulPlan(64, 128, 2, 4, 3, "xw"), id="xw-64-128-s2"),
        pytest.param(tm.MatmulPlan(64, 64, 3, 4, 3, "wy"), id="wy-64-64-s3-uneven"),
    ]


@pytest.mark.parametrize("plan", _plans())
@pytest.mark.parametrize("M", ROWS)
def test_silu_mul_matmul_equals_silu_mul_then_the_matmul(M, plan):
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_fused_mm as fm
    from tandem_core.ops import triton_matmul as tm

    g = torch.Generator().manual_seed(M * 7 + plan.BN)
    w = (torch.randn(HIDDEN, INTER, generator=g) * 0.02).bfloat16().to(DEV)
    # gate/up rows as the gate_up projection leaves them, inside a wider buffer (the runner's [W, 2I] rows)
    buf = (torch.randn(M + 2, 2 * INTER, generator=g) * 3.0).bfloat16().to(DEV)
    gu = buf[:M]
    act = torch.zeros(M, INTER, dtype=torch.bfloat16, device=DEV)
    tf.silu_mul(gu, act)
    want = tm.skinny_matmul(act, w, plan)
    got = fm.silu_mul_matmul(gu, w, plan)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), f"max |diff| {float((got.float() - want.float()).abs().max())}"
    # into a caller's buffer too (the runner's partials), and the first row alone is the same row
    out = torch.full_like(want, float("nan"))
    fm.silu_mul_matmul(gu, w, plan, out=out)
    assert torch.equal(out, want)
    one = fm.silu_mul_matmul(gu[:1], w, plan)
    assert torch.equal(one[..., 0, :], want[..., 0, :])


def test_silu_mul_matmul_refuses_a_gate_up_of_the_wrong_width():
    from tandem_core.ops import triton_fused_mm as fm

    with pytest.raises(ValueError, match="gate and up"):
        fm.silu_mul_matmul(torch.zeros(1, 100, dtype=torch.bfloat16, device=DEV),
                           torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV))


def _tree(n: int, seed: int) -> list[int]:
    from tandem_core.testing.trees import random_tree

    return random_tree(random.Random(seed), n, 50)[1]


def _windows(parents: list[int], kw: int) -> torch.Tensor:
    """Each node's conv window (``cuda_graphs.tree_tables``' rule): the tail, then its ancestors."""
    anc: list[list[int]] = []
    win = []
    for i, p in enumerate(parents):
        chain = [i] if p < 0 else anc[p] + [i]
        anc.append(chain)
        seq = list(range(kw - 1)) + [kw - 1 + a for a in chain[:-1]]
        win.append(seq[-(kw - 1):])
    return torch.tensor(win, dtype=torch.int32)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "verify"])
@pytest.mark.parametrize("N", ROWS)
def test_conv_gdn_tree_equals_conv_tree_then_the_tree(N, decode):
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_fused_mm as fm
    from tandem_core.ops import triton_gdn as tg

    if decode and N > 1:
        pytest.skip("decode is the one-node tree")
    g = torch.Generator().manual_seed(100 + N)
    C = 2 * HK * DK + HV * DV
    n_in = C + HV * DV + 2 * HV
    col_b, col_a = C + HV * DV, C + HV * DV + HV
    W = N + 2                                              # a padded width: rows past n are not computed
    parents = [-1] if N == 1 else _tree(N, N)
    plan_list = tg.tree_plan(parents).packed()
    plan = torch.tensor(plan_list, dtype=torch.int32).to(DEV)
    n = torch.tensor([N], dtype=torch.int32).to(DEV)
    win = torch.cat([_windows(parents, KW), torch.arange(KW - 1, dtype=torch.int32).repeat(W - N, 1)]).to(DEV)
    proj = torch.randn(1, W, n_in, generator=g).bfloat16().to(DEV)
    tail = torch.randn(C, KW - 1, generator=g).bfloat16().to(DEV)
    cw = (torch.randn(C, KW, generator=g) * 0.5).to(DEV)
    A_log = (torch.rand(1, HV, generator=g) * 2 - 1).to(DEV)
    dt_bias = torch.randn(1, HV, generator=g).to(DEV)
    S0 = (torch.randn(1, HV, DK, DV, generator=g) * 0.1).to(DEV)
    kw = dict(write_out=True, final_store=decode, scale=DK ** -0.5, num_k_heads=HK)

    qkv_a = torch.zeros(1, W, C, device=DEV)
    S_a, o_a = S0.clone(), torch.zeros(W, HV, DV, device=DEV)
    scr_a = torch.zeros(W, HV, DK, DV, device=DEV)
    tf.conv_tree(proj[0], tail, cw, win, n, qkv_a[0], DK, 2 * HK, W)
    tg.gdn_tree(qkv_a, proj, col_b, col_a, A_log, dt_bias, S_a, scr_a, o_a, plan, n, **kw)

    qkv_b = torch.zeros(1, W, C, device=DEV)
    S_b, o_b = S0.clone(), torch.zeros(W, HV, DV, device=DEV)
    scr_b = torch.zeros(W, HV, DK, DV, device=DEV)
    fm.conv_gdn_tree(proj[0], tail, cw, win, qkv_b, proj, col_b, col_a, A_log, dt_bias, S_b, scr_b, o_b, plan,
                     n, head_dim=DK, qk_heads=2 * HK, **kw)

    assert torch.equal(qkv_b, qkv_a), "conv rows"
    assert torch.equal(o_b, o_a), "tree output"
    assert torch.equal(S_b, S_a), "state"
    assert decode or torch.equal(S_b, S0)


def test_conv_gdn_tree_refuses_groups_that_are_not_the_heads():
    from tandem_core.ops import triton_fused_mm as fm

    C = 2 * HK * DK + HV * DV
    z = torch.zeros(1, 4, C, device=DEV)
    S = torch.zeros(1, HV, DK, DV, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="not the heads"):
        fm.conv_gdn_tree(z[0].bfloat16(), torch.zeros(C, KW - 1, device=DEV).bfloat16(),
                         torch.zeros(C, KW, device=DEV), torch.zeros(4, KW - 1, **i32), z, z.bfloat16(), 0, 0,
                         torch.zeros(1, HV, device=DEV), torch.zeros(1, HV, device=DEV), S, S, z,
                         torch.zeros(3, **i32), torch.ones(1, **i32), write_out=True, final_store=True,
                         scale=1.0, num_k_heads=HK, head_dim=DK // 2, qk_heads=2 * HK)


@pytest.mark.parametrize("R", ROWS)
def test_embed_rms_norm_equals_the_gather_then_the_norm(R):
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_fused_mm as fm

    g = torch.Generator().manual_seed(R)
    V = 3000
    embed = torch.randn(V, HIDDEN, generator=g).bfloat16().to(DEV)
    w = (torch.randn(HIDDEN, generator=g) * 0.1).to(DEV)
    ids = torch.randint(0, V, (R,), generator=g).to(DEV)
    x_a = torch.zeros(R + 2, HIDDEN, dtype=torch.bfloat16, device=DEV)[:R]
    h_a = torch.zeros_like(x_a)
    torch.index_select(embed, 0, ids, out=x_a)
    tf.add_rms_norm_1p(x_a, None, w, 1e-6, h_a)
    x_b, h_b = torch.full_like(x_a, float("nan")), torch.full_like(x_a, float("nan"))
    fm.embed_rms_norm_1p(embed, ids, x_b, w, 1e-6, h_b)
    assert torch.equal(x_b, x_a) and torch.equal(h_b, h_a)
