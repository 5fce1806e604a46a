"""Tree-verify helpers every engine's tests share: recorded decodes, random and oracle trees, state
equality, and an oracle drafter. Used by the runner conformance suite (``tandem_core.testing.conformance``)
and by tests of the decode loop; they need no model of their own.
"""

from __future__ import annotations

import random

import torch

from tandem_core.drafter import Proposal, Requirements
from tandem_core.spec.cut import PriceTable
from tandem_core.state import ModelState

__all__ = ["flat_prices", "Oracle", "Recorded", "path_to", "walk", "carries", "assert_same_state", "random_tree",
           "oracle_tree", "plain_rows_of_tree"]


def flat_prices(widest: int = 129) -> PriceTable:
    """A nearly flat verify price up to ``widest`` rows: the cut keeps every drafted node it believes in, so a
    test of speculation does not depend on how long its verifies happened to take."""
    return PriceTable((1, widest), (0, 100000), ((1.0, 1.02), (1.0, 1.02)))


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
