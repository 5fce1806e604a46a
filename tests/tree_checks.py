"""What every tree engine must pass, shared by the engines' tree-verify tests (tests/test_qwen38_tree.py,
tests/test_llama_tree.py): helpers, and the checks each file runs on its engine (``eng``), a second engine over
the same weights (``twin``, the plain-decode reference) and a recorded greedy decode (``rec``)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem_core.drafter import Proposal, Requirements
from tandem_core.spec.cut import PriceTable
from tandem_core.state import ModelState


def flat_prices(widest: int = 129) -> PriceTable:
    """A nearly flat verify price up to ``widest`` rows: the cut keeps every drafted node it believes in, so a
    test of speculation does not depend on how long its verifies happened to take."""
    return PriceTable((1, widest), (0, 100000), ((1.0, 1.02), (1.0, 1.02)))

__all__ = ["flat_prices", "Oracle", "Recorded", "path_to", "walk", "carries", "assert_same_state", "random_tree", "oracle_tree",
           "plain_rows_of_tree", "check_chains", "check_random_tree", "check_rejected_branches",
           "check_second_tree", "check_forward_settles", "check_oracle_speculation",
           "check_a_batched_linear_fails_at_width_two", "check_trim_pending", "check_trace_verbs"]


class Oracle:
    """A drafter of the plain greedy continuation (``truth``, the answer's tokens), a wrong token now and then
    and a distractor sibling: speculation with deep accepted paths on a model whose own text never repeats."""

    name = "oracle"

    def __init__(self, truth: list[int], seed: int, vocab: int) -> None:
        self.truth = truth
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.n0 = 0

    def requires(self) -> Requirements:
        return Requirements()

    def begin(self, prompt_ids) -> None:
        self.n0 = len(prompt_ids)

    def propose(self, context_ids, max_nodes: int) -> Proposal:
        g = len(context_ids) - self.n0                     # the answer's tokens so far
        k = min(max_nodes - 1, self.rng.randint(1, 12))
        chain = list(self.truth[g:g + k])
        if not chain or k < 1:
            return Proposal.empty(self.name)
        bad = self.rng.randint(0, len(chain) + 3)
        if bad < len(chain):
            chain[bad] = (chain[bad] + 1) % self.vocab
        tokens = chain + [(chain[0] + 7) % self.vocab]
        parents = list(range(-1, len(chain) - 1)) + [-1]
        return Proposal(tuple(tokens), tuple(parents), tuple([0.9] * len(chain) + [0.3]), self.name)

    def accepted(self, tokens) -> None:
        pass

    def reset(self) -> None:
        pass


class Recorded:
    """A prompt's state, then a greedy decode: rows[j] after feeding tokens[j], states[j] after it."""

    def __init__(self, engine, ids, n):
        engine.reset()
        logits = engine.forward(ids)
        self.start = engine.state.clone()
        self.tokens, rows, self.states, self.hidden = [], [], [], []
        tok = int(engine.picks(logits)[-1])
        for _ in range(n):
            self.tokens.append(tok)
            row = engine.forward([tok])
            rows.append(row[0])
            self.hidden.append(engine.hidden_post_norm()[0].clone())
            self.states.append(engine.state.clone())
            tok = int(engine.picks(row)[-1])
        self.rows = torch.stack(rows)

    def state_at(self, j: int) -> ModelState:
        """After the first ``j`` generated tokens."""
        return self.start if j == 0 else self.states[j - 1]


def path_to(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def walk(tokens: list[int], parents: list[int], picks: list[int]) -> tuple[list[int], int]:
    """The longest path whose every next token is the model's pick; returns (node path, the next pick)."""
    node = parents.index(-1)
    path = [node]
    while True:
        nxt = [j for j in range(len(tokens)) if parents[j] == node and tokens[j] == picks[node]]
        if not nxt:
            return path, picks[node]
        node = nxt[0]
        path.append(node)


def carries(tokens, parents, i, rest):
    """Node ``i`` heads a chain of descendants carrying ``rest``."""
    if tokens[i] != rest[0]:
        return False
    if len(rest) == 1:
        return True
    return any(parents[j] == i and carries(tokens, parents, j, rest[1:]) for j in range(len(tokens)))


def assert_same_state(got: ModelState, want: ModelState, when: str = "") -> None:
    assert got.length == want.length, when
    assert set(got.sections) == set(want.sections), when
    for k, t in want.sections.items():
        assert torch.equal(got.sections[k], t), f"section {k} {when}"
    for k, v in want.views.items():
        assert torch.equal(got.views[k].head(want.length), v.head(want.length)), f"view {k} {when}"


def _parents_first(rng: random.Random, tok: list[int], par: list[int]) -> tuple[list[int], list[int]]:
    # a random order with every parent before its children
    n = len(tok)
    order, ready = [], [i for i in range(n) if par[i] < 0]
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        ready.extend(j for j in range(n) if par[j] == i)
    new = {old: k for k, old in enumerate(order)}
    return [tok[i] for i in order], [-1 if par[i] < 0 else new[par[i]] for i in order]


def random_tree(rng: random.Random, n: int, vocab: int, path: list[int] | None = None) -> tuple[list[int], list[int]]:
    """``n`` nodes: ``path`` (if given) as the first chain, then random nodes, some branching off branches;
    shuffled into a random order with parents first. Returns (tokens, parents)."""
    tok, par = list(path or []), list(range(-1, len(path or []) - 1))
    while len(tok) < n:
        recent = max(0, len(tok) - 4)
        par.append(rng.choice([-1, *range(len(tok)), *range(recent, len(tok))]))
        tok.append(rng.randrange(vocab))
    return _parents_first(rng, tok, par)


def oracle_tree(rng: random.Random, root: int, truth: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """Root (the model's own pending token), then a random length of the true continuation, wrong tokens
    beside it and branches off them; sometimes the continuation's next token is left out or replaced."""
    keep = rng.choice([0, 1, 2, 3, 5, 8, len(truth)])
    chain = truth[:keep]
    if chain and rng.random() < 0.25:
        chain = chain[:-1] + [(chain[-1] + 1) % vocab]           # a wrong last guess
    tok, par = [root], [-1]
    for t in chain:
        tok.append(t)
        par.append(len(tok) - 2)
    for _ in range(rng.randrange(0, 12)):
        par.append(rng.randrange(len(tok)))
        tok.append(rng.randrange(vocab))
    return _parents_first(rng, tok, par)


def plain_rows_of_tree(twin, base: ModelState, tokens: list[int], parents: list[int]):
    """Plain decode of every node's own path: its row, its hidden row and the state after it."""
    rows, hidden, states = [], [], []
    for t, p in zip(tokens, parents):
        twin.state.restore(base if p < 0 else states[p])
        rows.append(twin.forward([t])[0])
        hidden.append(twin.hidden_post_norm()[0].clone())
        states.append(twin.state.clone())
    return torch.stack(rows), torch.stack(hidden), states


# -- the checks --------------------------------------------------------------------------------------------
def check_chains(eng, rec, vocab: int) -> None:
    """Chains of every width up to ``max_tree`` equal the decode rows (logits and hidden) and commit its state."""
    for w in range(1, eng.caps.max_tree + 1):
        at = w % 5                                              # chains start at several positions
        eng.state.restore(rec.state_at(at))
        out = eng.forward_block(rec.tokens[at:at + w])
        assert out.logits.shape == (w, vocab) and out.logits.dtype == torch.float32
        for j in range(w):
            assert torch.equal(out.logits[j], rec.rows[at + j]), f"width {w}, node {j}"
        assert torch.equal(eng.hidden_post_norm(), torch.stack(rec.hidden[at:at + w])), f"width {w} hidden"
        assert eng.kv.length == rec.start.length + at           # nothing committed yet
        eng.commit_tree(range(w))
        assert_same_state(eng.state, rec.state_at(at + w), f"after committing width {w}")


def check_random_tree(eng, twin, rec, size: int, seed: int, vocab: int) -> None:
    """A random tree's every node equals plain decode of its own path; committing a path leaves its state."""
    rng = random.Random(seed)
    base = rec.state_at(3)
    tokens, parents = random_tree(rng, size, vocab)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    want, hidden, states = plain_rows_of_tree(twin, base, tokens, parents)
    for i in range(size):
        assert torch.equal(out.logits[i], want[i]), f"node {i} (parent {parents[i]})"
    assert torch.equal(eng.hidden_post_norm(), hidden)
    assert eng.kv.length == base.length
    # commit the path to the deepest node: the state plain decode of that path leaves
    leaf = max(range(size), key=lambda i: (len(path_to(parents, i)), -i))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf], f"after committing the path to node {leaf}")


def check_rejected_branches(eng, rec, vocab: int) -> None:
    """Committing the true path of a bushy tree leaves the state plain decode leaves; decoding and verifying on
    are plain."""
    rng = random.Random(7)
    truth = rec.tokens[10:16]
    tokens, parents = random_tree(rng, 40, vocab, path=truth)
    # the path's nodes in the shuffled tree: the chain of roots/children carrying ``truth``
    path, parent = [], -1
    for t in truth:
        parent = next(i for i in range(len(tokens)) if parents[i] == parent and tokens[i] == t
                      and carries(tokens, parents, i, truth[len(path):]))
        path.append(parent)
    eng.state.restore(rec.state_at(10))
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    for d, node in enumerate(path):
        assert torch.equal(out.logits[node], rec.rows[10 + d])
    eng.commit_tree(path)
    eng.settle()
    assert_same_state(eng.state, rec.state_at(16), "after the commit")
    for j in range(16, 24):                                    # decoding on is plain decoding
        assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
    assert_same_state(eng.state, rec.state_at(24), "after decoding on")
    out = eng.forward_block(rec.tokens[24:30])                 # and verifying on is too
    assert all(torch.equal(out.logits[j], rec.rows[24 + j]) for j in range(6))


def check_second_tree(eng, rec) -> None:
    """A second verify replaces the first; a commit, ``discard_pending``, a forward and a rollback drop it."""
    eng.state.restore(rec.state_at(0))
    eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))
    out = eng.forward_block(rec.tokens[:4])
    assert all(torch.equal(out.logits[j], rec.rows[j]) for j in range(4))
    with pytest.raises(ValueError, match="parent 0, not -1"):
        eng.commit_tree([1])
    eng.commit_tree([0, 1])
    assert_same_state(eng.state, rec.state_at(2))
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])                                     # a commit consumes the tree
    eng.forward_block(rec.tokens[2:5])
    eng.discard_pending()
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    assert_same_state(eng.state, rec.state_at(2), "discard_pending changes nothing committed")
    eng.forward_block(rec.tokens[2:5])
    eng.forward([rec.tokens[2]])                                 # a forward drops the tree too
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    eng.forward_block([1])
    eng.commit_tree([])                                          # an empty path commits nothing
    assert eng.kv.length == rec.start.length + 3
    eng.forward_block([1, 2])
    eng.rollback_to(eng.kv.length)                               # a rollback drops the tree
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])


def check_forward_settles(eng, rec) -> None:
    """A forward makes the pending tokens permanent; a state restore and a reset forget pending and tree."""
    eng.state.restore(rec.state_at(0))
    eng.forward_block(rec.tokens[:3])
    eng.commit_tree(range(3))
    eng.forward([rec.tokens[3]])                                # a forward makes the pending tokens permanent
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    assert_same_state(eng.state, rec.state_at(4))
    eng.forward_block(rec.tokens[4:6])
    eng.commit_tree(range(2))
    eng.forward_block(rec.tokens[6:8])
    eng.state.restore(rec.state_at(2))                           # a cache restores another state
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    out = eng.forward_block(rec.tokens[2:6])
    assert all(torch.equal(out.logits[j], rec.rows[2 + j]) for j in range(4))
    eng.commit_tree(range(4))
    eng.reset()
    assert eng.kv.length == 0
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)


def check_oracle_speculation(eng, twin, prompts: list[list[int]], vocab: int, n: int = 36) -> None:
    """Greedy speculation with an oracle drafter (the true continuation, with errors and branches) equals plain
    greedy decoding token for token on every prompt, and the trees are accepted deeply."""
    rng = random.Random(2024)
    rounds = accepted = 0
    for k, ids in enumerate(prompts):
        twin.reset()
        logits = twin.forward(ids)
        plain = []
        for _ in range(n + 12):
            plain.append(int(twin.picks(logits)[-1]))
            logits = twin.forward([plain[-1]])
        eng.reset()
        pending = int(eng.picks(eng.forward(ids))[-1])
        out: list[int] = []
        while len(out) < n:
            truth = plain[len(out) + 1:len(out) + 10]            # the oracle's guess of what follows
            tokens, parents = oracle_tree(rng, pending, truth, vocab)
            verified = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
            path, pending = walk(tokens, parents, eng.picks(verified.logits).tolist())
            eng.commit_tree(path)
            eng.settle()
            out += [tokens[i] for i in path]
            rounds += 1
            accepted += len(path)
        first = next((i for i in range(n) if out[i] != plain[i]), None)
        assert first is None, f"prompt {k}: first difference at token {first}"
    assert accepted >= 2 * rounds                                # the oracle's trees were accepted deeply


def check_a_batched_linear_fails_at_width_two(build, gemm, k: int, layer: str) -> None:
    """A ``linear_rows`` kernel that multiplies the rows together (one GEMM) is what the op exists to avoid: on a
    BLAS whose M=1 and M=2 rows differ (probed with ``gemm``, a layer-0 product of ``k`` inputs), the self-check
    of an engine from ``build()`` fails at width 2 and names ``layer``."""
    from tandem_core import ops
    from tandem_core.spec.selfcheck import run_selfcheck

    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    if all(torch.equal(gemm(x)[i], gemm(x[i:i + 1])[0]) for i in range(2)):
        pytest.skip("this BLAS gives a 2-row GEMM the 1-row bits: nothing to catch")

    def batched(lin, x):
        return lin.matmul(x)

    ops.register("linear_rows", "cpu", batched)
    try:
        res = run_selfcheck(build())
    finally:
        ops.unregister("linear_rows", "cpu")
    assert not res.ok and res.mismatch is not None
    assert res.mismatch.width == 2 and res.mismatch.layer == layer
    assert "width 2" in res.first_mismatch and layer in res.first_mismatch


def check_trim_pending(eng, rec) -> int:
    """Three unsettled commits, ``trim_pending`` and a rollback inside them land on plain decode's states, and
    verifying on from there is plain; returns the prompt's length (what the callers' rollbacks count from)."""
    base = rec.start.length
    eng.state.restore(rec.state_at(5))
    for a, b in [(5, 8), (8, 10), (10, 14)]:                    # three commits, never settled: 9 pending
        eng.forward_block(rec.tokens[a:b])
        eng.commit_tree(range(b - a))
    assert_same_state(eng.state, rec.state_at(14))
    eng.trim_pending(4)
    assert_same_state(eng.state, rec.state_at(10), "after trim_pending(4)")
    eng.rollback_to(base + 7)
    assert_same_state(eng.state, rec.state_at(7), "after rollback_to")
    out = eng.forward_block(rec.tokens[7:12])                   # verify on from the rolled-back state
    assert all(torch.equal(out.logits[j], rec.rows[7 + j]) for j in range(5))
    eng.commit_tree(range(5))
    assert_same_state(eng.state, rec.state_at(12), "after committing again")
    with pytest.raises(ValueError, match="7 tokens are pending"):
        eng.trim_pending(8)
    return base


def check_trace_verbs(eng, twin, first_point: str, points: int, width: int) -> None:
    """``trace_forward`` and ``trace_tree`` compute what ``forward`` and ``forward_tree`` compute (``twin``
    runs those), with ``points`` rows of ``width`` from ``first_point`` to the final norm, and leave the sequence
    and the verified tree as they do."""
    from tandem_core.spec.selfcheck import Trace

    ids = [5, 17, 2, 99, 43]
    a = eng.trace_forward(ids)
    b = twin.forward(ids, all_logits=True)
    assert isinstance(a, Trace) and torch.equal(a.logits, b) and eng.kv.length == twin.kv.length == 5
    assert a.points[0] == first_point and a.points[-1] == "final norm"
    assert len(a.points) == points and all(r.shape == (5, width) for r in a.rows)
    assert torch.equal(a.rows[-1], twin.hidden_post_norm())
    t = eng.trace_tree([7, 8, 9], [-1, 0, 0])
    v = twin.forward_tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))
    assert torch.equal(t.logits, v.logits) and all(r.shape == (3, width) for r in t.rows)
    eng.commit_tree([0, 2])                                      # the traced tree is left verified
    twin.commit_tree([0, 2])
    assert_same_state(eng.state, twin.state)
    d = eng.trace_forward([11])                                  # a decode step's trace: its own row
    assert torch.equal(d.logits, twin.forward([11], all_logits=True))
