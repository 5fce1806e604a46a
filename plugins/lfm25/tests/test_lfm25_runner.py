"""The LFM2 runner under the core's sequence engine, on the tiny re-randomised checkpoints (fp32 unless named).

For the mixture of experts (with its expert bias) and the dense checkpoint the runner passes the runner conformance suite (``tandem_core.testing.conformance``: chains and trees of
every width bit for bit against plain decode, commits, rejected branches, pending tokens and rollbacks,
resume at an anchor, traces, taps, oracle speculation, the self-check). A random tree in bf16 is its decode
rows too. The experts' grouping is checked on its own: a row's result does not depend on which other rows
share its experts, and a verify runs each selected expert once.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_lfm25 import VOCAB, lfm25_ckpts, load_engine, load_weights_of, prompt  # noqa: F401  (fixture)

from tandem_core.ops.act import sigmoid, silu
from tandem_core.ops.rows import linear_rows
from tandem_core.testing.conformance import RunnerCase, RunnerContract, check_a_batched_linear_fails_at_width_two
from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree, random_tree
from tandem_lfm25 import moe


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's tensors are far below ATen's grain, so the thread count changes no arithmetic here;
    one thread keeps the many small calls fast on a busy 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lfm25_case(path, dtype: str = "fp32") -> RunnerCase:
    cfg, weights = load_weights_of(path, dtype)

    def build(max_context: int = 256, max_tree: int = 64):
        from tandem_lfm25.serving import build_engine

        return build_engine(cfg, weights, max_context, 512, max_tree=max_tree)

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


class TestLfm2MoeRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return lfm25_case(lfm25_ckpts.moe.path)

    def test_the_runner_verifies_through_the_tree_ops_and_holds_its_state(self, eng):
        names = set(eng.manifest().extra["ops"])
        assert {"linear_rows", "attention_tree", "causal_conv_tree"} <= names
        assert set(eng.state.sections) == {"conv"} and set(eng.state.views) == {"K", "V"}
        parts = {p.name for p in eng.memory_parts()}
        assert {"weights", "conv", "kv"} <= parts


class TestLfm2DenseRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return lfm25_case(lfm25_ckpts.dense.path)


def test_a_batched_linear_kernel_fails_the_self_check_at_width_two(lfm25_ckpts):
    case = lfm25_case(lfm25_ckpts.moe.path)
    lin = case.build(max_context=8).runner.w.layers[0].mixer.in_proj
    check_a_batched_linear_fails_at_width_two(lambda: case.build(max_context=256), lin.matmul, lin.shape[1],
                                              "layer 0 conv mixer")


def test_tree_rows_equal_decode_rows_in_bf16(lfm25_ckpts):
    case = lfm25_case(lfm25_ckpts.moe.path, "bf16")
    eng, twin = case.build(max_context=128), case.build(max_context=128)
    twin.forward(prompt(17, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(11), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])


def _moe_layer(path):
    cfg, weights = load_weights_of(path)
    return cfg, weights.layers[cfg.num_dense_layers].ffn


def test_an_experts_rows_do_not_depend_on_who_shares_the_group(lfm25_ckpts):
    cfg, w = _moe_layer(lfm25_ckpts.moe.path)
    x = torch.randn(24, cfg.hidden_size, generator=torch.Generator().manual_seed(3))

    def routes(rows: torch.Tensor) -> moe.Routes:
        return moe.route(linear_rows(w.router, rows), w.expert_bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         cfg.routed_scaling_factor, sigmoid)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return moe.experts_grouped(rows, routes(rows), w.gate_up, w.down, linear_rows, silu)

    together = run(x)
    assert max(len(rows) for _, rows, _ in moe.groups(routes(x))) > 1     # groups really hold several rows
    for i in range(x.shape[0]):
        assert torch.equal(run(x[i:i + 1])[0], together[i]), f"row {i}"
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(4))
    assert torch.equal(run(x[perm]), together[perm])


def test_a_verify_runs_each_selected_expert_once_over_the_union(lfm25_ckpts, monkeypatch):
    cfg, w = _moe_layer(lfm25_ckpts.moe.path)
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    r = moe.route(linear_rows(w.router, x), w.expert_bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                  cfg.routed_scaling_factor, sigmoid)
    calls: list[int] = []
    index = {id(lin): e for e, lin in enumerate(w.gate_up)}

    def counting(lin, rows):
        if id(lin) in index:
            calls.append(index[id(lin)])
        return linear_rows(lin, rows)

    moe.experts_grouped(x, r, w.gate_up, w.down, counting, silu)
    assert calls == sorted(set(r.experts.reshape(-1).tolist()))          # the union, each once, in order
    assert len(calls) < 16 * cfg.num_experts_per_tok


def test_the_expert_bias_moves_the_selection_only(lfm25_ckpts):
    cfg, w = _moe_layer(lfm25_ckpts.moe.path)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = w.router.matmul(x)
    with_bias = moe.route(logits, w.expert_bias, 3, True, 1.5, sigmoid)
    without = moe.route(logits, None, 3, True, 1.5, sigmoid)
    assert not torch.equal(with_bias.experts, without.experts)            # the bias changes some selection
    p = sigmoid(logits)
    same = (with_bias.experts == without.experts).all(-1)
    assert same.any() and torch.equal(with_bias.weights[same], without.weights[same])
    picked = p.gather(1, with_bias.experts)                               # weights are p, not p + bias
    assert torch.allclose(with_bias.weights, picked / (picked.sum(-1, keepdim=True) + 1e-6) * 1.5)
