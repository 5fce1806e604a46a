"""StairCut on synthetic price curves: big trees when verify is flat, a chain or nothing when it is steep;
online price learning converges to the true curve; calibration corrects an over-confident drafter."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from tandem_core.drafter import Proposal
from tandem_core.spec.cut import (
    Calibration,
    OnlinePrices,
    PriceFileError,
    PriceTable,
    StairCut,
    find_price_file,
    price_file_path,
)
from tandem_core.spec.tree import TokenTree

WIDTHS = tuple(range(1, 65))


def table(fn, contexts=(0, 65536)) -> PriceTable:
    """A price table of ``fn(n, L)`` over widths 1..64."""
    ms = tuple(tuple(float(fn(n, L)) for n in WIDTHS) for L in contexts)
    return PriceTable(WIDTHS, tuple(contexts), ms)


def bushy_tree(depth: int = 12, main: float = 0.8, side: float = 0.08) -> TokenTree:
    """A confident chain (``main`` a node) with two unlikely side branches of two nodes at every step."""
    toks, pars, probs = [], [], []
    prev = -1
    for d in range(depth):
        toks.append(100 + d), pars.append(prev), probs.append(main)
        me = len(toks) - 1
        for s in range(2):
            toks.append(200 + 10 * d + s), pars.append(prev), probs.append(side)
            toks.append(300 + 10 * d + s), pars.append(len(toks) - 2), probs.append(0.5)
        prev = me
    return TokenTree.from_proposal(Proposal(tuple(toks), tuple(pars), tuple(probs), "d"))


def closed(tree: TokenTree, keep) -> bool:
    s = set(keep)
    return all(tree.parents[i] < 0 or tree.parents[i] in s for i in s)


def test_flat_verify_keeps_a_big_tree():
    tree = bushy_tree()
    r = StairCut(table(lambda n, L: 10.0), max_tree=64).cut(tree, 1000)
    assert len(r.keep) == len(tree) and not r.tree.is_chain
    assert r.price_ms == 10.0 and r.expected > 4


def test_steep_verify_keeps_a_chain_or_nothing():
    tree = bushy_tree()
    mid = StairCut(table(lambda n, L: 10.0 + 2.0 * n)).cut(tree, 1000)
    assert mid.tree.is_chain and 2 <= len(mid.keep) <= 6
    assert mid.tree.tokens == tuple(100 + d for d in range(len(mid.keep)))
    steep = StairCut(table(lambda n, L: 10.0 * n)).cut(tree, 1000)
    assert steep.keep == () and steep.expected == 1.0 and steep.price_ms == 10.0  # plain decode wins
    empty = StairCut(table(lambda n, L: 10.0)).cut(TokenTree.empty(), 1000)
    assert empty.keep == () and len(empty.tree) == 0 and empty.rate == pytest.approx(0.1)


def test_a_staircase_is_cut_just_below_a_step():
    tree = bushy_tree(depth=30, main=0.95, side=0.02)
    stair = table(lambda n, L: 10.0 * (1 + 0.6 * ((n - 1) // 16)))
    r = StairCut(stair, base_rows=1).cut(tree, 1000)
    assert len(r.keep) == 15 and r.price_ms == 10.0  # 16 rows: the last width before the step


def test_context_length_moves_the_cut():
    """Verify cost growing with context (attention) makes long contexts cut smaller."""
    tree = bushy_tree()
    t = table(lambda n, L: 10.0 + n * (0.2 + L / 4000.0), contexts=(0, 8192, 32768))
    sc = StairCut(t)
    assert len(sc.cut(tree, 100).keep) > len(sc.cut(tree, 32000).keep)


def test_best_first_prefix_is_the_best_closed_set_of_each_size():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randrange(1, 10)
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        tree = TokenTree.from_proposal(Proposal(tuple(range(n)), tuple(parents),
                                                tuple(rng.uniform(0.05, 0.5) for _ in range(n)), "x"))
        sc = StairCut(table(lambda w, L, a=rng.uniform(0, 3): 10.0 + a * w))
        acc = sc.acceptance(tree)
        best = {0: 0.0}
        for k in range(1, n + 1):
            best[k] = max(sum(acc[list(s)]) for s in itertools.combinations(range(n), k) if closed(tree, s))
        r = sc.cut(tree, 0)
        assert closed(tree, r.keep)
        assert r.expected == pytest.approx(1.0 + best[len(r.keep)])
        curve = sc.curve(0, n + 1)
        assert r.rate == pytest.approx(max((1.0 + best[k]) / curve[k] for k in range(n + 1)))


def test_siblings_share_at_most_one_acceptance():
    tree = TokenTree.from_proposal(Proposal((1, 2, 3), (-1, -1, -1), (0.9, 0.9, 0.2), "x"))
    acc = StairCut().acceptance(tree)
    assert acc.sum() == pytest.approx(1.0) and acc[0] == pytest.approx(0.9 / 2.0)


def test_price_file_beyond_its_widths_is_never_verified():
    tree = bushy_tree()
    t = PriceTable((1, 2, 4, 8), (0,), ((10.0, 10.0, 10.0, 10.0),))
    r = StairCut(t, base_rows=1).cut(tree, 500)
    assert len(r.keep) == 7  # 8 rows with the pending token
    assert np.isinf(t.curve(0, 9)[8]) and t.price(3, 0) == 10.0


def test_price_table_interpolates_and_is_monotone():
    t = PriceTable((1, 4), (1000, 3000), ((10.0, 13.0), (20.0, 17.0)))  # second row dips: made monotone
    assert t.price(1, 2000) == pytest.approx(15.0)
    assert t.price(2, 1000) == pytest.approx(11.0)
    c = t.curve(3000, 4)
    assert np.all(np.diff(c) >= 0) and c[0] == 20.0
    assert t.price(1, 5000) == pytest.approx(30.0)  # the last segment's slope continues
    assert t.price(1, 0) == 10.0


def test_price_file_round_trip_and_lookup(tmp_path):
    t = PriceTable((1, 2, 16), (512, 4096), ((5.0, 5.1, 6.0), (5.5, 5.6, 7.0)),
                   meta={"model": "m", "profile": "bf16", "device": "h200"})
    path = price_file_path(tmp_path, "m", "bf16", "h200")
    t.save(path)
    back = PriceTable.load(path)
    assert back.widths == t.widths and back.ms == t.ms and back.meta["device"] == "h200"
    assert find_price_file("m", "bf16", "h200", [tmp_path / "nowhere", tmp_path]) == path
    assert find_price_file("m", "bf16", "cpu", [tmp_path]) is None
    assert not StairCut.for_model("m", "bf16", "h200", dirs=[tmp_path]).learning_prices
    assert StairCut.for_model("m", "fp8", "h200", dirs=[tmp_path]).learning_prices


@pytest.mark.parametrize("patch,match", [
    ({"format": "other"}, "'format'"),
    ({"version": 9}, "'version'"),
    ({"widths": [2, 1, 3]}, "'widths' must be ascending"),
    ({"ms": [[1.0, -2.0, 3.0], [1.0, 2.0, 3.0]]}, r"ms\[0\]\[1\] \(context 512, width 2\)"),
    ({"ms": [[1.0, 2.0, 3.0]]}, "'ms' must be 2 rows"),
    ({"contexts": None}, "'contexts' is missing"),
])
def test_malformed_price_file_is_refused_naming_the_field(tmp_path, patch, match):
    d = {"format": "tandem-prices", "version": 1, "widths": [1, 2, 3], "contexts": [512, 1024],
         "ms": [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]}
    d.update(patch)
    p = tmp_path / "x.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PriceFileError, match=match) as e:
        PriceTable.load(p)
    assert str(p) in str(e.value)


def true_price(n: float, L: float) -> float:
    return 8.0 + 0.3 * n + 0.0004 * L + 2.0 * ((n - 1) // 16)


def test_online_prices_converge_to_the_true_curve():
    rng = np.random.default_rng(0)
    on = OnlinePrices()
    for _ in range(3000):
        n, L = int(rng.integers(1, 33)), float(rng.uniform(1000, 32000))
        ms = true_price(n, L) * (1 + 0.03 * rng.standard_normal())
        if rng.random() < 0.05:
            ms *= 3.0  # a stray slow round
        on.observe(n, L, ms)
    for L in (4000, 16000, 30000):
        est = on.curve(L, 32)
        truth = np.array([true_price(n, L) for n in range(1, 33)])
        assert np.max(np.abs(est / truth - 1)) < 0.05, (L, est, truth)
        assert np.all(np.diff(est) >= 0)


def test_a_width_measured_over_a_few_contexts_is_not_carried_far_on_its_own_slope():
    def truth(n, L):
        return 10.0 + 2.0 * n + 0.01 * L

    rng = np.random.default_rng(3)
    on = OnlinePrices()
    for w in (1, 8):                       # measured over the whole range of contexts
        for L in np.linspace(100, 4000, 40):
            on.observe(w, L, truth(w, L) * (1 + 0.01 * rng.standard_normal()))
    # width 3: three samples within 20 tokens, the last two slow: a local slope of 0.5 ms a token
    for L, slow in ((80, 1.0), (90, 1.3), (100, 1.6)):
        on.observe(3, L, truth(3, L) * slow)
    est = on.curve(3000, 8)
    assert est[2] / truth(3, 3000) - 1 < 0.3, est          # its samples plus the shared slope, not 1.5 s
    assert est[0] == pytest.approx(truth(1, 3000), rel=0.05) and est[7] == pytest.approx(truth(8, 3000), rel=0.05)
    assert np.all(np.diff(est) >= 0)


def test_online_learning_reaches_the_cut_of_the_true_prices():
    rng = np.random.default_rng(1)
    tree = bushy_tree()
    for fn in (lambda n, L: 10.0, lambda n, L: 10.0 + 2.0 * n, lambda n, L: 10.0 * n):
        truth = StairCut(table(fn))
        learner = StairCut()
        for _ in range(400):  # the loop: cut, verify (measured), observe
            r = learner.cut(tree, 2000)
            rows = learner.base_rows + len(r.keep)
            learner.observe(rows, 2000, fn(rows, 2000) * (1 + 0.02 * rng.standard_normal()))
            # plus the occasional other width (other trees, other drafters)
            w = int(rng.integers(1, 65))
            learner.observe(w, 2000, fn(w, 2000) * (1 + 0.02 * rng.standard_normal()))
        assert learner.cut(tree, 2000).keep == truth.cut(tree, 2000).keep


def test_online_prices_without_data_use_the_prior_and_stay_monotone():
    on = OnlinePrices(prior_slope=0.1)
    assert on.curve(100, 3).tolist() == pytest.approx([1.0, 1.1, 1.2])
    on.observe(4, 100, 20.0)
    c = on.curve(100, 8)
    assert c[3] == pytest.approx(20.0) and np.all(np.diff(c) > 0)  # beyond: the prior's trend
    for ms in (30.0, 31.0, 29.0):
        on.observe(2, 100, ms)  # narrower but dearer: the isotonic fit pools them
    c = on.curve(100, 8)
    assert np.all(np.diff(c) >= 0)


def simulate(sc: StairCut, tree: TokenTree, true_accept: float, rounds: int, rng: random.Random) -> float:
    """Walk a chain whose every node is accepted with ``true_accept`` given its parent; return mean tokens."""
    got = 0
    for _ in range(rounds):
        path = []
        for i in range(len(tree)):
            if rng.random() >= true_accept:
                break
            path.append(i)
        sc.observe_walk(tree, path)
        got += len(path) + 1
    return got / rounds


def test_calibration_corrects_an_over_confident_drafter():
    rng = random.Random(5)
    tree = TokenTree.from_proposal(Proposal.chain(range(8), [0.9] * 8, "over"))
    sc = StairCut(table(lambda n, L: 10.0 + 3.0 * n))
    before = sc.cut(tree, 100)
    assert sc.calibration("over", [0.9])[0] == pytest.approx(0.9)
    simulate(sc, tree, 0.3, 600, rng)
    assert sc.calibration("over", [0.9])[0] == pytest.approx(0.3, abs=0.05)
    after = sc.cut(tree, 100)
    assert len(after.keep) < len(before.keep)
    # the calibrated expectation of the kept chain matches what the walk then yields
    mean = simulate(StairCut(table(lambda n, L: 10.0)), tree.subtree(after.keep), 0.3, 4000, random.Random(6))
    assert after.expected == pytest.approx(mean, rel=0.08)


def test_calibration_is_per_source_and_monotone():
    cal = Calibration()
    rng = np.random.default_rng(2)
    p = rng.uniform(0, 1, 5000)
    cal.observe(p, rng.uniform(0, 1, 5000) < p ** 2, ["sq"] * 5000)        # true rate p^2
    cal.observe(p, rng.uniform(0, 1, 5000) < p, ["honest"] * 5000)
    grid = np.linspace(0.05, 0.95, 10)
    assert np.all(np.diff(cal("sq", grid)) >= 0)
    assert np.max(np.abs(cal("sq", grid) - grid ** 2)) < 0.08
    assert np.max(np.abs(cal("honest", grid) - grid)) < 0.08
    assert cal("never-seen", [0.42])[0] == pytest.approx(0.42)
    assert cal.sources == ("honest", "sq")


def test_observe_walk_counts_only_nodes_whose_parent_was_accepted():
    tree = TokenTree.merge([Proposal((1, 2, 3, 4), (-1, 0, 0, 1), (0.5, 0.6, 0.7, 0.8), "a"),
                            Proposal((1, 9), (-1, 0), (0.4, 0.3), "b")])
    seen: list[tuple] = []
    sc = StairCut()
    sc.calibration.observe = lambda p, a, s: seen.extend(zip(p, a, s))  # type: ignore[method-assign]
    sc.observe_walk(tree, [0, 2])
    # node 0 (both sources) accepted; its children 1, 2, 4 tried, 2 accepted; node 3's parent (1) was not
    assert sorted(seen) == sorted([(0.5, True, "a"), (0.4, True, "b"), (0.6, False, "a"), (0.7, True, "a"),
                                   (0.3, False, "b")])


def run_rounds(sc: StairCut, tree: TokenTree, true_accept: float, rounds: int, rng: random.Random) -> int:
    """The loop's use of the cut: ``cut_round``, a walk of the kept chain, ``observe_walk``; kept nodes."""
    kept = 0
    for _ in range(rounds):
        r = sc.cut_round(tree, 1000)
        kept += len(r.keep)
        path = []
        for i in range(len(r.tree)):
            if rng.random() >= true_accept:
                break
            path.append(i)
        sc.observe_walk(r.tree, path)
    return kept


def test_a_cut_that_keeps_nothing_explores_and_learns_again():
    tree = TokenTree.from_proposal(Proposal.chain(range(8), [0.9] * 8, "d"))
    prices = table(lambda n, L: 10.0 + 1.0 * n)
    # every 16 rounds in a row that keep nothing, one round keeps the best non-empty cut
    steep = StairCut(table(lambda n, L: 10.0 * n ** 2))
    kept = [len(steep.cut_round(tree, 1000).keep) for _ in range(51)]
    assert kept == ([0] * 16 + [1]) * 3 and steep.explored == 3
    assert steep.cut(tree, 1000).keep == () and steep.explored == 3      # ``cut`` itself never explores
    assert StairCut(prices).cut_round(TokenTree.empty(), 1000).keep == ()  # nothing drafted, nothing to explore
    # a drafter that missed everything at first, then turns good: the exploring cut finds out, the other never
    outcomes = {}
    for every in (16, 0):
        sc = StairCut(prices, explore_every=every)
        rng = random.Random(7)
        run_rounds(sc, tree, 0.0, 1300, rng)
        assert sc.cut(tree, 1000).keep == ()                            # calibrated down to nothing
        outcomes[every] = run_rounds(sc, tree, 0.95, 400, rng), len(sc.cut(tree, 1000).keep)
    assert outcomes[0] == (0, 0)
    assert outcomes[16][1] >= 4 and outcomes[16][0] > 400, outcomes
