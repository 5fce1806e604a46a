"""Any model through every tier, with no edit to the cache code.

Made-up states (a hybrid, attention only, recurrent only, and odd views: token axes 0,
1 and 2; fp32, bf16, int8, float64 and a 0-d int64 section) go through the resident
prefix, the snapshot store, the disk tier, the session spill and the memory gate. For
each, a restore followed by a forward of the rest of the prompt equals a cold prefill
of the whole prompt BIT FOR BIT (logits and every byte of state): the made-up engine
computes each position on its own, so no tolerance is needed.
"""

from __future__ import annotations

import logging

import pytest
import torch

from test_cache_toys import LAYOUTS, TinyEngine, assert_same_state, cold, tokens

from tandem_core.cache import (
    CacheStack, CostModel, DiskTier, MemoryGate, MemoryGateError, ResidentPrefix, SessionSpill, SnapshotStore,
)

EVERY = 64
CHUNK = 50


def stack_for(lower=(), gate=None, keep_displaced=16) -> CacheStack:
    return CacheStack(ResidentPrefix(EVERY), lower, gate=gate, chunk=CHUNK, keep_displaced=keep_displaced)


def generate(stack: CacheStack, eng: TinyEngine, logits: torch.Tensor, n: int) -> list[int]:
    """Greedy decode of ``n`` tokens the way the decode loop does it: the last pick is not forwarded."""
    out = []
    for i in range(n):
        tok = int(eng.picks(logits)[-1])
        out.append(tok)
        if i < n - 1:
            logits = eng.forward(torch.tensor([tok]))
            stack.commit(eng, [tok])
    stack.end_generation(eng)
    return out


def check_equals_cold(layout: str, eng: TinyEngine, logits: torch.Tensor, prompt: list[int]) -> None:
    ref, ref_eng = cold(LAYOUTS[layout], prompt)
    assert torch.equal(logits, ref)
    assert_same_state(eng.state, ref_eng.state)


@pytest.fixture(params=list(LAYOUTS), ids=list(LAYOUTS))
def layout(request):
    return request.param


def agent_turns():
    """Turn 1's prompt, and a function making turn 2 = turn 1's prompt + answer + tool result."""
    p1 = tokens(150, seed=11)
    tool = tokens(37, seed=12)
    return p1, (lambda answer: p1 + answer + tool)


def test_resident_turn_resumes_at_end_anchor_and_equals_cold(layout):
    eng = TinyEngine(**LAYOUTS[layout])
    stack = stack_for()
    p1, turn2 = agent_turns()
    first = stack.prefill(eng, p1)
    assert first.start.describe() == f"cold 0 of {len(p1)}"
    answer = generate(stack, eng, first.logits, 12)
    p2 = turn2(answer)
    out = stack.prefill(eng, p2)
    end = len(p1) + len(answer) - 1      # the last pick was never forwarded
    assert out.start.start == end
    has_sections = bool(eng.state.sections)
    assert out.start.describe() == (f"resident anchor at {end} of {len(p2)}" if has_sections
                                    else f"resident {end} of {len(p2)}")
    check_equals_cold(layout, eng, out.logits, p2)


def test_resident_divergent_prompt_resumes_at_an_anchor_and_equals_cold(layout):
    eng = TinyEngine(**LAYOUTS[layout])
    stack = stack_for()
    a = tokens(300, seed=21)
    stack.prefill(eng, a)
    b = a[:200] + tokens(50, seed=22)           # shares 200 tokens, diverges inside a grid interval
    out = stack.prefill(eng, b)
    assert out.start.start == (192 if eng.state.sections else 200)
    check_equals_cold(layout, eng, out.logits, b)


def test_store_restores_another_session_and_equals_cold(layout):
    eng = TinyEngine(**LAYOUTS[layout])
    store = SnapshotStore(64 << 20)
    stack = stack_for([store])
    p1, turn2 = agent_turns()
    answer = generate(stack, eng, stack.prefill(eng, p1).logits, 9)
    other = tokens(120, seed=31)                # another session displaces the first
    assert stack.prefill(eng, other).start.tier == "cold"
    assert store.stats().entries == 1
    p2 = turn2(answer)
    out = stack.prefill(eng, p2)
    assert out.start.describe() == f"store {len(p1) + len(answer) - 1} of {len(p2)}"
    assert store.stats().hits == 1
    check_equals_cold(layout, eng, out.logits, p2)
    # and the first session's other prefix: diverging before its end resumes at a kept end anchor
    back = stack.prefill(eng, other + tokens(10, seed=32))
    assert back.start.tier == "store" and back.start.start == len(other)
    check_equals_cold(layout, eng, back.logits, other + tokens(10, seed=32))


def test_disk_restores_after_reopen_and_equals_cold(layout, tmp_path):
    eng = TinyEngine(**LAYOUTS[layout])
    fp = eng.manifest().fingerprint()
    p1, turn2 = agent_turns()
    stack = stack_for()
    answer = generate(stack, eng, stack.prefill(eng, p1).logits, 7)
    assert DiskTier(tmp_path, fp, 1 << 30).offer(stack.snapshot(eng))
    # a new process: a fresh engine, a fresh resident prefix, the disk tier reopened
    eng2 = TinyEngine(**LAYOUTS[layout])
    disk = DiskTier(tmp_path, fp, 1 << 30)
    stack2 = stack_for([disk])
    p2 = turn2(answer)
    out = stack2.prefill(eng2, p2)
    assert out.start.describe() == f"disk {len(p1) + len(answer) - 1} of {len(p2)}"
    assert eng2.resumed_at == [len(p1) + len(answer) - 1]
    check_equals_cold(layout, eng2, out.logits, p2)


def test_spill_restores_sessions_after_restart_and_equals_cold(layout, tmp_path):
    eng = TinyEngine(**LAYOUTS[layout])
    fp = eng.manifest().fingerprint()
    p1, turn2 = agent_turns()
    stack = stack_for()
    answer = generate(stack, eng, stack.prefill(eng, p1).logits, 5)
    SessionSpill(tmp_path, fp).save({"slot0": stack.snapshot(eng)})
    eng2 = TinyEngine(**LAYOUTS[layout])
    stack2 = stack_for()
    restored = SessionSpill(tmp_path, fp).load()
    stack2.adopt(eng2, restored["slot0"])
    assert_same_state(eng2.state, eng.state)
    p2 = turn2(answer)
    out = stack2.prefill(eng2, p2)
    assert out.start.tier == "resident" and out.start.start == len(p1) + len(answer) - 1
    check_equals_cold(layout, eng2, out.logits, p2)


def test_gate_releases_caches_and_the_prefill_still_equals_cold(layout):
    eng = TinyEngine(**LAYOUTS[layout])
    store = SnapshotStore(64 << 20)
    resident = ResidentPrefix(EVERY)
    stack = CacheStack(resident, [store], chunk=CHUNK, keep_displaced=16)
    a, b, c = tokens(200, seed=41), tokens(150, seed=42), tokens(180, seed=43)
    stack.prefill(eng, a)
    stack.prefill(eng, b)                       # a goes to the store
    assert store.stats().entries == 1
    gate = MemoryGate(lambda n: 100 * n, eng.state.view_bytes_per_token(), [resident, store])
    need = gate.need(len(c)).total
    held = gate.held()
    gate.peak = need + held - 1                 # c fits only if some cache is given back
    stack.gate = gate
    out = stack.prefill(eng, c)
    assert gate.released_bytes > 0
    assert gate.available() >= 0
    check_equals_cold(layout, eng, out.logits, c)
    # a prompt that cannot fit even with every cache given back fails alone, releasing nothing
    before = gate.held()
    gate.peak = gate.need(len(a)).total - 1
    with pytest.raises(MemoryGateError, match=f"needs {gate.need(len(a)).total} bytes"):
        stack.prefill(eng, a)
    assert gate.held() == before
    gate.peak = 0                               # measured from the device again: the next request runs
    check_equals_cold(layout, eng, stack.prefill(eng, a + c).logits, a + c)


def test_every_tier_reports_stats(layout, tmp_path, caplog):
    eng = TinyEngine(**LAYOUTS[layout])
    fp = eng.manifest().fingerprint()
    store, disk = SnapshotStore(64 << 20), DiskTier(tmp_path / "disk", fp, 1 << 30)
    stack = stack_for([store, disk])
    with caplog.at_level(logging.INFO, logger="tandem.cache"):
        stack.prefill(eng, tokens(100, seed=51))
    assert any(r.getMessage() == "prefill started: cold 0 of 100" for r in caplog.records)
    stats = {s.tier: s.as_dict() for s in stack.stats()}
    assert set(stats) == {"resident", "store", "disk"}
    for s in stats.values():
        assert set(s) == {"tier", "bytes", "entries", "hits", "misses"}
    assert stats["resident"]["misses"] == 1
    assert stats["store"]["misses"] == 1 and stats["disk"]["misses"] == 1
    spill = SessionSpill(tmp_path / "spill", fp)
    spill.save({"a": stack.snapshot(eng)})
    assert spill.stats().entries == 1 and spill.stats().bytes > 0


def test_cost_model_prices_tokens():
    assert CostModel(2e-3).seconds(100, 600) == pytest.approx(1.0)
    assert CostModel().seconds(0, 131072) == pytest.approx(208.3)
