"""What the qwen4_exp runner's tree verify must get right beyond the runner conformance suite (which
``test_flashnext_runner.py`` runs): every state kind read from a node's own path, shown on trees where each
kind matters, bit for bit (``torch.equal``) against plain decode of each node's path:

- end-of-sequence tokens inside the tree and in the committed context (the n-gram segments);
- paths deeper than the PLE conv's 9-token window and across the QSA blocks (the indexer pools tree nodes);
- every capture point of every node (the self-check's layer names), and the commit of the deepest path;
- the MoE's rows do not depend on which other rows share an expert.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_flashnext import EOS, flashnext_ckpts, load_engine, one_thread, prompt  # noqa: F401  (fixtures)

from tandem_core import ops
from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree
from tandem_flashnext.blocks import moe

pytestmark = pytest.mark.usefixtures("one_thread")

START = 37           # tokens committed before each tree: 9 complete QSA blocks and one token


@pytest.fixture(scope="module")
def engines(flashnext_ckpts):
    eng, twin = load_engine(flashnext_ckpts.text.path), load_engine(flashnext_ckpts.text.path)
    twin.forward(prompt(START, seed=11))
    return eng, twin, twin.state.clone()


def deep_tree(seed: int) -> tuple[list[int], list[int]]:
    """A 14-node chain (past the 9-token PLE window, over three QSA block boundaries) with branches off it,
    eos tokens on and off the chain."""
    rng = random.Random(seed)
    parents = [-1] + list(range(13)) + [3, 14, 15, -1, 17, 8, 19]
    tokens = [EOS if rng.random() < 0.2 else rng.randrange(320) for _ in parents]
    tokens[2] = tokens[15] = EOS
    return tokens, parents


@pytest.mark.parametrize("seed", [0, 1])
def test_every_node_and_capture_point_equals_decode_of_its_path(engines, seed):
    eng, twin, base = engines
    tokens, parents = deep_tree(seed)
    want, hidden, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    trace = eng.trace_tree(tokens, parents)
    for i in range(len(tokens)):
        assert torch.equal(trace.logits[i], want[i]), f"node {i}"
        path = path_to(parents, i)
        twin.state.restore(base)
        for t in path[:-1]:
            twin.forward([tokens[t]])
        point = twin.trace_forward([tokens[i]])
        for name, rows, decoded in zip(trace.points, trace.rows, point.rows):
            assert torch.equal(rows[i], decoded[0]), f"node {i}: {name}"
    assert torch.equal(eng.hidden_post_norm(), hidden)
    deepest = max(range(len(tokens)), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, deepest))
    assert_same_state(eng.state, states[deepest], "after committing the deepest path")


def test_an_expert_row_does_not_depend_on_the_rows_sharing_it(engines):
    """Rows routed to one expert are computed as if each were alone: the same bits in groups of 1 and 6."""
    runner = engines[0].runner
    rows_op = ops.get("linear_rows")
    op = {name: ops.get(name) for name in ("softmax", "silu", "sigmoid")}
    w, k = runner.w.layers[0].moe, runner.cfg.num_experts_per_tok
    x = torch.randn(6, runner.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    together = moe(op, rows_op, x, w, k)
    for i in range(6):
        assert torch.equal(together[i], moe(op, rows_op, x[i:i + 1], w, k)[0])
    experts = op["softmax"](x @ w.router.dense().t()).topk(k).indices
    assert len(torch.unique(experts)) < 6 * k, "some rows share an expert"
