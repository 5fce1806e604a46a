"""The memory gate: admits what fits, gives caches back cheapest first across tiers, refuses with the sizes."""

from __future__ import annotations

import math

import pytest

from test_cache_toys import LAYOUTS, TinyEngine, tokens

from tandem_core.cache import CacheStack, MemoryGate, MemoryGateError, ResidentPrefix, SnapshotStore, TierStats
from tandem_core.cache.gate import device_available


class FakeTier:
    """A cache holding entries of 100 bytes with the given values (seconds saved per byte)."""

    def __init__(self, name: str, values: list[float], log: list) -> None:
        self.name, self.values, self.log = name, sorted(values), log

    def value_per_byte(self) -> float:
        return self.values[0] if self.values else math.inf

    def release(self, bytes_needed: int) -> int:
        freed = 0
        while freed < bytes_needed and self.values:
            self.log.append((self.name, self.values.pop(0)))
            freed += 100
        return freed

    def stats(self) -> TierStats:
        return TierStats(self.name, 100 * len(self.values), len(self.values), 0, 0)


def test_a_prompt_that_fits_releases_nothing():
    log: list = []
    a = FakeTier("a", [1, 2], log)
    gate = MemoryGate(lambda n: 10 * n, 2, [a], peak_bytes=10_000, base_bytes=1_000)
    res = gate.check(100, start=40)
    assert res.need.workspace == 1000 and res.need.views == 120 and res.need.total == 1120
    assert res.available == 10_000 - 1_000 - 200 and res.released == () and log == []


def test_caches_are_given_back_cheapest_first_across_tiers():
    log: list = []
    a, b = FakeTier("a", [1, 5, 9], log), FakeTier("b", [2, 3, 10], log)
    gate = MemoryGate(lambda n: n, 0, [a, b], peak_bytes=1, base_bytes=0)
    need = gate.need(1000).total
    gate.peak = need + 600 - 450           # everything cached (600) and 450 short
    res = gate.check(1000)
    assert log == [("a", 1), ("b", 2), ("b", 3), ("a", 5), ("a", 9)]
    assert res.released == (("a", 300), ("b", 200))
    assert res.available >= need
    assert gate.value_order() == [("b", 10), ("a", math.inf)]


def test_a_prompt_that_cannot_fit_fails_alone_with_the_sizes_and_releases_nothing():
    log: list = []
    a = FakeTier("a", [1, 2, 3], log)
    gate = MemoryGate(lambda n: 4096 * n, 1024, [a], peak_bytes=3 << 20, base_bytes=1 << 20)
    with pytest.raises(MemoryGateError) as err:
        gate.check(1000)
    need = 4096 * 1000 + 1024 * 1000
    have = (3 << 20) - (1 << 20) - 300
    msg = str(err.value)
    assert f"a prompt of 1000 tokens needs {need} bytes" in msg
    assert f"but {have} bytes" in msg and "under the declared peak of 3.00 MiB" in msg
    assert "could give back only 300 bytes" in msg
    assert err.value.need.total == need and err.value.available == have
    assert log == [] and a.stats().entries == 3 and gate.refused == 1
    assert gate.check(100).released == ()  # the next request, which fits, runs


def test_measured_from_the_device_counts_what_was_released():
    log: list = []
    a = FakeTier("a", [4, 1, 2, 3, 5, 6], log)
    gate = MemoryGate(lambda n: n, 0, [a], available=lambda: 1000)
    res = gate.check(1250)
    assert res.available == 1300 and [v for _, v in log] == [1, 2, 3]
    with pytest.raises(MemoryGateError, match="on the device"):
        gate.check(5000)


def test_device_available_on_the_cpu_is_a_positive_byte_count():
    n = device_available("cpu")
    assert isinstance(n, int) and n > 0


def test_peak_from_the_setting(monkeypatch):
    monkeypatch.setenv("TANDEM_MEM_PEAK", str(7 << 30))
    gate = MemoryGate.from_settings(lambda n: n, 8)
    assert gate.peak == 7 << 30


def test_real_tiers_release_least_recompute_per_byte_first():
    eng = TinyEngine(**LAYOUTS["hybrid"])
    resident, store = ResidentPrefix(64), SnapshotStore(1 << 20)
    stack = CacheStack(resident, [store], chunk=50, keep_displaced=16)
    stack.prefill(eng, tokens(300, seed=1))
    stack.prefill(eng, tokens(100, seed=2))          # the 300-token session goes to the store
    assert store.stats().entries == 1 and resident.stats().entries == 2   # anchors 64 and 100
    gate = MemoryGate(lambda n: n, 0, [resident, store], peak_bytes=1)
    # the toy's recurrent state is tiny: an anchor saves 36 tokens for 96 bytes, the stored snapshot
    # 300 tokens for its whole views, so the snapshot is the cheaper memory to give back
    assert store.value_per_byte() < resident.value_per_byte()
    held = store.stats().bytes
    gate.peak = gate.need(10).total + gate.held() - 1
    res = gate.check(10)
    assert res.released == (("store", held),)
    assert store.stats().entries == 0 and [a.position for a in resident.anchors()] == [64, 100]
    anchor = resident.anchors()[0].nbytes
    gate.peak = gate.need(10).total + gate.held() - 1
    res = gate.check(10)                # then the anchor at 64: the latest (100) goes last
    assert res.released == (("resident", anchor),)
    assert [a.position for a in resident.anchors()] == [100]


def test_a_side_lane_prompt_counts_the_parked_state():
    log: list = []
    a = FakeTier("a", [1], log)
    gate = MemoryGate(lambda n: 10 * n, 2, [a], peak_bytes=10_000, base_bytes=1_000)
    # 8,900 available (peak - base - the 100 cached); the prompt alone needs 1,200
    assert gate.check(100, 0, parked=7_700).released == ()                       # fits as it is
    with pytest.raises(MemoryGateError, match=r"workspace 1000 B \+ views 200 B \+ parked state 7.62 KiB"):
        gate.check(100, 0, parked=7_801)                                         # even with the cache given back
    assert log == []
    assert gate.check(100, 0, parked=7_750).released == (("a", 100),)          # with the cache given back
