"""The fused kernels' plain-torch references (``tandem_core.ops.fused_ref``) equal the per-op references they fuse.

The CUDA kernels are checked against these references on a device (tests/test_gpu_kernels.py); here each
reference is checked, on the CPU, against the reference ops the CPU runner uses (conv over a tree, the
zero-centred norm and rotary, attention over a tree, the commit of a path), on random trees.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem_core import ops
from tandem_core.ops import fused_ref as fr
from tandem_core.ops.rope import apply_rope, cos_sin, inv_freq
from tandem_core.testing.trees import path_to, random_tree


def windows(parents: list[int], K: int) -> torch.Tensor:
    """``win[i, k]``: where node ``i``'s ``k``-th window input comes from (``< K-1``: a tail column; else
    ``K-1 + node``), the last ``K-1`` inputs before it on its path."""
    rows = []
    for i in range(len(parents)):
        src = [c for c in range(K - 1)] + [K - 1 + a for a in path_to(parents, i)[:-1]]
        rows.append(src[-(K - 1):])
    return torch.tensor(rows, dtype=torch.int32)


def ancestors(parents: list[int]) -> torch.Tensor:
    """``anc[j, d]``: node ``j``'s ancestor at depth ``d`` (itself at its own depth)."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.int32)
    for j in range(n):
        for d, a in enumerate(path_to(parents, j)):
            anc[j, d] = a
    return anc


@pytest.mark.parametrize("N,C,K,DH,QK", [(1, 64, 4, 16, 2), (13, 96, 4, 32, 2), (24, 64, 3, 16, 3)], ids=str)
def test_conv_tree_ref_is_the_tree_conv_then_the_qk_norm(N, C, K, DH, QK):
    g = torch.Generator().manual_seed(N + C)
    _, parents = random_tree(random.Random(N), N, 50)
    raw = torch.randn(N, C + 8, generator=g).bfloat16()                    # row-strided: extra columns after C
    tail = torch.randn(C, K - 1, generator=g).bfloat16()
    w = torch.randn(C, K, generator=g)
    out = torch.zeros(N, C)
    fr.conv_tree_ref(raw, tail, w, windows(parents, K), torch.tensor([N]), out, DH, QK, N)
    want = ops.get("causal_conv_tree")(raw[:, :C].contiguous(), tail, w, torch.tensor(parents)).float()
    want[:, :QK * DH] = ops.get("l2_norm")(want[:, :QK * DH].reshape(N, QK, DH)).reshape(N, QK * DH)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,D,R,rows", [(4, 2, 32, 8, 5), (8, 1, 64, 16, 1), (2, 2, 16, 16, 9)], ids=str)
def test_qk_post_ref_is_the_norm_then_rotary_into_the_cache(hq, hkv, D, R, rows):
    g = torch.Generator().manual_seed(D + rows)
    L, S, eps = 7, 32, 1e-6
    raw = torch.randn(rows, 2 * hq * D + 2 * hkv * D, generator=g).bfloat16()
    qn, kn = torch.randn(D, generator=g) * 0.1, torch.randn(D, generator=g) * 0.1
    freqs = inv_freq(R, 10000.0, "cpu")
    pos = torch.arange(L, L + rows, dtype=torch.int32)
    q_out = torch.zeros(rows, hq * D, dtype=torch.bfloat16)
    Kc, Vc = torch.zeros(hkv, S, D, dtype=torch.bfloat16), torch.zeros(hkv, S, D, dtype=torch.bfloat16)
    fr.qk_post_ref(raw, qn, kn, freqs, pos, torch.tensor([L, rows]), q_out, Kc, Vc, hq, hkv, D, R, eps, rows)
    qg = raw[:, :2 * hq * D].view(rows, hq, 2 * D)[..., :D]
    k = raw[:, 2 * hq * D:2 * hq * D + hkv * D].view(rows, hkv, D)
    v = raw[:, 2 * hq * D + hkv * D:].view(rows, hkv, D)
    cos, sin = cos_sin(pos.long(), freqs)
    q_want = apply_rope(ops.get("rms_norm_1p")(qg, qn, eps), cos, sin)
    k_want = apply_rope(ops.get("rms_norm_1p")(k, kn, eps), cos, sin)
    torch.testing.assert_close(q_out.float(), q_want.reshape(rows, hq * D).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(Kc[:, L:L + rows].float(), k_want.transpose(0, 1).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(Vc[:, L:L + rows], v.transpose(0, 1))
    assert not Kc[:, :L].any() and not Kc[:, L + rows:].any()


def test_kv_commit_ref_moves_the_paths_rows():
    g = torch.Generator().manual_seed(1)
    K, V = torch.randn(2, 3, 40, 8, generator=g), torch.randn(2, 3, 40, 8, generator=g)
    K0, V0 = K.clone(), V.clone()
    path = torch.tensor([0, 2, 5, 9], dtype=torch.int32)
    fr.kv_commit_ref(K, V, torch.tensor([10, 12]), path, torch.tensor([4]))
    for i, p in enumerate(path.tolist()):
        assert torch.equal(K[:, :, 10 + i], K0[:, :, 10 + p]) and torch.equal(V[:, :, 10 + i], V0[:, :, 10 + p])
    assert torch.equal(K[:, :, :10], K0[:, :, :10]) and torch.equal(K[:, :, 14:], K0[:, :, 14:])


@pytest.mark.parametrize("N,hq,hkv,D,L", [(1, 4, 2, 16, 9), (11, 4, 1, 32, 20), (20, 2, 2, 16, 3)], ids=str)
def test_tree_attention_ref_is_attention_over_each_nodes_path_times_the_gate(N, hq, hkv, D, L):
    g = torch.Generator().manual_seed(N + L)
    _, parents = random_tree(random.Random(N + 1), N, 50)
    cap = L + N + 4
    q = torch.randn(N, hq * D, generator=g).bfloat16()
    raw = torch.randn(N, 2 * hq * D, generator=g).bfloat16()                 # the gates at [h*2D + D, h*2D + 2D)
    k_nodes = torch.randn(N, hkv, D, generator=g).bfloat16()
    v_nodes = torch.randn(N, hkv, D, generator=g).bfloat16()
    Kc, Vc = torch.randn(hkv, cap, D, generator=g).bfloat16(), torch.randn(hkv, cap, D, generator=g).bfloat16()
    Kc[:, L:L + N], Vc[:, L:L + N] = k_nodes.transpose(0, 1), v_nodes.transpose(0, 1)   # node i's row at L + i
    depth = [len(path_to(parents, i)) - 1 for i in range(N)]
    pos = torch.tensor([L + d for d in depth], dtype=torch.int32)
    out = torch.zeros(N, hq * D, dtype=torch.bfloat16)
    fr.tree_attention_ref(q, raw, Kc, Vc, torch.tensor([L, N]), pos, ancestors(parents), None, out, hq=hq, hkv=hkv,
                          head_dim=D, scale=D ** -0.5, rows=N)
    base_K, base_V = Kc.clone(), Vc.clone()
    o = ops.get("attention_tree")(q.view(N, hq, D).float(), k_nodes.float(), v_nodes.float(), base_K.float(),
                                  base_V.float(), L, torch.tensor(parents), D ** -0.5)       # [N, Hq, D]
    gate = raw.view(N, hq, 2 * D)[..., D:].float()
    want = o.bfloat16().float() * torch.sigmoid(gate).bfloat16().float()
    torch.testing.assert_close(out.float(), want.reshape(N, hq * D), rtol=2e-2, atol=2e-2)
