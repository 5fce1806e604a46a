"""The runner conformance suite: what every engine over a ``Runner`` must pass, run unchanged by each family.

A family's test file subclasses ``RunnerContract`` and gives it a ``case`` fixture::

    class TestMyRunner(RunnerContract):
        @pytest.fixture(scope="class")
        @classmethod
        def case(cls, my_checkpoint):
            return RunnerCase(build=lambda **kw: my_engine(my_checkpoint, **kw), vocab=320)

``case.build(max_context=..., max_tree=...)`` returns a fresh engine (its own buffers) over the same
weights each call; the suite builds the engine under test, a twin (the plain-decode reference) and small
engines of its own. Everything is checked bit for bit (``torch.equal``) against the twin's plain decode
(``forward`` of one token at a time), so a runner passes only if its verified rows are its decode rows:

- the contracts: ``TreeEngine`` and ``ResumableEngine`` verbs, ``caps`` as built;
- chains of every width ``1 .. max_tree`` and random trees (distractors, branches off branches, each node
  against plain decode of its own path): logits and hidden rows, and the state after a commit (sections
  whole, views up to length); rejected branches leave no trace; decoding and verifying on stay plain;
- a tree's lifetime (a second verify, commit, ``discard_pending``, forward, rollback, restore, reset);
- refusals: too wide, bad parents, ids outside the vocabulary, no tokens, a path that is not one, a verify
  past the context;
- ``trim_pending`` / ``rollback_to`` (within the pending tokens for a runner with sections; to any length
  without) and ``settle``; ``resume_at`` at an anchor (sections) or a common prefix;
- the trace verbs (``caps.trace``) have their verbs' arithmetic; taps (``caps.hidden_layers``) of a verify
  equal the decode rows' taps;
- greedy speculation with an oracle drafter equals plain greedy token for token on 20 prompts, with deep
  acceptance; the load-time self-check passes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from tandem_core.engine import ContextFull, ResumableEngine, TreeEngine
from tandem_core.state import StateMismatch
from tandem_core.testing.trees import (
    Recorded, assert_same_state, carries, oracle_tree, path_to, plain_rows_of_tree, random_tree, walk,
)

__all__ = ["RunnerCase", "RunnerContract", "check_a_batched_linear_fails_at_width_two"]


def _prompt(vocab: int) -> Callable[[int, int], list[int]]:
    def make(n: int, seed: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return make


@dataclass
class RunnerCase:
    """One family's runner, for the suite.

    build      ``build(max_context=256, max_tree=64) -> engine``: a fresh engine over the same weights
    vocab      the vocabulary size (ids the engine accepts: ``0 .. vocab - 1``)
    max_tree   the engine's widest verify as ``build`` makes it by default
    prompt     ``prompt(n, seed) -> ids``; default: seeded ids in ``3 .. vocab - 1``
    """

    build: Callable[..., Any]
    vocab: int
    max_tree: int = 64
    prompt: Callable[[int, int], list[int]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def ids(self, n: int, seed: int) -> list[int]:
        return (self.prompt or _prompt(self.vocab))(n, seed)


class RunnerContract:
    """The suite; subclass it (``class TestX(RunnerContract)``) with a class-scoped ``case`` fixture."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> RunnerCase:
        pytest.fail(f"{cls.__name__}: a RunnerContract subclass gives a class-scoped `case` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, case: RunnerCase) -> Any:
        return case.build(max_context=256)

    @pytest.fixture(scope="class")
    @classmethod
    def twin(cls, case: RunnerCase) -> Any:
        """A second engine over the same weights: the plain-decode reference."""
        return case.build(max_context=256)

    @pytest.fixture(scope="class")
    @classmethod
    def rec(cls, case: RunnerCase, twin: Any) -> Recorded:
        return Recorded(twin, case.ids(20, 21), 68)

    # -- the contracts ---------------------------------------------------------------------------------
    def test_the_engine_offers_the_tree_and_resume_verbs(self, case, eng):
        assert isinstance(eng, TreeEngine) and isinstance(eng, ResumableEngine)
        assert eng.caps.tree and eng.caps.resume and eng.caps.max_tree == case.max_tree
        assert eng.caps.max_context == 256 and eng.kv.length == 0
        assert all(p.nbytes >= 0 for p in eng.memory_parts())
        assert eng.manifest().fingerprint() == case.build(max_context=256).manifest().fingerprint()

    # -- row invariance: chains and trees ---------------------------------------------------------------
    def test_chains_of_every_width_equal_the_decode_rows_and_commit_its_state(self, case, eng, rec):
        for w in range(1, eng.caps.max_tree + 1):
            at = w % 5                                              # chains start at several positions
            eng.state.restore(rec.state_at(at))
            out = eng.forward_block(rec.tokens[at:at + w])
            assert out.logits.shape == (w, case.vocab) and out.logits.dtype == torch.float32
            for j in range(w):
                assert torch.equal(out.logits[j], rec.rows[at + j]), f"width {w}, node {j}"
            assert torch.equal(eng.hidden_post_norm(), torch.stack(rec.hidden[at:at + w])), f"width {w} hidden"
            assert eng.kv.length == rec.start.length + at           # nothing committed yet
            eng.commit_tree(range(w))
            assert_same_state(eng.state, rec.state_at(at + w), f"after committing width {w}")

    @pytest.mark.parametrize("size,seed", [(1, 0), (2, 1), (5, 2), (13, 3), (33, 4), (64, 5)])
    def test_random_trees_equal_plain_decode_of_every_nodes_path(self, case, eng, twin, rec, size, seed):
        size = min(size, eng.caps.max_tree)
        rng = random.Random(seed)
        base = rec.state_at(3)
        tokens, parents = random_tree(rng, size, case.vocab)
        eng.state.restore(base)
        out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
        want, hidden, states = plain_rows_of_tree(twin, base, tokens, parents)
        for i in range(size):
            assert torch.equal(out.logits[i], want[i]), f"node {i} (parent {parents[i]})"
        assert torch.equal(eng.hidden_post_norm(), hidden)
        assert eng.kv.length == base.length
        leaf = max(range(size), key=lambda i: (len(path_to(parents, i)), -i))
        eng.commit_tree(path_to(parents, leaf))
        assert_same_state(eng.state, states[leaf], f"after committing the path to node {leaf}")

    def test_rejected_branches_leave_no_trace(self, case, eng, rec):
        rng = random.Random(7)
        truth = rec.tokens[10:16]
        tokens, parents = random_tree(rng, min(40, eng.caps.max_tree), case.vocab, path=truth)
        path, parent = [], -1
        for t in truth:                                            # the path's nodes in the shuffled tree
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

    # -- a tree's lifetime and the refusals -------------------------------------------------------------
    def test_a_second_tree_replaces_the_first_and_discard_drops_it(self, eng, rec):
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

    def test_verify_and_commit_refuse_what_they_cannot_do(self, case, eng, rec):
        eng.state.restore(rec.state_at(0))
        widest = eng.caps.max_tree
        with pytest.raises(ValueError, match=f"exceed max_tree {widest}"):
            eng.forward_block([1] * (widest + 1))
        with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
            eng.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
        with pytest.raises(ValueError, match="3 tokens but 2 parents"):
            eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]))
        with pytest.raises(ValueError, match=f"token id {case.vocab}"):
            eng.forward_block([1, case.vocab])
        with pytest.raises(ValueError, match="token id -1"):
            eng.forward([-1])
        with pytest.raises(ValueError, match="no tokens"):
            eng.forward_block([])
        eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, -1]))
        with pytest.raises(ValueError, match=r"path\[0\] = 7 is not a node"):
            eng.commit_tree([7])
        with pytest.raises(ValueError, match=r"path\[1\] = node 2 has parent -1, not 0"):
            eng.commit_tree([0, 2])
        assert_same_state(eng.state, rec.state_at(0), "refused commits change nothing")
        small = case.build(max_context=24, max_tree=8)
        small.forward(case.ids(20, 3))
        with pytest.raises(ContextFull, match="exceed the engine's context of 24"):
            small.forward_block([1, 2, 3, 4, 5])
        with pytest.raises(ContextFull, match="exceed the engine's context of 24"):
            small.forward([1] * 5)
        assert small.kv.length == 20
        small.forward_tree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, -1, -1, 0]))   # depth 2 fits
        small.commit_tree([0, 4])
        assert small.kv.length == 22

    def test_forward_settles_and_a_state_restore_forgets_pending_and_tree(self, eng, rec):
        eng.state.restore(rec.state_at(0))
        eng.forward_block(rec.tokens[:3])
        eng.commit_tree(range(3))
        eng.forward([rec.tokens[3]])                                # a forward makes the pending permanent
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

    # -- pending tokens, rollback, resume ---------------------------------------------------------------
    def test_trim_pending_and_rollback_land_on_plain_decodes_states(self, eng, rec):
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
        with pytest.raises(ValueError, match="holds"):
            eng.rollback_to(base + 13)
        if eng.state.sections:                                      # recurrent: only the pending tokens
            with pytest.raises(ValueError, match=f"only pending tokens can be taken back \\(positions {base + 5}"):
                eng.rollback_to(base + 4)
            eng.rollback_to(base + 5)                               # every pending token
            assert_same_state(eng.state, rec.state_at(5), "after rolling every pending token back")
            eng.forward_block(rec.tokens[5:9])
            eng.commit_tree(range(4))
            eng.settle()
            with pytest.raises(ValueError, match="only pending tokens"):
                eng.rollback_to(base + 8)
            eng.rollback_to(base + 9)                               # the length itself: nothing to do
            assert_same_state(eng.state, rec.state_at(9))
        else:                                                       # views only: any earlier length
            eng.settle()
            eng.rollback_to(base + 2)
            assert_same_state(eng.state, rec.state_at(2), "after rolling back past the settle point")
            for j in range(2, 6):
                assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
            eng.forward_block(rec.tokens[6:9])
            eng.commit_tree(range(3))                               # 3 pending from base + 6
            eng.rollback_to(base + 4)                               # before them: none are left
            with pytest.raises(ValueError, match="0 tokens are pending"):
                eng.trim_pending(1)
            eng.forward_block(rec.tokens[4:7])
            eng.commit_tree(range(3))
            eng.trim_pending(3)
            assert_same_state(eng.state, rec.state_at(4), "pending counted from the rollback")
        eng.settle()
        with pytest.raises(ValueError, match="0 tokens are pending"):
            eng.trim_pending(1)
        eng.trim_pending(0)

    def test_resume_at_an_anchor_then_forward_equals_the_plain_run(self, eng, rec):
        anchor = rec.state_at(6)                                    # the sections after exactly 6 tokens
        eng.state.restore(rec.state_at(0))
        eng.forward_block(rec.tokens[:12])
        eng.commit_tree(range(12))                                  # the views hold 12 tokens' rows
        eng.forward_block(rec.tokens[12:14])
        eng.resume_at(anchor.length, {k: v.clone() for k, v in anchor.sections.items()})
        assert eng.kv.length == anchor.length
        with pytest.raises(RuntimeError, match="no verified tree"):
            eng.commit_tree([0])
        with pytest.raises(ValueError, match="0 tokens are pending"):
            eng.trim_pending(1)
        for j in range(6, 10):
            assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
        out = eng.forward_block(rec.tokens[10:14])
        assert all(torch.equal(out.logits[i], rec.rows[10 + i]) for i in range(4))
        eng.commit_tree(range(4))
        assert_same_state(eng.state, rec.state_at(14), "after resuming and verifying on")
        eng.resume_at(eng.kv.length)                                 # the caches set the state and say so
        with pytest.raises(StateMismatch, match="cannot resume"):
            eng.resume_at(eng.kv.length + 1)
        if eng.state.sections:
            with pytest.raises(StateMismatch, match="needs the recurrent sections"):
                eng.resume_at(eng.kv.length - 1)
        with pytest.raises(StateMismatch, match="anchor sections"):
            eng.resume_at(4, {"no.such.section": torch.zeros(1)})

    # -- diagnostics and drafter features ---------------------------------------------------------------
    def test_the_trace_verbs_have_their_verbs_arithmetic(self, case):
        eng, twin = case.build(max_context=128), case.build(max_context=128)
        if not eng.caps.trace:
            with pytest.raises(RuntimeError, match="caps.trace"):
                eng.trace_forward([1])
            return
        ids = case.ids(5, 9)
        a = eng.trace_forward(ids)
        b = twin.forward(ids, all_logits=True)
        assert torch.equal(a.logits, b) and eng.kv.length == twin.kv.length == 5
        assert a.points[-1] == "final norm" and len(set(a.points)) == len(a.points)
        width = twin.hidden_post_norm().shape[-1]
        assert all(r.shape == (5, width) for r in a.rows)
        assert torch.equal(a.rows[-1], twin.hidden_post_norm())
        t = eng.trace_tree([7, 8, 9], [-1, 0, 0])
        v = twin.forward_tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))
        assert torch.equal(t.logits, v.logits) and t.points == a.points
        assert all(r.shape == (3, width) for r in t.rows)
        eng.commit_tree([0, 2])                                      # the traced tree is left verified
        twin.commit_tree([0, 2])
        assert_same_state(eng.state, twin.state)
        d = eng.trace_forward([11])                                  # a decode step's trace: its own row
        assert torch.equal(d.logits, twin.forward([11], all_logits=True))

    def test_taps_of_a_verify_equal_the_decode_rows_taps(self, case, rec):
        eng, twin = case.build(max_context=128), case.build(max_context=128)
        layers = eng.caps.hidden_layers
        if not layers:
            with pytest.raises(ValueError, match="cannot be tapped"):
                eng.tap([0])
            return
        tapped = sorted({layers[0], layers[len(layers) // 2], layers[-1]})
        with pytest.raises(ValueError, match="cannot be tapped"):
            eng.tap([max(layers) + 1])
        eng.tap(tapped)
        twin.tap(tapped)
        twin.state.restore(rec.state_at(2))
        want = {i: [] for i in tapped}
        for j in range(2, 9):
            twin.forward([rec.tokens[j]])
            for i in tapped:
                want[i].append(twin.hidden_at(i)[0].clone())
        eng.state.restore(rec.state_at(2))
        eng.forward_block(rec.tokens[2:9])
        for i in tapped:
            assert torch.equal(eng.hidden_at(i), torch.stack(want[i])), f"layer {i}"
        eng.tap(())
        with pytest.raises(KeyError, match="not tapped"):
            eng.hidden_at(tapped[0])

    # -- speculation and the self-check -------------------------------------------------------------------
    def test_greedy_speculation_with_an_oracle_drafter_equals_plain_greedy(self, case, eng, twin):
        prompts = [case.ids(8 + 3 * i, 100 + i) for i in range(14)] + [
            [5, 6, 7] * 8, [9] * 20, [11, 12] * 11 + [11], [40, 41, 42, 43, 44] * 5, [3] * 3 + [30] * 10,
            [7, 7, 8] * 9]
        prompts = [[t % case.vocab for t in p] for p in prompts]
        rng = random.Random(2024)
        rounds = accepted = 0
        n = 36
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
                tokens, parents = oracle_tree(rng, pending, truth, case.vocab)
                tokens, parents = tokens[:eng.caps.max_tree], parents[:eng.caps.max_tree]
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

    def test_the_self_check_passes(self, case):
        from tandem_core.spec.selfcheck import run_selfcheck

        width = min(16, case.max_tree)
        eng = case.build(max_context=128, max_tree=width)
        res = run_selfcheck(eng)
        assert res.ok, res.first_mismatch
        assert res.widths == tuple(range(1, width + 1))
        assert eng.kv.length == 0, "the self-check leaves the engine reset"


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
