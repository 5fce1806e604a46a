"""The token tree: merging proposals, the ancestor mask, paths, subtrees; chains are trees."""

from __future__ import annotations

import random

import pytest
import torch

from tandem_core.drafter import Proposal
from tandem_core.spec.tree import TokenTree


def random_proposal(rng: random.Random, n: int, vocab: int, source: str) -> Proposal:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return Proposal(tuple(rng.randrange(vocab) for _ in range(n)), tuple(parents),
                    tuple(rng.random() for _ in range(n)), source)


def test_merge_shares_prefixes_keeps_max_and_every_source():
    a = Proposal.chain([5, 6, 7, 8], [0.9, 0.8, 0.7, 0.6], "block")
    b = Proposal((5, 6, 9, 3), (-1, 0, 1, -1), (0.5, 0.95, 0.4, 0.2), "lookup")
    t = TokenTree.merge([a, b])
    assert t.tokens == (5, 6, 7, 8, 9, 3)
    assert t.parents == (-1, 0, 1, 2, 1, -1)
    assert t.probs == (0.9, 0.95, 0.7, 0.6, 0.4, 0.2)
    assert t.sources[0] == ("block", "lookup") and t.sources[1] == ("block", "lookup")
    assert t.source_probs[0] == (0.9, 0.5) and t.source_probs[1] == (0.8, 0.95)
    assert t.sources[4] == ("lookup",) and t.sources[2] == ("block",)
    assert t.depth == (1, 2, 3, 4, 3, 1)
    assert t.path_probs[3] == pytest.approx(0.9 * 0.95 * 0.7 * 0.6)


def test_same_token_under_different_parents_stays_two_nodes():
    a = Proposal((1, 2), (-1, -1), (0.5, 0.5), "x")
    b = Proposal((2, 1), (-1, 0), (0.3, 0.3), "y")
    t = TokenTree.merge([a, b])
    # token 2 at the root merges; token 1 under token 2 is a new node, not the root's token 1
    assert t.tokens == (1, 2, 1) and t.parents == (-1, -1, 1)


def test_merge_of_random_proposals_keeps_every_path():
    rng = random.Random(0)
    props = [random_proposal(rng, 20, 4, s) for s in ("a", "b", "c")]
    t = TokenTree.merge(props)
    merged_paths = {tuple(t.tokens[i] for i in t.path_to(j)) for j in range(len(t))}
    for p in props:
        tp = TokenTree.from_proposal(p)
        for j in range(len(tp)):
            assert tuple(tp.tokens[i] for i in tp.path_to(j)) in merged_paths
    # no two siblings carry the same token
    for kids in t.children:
        toks = [t.tokens[c] for c in kids]
        assert len(toks) == len(set(toks))


def test_ancestor_mask_matches_paths():
    rng = random.Random(1)
    t = TokenTree.merge([random_proposal(rng, 30, 3, "a"), random_proposal(rng, 30, 3, "b")])
    m = t.ancestor_mask()
    assert m.dtype == torch.bool and m.shape == (len(t), len(t))
    for i in range(len(t)):
        expect = set(t.path_to(i))
        assert {j for j in range(len(t)) if m[i, j]} == expect


def test_chain_is_a_tree_with_a_triangular_mask():
    t = TokenTree.chain([4, 5, 6, 7])
    assert t.is_chain and t.paths == ((0, 1, 2, 3),)
    assert torch.equal(t.ancestor_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert t.tokens_tensor().dtype == torch.long and t.parents_tensor().tolist() == [-1, 0, 1, 2]
    assert not TokenTree.merge([Proposal((1, 2), (-1, -1), (1.0, 1.0), "x")]).is_chain


def test_paths_are_root_to_leaf():
    t = TokenTree.merge([Proposal((1, 2, 3, 4, 5), (-1, 0, 0, 2, -1), (1.0,) * 5, "x")])
    assert t.paths == ((0, 1), (0, 2, 3), (4,))


def test_subtree_reindexes_and_preserves_parents():
    rng = random.Random(2)
    t = TokenTree.merge([random_proposal(rng, 40, 5, "a")])
    keep = set()
    for j in rng.sample(range(len(t)), 8):
        keep.update(t.path_to(j))
    s = t.subtree(keep)
    kept = sorted(keep)
    assert len(s) == len(kept)
    for new, old in enumerate(kept):
        assert s.tokens[new] == t.tokens[old] and s.probs[new] == t.probs[old]
        old_path = [t.tokens[i] for i in t.path_to(old)]
        assert [s.tokens[i] for i in s.path_to(new)] == old_path


def test_subtree_refuses_a_set_not_closed_under_ancestors():
    t = TokenTree.chain([1, 2, 3])
    with pytest.raises(ValueError, match="node 2 is kept but its parent 1"):
        t.subtree([0, 2])
    assert len(t.subtree([])) == 0


def test_proposal_and_tree_validate():
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        Proposal((1, 2), (-1, 1), (0.5, 0.5), "bad")
    with pytest.raises(ValueError, match="probability 1.5"):
        Proposal((1,), (-1,), (1.5,), "bad")
    with pytest.raises(ValueError, match="differ in length"):
        Proposal((1, 2), (-1,), (0.5, 0.5), "bad")
    assert len(TokenTree.merge([Proposal.empty("x")])) == 0
