"""The lookup drafter: long right chains on repetitive sequences, trees from counts, an incremental index that
equals a rebuilt one, the session's earlier turns, and a lossless speculative loop over a toy model."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tandem_core.drafter import Drafter, Proposal
from tandem_core.spec.cut import PriceTable, StairCut
from tandem_core.spec.tree import TokenTree
from tandem_core.spec.walk import walk

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "plugins" / "drafters") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins" / "drafters"))

from tandem_drafters.lookup import LookupConfig, LookupDrafter  # noqa: E402
from tandem_drafters.ngram import NgramIndex, suffix_keys  # noqa: E402


def drafter(**cfg) -> LookupDrafter:
    return LookupDrafter(corpus="", config=LookupConfig(**cfg))


def best_path(p: Proposal) -> list[int]:
    """The proposal's most probable chain: from the root, always the likeliest child."""
    t = TokenTree.from_proposal(p)
    out, node = [], -1
    while t.children[node]:
        node = max(t.children[node], key=lambda c: t.probs[c])
        out.append(t.tokens[node])
    return out


def test_repetitive_sequence_gets_a_long_right_chain():
    rng = random.Random(3)
    pat = [rng.randrange(5000) for _ in range(40)]
    seq = pat * 3 + pat[:10]
    d = drafter()
    assert isinstance(d, Drafter)
    d.begin(seq)
    p = d.propose(seq, 64)
    want = (pat * 4)[10:10 + 64]
    assert len(p) >= 40 and TokenTree.from_proposal(p).is_chain
    assert list(p.tokens) == want[:len(p)]
    assert min(p.probs) > 0.9  # a 16-token match seen twice: confident


def test_different_continuations_make_a_tree_with_counts():
    # after "1 2 3 4 5" came 6 twice and 7 once
    seq = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 7, 0, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]
    d = drafter()
    d.begin(seq)
    p = d.propose(seq, 12)
    t = TokenTree.from_proposal(p)
    roots = {t.tokens[c]: t.probs[c] for c in t.children[-1]}
    assert roots[6] > roots[7] > 0
    assert not t.is_chain and len(p) <= 12
    assert best_path(p)[:2] == [6, 0] or best_path(p)[:2] == [6, 9]


def test_nothing_seen_proposes_nothing_and_max_nodes_is_kept():
    d = drafter()
    d.begin([1, 2, 3])
    assert len(d.propose([1, 2, 3], 8)) == 0
    assert len(d.propose([1, 2, 3], 0)) == 0
    d.begin([1, 2, 3, 1, 2, 3, 1, 2])
    for m in (1, 2, 5):
        assert 1 <= len(d.propose([1, 2, 3, 1, 2, 3, 1, 2], m)) <= m


def test_incremental_index_equals_a_rebuilt_one():
    rng = random.Random(1)
    seq = [rng.randrange(12) for _ in range(1500)]
    inc = NgramIndex()
    inc.extend(seq[:300])                  # bulk
    for i in range(300, 1500, 5):           # then a few at a time
        inc.extend(seq[i:i + 5])
    inc.truncate(1200)
    inc.extend(seq[1200:1400])
    ref = NgramIndex()
    ref.extend(seq[:1400])
    for n in range(20, 1400, 97):
        tail = seq[:n][-16:]
        keys = suffix_keys(tail, inc.orders)
        assert inc.occurrences(tail, keys, 8) == ref.occurrences(tail, keys, 8)
    assert inc.end_keys() == suffix_keys(seq[:1400][-16:], inc.orders)
    assert inc.end_keys([3, 4]) == suffix_keys((seq[:1400] + [3, 4])[-16:], inc.orders)


def test_occurrences_are_real_matches_longest_first():
    rng = random.Random(2)
    seq = [rng.randrange(4) for _ in range(800)]
    ix = NgramIndex()
    ix.extend(seq)
    tail = seq[-16:]
    got = ix.occurrences(tail, suffix_keys(tail, ix.orders), 50)
    assert got and len({e for e, _ in got}) == len(got)
    for e, k in got:
        assert seq[e - k:e] == tail[-k:] and e < len(seq)
    ks = [k for _, k in got]
    assert ks == sorted(ks, reverse=True)


def test_accepted_tokens_extend_the_sequence_and_a_provisional_tail_is_fine():
    rng = random.Random(4)
    pat = [rng.randrange(100) for _ in range(30)]
    full = pat * 3
    d = drafter()
    d.begin(full[:35])
    ctx = full[:35]
    for i in range(35, 80):
        # the loop asks with one pending token the drafter was not told about yet
        p = d.propose(ctx + [full[i]], 8)
        if i >= 36:
            assert p.tokens[:1] == (full[i + 1],)
        d.accepted([full[i]])
        ctx.append(full[i])
    fresh = drafter()
    fresh.begin(ctx)
    assert fresh.propose(ctx, 16) == d.propose(ctx, 16)


def test_a_context_that_diverges_resyncs():
    d = drafter()
    d.begin([5, 6, 7, 8, 5, 6, 7])
    assert d.propose([5, 6, 7, 8, 5, 6, 7], 4).tokens[:1] == (8,)
    # the loop rolled back and went elsewhere without telling: the drafter follows the context it is given
    other = [1, 2, 3, 1, 2]
    assert d.propose(other, 4).tokens[:1] == (3,)


def test_agent_turns_are_incremental_and_dropped_tails_stay_in_the_session():
    rng = random.Random(5)
    prompt1 = [rng.randrange(1000) for _ in range(300)]
    answer = [rng.randrange(1000) for _ in range(60)]        # e.g. reasoning the next prompt leaves out
    tool = [rng.randrange(1000) for _ in range(100)]
    d = drafter()
    d.begin(prompt1)
    d.accepted(answer)
    prompt2 = prompt1 + answer[:10] + tool                    # the template keeps only the answer's start
    d.begin(prompt2)
    assert d._seq.tokens == prompt2
    # the dropped part of the answer is still proposed from the session
    ctx = prompt2 + answer[20:36]
    p = d.propose(ctx, 16)
    assert list(p.tokens[:8]) == answer[36:44]
    d.reset()  # the session is forgotten: the dropped answer is no longer there to propose
    assert list(d.propose(ctx, 16).tokens[:8]) != answer[36:44]


def test_probabilities_and_parents_are_valid_on_random_data():
    rng = random.Random(6)
    d = drafter(max_depth=12)
    seq = [rng.randrange(6) for _ in range(400)]
    d.begin(seq[:50])
    for i in range(50, 400, 3):
        p = d.propose(seq[:i], 24)  # Proposal validates parents < i and probabilities in [0, 1]
        assert len(p) <= 24 and all(x > 0 for x in p.probs)
        t = TokenTree.from_proposal(p)
        for kids in t.children:  # siblings: distinct tokens, conditional probabilities summing below 1
            assert len({t.tokens[c] for c in kids}) == len(kids)
            assert sum(t.probs[c] for c in kids) < 1.0
        d.accepted(seq[i:i + 3])


_PERM = random.Random(8).sample(range(40), 40)


def toy_next(prefix: list[int]) -> int:
    """A toy greedy 'model' that goes round in loops and is knocked into another now and then
    (as code edits and tool echoes do): a random permutation's cycles, a jump every 61 tokens."""
    return (_PERM[prefix[-1]] + (1 if len(prefix) % 61 == 0 else 0)) % 40


def test_lookup_speculation_is_lossless_and_accepts_long_runs():
    prompt = [1, 2, 5, 9]
    n = 300
    plain = list(prompt)
    while len(plain) < len(prompt) + n:
        plain.append(toy_next(plain))
    d = drafter()
    sc = StairCut(PriceTable(tuple(range(1, 65)), (0,), (tuple(10.0 + 0.1 * w for w in range(1, 65)),)))
    seq = list(prompt)
    d.begin(seq)
    rounds = 0
    while len(seq) < len(prompt) + n:
        tree = TokenTree.merge([d.propose(seq, 48)])
        cut = sc.cut(tree, len(seq))
        t = cut.tree
        picks = [toy_next(seq + [t.tokens[i] for i in t.path_to(k)]) for k in range(len(t))]
        r = walk(t, picks, toy_next(seq))
        sc.observe_walk(t, r.path_nodes)
        seq.extend(r.tokens)
        d.accepted(r.tokens)
        rounds += 1
    assert seq[:len(prompt) + n] == plain[:len(prompt) + n]
    assert n / rounds > 5.0, f"{n / rounds:.2f} tokens a round"
