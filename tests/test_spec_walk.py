"""The walk: the longest agreeing path plus one token of the model's own equals plain decoding,
greedy and seeded-sampled, on random trees over a toy model."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from tandem_core.drafter import Proposal
from tandem_core.spec.sampler import Sampler, SamplingParams
from tandem_core.spec.tree import TokenTree
from tandem_core.spec.walk import pick_positions, walk, walk_lazy

VOCAB = 6


def toy_logits(prefix: list[int]) -> torch.Tensor:
    """A deterministic toy 'model': next-token logits [VOCAB] from the last three tokens."""
    key = hashlib.blake2b(repr(prefix[-3:]).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") & ((1 << 62) - 1))
    return torch.randn(VOCAB, generator=g) * 3


def plain(prompt: list[int], n: int, sampler: Sampler | None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        lg = toy_logits(seq)
        if sampler is None:
            t = int(torch.argmax(lg))
        else:
            t = sampler.pick(lg, len(seq)).token
            sampler.accept(t)
        seq.append(t)
    return seq[len(prompt):]


def random_tree(rng: random.Random, truth: list[int]) -> TokenTree:
    """A tree mixing the true continuation (sometimes with a wrong token) and random branches."""
    props = []
    good = list(truth[:rng.randrange(0, 8)])
    if good and rng.random() < 0.5:
        good[rng.randrange(len(good))] = rng.randrange(VOCAB)
    props.append(Proposal.chain(good, [0.9] * len(good), "a"))
    n = rng.randrange(0, 12)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    props.append(Proposal(tuple(rng.randrange(VOCAB) for _ in range(n)), tuple(parents[:n]), (0.5,) * n, "b"))
    return TokenTree.merge(props)


def node_picks(tree: TokenTree, seq: list[int], sampler: Sampler | None) -> tuple[list[int], int]:
    """Every node's pick, as one verify forward would give them (all rows at once)."""
    rows = [toy_logits(seq)]
    rows += [toy_logits(seq + [tree.tokens[i] for i in tree.path_to(k)]) for k in range(len(tree))]
    logits = torch.stack(rows)
    if sampler is None:
        p = torch.argmax(logits, -1).tolist()
    else:
        pos = [len(seq)] + pick_positions(tree, len(seq))
        p = [x.token for x in sampler.pick_rows(logits, pos)]
    return p[1:], p[0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculative_walk_equals_plain_decoding(sampled):
    rng = random.Random(7)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    want = plain(prompt, 60, Sampler(params) if sampled else None)
    seq = list(prompt)
    sampler = Sampler(params) if sampled else None
    rounds = accepted = 0
    while len(seq) - len(prompt) < 60:
        truth = want[len(seq) - len(prompt):]
        tree = random_tree(rng, truth)
        picks, root = node_picks(tree, seq, sampler)
        r = walk(tree, picks, root)
        assert list(r.tokens) == [tree.tokens[i] for i in r.path_nodes] + [r.bonus]
        assert all(tree.parents[b] == a for a, b in zip((-1,) + r.path_nodes, r.path_nodes))
        seq.extend(r.tokens)
        rounds += 1
        accepted += r.accepted
    assert seq[len(prompt):len(prompt) + 60] == want
    assert accepted > 0 and rounds < 60  # speculation did something


def test_lazy_walk_with_penalties_equals_plain():
    """A picker whose draw depends on the path (frequency penalty) walks lazily, accepting as it goes."""
    rng = random.Random(3)
    params = SamplingParams(temperature=1.0, seed=99, frequency_penalty=0.7, presence_penalty=0.3)
    prompt = [0, 1]
    want = plain(prompt, 40, Sampler(params))
    seq, sampler = list(prompt), Sampler(params)
    while len(seq) - len(prompt) < 40:
        tree = random_tree(rng, want[len(seq) - len(prompt):])
        calls: list[int] = []

        def pick(k: int) -> int:
            calls.append(k)
            if k >= 0:
                sampler.accept(tree.tokens[k])  # node k is accepted: its token counts from here on
            path = [] if k < 0 else [tree.tokens[i] for i in tree.path_to(k)]
            return sampler.pick(toy_logits(seq + path), len(seq) + len(path)).token

        r = walk_lazy(tree, pick)
        assert calls == [-1, *r.path_nodes]
        sampler.accept(r.bonus)
        seq.extend(r.tokens)
    assert seq[len(prompt):len(prompt) + 40] == want


def test_no_agreeing_child_gives_the_models_own_token():
    t = TokenTree.chain([4, 5])
    r = walk(t, [5, 9], picks_root=2)
    assert r.path_nodes == () and r.tokens == (2,) and r.bonus == 2 and r.accepted == 0
    r = walk(t, torch.tensor([5, 9]), picks_root=4)
    assert r.path_nodes == (0, 1) and r.tokens == (4, 5, 9)
    assert walk(TokenTree.empty(), [], 3).tokens == (3,)


def test_walk_follows_the_right_branch():
    t = TokenTree.merge([Proposal((1, 2, 3, 7, 8), (-1, 0, 0, 1, 2), (0.5,) * 5, "x")])
    # root pick 1, then after node 0 the model picks 3 (node 2), then 8 (node 4), then its own 0
    r = walk(t, [3, 0, 8, 0, 0], 1)
    assert r.path_nodes == (0, 2, 4) and r.tokens == (1, 3, 8, 0)


def test_walk_refuses_picks_of_the_wrong_length():
    with pytest.raises(ValueError, match="2 picks for a tree of 3"):
        walk(TokenTree.chain([1, 2, 3]), [1, 2], 0)


def test_pick_positions_are_first_plus_depth():
    t = TokenTree.merge([Proposal((1, 2, 3, 4), (-1, 0, -1, 1), (0.5,) * 4, "x")])
    assert pick_positions(t, 100) == [101, 102, 101, 103]
