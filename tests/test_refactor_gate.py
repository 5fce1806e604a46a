"""The refactor gate: the exact bytes of tiny qwen3_5 and lfm2_moe engines' runs must not move.

Every logit and every byte of state after a chunked prefill and two decode steps
is hashed (tests/refactor_gate_run.py) in a child process pinned to one thread
and CPU-width-independent kernels, and compared with the committed fixture
tests/fixtures/refactor_gate.json. A change that is meant to change arithmetic
re-records it and says why:

    python tests/refactor_gate_run.py --record
"""

from __future__ import annotations

import json

import pytest
import torch

import refactor_gate_run as gate


@pytest.fixture(scope="module")
def pinned_hashes() -> dict[str, str]:
    return gate.run_pinned("default")


def test_every_byte_equals_the_recorded_run(pinned_hashes):
    assert gate.FIXTURE.exists(), "no fixture: run python tests/refactor_gate_run.py --record"
    recorded = json.loads(gate.FIXTURE.read_text())["hashes"]
    assert set(pinned_hashes) == set(recorded), "the gate records other tensors than the fixture"
    moved = sorted(k for k in recorded if recorded[k] != pinned_hashes[k])
    assert not moved, (f"bytes moved in {moved}; if the arithmetic is meant to change, re-record with "
                       f"python tests/refactor_gate_run.py --record and say why")
    for tag in ("prefill", "decode0", "decode1"):
        assert {f"{tag}.logits", f"{tag}.hidden", f"{tag}.state.gdn.S", f"{tag}.state.gdn.conv",
                f"{tag}.state.K", f"{tag}.state.V"} <= set(recorded)
    for tag in ("prefill", "decode0", "decode1", "block_commit", "tree_commit"):
        assert {f"lfm2_moe.{tag}.logits", f"lfm2_moe.{tag}.hidden", f"lfm2_moe.{tag}.state.conv",
                f"lfm2_moe.{tag}.state.K", f"lfm2_moe.{tag}.state.V"} <= set(recorded)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs a CPU with AVX2 to compare vector widths")
def test_the_bytes_do_not_depend_on_the_cpu_vector_width(pinned_hashes):
    assert gate.run_pinned("avx2") == pinned_hashes


def test_the_gate_sees_a_moved_byte():
    """The hash covers the bytes: one ulp in one logit changes it."""
    t = torch.linspace(-1, 1, 64)
    u = t.clone()
    u[17] = torch.nextafter(u[17], torch.tensor(2.0))
    assert gate._digest(t) != gate._digest(u) and gate._digest(t) == gate._digest(t.clone())
