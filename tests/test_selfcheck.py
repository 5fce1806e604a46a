"""The load-time self-check (tandem_core.spec.selfcheck) on the tiny qwen3_5 engine: it passes on the real
engine, and on a deliberately broken one it fails naming the verify's width, the row and the layer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from conftest_qwen38 import load_engine, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.engine import SequenceEngine, TreeStep
from tandem_core.spec.selfcheck import LayerTrace, SelfCheck, run_selfcheck
from tandem_core.testing.conformance import check_a_batched_linear_fails_at_width_two

WIDTH = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Far below ATen's grain the thread count changes no arithmetic; one thread is fast on a busy runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine_cls():
    return SequenceEngine


@pytest.fixture(scope="module")
def runner_cls(qwen38_ckpts):
    return type(load_engine(qwen38_ckpts.text.path, max_context=8).runner)


def build(qwen38_ckpts, cls=None, runner=None, **kw):
    """An engine of ``cls`` (a test subclass of the core's engine) over a runner of ``runner`` (a test subclass
    of the plugin's reference runner) on the tiny text checkpoint, ``max_tree`` = WIDTH."""
    base = load_engine(qwen38_ckpts.text.path, max_context=8).runner
    run = (runner or type(base))(base.cfg, base.w, max_context=128, max_tree=WIDTH, **kw)
    return (cls or SequenceEngine)(run)


def nudge(t: torch.Tensor) -> torch.Tensor:
    """Every element one ulp up."""
    return torch.nextafter(t, torch.full_like(t, math.inf))


def test_the_self_check_passes_on_the_engine(qwen38_ckpts):
    eng = build(qwen38_ckpts)
    assert eng.caps.trace and isinstance(eng, LayerTrace)
    res = run_selfcheck(eng)
    assert isinstance(res, SelfCheck)
    assert res.ok, res.first_mismatch
    assert res.first_mismatch is None and res.mismatch is None
    assert res.widths == tuple(range(1, WIDTH + 1))
    # one chain of every width 1..16 and one tree of every width (its path's rows), and the replays' ends
    assert res.rows_checked >= WIDTH * (WIDTH + 1) // 2 + WIDTH
    assert res.seconds < 20, f"the self-check took {res.seconds:.1f} s"
    assert eng.kv.length == 0, "the self-check leaves the engine reset"
    wider = run_selfcheck(eng, tokens=8, max_width=99, seed=3)      # clipped to caps.max_tree
    assert wider.ok and wider.widths == tuple(range(1, WIDTH + 1))


def test_the_self_checks_trees_branch_share_prefixes_and_shuffle(qwen38_ckpts, engine_cls):
    seen: list[tuple[list[int], list[int]]] = []

    class Recording(engine_cls):
        def forward_tree(self, tokens, parents):
            seen.append((torch.as_tensor(tokens).tolist(), torch.as_tensor(parents).tolist()))
            return super().forward_tree(tokens, parents)

    assert run_selfcheck(build(qwen38_ckpts, Recording)).ok
    trees = [(t, p) for t, p in seen if any(q != i - 1 for i, q in enumerate(p))]   # not chains
    assert sorted({len(t) for t, _ in seen}) == list(range(1, WIDTH + 1))
    roots = [sum(q < 0 for q in p) for _, p in trees]
    assert max(roots) >= 2, "some trees have siblings of the path's root"
    deep = [p for _, p in trees if any(q >= 0 and p[q] >= 0 for q in p)]
    assert deep, "some branches hang off branches (shared prefixes)"
    assert any(any(q not in (-1, i - 1) for i, q in enumerate(p)) for _, p in trees)


@pytest.mark.parametrize("layer,kind", [(1, "linear_attention"), (3, "full_attention")])
def test_a_one_ulp_difference_in_one_layers_verify_fails_naming_that_layer(qwen38_ckpts, runner_cls, layer,
                                                                           kind):
    class OneUlpOff(runner_cls):
        """Verifies of 3 or more nodes are off by one ulp in one layer's mixer output."""

        def _gated_deltanet(self, x, w, slot, step, tree):
            out = super()._gated_deltanet(x, w, slot, step, tree)
            hit = kind == "linear_attention" and self.cfg.linear_layers[slot] == layer
            return nudge(out) if hit and isinstance(step, TreeStep) and step.count >= 3 else out

        def _attention(self, x, w, slot, step, tree, cos, sin):
            out = super()._attention(x, w, slot, step, tree, cos, sin)
            hit = kind == "full_attention" and self.cfg.attention_layers[slot] == layer
            return nudge(out) if hit and isinstance(step, TreeStep) and step.count >= 3 else out

    res = run_selfcheck(build(qwen38_ckpts, runner=OneUlpOff))
    assert not res.ok
    m = res.mismatch
    assert m is not None and m.form == "chain" and m.width == 3 and m.node == 0
    assert m.layer == f"layer {layer} {kind} mixer"
    assert "width 3" in res.first_mismatch and f"layer {layer} {kind} mixer" in res.first_mismatch
    assert f"decode row {m.row}" in res.first_mismatch and f"position {m.position}" in res.first_mismatch
    assert res.rows_checked == 1 + 2 + 1                   # widths 1 and 2 passed; the first row of width 3


def test_a_non_invariant_linear_kernel_fails_the_check_at_width_two(qwen38_ckpts):
    lin = build(qwen38_ckpts).runner.w.layers[0].mixer.in_qkv
    check_a_batched_linear_fails_at_width_two(lambda: build(qwen38_ckpts), lambda x: F.linear(x, lin.dense()),
                                              lin.shape[1], "layer 0 linear_attention mixer")


def test_an_inexact_commit_is_named_as_the_state_before_the_row(qwen38_ckpts, engine_cls):
    class LossyCommit(engine_cls):
        def commit_tree(self, path):
            super().commit_tree(path)
            S = self.state.sections["gdn.S"]
            S[0] = nudge(S[0])

    res = run_selfcheck(build(qwen38_ckpts, LossyCommit))
    assert not res.ok and res.mismatch is not None
    assert res.mismatch.form == "chain" and res.mismatch.width == 2 and res.mismatch.layer is None
    assert "the state earlier commits left differs" in res.first_mismatch


def test_a_state_difference_the_rows_cannot_show_is_named_by_tensor(qwen38_ckpts, engine_cls):
    class LastCommitOff(engine_cls):
        """The commit that reaches the recorded end leaves gdn.S slot 2 one ulp off."""

        end = 0

        def commit_tree(self, path):
            super().commit_tree(path)
            if self.kv.length == self.end:
                S = self.state.sections["gdn.S"]
                S[2] = nudge(S[2])

    eng = build(qwen38_ckpts, LastCommitOff)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    eng.end = len(ids) + 12
    res = run_selfcheck(eng, ids, tokens=12, max_width=4)
    assert not res.ok and res.mismatch is not None and res.mismatch.form == "state"
    assert res.mismatch.layer == "section gdn.S at index (2, 0, 0, 0)"
    assert "state after replaying 12 decode steps" in res.first_mismatch and "gdn.S" in res.first_mismatch


class TreeOnly:
    """A ``TreeEngine`` without the diagnostics: every verb but ``trace_*`` passed through."""

    def __init__(self, inner, caps=None):
        self._inner = inner
        self.caps = caps or inner.caps
        self.kv = inner.kv

    def __getattr__(self, name):
        if name.startswith("trace_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def forward(self, tokens, *, all_logits=False):
        return self._inner.forward(tokens, all_logits=all_logits)

    def forward_tree(self, tokens, parents):
        return self._inner.forward_tree(tokens, parents)

    def forward_block(self, tokens):
        return self._inner.forward_block(tokens)

    def commit_tree(self, path):
        self._inner.commit_tree(path)

    def rollback_to(self, n):
        self._inner.rollback_to(n)

    def discard_pending(self):
        self._inner.discard_pending()

    def trim_pending(self, n):
        self._inner.trim_pending(n)

    def settle(self):
        self._inner.settle()

    def resume_at(self, n, sections=None):
        self._inner.resume_at(n, sections)

    def picks(self, logits):
        return self._inner.picks(logits)

    def hidden_post_norm(self):
        return self._inner.hidden_post_norm()

    @property
    def state(self):
        return self._inner.state

    def reset(self):
        self._inner.reset()

    def manifest(self):
        return self._inner.manifest()

    def memory_parts(self):
        return self._inner.memory_parts()


def test_without_a_layer_trace_the_row_is_still_named(qwen38_ckpts, engine_cls):
    class Off(engine_cls):
        def forward_tree(self, tokens, parents):
            out = super().forward_tree(tokens, parents)
            return out._replace(logits=nudge(out.logits)) if len(out.logits) == 5 else out

    inner = build(qwen38_ckpts, Off)
    wrapped = TreeOnly(inner, dataclasses.replace(inner.caps, trace=False))
    assert not isinstance(wrapped, LayerTrace)
    res = run_selfcheck(wrapped)
    assert not res.ok and res.mismatch is not None and res.mismatch.layer is None
    assert res.mismatch.width == 5 and "layer unknown" in res.first_mismatch
    assert "no layer trace (caps.trace is off)" in res.first_mismatch


def test_an_engine_without_trees_or_one_that_raises_fails_the_check(qwen38_ckpts, engine_cls):
    eng = build(qwen38_ckpts)
    res = run_selfcheck(TreeOnly(eng, dataclasses.replace(eng.caps, tree=False)))
    assert not res.ok and res.rows_checked == 0 and "caps.tree" in res.first_mismatch

    class Broken(engine_cls):
        def commit_tree(self, path):
            raise RuntimeError("the commit kernel is missing")

    res = run_selfcheck(build(qwen38_ckpts, Broken))
    assert not res.ok and "RuntimeError: the commit kernel is missing" in res.first_mismatch


def test_the_trace_names_the_layers_of_the_family(qwen38_ckpts):
    t = build(qwen38_ckpts).trace_forward([5, 17, 2, 99, 43])
    assert t.points[0] == "layer 0 linear_attention mixer" and len(t.points) == 2 * 4 + 1
    assert all(r.shape == (5, 64) for r in t.rows)
