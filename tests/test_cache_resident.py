"""The resident prefix: anchor points, anchors at exact positions, plans, the turn pattern, rollback, budget."""

from __future__ import annotations

import logging

import pytest
import torch

from test_cache_toys import LAYOUTS, TinyEngine, assert_same_state, cold, tokens

from tandem_core.cache import GEN_END, GRID, PROMPT_END, CacheStack, ResidentPrefix
from tandem_core.state import ModelState, StateMismatch


def test_anchor_points_and_chunks_split_at_exact_positions():
    r = ResidentPrefix(64)
    assert r.anchor_points(10, 200) == [64, 128, 192, 200]
    assert r.anchor_points(64, 130) == [128, 130]
    assert r.anchor_points(0, 64) == [64]
    assert r.anchor_points(0, 63) == [63]
    assert r.anchor_points(70, 70) == []
    chunks = r.chunks(10, 200, 50)
    assert chunks == [(10, 60), (60, 64), (64, 114), (114, 128), (128, 178), (178, 192), (192, 200)]
    assert ResidentPrefix(1024).anchor_points(0, 2310) == [1024, 2048, 2310]


def prefill(r: ResidentPrefix, eng: TinyEngine, toks: list[int], chunk: int = 50) -> torch.Tensor:
    plan = r.plan(toks, eng.state)
    r.apply(plan, eng.state, reset=eng.reset)
    out = None
    for a, b in r.chunks(plan.start, len(toks), chunk):
        out = eng.forward(torch.as_tensor(toks[a:b]))
        r.commit(toks[a:b], eng.state)
    r.mark_end(eng.state, PROMPT_END)
    return out


def test_anchors_captured_at_exact_positions_during_a_chunked_prefill():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    toks = tokens(230, seed=1)
    prefill(r, eng, toks, chunk=50)
    anchors = r.anchors()
    assert [(a.position, a.kind) for a in anchors] == [(64, GRID), (128, GRID), (192, GRID), (230, PROMPT_END)]
    for a in anchors:    # each anchor is the recurrent state after exactly its position, bit for bit
        _, ref = cold(LAYOUTS["hybrid"], toks[:a.position])
        assert set(a.sections) == set(ref.state.sections)
        for k, v in a.sections.items():
            assert torch.equal(v, ref.state.sections[k]), (a.position, k)
            assert v.data_ptr() != eng.state.sections[k].data_ptr()     # a clone, not the live buffer


def test_plan_latest_anchor_at_or_before_the_common_prefix():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    toks = tokens(230, seed=2)
    prefill(r, eng, toks)
    for common, expect in [(230, 230), (229, 192), (192, 192), (191, 128), (64, 64), (63, 0), (0, 0)]:
        new = toks[:common] + [(toks[common] + 1) % 40 if common < 230 else 0] + [5, 6]
        plan = r.plan(new, eng.state)
        assert plan.common == common and plan.start == expect, (common, plan)
        assert (plan.anchor is None) == (expect == 0)
    # the whole prompt resident: the last token is still forwarded (its logits are needed)
    plan = r.plan(toks, eng.state)
    assert plan.common == 230 and plan.start == 192


def test_model_without_sections_resumes_at_the_common_prefix_itself():
    eng = TinyEngine(**LAYOUTS["attention-only"])
    r = ResidentPrefix(64)
    toks = tokens(230, seed=3)
    prefill(r, eng, toks)
    assert r.anchors() == [] and r.stats().bytes == 0
    new = toks[:101] + [(toks[101] + 1) % 40, 7]
    plan = r.plan(new, eng.state)
    assert plan.start == 101 and plan.anchor is None
    assert plan.describe().describe() == "resident 101 of 103"
    out = prefill(r, eng, new)
    ref, ref_eng = cold(LAYOUTS["attention-only"], new)
    assert torch.equal(out, ref)
    assert_same_state(eng.state, ref_eng.state)


def test_turn_pattern_resumes_exactly_at_the_end_of_the_last_generation():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(1024)        # no grid anchor inside these prompts: only the end anchors count
    stack = CacheStack(r, chunk=64)
    prompt = tokens(300, seed=4)
    logits = stack.prefill(eng, prompt).logits
    history = list(prompt)
    for turn in range(3):
        answer = []
        for i in range(8):
            tok = int(eng.picks(logits)[-1])
            answer.append(tok)
            if i < 7:
                logits = eng.forward(torch.tensor([tok]))
                stack.commit(eng, [tok])
        stack.end_generation(eng)
        assert r.anchors()[-1].kind == GEN_END and r.anchors()[-1].position == eng.state.length
        history = history + answer + tokens(20, seed=100 + turn)
        out = stack.prefill(eng, history)
        assert out.start.describe() == f"resident anchor at {len(history) - 20 - 1} of {len(history)}"
        ref, _ = cold(LAYOUTS["hybrid"], history)
        assert torch.equal(out.logits, ref)
        logits = out.logits


def test_speculation_rollback_tokens_past_the_committed_length_are_not_resident():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    toks = tokens(100, seed=5)
    prefill(r, eng, toks[:90])
    # a verified block of 10 was committed, then the engine rolled back 6 of them
    eng.forward(torch.as_tensor(toks[90:100]))
    r.commit(toks[90:100], eng.state)
    r.mark_end(eng.state, GEN_END)
    eng.rollback_to(94)
    r.rollback(94)
    assert r.length == 94 and max(a.position for a in r.anchors()) == 90
    plan = r.plan(toks + [1, 2], eng.state)
    assert plan.common == 94 and plan.start == 90
    # a rollback the tier was not told of: the live state's length still bounds the plan
    eng.forward(torch.as_tensor(toks[94:100]))
    r.commit(toks[94:100], eng.state)
    eng.rollback_to(96)
    plan = r.plan(toks + [1, 2], eng.state)
    assert plan.common == 96 and plan.start == 90
    r.apply(plan, eng.state, reset=eng.reset)
    out = eng.forward(torch.as_tensor(toks[90:] + [1, 2]))
    ref, ref_eng = cold(LAYOUTS["hybrid"], toks + [1, 2])
    assert torch.equal(out, ref)
    assert_same_state(eng.state, ref_eng.state)


def test_commit_out_of_step_forgets_everything(caplog):
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    prefill(r, eng, tokens(70, seed=6))
    eng.forward(torch.tensor([1, 2]))
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        r.commit([1], eng.state)            # two forwarded, one told
    assert "out of step" in caplog.text
    assert r.length == 0 and r.anchors() == []
    assert r.plan(tokens(70, seed=6) + [1, 2], eng.state).cold


def test_capture_refuses_a_position_the_state_does_not_hold():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    prefill(r, eng, tokens(70, seed=7))
    with pytest.raises(ValueError, match="anchor at 60"):
        r.capture(60, eng.state)


def test_apply_cold_needs_the_engines_reset():
    r = ResidentPrefix(64)
    plan = r.plan([1, 2, 3])
    assert plan.cold
    with pytest.raises(ValueError, match="reset"):
        r.apply(plan, ModelState())


def test_resume_refuses_foreign_sections():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    toks = tokens(130, seed=8)
    prefill(r, eng, toks)
    plan = r.plan(toks[:100] + [0], eng.state)
    other = TinyEngine(**LAYOUTS["odd-views"])
    with pytest.raises(StateMismatch):
        r.apply(plan, other.state, reset=other.reset)


def test_anchor_budget_drops_least_valuable_and_keeps_the_latest():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    one = ResidentPrefix(64)
    prefill(one, eng, tokens(500, seed=9))
    size = one.anchors()[0].nbytes
    assert [a.position for a in one.anchors()] == [64, 128, 192, 256, 320, 384, 448, 500]
    eng2 = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64, anchor_budget=3 * size)
    prefill(r, eng2, tokens(500, seed=9))
    kept = [a.position for a in r.anchors()]
    assert len(kept) == 3 and kept[-1] == 500       # the end anchor is the last to go
    assert r.stats().bytes <= 3 * size


def test_release_order_cheapest_first_latest_last():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    r = ResidentPrefix(64)
    toks = tokens(300, seed=10)
    prefill(r, eng, toks[:100])                     # anchors 64, 100 (prompt end)
    prefill(r, eng, toks)                           # resumes at 100: anchors 64, 100, 128, 192, 256, 300
    assert [a.position for a in r.anchors()] == [64, 100, 128, 192, 256, 300]
    size = r.anchors()[0].nbytes
    # value = tokens back to the previous anchor: 100 (36) and 128 (28) are cheapest; 300 (latest) last
    assert r.value_per_byte() == pytest.approx(r.cost.seconds(100, 128) / size)
    assert r.release(1) == size
    assert [a.position for a in r.anchors()] == [64, 100, 192, 256, 300]
    assert r.release(2 * size) == 2 * size
    # then 100 (36 back to 64), then 64 (64 back to 0; 256 is as cheap but later)
    assert [a.position for a in r.anchors()] == [192, 256, 300]
    r.release(10 * size)
    assert r.anchors() == [] and r.value_per_byte() == float("inf")


def test_grid_follows_the_engines_prefill_chunk(monkeypatch, tmp_path):
    from tandem_core.cache import CacheContext
    from tandem_core.cache.resident import grid_spacing

    assert grid_spacing(1024, 512) == 1024          # a chunk finer than the grid leaves it
    assert grid_spacing(1024, 8192) == 8192         # the 27B CUDA runner's chunk
    assert grid_spacing(1024, 3000) == 3072         # a multiple of the grid, at least the chunk
    with pytest.raises(ValueError, match="anchor spacing"):
        grid_spacing(0, 512)
    monkeypatch.setenv("TANDEM_CACHE_ANCHOR_EVERY", "64")
    r = ResidentPrefix.build(CacheContext("fp", tmp_path, chunk=100))
    assert r.every == 128
    # a cold prompt is forwarded in whole chunks: no grid point cuts one short
    eng = TinyEngine(**LAYOUTS["hybrid"])
    toks = tokens(300, seed=3)
    plan = r.plan(toks, eng.state)
    r.apply(plan, eng.state, reset=eng.reset)
    assert r.chunks(plan.start, len(toks), 128) == [(0, 128), (128, 256), (256, 300)]
    for a, b in r.chunks(plan.start, len(toks), 128):
        eng.forward(torch.as_tensor(toks[a:b]))
        r.commit(toks[a:b], eng.state)
    assert [a.position for a in r.anchors()] == [128, 256]
