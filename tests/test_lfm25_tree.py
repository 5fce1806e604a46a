"""The LFM2 runner's verify and commit: bit for bit the decode step's rows and state (row invariance).

A recorded greedy decode (prompt, then one token a step) is the reference. Chains of every width and
random trees holding the recorded continuation among distractor branches are verified from the
prompt's state: the path's rows must equal the recorded decode rows with ``torch.equal`` (logits, hidden
rows, taps and every capture point), and after committing the path the conv tails and the K/V rows must
equal the decode's. The experts' grouping is checked on its own: a row's result must not depend on which
other rows share its experts.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_lfm25 import lfm25_ckpts, load_runner, prompt, tree  # noqa: F401  (fixture)

STEPS = 12
PROMPT_LEN = 20


class Recorded:
    """A greedy decode after a prompt: per step its logits, hidden row and capture, and the conv tails
    after it; the K/V buffers after the last step."""

    def __init__(self, runner, ids: torch.Tensor) -> None:
        self.prompt = ids
        runner.reset()
        logits = runner.prefill(ids, 0, logits="last").logits
        self.conv0 = runner.buffers()[0]["conv"].clone()
        self.tokens, self.logits, self.hidden, self.captures, self.conv = [], [], [], [], []
        for n in range(PROMPT_LEN, PROMPT_LEN + STEPS):
            tok = int(logits[-1].argmax())
            capture: list = []
            rows = runner.decode(torch.tensor([tok]), n, capture=capture)
            logits = rows.logits
            self.tokens.append(tok)
            self.logits.append(rows.logits[0])
            self.hidden.append(rows.hidden[0])
            self.captures.append(capture)
            self.conv.append(runner.buffers()[0]["conv"].clone())
        _, views = runner.buffers()
        self.K = views["K"].head(PROMPT_LEN + STEPS).clone()
        self.V = views["V"].head(PROMPT_LEN + STEPS).clone()

    def restore(self, runner, committed: int) -> None:
        """The runner's state after the prompt and the first ``committed`` decode steps."""
        sections, views = runner.buffers()
        sections["conv"].copy_(self.conv0 if committed == 0 else self.conv[committed - 1])
        n = PROMPT_LEN + committed
        views["K"].head(n).copy_(self.K[:, :, :n])
        views["V"].head(n).copy_(self.V[:, :, :n])


@pytest.fixture(scope="module", params=["moe", "dense", "moe_untied"])
def recorded(request, lfm25_ckpts):
    path = getattr(lfm25_ckpts, request.param).path
    runner = load_runner(path, max_context=64)
    return path, Recorded(runner, prompt(PROMPT_LEN, seed=17))


def _assert_rows(rows, rec: Recorded, nodes: list[int], steps: list[int], what: str) -> None:
    for node, step in zip(nodes, steps):
        assert torch.equal(rows.logits[node], rec.logits[step]), f"{what}: logits of node {node} (step {step})"
        assert torch.equal(rows.hidden[node], rec.hidden[step]), f"{what}: hidden of node {node}"


def _assert_state(runner, rec: Recorded, committed: int, what: str) -> None:
    sections, views = runner.buffers()
    assert torch.equal(sections["conv"], rec.conv[committed - 1]), f"{what}: conv tails"
    n = PROMPT_LEN + committed
    assert torch.equal(views["K"].head(n), rec.K[:, :, :n]), f"{what}: K rows"
    assert torch.equal(views["V"].head(n), rec.V[:, :, :n]), f"{what}: V rows"


def test_chains_of_every_width_equal_decode_and_commit_to_its_state(recorded):
    path, rec = recorded
    runner = load_runner(path, max_context=64)
    for start in (0, 3):
        for width in range(1, STEPS - start + 1):
            rec.restore(runner, start)
            t = tree(PROMPT_LEN + start, list(range(-1, width - 1)))
            capture: list = []
            rows = runner.verify(torch.tensor(rec.tokens[start:start + width]), t, capture=capture)
            steps = list(range(start, start + width))
            _assert_rows(rows, rec, list(range(width)), steps, f"chain {width} at {start}")
            for j, (name, got) in enumerate(capture):                    # every layer's rows, decode's capture
                for node, step in enumerate(steps):
                    want_name, want = rec.captures[step][j]
                    assert name == want_name and torch.equal(got[node], want[0]), f"{name}, node {node}"
            kept = runner.commit(t, list(range(width)))
            _assert_state(runner, rec, start + width, f"chain {width} at {start}")
            assert kept is not None and kept.count == width


def _random_tree(rng: random.Random, rec: Recorded, start: int, length: int, extra: int, vocab: int):
    """A tree holding the recorded path of ``length`` nodes after ``start`` steps among ``extra``
    distractors, shuffled (parents before children); returns (tokens, parents, path)."""
    nodes = [(-1, rec.tokens[start], True)]                               # (parent, token, on the path)
    for d in range(1, length):
        nodes.append((d - 1, rec.tokens[start + d], True))
    for _ in range(extra):
        parent = rng.randrange(-1, len(nodes))
        tok = rng.randrange(vocab)
        if parent + 1 < length and parent >= -1 and tok == rec.tokens[start + parent + 1]:
            tok = (tok + 1) % vocab                                       # a distractor never repeats the path
        nodes.append((parent, tok, False))
    # shuffle, keeping parents before children
    order, placed = [], set()
    pending = list(range(len(nodes)))
    rng.shuffle(pending)
    while pending:
        for i in list(pending):
            if nodes[i][0] < 0 or nodes[i][0] in placed:
                order.append(i)
                placed.add(i)
                pending.remove(i)
    where = {old: new for new, old in enumerate(order)}
    parents = [-1 if nodes[i][0] < 0 else where[nodes[i][0]] for i in order]
    tokens = [nodes[i][1] for i in order]
    return tokens, parents, [where[i] for i in range(length)]


def test_random_trees_equal_decode_on_the_path_and_commit_to_its_state(recorded):
    path, rec = recorded
    runner = load_runner(path, max_context=64)
    rng = random.Random(7)
    vocab = runner.cfg.vocab_size
    for trial in range(10):
        start = rng.randrange(0, STEPS - 1)
        length = rng.randrange(1, STEPS - start + 1)
        tokens, parents, on_path = _random_tree(rng, rec, start, length, rng.randrange(1, 14), vocab)
        rec.restore(runner, start)
        t = tree(PROMPT_LEN + start, parents)
        rows = runner.verify(torch.tensor(tokens), t)
        _assert_rows(rows, rec, on_path, list(range(start, start + length)), f"tree {trial}")
        runner.commit(t, on_path)
        _assert_state(runner, rec, start + length, f"tree {trial}")


def test_replay_from_the_settle_point_equals_decode(recorded):
    path, rec = recorded
    runner = load_runner(path, max_context=64)
    rec.restore(runner, 0)
    settle = runner.buffers()[0]["conv"].clone()
    kept = []
    for a, b in ((0, 4), (4, 5), (5, 9)):                                 # three commits since the settle point
        t = tree(PROMPT_LEN + a, list(range(-1, b - a - 1)))
        runner.verify(torch.tensor(rec.tokens[a:b]), t)
        kept.append(runner.commit(t, list(range(b - a))))
    for n in (9, 6, 4, 1):
        runner.buffers()[0]["conv"].copy_(settle)
        record = runner.replay(kept, n)
        assert torch.equal(runner.buffers()[0]["conv"], rec.conv[n - 1]), f"replay {n}"
        assert record.count == n
    runner.buffers()[0]["conv"].copy_(settle)
    assert runner.replay(kept, 0) is None and torch.equal(runner.buffers()[0]["conv"], settle)
    with pytest.raises(ValueError, match="hold 9 tokens"):
        runner.replay(kept, 10)


def test_a_commit_needs_the_tree_verified_last(recorded):
    path, rec = recorded
    runner = load_runner(path, max_context=64)
    rec.restore(runner, 0)
    t = tree(PROMPT_LEN, [-1])
    runner.verify(torch.tensor(rec.tokens[:1]), t)
    runner.decode(torch.tensor(rec.tokens[:1]), PROMPT_LEN)               # any other call drops the verify
    with pytest.raises(RuntimeError, match="not the one this runner verified last"):
        runner.commit(t, [0])


def test_an_experts_rows_do_not_depend_on_who_shares_the_group(lfm25_ckpts):
    from tandem_core.ops.act import silu, sigmoid
    from tandem_core.ops.rows import linear_rows
    from tandem_lfm25 import moe

    runner = load_runner(lfm25_ckpts.moe.path)
    w = runner.w.layers[runner.cfg.num_dense_layers].ffn
    x = torch.randn(24, runner.cfg.hidden_size, generator=torch.Generator().manual_seed(3))

    def run(rows: torch.Tensor) -> torch.Tensor:
        routes = moe.route(linear_rows(w.router, rows), w.expert_bias, 3, True, 1.5, sigmoid)
        return moe.experts_grouped(rows, routes, w.gate_up, w.down, linear_rows, silu)

    together = run(x)
    shared = [len(rows) for _, rows, _ in moe.groups(moe.route(linear_rows(w.router, x), w.expert_bias, 3, True,
                                                               1.5, sigmoid))]
    assert max(shared) > 1                                                # groups really hold several rows
    for i in range(x.shape[0]):
        assert torch.equal(run(x[i:i + 1])[0], together[i]), f"row {i}"
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(4))
    assert torch.equal(run(x[perm]), together[perm])
