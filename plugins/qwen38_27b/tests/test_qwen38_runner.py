"""The Qwen3.8 runners under the core's sequence engine, on the tiny re-randomised checkpoints (fp32 unless named).

The reference runner passes the runner conformance suite (``tandem_core.testing.conformance``: chains and
trees of every width bit for bit against plain decode, commits, rejected branches, pending tokens and
rollbacks, resume at an anchor, traces, taps, oracle speculation, the self-check) in fp32, and a random tree
in bf16 is its decode rows too; the tree ops and the row-invariant ops it relies on are checked on their own
below. The CUDA runner runs the
same suite on a CUDA device (``test_qwen38_gpu.py``).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_qwen38 import load_engine, prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core import ops
from tandem_core.linear import DenseLinear
from tandem_core.ops.conv import conv_tail
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree, random_tree

VOCAB = 320


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's tensors are far below ATen's grain, so the thread count changes no arithmetic here;
    one thread keeps the many small calls fast on a busy 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def qwen38_case(path, dtype: str = "fp32") -> RunnerCase:
    def build(max_context: int = 256, max_tree: int = 64):
        from tandem_qwen38.serving import build_engine

        base = load_engine(path, dtype=dtype, max_context=8).runner
        return build_engine(base.cfg, base.w, max_context, 512, max_tree=max_tree)

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


class TestQwen38Runner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, qwen38_ckpts):
        return qwen38_case(qwen38_ckpts.text.path)

    def test_the_reference_runner_verifies_through_the_tree_ops(self, eng):
        names = {n for n in eng.manifest().extra["ops"]}
        assert {"linear_rows", "gdn_tree", "attention_tree", "causal_conv_tree"} <= names
        assert set(eng.state.sections) == {"gdn.S", "gdn.conv"} and set(eng.state.views) == {"K", "V"}


@pytest.mark.parametrize("dtype", ["bf16"])
def test_tree_rows_equal_decode_rows_in_bf16(qwen38_ckpts, dtype):
    case = qwen38_case(qwen38_ckpts.text.path, dtype)
    eng, twin = case.build(max_context=128), case.build(max_context=128)
    twin.forward(prompt(17, VOCAB, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(11), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])


# -- the ops on their own -------------------------------------------------------------------------------
@pytest.mark.parametrize("K,N", [(64, 160), (64, 4), (96, 64), (17, 33), (1024, 3072)], ids=str)
def test_linear_rows_gives_every_row_the_decode_steps_bits(K, N):
    g = torch.Generator().manual_seed(K + N)
    lin = DenseLinear(torch.randn(N, K, generator=g) / K ** 0.5)
    X = torch.randn(64, K, generator=g)
    fn = ops.get("linear_rows", "cpu")
    alone = [lin.matmul(X[i:i + 1].clone()) for i in range(64)]          # the decode step's call
    for M in (1, 2, 3, 4, 7, 64):
        got = fn(lin, X[:M])
        assert got.shape == (M, N)
        assert all(torch.equal(got[i], alone[i][0]) for i in range(M)), f"M={M}"
    buf = torch.zeros(64 * K + 3)                                          # rows that start misaligned
    odd = buf[3:].view(64, K)
    odd.copy_(X)
    assert all(torch.equal(fn(lin, odd[i:i + 1])[0], alone[i][0]) for i in range(0, 64, 9))
    with pytest.raises(ValueError, match="must be"):
        fn(lin, X[0])


@pytest.mark.parametrize("shape", [(64,), (4, 32), (4, 24), (1024,), (8, 128), (3072,)], ids=str)
def test_norms_and_activations_are_row_invariant(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(64, *shape, generator=g) * 3
    gate = torch.randn(64, *shape, generator=g)
    w = torch.randn(shape[-1], generator=g) * 0.2
    cases = {
        "rms_norm_1p": lambda t, z: ops.get("rms_norm_1p")(t, w, 1e-6),
        "gated_rms_norm": lambda t, z: ops.get("gated_rms_norm")(t, z, w, 1e-6),
        "l2_norm": lambda t, z: ops.get("l2_norm")(t),
        "silu": lambda t, z: ops.get("silu")(t),
        "sigmoid": lambda t, z: ops.get("sigmoid")(t),
        "softplus": lambda t, z: ops.get("softplus")(t),
    }
    for name, fn in cases.items():
        alone = [fn(x[i:i + 1].clone(), gate[i:i + 1].clone()) for i in range(64)]
        for M in (2, 3, 4, 17, 64):
            got = fn(x[:M], gate[:M])
            assert all(torch.equal(got[i], alone[i][0]) for i in range(M)), f"{name}, M={M}"


def test_tree_ops_equal_their_one_token_calls_along_each_path():
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    tokens, parents = random_tree(rng, 30, VOCAB)
    N, C, Kc = len(tokens), 40, 4
    # the short conv: node i's row is causal_conv's one-row call with the tail its path leaves
    x = torch.randn(N, C, generator=g)
    tail0 = torch.randn(C, Kc - 1, generator=g)
    wconv = torch.randn(C, Kc, generator=g)
    conv, conv_tree = ops.get("causal_conv"), ops.get("causal_conv_tree")
    y = conv_tree(x, tail0, wconv, torch.tensor(parents))
    tails = []
    for i, p in enumerate(parents):
        yi, ti = conv(x[i:i + 1], tail0 if p < 0 else tails[p], wconv)
        tails.append(ti)
        assert torch.equal(y[i], yi[0]), f"conv node {i}"
        path = path_to(parents, i)
        assert torch.equal(conv_tail(tail0, x[path]), ti), f"conv tail after node {i}"
    # the gated delta rule: node i from its parent's state
    hk, hv, dk, dv = 2, 4, 8, 6
    q = ops.get("l2_norm")(torch.randn(N, hk, dk, generator=g))
    k = ops.get("l2_norm")(torch.randn(N, hk, dk, generator=g))
    v = torch.randn(N, hv, dv, generator=g)
    decay = -torch.rand(N, hv, generator=g)
    beta = torch.rand(N, hv, generator=g)
    S0 = torch.randn(hv, dk, dv, generator=g)
    before = S0.clone()
    o = ops.get("gdn_tree")(q, k, v, decay, beta, S0, torch.tensor(parents), scale=0.3)
    assert torch.equal(S0, before)
    states = []
    for i, p in enumerate(parents):
        oi, Si = ops.get("gdn_recurrent")(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1],
                                          S0 if p < 0 else states[p], scale=0.3)
        states.append(Si)
        assert torch.equal(o[i], oi[0]), f"gated delta rule node {i}"
    # attention: node i over the sequence and its ancestors, laid out as the decode step's cache
    hq, hkv, D, start, cap = 4, 2, 16, 9, 64
    qa = torch.randn(N, hq, D, generator=g)
    ka, va = torch.randn(N, hkv, D, generator=g), torch.randn(N, hkv, D, generator=g)
    Kb, Vb = torch.randn(hkv, cap, D, generator=g), torch.randn(hkv, cap, D, generator=g)
    seq = (Kb[:, :start].clone(), Vb[:, :start].clone())
    oa = ops.get("attention_tree")(qa, ka, va, Kb, Vb, start, torch.tensor(parents), 0.25)
    assert torch.equal(Kb[:, :start], seq[0]) and torch.equal(Vb[:, :start], seq[1])
    for i in range(N):
        path = path_to(parents, i)
        Kd = torch.zeros(hkv, cap, D)
        Vd = torch.zeros(hkv, cap, D)
        Kd[:, :start], Vd[:, :start] = seq
        Kd[:, start:start + len(path)] = ka[path].transpose(0, 1)
        Vd[:, start:start + len(path)] = va[path].transpose(0, 1)
        end = start + len(path)
        mask = torch.ones(1, end, dtype=torch.bool)
        want = ops.get("attention")(qa[i:i + 1], Kd[:, :end], Vd[:, :end], mask, 0.25)
        assert torch.equal(oa[i], want[0]), f"attention node {i}"
    with pytest.raises(ValueError, match="exceed the cache"):
        ops.get("attention_tree")(qa, ka, va, Kb[:, :12], Vb[:, :12], 10, torch.tensor(parents), 0.25)


def test_the_recurrent_rule_over_T_tokens_is_T_one_token_calls():
    """What gdn_tree's runs and the commit of a path rely on (tandem_core.ops.gdn)."""
    g = torch.Generator().manual_seed(8)
    T, hk, hv, dk, dv = 19, 2, 4, 16, 24
    q = ops.get("l2_norm")(torch.randn(T, hk, dk, generator=g))
    k = ops.get("l2_norm")(torch.randn(T, hk, dk, generator=g))
    v = torch.randn(T, hv, dv, generator=g)
    decay, beta = -torch.rand(T, hv, generator=g), torch.rand(T, hv, generator=g)
    S = torch.randn(hv, dk, dv, generator=g)
    rule = ops.get("gdn_recurrent")
    o, S_T = rule(q, k, v, decay, beta, S, scale=0.25)
    for t in range(T):
        o_t, S = rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], S, scale=0.25)
        assert torch.equal(o[t], o_t[0]), f"token {t}"
    assert torch.equal(S_T, S)
