"""The snapshot store: the prefix hash chain, byte budget, eviction order (least valuable first), lookups."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem_core.cache import Anchor, CostModel, Snapshot, SnapshotStore
from tandem_core.cache.keys import PrefixIndex
from tandem_core.state import ModelState, View

SEC = 400      # floats in the made-up recurrent section: 1,600 bytes
BPT = 16       # view bytes a token


def made_up(toks: list[int], sections: bool = True, anchors: tuple[int, ...] = ()) -> Snapshot:
    """A made-up state holding ``toks``: a section [SEC] and a view [L, 4] whose rows are the tokens."""
    n = len(toks)
    secs = {"s": torch.full((SEC,), float(sum(toks)))} if sections else {}
    rows = torch.tensor(toks, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    state = ModelState(secs, {"v": View(rows, 0)}, n)
    anch = tuple(Anchor(p, {"s": torch.full((SEC,), float(sum(toks[:p])))}) for p in anchors) if sections else ()
    return Snapshot(np.asarray(toks, dtype=np.int64), state, anch)


def seq(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def size(n: int, sections: bool = True) -> int:
    return (SEC * 4 if sections else 0) + BPT * n


def test_budget_and_eviction_order_least_valuable_first():
    a, b, c = made_up(seq(200, 1)), made_up(seq(50, 2)), made_up(seq(100, 3))
    evicted = []
    store = SnapshotStore(size(200) + size(50) + size(100), on_evict=lambda s, h: evicted.append((s.length, h)))
    for s in (a, b, c):
        assert store.offer(s)
    assert store.stats().bytes == size(200) + size(50) + size(100) and store.stats().entries == 3
    # per byte, a short recurrent snapshot saves the least (its section is paid whatever its length)
    assert [e.snap.length for e in store.entries()] == [50, 100, 200]
    assert store.offer(made_up(seq(150, 4)))          # needs size(150): pushes out 50, then 100
    assert evicted == [(50, 0), (100, 0)]
    assert sorted(e.snap.length for e in store.entries()) == [150, 200]
    assert store.stats().bytes <= store.budget


def test_a_newcomer_worth_less_than_what_it_would_push_out_is_refused():
    store = SnapshotStore(size(200) + size(180))
    assert store.offer(made_up(seq(200, 1))) and store.offer(made_up(seq(180, 2)))
    assert not store.would_keep(40, size(40))
    assert not store.offer(made_up(seq(40, 3)))
    assert store.stats().entries == 2
    assert not store.offer(made_up(seq(1000, 4)))      # larger than the whole budget


def test_hits_raise_value_and_ties_go_least_recently_used_first():
    b, c = made_up(seq(50, 2)), made_up(seq(100, 3))
    store = SnapshotStore(size(50) + size(100) + size(120))
    store.offer(b)
    store.offer(c)
    for _ in range(2):                                  # b is restored twice: worth 3x now
        hit = store.lookup(np.asarray(b.tokens.tolist() + [7]), 50)
        assert hit is not None and hit.start == 50
        assert store.load(hit) is not None
    assert [e.snap.length for e in store.entries()] == [100, 50]
    assert store.offer(made_up(seq(120, 5)))          # fits
    evicted = [e.key for e in store.entries()][:2]
    assert store.offer(made_up(seq(120, 6)))          # pushes out c (100), then the other 120 (as cheap, older)
    assert sorted(e.snap.length for e in store.entries()) == [50, 120]
    assert not {e.key for e in store.entries()} & set(evicted)
    # no sections: every entry is worth the same per byte, the least recently used goes first
    lru = SnapshotStore(3 * size(60, False))
    xs = [made_up(seq(60, 10 + i), sections=False) for i in range(3)]
    for x in xs:
        lru.offer(x)
    lru.offer(xs[0])                                    # offered again: used now
    lru.offer(made_up(seq(60, 20), sections=False))
    kept = {tuple(e.snap.tokens.tolist()) for e in lru.entries()}
    assert tuple(xs[1].tokens.tolist()) not in kept and tuple(xs[0].tokens.tolist()) in kept


def test_lookup_finds_the_longest_stored_prefix_and_resumes_at_an_anchor_inside_it():
    x = seq(300, 1)
    store = SnapshotStore(1 << 20, block=32)
    store.offer(made_up(x, anchors=(100, 200, 250)))
    store.offer(made_up(x[:100] + seq(150, 2), anchors=(100,)))
    store.offer(made_up(x[:260]))                       # a shorter prefix of x itself
    store.offer(made_up(seq(90, 3)))
    q = np.asarray(x[:280] + seq(10, 4))
    hit = store.lookup(q, len(q) - 1)
    assert hit.start == 260 and hit.common == 260       # x[:260] is whole at 260; x itself only at 250
    got = store.load(hit)
    assert got.length == 260 and torch.equal(got.views["v"].head(260)[:, 0], torch.tensor(x[:260], dtype=torch.float32))
    q2 = np.asarray(x[:255] + seq(10, 5))
    hit = store.lookup(q2, len(q2) - 1)
    assert hit.start == 250 and hit.common == 255       # x's anchor at 250
    st = store.load(hit)
    assert st.length == 250 and torch.equal(st.sections["s"], torch.full((SEC,), float(sum(x[:250]))))
    assert store.lookup(np.asarray(seq(50, 6)), 49) is None
    s = store.stats()
    assert (s.hits, s.misses, s.entries) == (2, 1, 4)


def test_lookup_never_covers_the_whole_prompt_and_no_sections_resume_anywhere():
    x = seq(120, 7)
    store = SnapshotStore(1 << 20, block=16)
    store.offer(made_up(x, sections=False))
    hit = store.lookup(np.asarray(x), len(x) - 1)
    assert hit.start == 119
    assert store.load(hit).length == 119
    rec = SnapshotStore(1 << 20, block=16)
    rec.offer(made_up(x))
    assert rec.lookup(np.asarray(x), len(x) - 1) is None   # no anchor below its end


def test_put_clones_and_release_goes_cheapest_first():
    toks = seq(80, 8)
    live = made_up(toks).state
    store = SnapshotStore(1 << 20)
    assert store.put(toks, live)
    live.sections["s"].zero_()
    live.views["v"].tensor.zero_()
    hit = store.lookup(np.asarray(toks + [1]), 80)
    assert store.load(hit).sections["s"][0] == float(sum(toks))
    store.offer(made_up(seq(30, 9)))
    assert store.value_per_byte() == pytest.approx(CostModel().seconds(0, 30) / size(30))
    assert store.release(1) == size(30)
    assert store.stats().entries == 1
    assert store.release(1 << 30) == size(80) and store.value_per_byte() == float("inf")


def test_prefix_index_matches_brute_force():
    rng = random.Random(0)
    idx = PrefixIndex(block=4)
    stored: dict[str, np.ndarray] = {}
    base = [rng.randrange(5) for _ in range(60)]
    for i in range(40):
        cut = rng.randrange(0, 60)
        t = np.asarray(base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 30))], dtype=np.int64)
        stored[f"k{i}"] = t
        idx.add(f"k{i}", t)
    for k in list(stored)[:10]:
        idx.remove(k)
        del stored[k]
    for trial in range(200):
        cut = rng.randrange(0, 60)
        q = np.asarray(base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 20))], dtype=np.int64)
        limit = rng.randrange(0, len(q) + 1)

        def common(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        want = max((common(t, q[:limit]) for t in stored.values()), default=0)
        got = idx.search(q, limit, lambda k, c: c)
        assert (got[1] if got else 0) == want, trial
        if got:
            assert common(stored[got[0]], q[:limit]) == got[2] == want
