"""The qwen3_5 engine's tree verbs on the tiny re-randomised checkpoints (fp32 unless named).

What is proved, bit for bit (``torch.equal``) against plain decode (``forward`` of one token at a time,
the engine's own decode step, which test_qwen38_model.py checks against transformers):

- every verified row of chains of every width 1..max_tree and of random trees (distractors included,
  each against plain decode of its own path) equals the decode step's row;
- ``commit_tree`` leaves the state (sections whole, views up to length) plain decode leaves; rejected
  branches leave no trace;
- ``trim_pending`` / ``rollback_to`` / ``discard_pending`` / ``settle`` / ``resume_at`` semantics;
- greedy decoding driven by an oracle drafter (the true continuation plus wrong branches) equals plain
  greedy token for token on 20 prompts, repetitive ones included;
- the tree ops and the row-invariant ops on their own (``tandem_core.ops``).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_qwen38 import load_engine, prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tree_checks import (Recorded, assert_same_state, check_chains, check_forward_settles,  # noqa: E402
                         check_oracle_speculation, check_random_tree, check_rejected_branches,
                         check_second_tree, check_trim_pending, path_to, plain_rows_of_tree, random_tree)
from tandem_core import ops
from tandem_core.engine import ResumableEngine, TreeEngine
from tandem_core.linear import DenseLinear
from tandem_core.ops.conv import conv_tail
from tandem_core.state import StateMismatch

VOCAB = 320


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's tensors are far below ATen's grain, so the thread count changes no arithmetic here;
    one thread keeps the many small calls fast on a busy 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def eng(qwen38_ckpts):
    return load_engine(qwen38_ckpts.text.path, max_context=256)


@pytest.fixture(scope="module")
def twin(eng):
    """A second engine over the same weights: the plain-decode reference."""
    return type(eng)(eng.cfg, eng.w, max_context=256)


@pytest.fixture(scope="module")
def rec(twin):
    return Recorded(twin, prompt(20, VOCAB, seed=21), 68)


# -- the engine contract ------------------------------------------------------------------------------
def test_the_engine_offers_the_tree_and_resume_verbs(eng):
    assert isinstance(eng, TreeEngine) and isinstance(eng, ResumableEngine)
    assert eng.caps.tree and eng.caps.resume and eng.caps.recurrent and eng.caps.max_tree == 64
    names = {n for n in eng.manifest().extra["ops"]}
    assert {"linear_rows", "gdn_tree", "attention_tree", "causal_conv_tree"} <= names


def test_chains_of_every_width_equal_the_decode_rows_and_commit_its_state(eng, rec):
    check_chains(eng, rec, VOCAB)


@pytest.mark.parametrize("size,seed", [(1, 0), (2, 1), (5, 2), (13, 3), (33, 4), (64, 5)])
def test_random_trees_equal_plain_decode_of_every_nodes_path(eng, twin, rec, size, seed):
    check_random_tree(eng, twin, rec, size, seed, VOCAB)


def test_rejected_branches_leave_no_trace(eng, rec):
    check_rejected_branches(eng, rec, VOCAB)


def test_a_second_tree_replaces_the_first_and_discard_drops_it(eng, rec):
    check_second_tree(eng, rec)


def test_verify_and_commit_refuse_what_they_cannot_do(eng, rec):
    eng.state.restore(rec.state_at(0))
    with pytest.raises(ValueError, match="exceed max_tree 64"):
        eng.forward_block(list(range(65)))
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        eng.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="3 tokens but 2 parents"):
        eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="token id 320"):
        eng.forward_block([1, 320])
    with pytest.raises(ValueError, match="no tokens"):
        eng.forward_block([])
    eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, -1]))
    with pytest.raises(ValueError, match=r"path\[0\] = 7 is not a node"):
        eng.commit_tree([7])
    with pytest.raises(ValueError, match=r"path\[1\] = node 2 has parent -1, not 0"):
        eng.commit_tree([0, 2])
    small = type(eng)(eng.cfg, eng.w, max_context=24, max_tree=8)
    small.forward(list(range(20)))
    with pytest.raises(ValueError, match="exceed max_context 24"):
        small.forward_block([1, 2, 3, 4, 5])
    assert small.kv.length == 20
    small.forward_tree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, -1, -1, 0]))   # depth 2 fits


def test_trim_pending_and_rollback_replay_plain_decode(eng, rec):
    base = check_trim_pending(eng, rec)
    with pytest.raises(ValueError, match=f"only pending tokens can be taken back \\(positions {base + 5}"):
        eng.rollback_to(base + 4)
    with pytest.raises(ValueError, match="holds"):
        eng.rollback_to(base + 13)
    eng.rollback_to(base + 5)                                   # every pending token
    assert_same_state(eng.state, rec.state_at(5), "after rolling every pending token back")
    eng.forward_block(rec.tokens[5:9])
    eng.commit_tree(range(4))
    eng.settle()
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    with pytest.raises(ValueError, match="only pending tokens"):
        eng.rollback_to(base + 8)
    eng.rollback_to(base + 9)                                   # the length itself: nothing to do
    eng.trim_pending(0)
    assert_same_state(eng.state, rec.state_at(9))


def test_forward_settles_and_a_state_restore_forgets_pending_and_tree(eng, rec):
    check_forward_settles(eng, rec)


def test_resume_at_an_anchor_then_forward_equals_the_plain_run(eng, rec):
    anchor = rec.state_at(6)                                    # the sections after exactly 6 tokens
    eng.state.restore(rec.state_at(0))
    eng.forward_block(rec.tokens[:12])
    eng.commit_tree(range(12))                                  # the views hold 12 tokens' rows
    eng.resume_at(anchor.length, {k: v.clone() for k, v in anchor.sections.items()})
    assert eng.kv.length == anchor.length
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    for j in range(6, 10):
        assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
    out = eng.forward_block(rec.tokens[10:14])
    assert all(torch.equal(out.logits[i], rec.rows[10 + i]) for i in range(4))
    eng.commit_tree(range(4))
    assert_same_state(eng.state, rec.state_at(14), "after resuming and verifying on")
    eng.resume_at(eng.kv.length)                                 # the caches set the state and say so
    with pytest.raises(StateMismatch, match="needs the recurrent sections"):
        eng.resume_at(eng.kv.length - 1)


@pytest.mark.parametrize("dtype", ["bf16"])
def test_tree_rows_equal_decode_rows_in_bf16(qwen38_ckpts, dtype):
    eng = load_engine(qwen38_ckpts.text.path, dtype=dtype, max_context=128)
    twin = type(eng)(eng.cfg, eng.w, max_context=128)
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


# -- speculation with an oracle drafter ----------------------------------------------------------------
PROMPTS = [prompt(8 + 3 * i, VOCAB, seed=100 + i).tolist() for i in range(14)] + [
    [5, 6, 7] * 8, [9] * 20, [1, 2] * 11 + [1], [40, 41, 42, 43, 44] * 5, [3] * 3 + [300] * 10, [7, 7, 8] * 9,
]


def test_greedy_speculation_with_an_oracle_drafter_equals_plain_greedy(eng, twin):
    assert len(PROMPTS) == 20
    check_oracle_speculation(eng, twin, PROMPTS, VOCAB)


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
