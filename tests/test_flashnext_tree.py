"""The qwen4_exp tree verify and commit, bit for bit (``torch.equal``) against the model's own decode step
(which test_flashnext_model.py checks against transformers).

- every verified row (logits, hidden, every capture point) of chains of every width and of random trees
  (several roots, eos tokens inside, paths deeper than the PLE conv's 9-token window and across QSA blocks)
  equals the decode row after committing the node's path;
- ``commit`` leaves every section and the views' rows decode leaves; ``replay`` of kept commits from the
  sections put back equals decoding those tokens;
- the MoE's rows do not depend on which other rows share an expert.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_flashnext import (  # noqa: F401  (fixtures)
    EOS, flashnext_ckpts, load_model, prompt, one_thread)

from tandem_core import ops
from tandem_flashnext.blocks import moe
from tandem_flashnext.model import FlashNextModel
from tandem_flashnext.steps import tree_step

pytestmark = pytest.mark.usefixtures("one_thread")

START = 37           # tokens committed before each tree: 9 complete QSA blocks and one token


@pytest.fixture(scope="module")
def model(flashnext_ckpts) -> FlashNextModel:
    m = load_model(flashnext_ckpts.text.path)
    m.prefill(prompt(START, seed=11), 0)
    return m


class Snapshot:
    """The sections whole and the views' first ``n`` rows of a model, to put back."""

    def __init__(self, model: FlashNextModel, n: int) -> None:
        sections, views = model.buffers()
        self.n = n
        self.sections = {k: t.clone() for k, t in sections.items()}
        self.views = {k: t.narrow(axis, 0, n).clone() for k, (t, axis) in views.items()}

    def restore(self, model: FlashNextModel) -> None:
        sections, views = model.buffers()
        for k, t in sections.items():
            t.copy_(self.sections[k])
        for k, (t, axis) in views.items():
            t.narrow(axis, 0, self.n).copy_(self.views[k])

    def equals(self, model: FlashNextModel) -> list[str]:
        """The names of what differs from ``model``'s state (empty when every byte agrees)."""
        other = Snapshot(model, self.n)
        out = [k for k in self.sections if not torch.equal(self.sections[k], other.sections[k])]
        return out + [k for k in self.views if not torch.equal(self.views[k], other.views[k])]


def path_to(parents, i) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def decoded(model, base: Snapshot, tokens, path):
    """Decode ``path``'s tokens from ``base``: the last row's (logits, hidden, capture)."""
    base.restore(model)
    for j, node in enumerate(path):
        cap = []
        rows = model.decode(tokens[node:node + 1], base.n + j, capture=cap)
    return rows.logits[0], rows.hidden[0], cap


def random_tree(rng: random.Random, n: int) -> list[int]:
    parents = []
    for i in range(n):
        parents.append(-1 if i == 0 or rng.random() < 0.1 else rng.choice([i - 1, i - 1, rng.randrange(i)]))
    return parents


def check_tree(model, tokens: torch.Tensor, parents: list[int]) -> None:
    base = Snapshot(model, START)
    tree = tree_step(START, parents)
    cap = []
    out = model.verify(tokens, tree, capture=cap)
    for i in range(len(parents)):
        logits, hidden, dcap = decoded(model, base, tokens, path_to(parents, i))
        assert torch.equal(out.logits[i], logits), f"node {i} logits"
        assert torch.equal(out.hidden[i], hidden), f"node {i} hidden"
        for (name, rows), (dname, drow) in zip(cap, dcap):
            assert name == dname and torch.equal(rows[i], drow[0]), f"node {i}: {name}"
    base.restore(model)


@pytest.mark.parametrize("width", [1, 2, 3, 5, 12, 17])
def test_a_chain_of_every_width_equals_decode(model, width):
    tokens = prompt(width, seed=width + 40)
    check_tree(model, tokens, list(range(-1, width - 1)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_tree_equals_decode_of_each_path(model, seed):
    rng = random.Random(seed)
    n = 24
    parents = random_tree(rng, n)
    tokens = torch.tensor([EOS if rng.random() < 0.15 else rng.randrange(320) for _ in range(n)])
    assert max(len(path_to(parents, i)) for i in range(n)) > 1
    check_tree(model, tokens, parents)


def test_commit_leaves_the_state_decode_leaves_and_replay_redoes_it(model):
    rng = random.Random(7)
    parents = [-1] + [i - 1 for i in range(1, 14)] + [3, 14, 15, -1, 17]       # a deep chain and branches
    tokens = torch.tensor([rng.randrange(320) for _ in parents])
    tokens[[2, 15]] = EOS
    base = Snapshot(model, START)
    # 14 tokens: past the 9-token window
    path = path_to(parents, 13)
    tree = tree_step(START, parents)
    model.verify(tokens, tree)
    kept = model.commit(tree, path)
    committed = Snapshot(model, START + len(path))
    decoded(model, base, tokens, path)
    assert committed.equals(model) == []

    # a second tree on the committed path, then taking back to 3 + 5 of the 14 + 2 tokens by replay
    committed.restore(model)
    tree2 = tree_step(START + len(path), [-1, 0, -1])
    model.verify(tokens[:3], tree2)
    kept2 = model.commit(tree2, [0, 1])
    for keep in (0, 5, 14, 16):
        base.restore(model)
        rows = model.replay([kept, kept2], keep)
        assert (rows is None) == (keep == 0) and (keep == 0 or rows.count == keep)
        after = Snapshot(model, START)                                          # sections only compared below
        toks = torch.cat([tokens[path], tokens[:2]])[:keep]
        base.restore(model)
        for j in range(keep):
            model.decode(toks[j:j + 1], START + j)
        want = Snapshot(model, START)
        assert [k for k in want.sections if not torch.equal(want.sections[k], after.sections[k])] == [], keep
    base.restore(model)


def test_a_commit_needs_the_last_verified_tree(model):
    tree = tree_step(START, [-1, 0])
    model.verify(torch.tensor([3, 4]), tree)
    with pytest.raises(RuntimeError, match="not the last one verified"):
        model.commit(tree_step(START, [-1]), [0])
    assert model.commit(tree, []) is None


def test_an_expert_row_does_not_depend_on_the_rows_sharing_it(model):
    """Rows routed to one expert are computed as if each were alone: the same bits in groups of 1 and 6."""
    rows_op = ops.get("linear_rows")
    op = {name: ops.get(name) for name in ("softmax", "silu", "sigmoid")}
    w = model.w.layers[0].moe
    x = torch.randn(6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    together = moe(op, rows_op, x, w, model.cfg.num_experts_per_tok)
    for i in range(6):
        assert torch.equal(together[i], moe(op, rows_op, x[i:i + 1], w, model.cfg.num_experts_per_tok)[0])
    probs = op["softmax"](x @ w.router.dense().t())
    assert len(torch.unique(probs.topk(2).indices)) < 12, "some rows share an expert"
