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


# -- the fused kernels against their plain-torch references (tandem_core.ops.fused_ref) ------------------
def _tree(n: int, seed: int) -> list[int]:
    import random

    from tandem_core.testing.trees import random_tree

    return random_tree(random.Random(seed), n, 50)[1]


@pytest.mark.parametrize("hq,hkv,D,R,rows", [(24, 4, 256, 64, 1), (24, 4, 256, 64, 17), (8, 2, 128, 128, 64),
                                             (16, 16, 64, 32, 5)], ids=str)
def test_qk_post_equals_its_reference(hq, hkv, D, R, rows):
    from tandem_core.ops import fused_ref as fr
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops.rope import inv_freq

    dev, L, S = "cuda", 37, 200
    raw = torch.randn(rows, 2 * hq * D + 2 * hkv * D, device=dev).bfloat16()
    qn, kn = torch.randn(D, device=dev) * 0.1, torch.randn(D, device=dev) * 0.1
    freqs = inv_freq(R, 1e7, dev)
    pos = torch.arange(L, L + rows, dtype=torch.int32, device=dev)
    meta = torch.tensor([L, rows], dtype=torch.int32, device=dev)
    outs = []
    for fn in (tf.qk_post, fr.qk_post_ref):
        q = torch.zeros(rows, hq * D, device=dev, dtype=torch.bfloat16)
        K = torch.zeros(hkv, S, D, device=dev, dtype=torch.bfloat16)
        V = torch.zeros(hkv, S, D, device=dev, dtype=torch.bfloat16)
        fn(raw, qn, kn, freqs, pos, meta, q, K, V, hq, hkv, D, R, 1e-6, rows)
        outs.append((q, K, V))
    (q1, K1, V1), (q2, K2, V2) = outs
    assert rel(q1, q2) < 5e-3 and rel(K1, K2) < 5e-3 and torch.equal(V1, V2)
    assert torch.equal(K1[:, :L], K2[:, :L]) and torch.equal(K1[:, L + rows:], K2[:, L + rows:])


@pytest.mark.parametrize("N,C,K,DH,QK", [(1, 1024, 4, 128, 4), (16, 10240, 4, 128, 32), (64, 512, 4, 64, 2),
                                         (7, 384, 3, 128, 1)], ids=str)
def test_conv_tree_equals_its_reference(N, C, K, DH, QK):
    from tandem_core.ops import fused_ref as fr
    from tandem_core.ops import triton_fused as tf
    from test_fused_ref import windows

    dev = "cuda"
    parents = _tree(N, N + C)
    raw = torch.randn(N, C + 64, device=dev).bfloat16()
    tail = torch.randn(C, K - 1, device=dev).bfloat16()
    w = torch.randn(C, K, device=dev)
    win = windows(parents, K).to(dev)
    n = torch.tensor([N], dtype=torch.int32, device=dev)
    a, b = torch.zeros(N, C, device=dev), torch.zeros(N, C, device=dev)
    tf.conv_tree(raw, tail, w, win, n, a, DH, QK, N)
    fr.conv_tree_ref(raw, tail, w, win, n, b, DH, QK, N)
    # the same arithmetic; the compiler may contract the taps differently, so a value can round to the
    # neighbouring bf16 before the q/k norm (the reference rounds the conv output), nothing more
    assert torch.allclose(a, b, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("L,Hkv,S,D,d", [(0, 4, 64, 256, 1), (100, 4, 300, 256, 16), (7, 2, 200, 128, 64),
                                         (140000, 4, 140100, 256, 8)], ids=str)
def test_kv_commit_equals_its_reference(L, Hkv, S, D, d):
    from tandem_core.ops import fused_ref as fr
    from tandem_core.ops import triton_fused as tf

    dev = "cuda"
    layers = 16 if S > 100000 else 3          # 16 x 4 x 140K x 256: offsets past 2**31 elements (int64 needed)
    K0 = torch.randn(layers, Hkv, S, D, device=dev).bfloat16()
    V0 = torch.randn(layers, Hkv, S, D, device=dev).bfloat16()
    path = torch.tensor(sorted(__import__("random").Random(d).sample(range(d + 20), d)), dtype=torch.int32,
                        device=dev)
    meta = torch.tensor([L, d + 20], dtype=torch.int32, device=dev)
    dd = torch.tensor([d], dtype=torch.int32, device=dev)
    K1, V1, K2, V2 = K0.clone(), V0.clone(), K0.clone(), V0.clone()
    tf.kv_commit(K1, V1, meta, path, dd)
    fr.kv_commit_ref(K2, V2, meta, path, dd)
    assert torch.equal(K1, K2) and torch.equal(V1, V2)


@pytest.mark.parametrize("N,hq,hkv,D,L", [(1, 24, 4, 256, 4096), (16, 24, 4, 256, 700), (64, 8, 2, 128, 33),
                                          (5, 16, 16, 64, 0)], ids=str)
def test_tree_attention_equals_its_reference(N, hq, hkv, D, L):
    from tandem_core.ops import fused_ref as fr
    from tandem_core.ops import triton_attention as ta
    from test_fused_ref import ancestors

    dev = "cuda"
    parents = _tree(N, N + L)
    cap = L + 128 + 8
    q = torch.randn(N, hq * D, device=dev).bfloat16()
    raw = torch.randn(N, 2 * hq * D, device=dev).bfloat16()
    K = torch.randn(hkv, cap, D, device=dev).bfloat16()
    V = torch.randn(hkv, cap, D, device=dev).bfloat16()
    from tandem_core.testing.trees import path_to

    pos = torch.tensor([L + len(path_to(parents, i)) - 1 for i in range(N)], dtype=torch.int32, device=dev)
    anc = ancestors(parents).to(dev)
    meta = torch.tensor([L, N], dtype=torch.int32, device=dev)
    scratch = ta.AttnScratch(N, hq, D, cap, torch.device(dev))
    a = torch.zeros(N, hq * D, device=dev, dtype=torch.bfloat16)
    b = torch.zeros(N, hq * D, device=dev, dtype=torch.bfloat16)
    ta.tree_attention(q, raw, K, V, meta, pos, anc, scratch, a, hq=hq, hkv=hkv, head_dim=D, scale=D ** -0.5, rows=N)
    fr.tree_attention_ref(q, raw, K, V, meta, pos, anc, None, b, hq=hq, hkv=hkv, head_dim=D, scale=D ** -0.5,
                          rows=N)
    assert rel(a, b) < 2e-2


def test_a_capture_survives_old_graphs_left_in_reference_cycles():
    """Earlier engines' graphs held in reference cycles are collected before the capture, never inside it (a
    CUDAGraph destroyed on the capturing thread invalidates a thread-local capture)."""
    import gc

    from tandem_core.engine.runner import graph_capture

    x = torch.ones(64, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(3):
        old = torch.cuda.CUDAGraph()
        with graph_capture(old, stream, capture_error_mode="thread_local"):
            x.mul_(1.0)
        cycle: list = [old]
        cycle.append(cycle)                        # only the cyclic collector frees it
        del old, cycle
    g = torch.cuda.CUDAGraph()
    with graph_capture(g, stream, capture_error_mode="thread_local"):
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    assert gc.isenabled() and torch.equal(y, x * 2)


def test_pinned_copies_lock_their_own_bytes_not_a_power_of_two():
    """A snapshot copy of 80 MiB is page-locked in place (exact size, freed with it), not a 128 MiB block of the
    caching host allocator."""
    import re
    from pathlib import Path

    from tandem_core.state import copy_to

    def rss() -> int:
        return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10

    src = torch.randn(80 << 18, device="cuda")                   # 80 MiB of fp32
    before = rss()
    host = copy_to(src, "cpu", pin=True)
    grew = rss() - before
    assert host.is_pinned() and torch.equal(host.cuda(non_blocking=True), src)
    assert grew < 100 << 20, f"{grew >> 20} MiB resident for an 80 MiB copy"
    del host
    assert rss() - before < 20 << 20                             # given back, not cached
