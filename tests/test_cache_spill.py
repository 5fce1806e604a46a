"""The session spill: sessions through a restart, and a ``kill -9`` mid-spill leaves the old or the new one.

The kill tests run the spill in a real subprocess and SIGKILL it: once at a known point
(after its second file, while it waits in its progress callback), and at random instants
of a spill with many files. Every time, the next ``load`` restores either the old spill or
the new one whole, checked by a sha256 over every session's tokens and tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem_core.cache import Snapshot
from tandem_core.cache.base import Anchor
from tandem_core.cache.spill import SessionSpill
from tandem_core.state import ModelState, View

FP = "f" * 64
HERE = Path(__file__).resolve().parent

CHILD = """
import sys, time
sys.path.insert(0, {here!r})
from test_cache_spill import make_sessions
from tandem_core.cache.spill import SessionSpill
d, seed, n, kib, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sessions = make_sessions(seed, n, kib)
def on_file(name, done, total):
    print("file", done, flush=True)
    if done == pause_at:
        time.sleep(60)
SessionSpill(d, {fp!r}).save(sessions, on_file=on_file)
print("done", flush=True)
"""


def make_sessions(seed: int, n: int, kib: int) -> dict[str, Snapshot]:
    """``n`` made-up sessions of about ``kib`` KiB each (a recurrent section, a bf16 view, an anchor)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        length = 50 + i
        toks = torch.randint(0, 1000, (length,), generator=g).numpy().astype(np.int64)
        state = ModelState({"gdn.S": torch.randn(kib * 256, generator=g)},
                           {"K": View(torch.randn(2, length, 16, generator=g).to(torch.bfloat16), 1)}, length)
        anchor = Anchor(length // 2, {"gdn.S": torch.randn(kib * 256, generator=g)}, "prompt")
        out[f"slot{i}"] = Snapshot(toks, state, (anchor,))
    return out


def digest(sessions: dict[str, Snapshot]) -> dict[str, str]:
    """A sha256 over each session's tokens, tensors and anchors."""
    out = {}
    for name, s in sessions.items():
        h = hashlib.sha256(s.tokens.astype("<i8").tobytes())
        for k, t in sorted(s.state.tensors().items()):
            h.update(k.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        for a in s.anchors:
            h.update(f"{a.position}{a.kind}".encode())
            for k, t in sorted(a.sections.items()):
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def child(tmp_path: Path, d: Path, seed: int, n: int, kib: int, pause_at: int) -> subprocess.Popen:
    """A fresh interpreter spilling ``make_sessions(seed, n, kib)`` into ``d``, pausing after file ``pause_at``."""
    script = tmp_path / "spill_child.py"
    script.write_text(CHILD.format(here=str(HERE), fp=FP))
    return subprocess.Popen([sys.executable, str(script), str(d), str(seed), str(n), str(kib), str(pause_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, line: str, timeout: float = 30.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            raise AssertionError(f"child ended before {line!r}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"child never printed {line!r}")


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_roundtrip_and_generations(tmp_path):
    spill = SessionSpill(tmp_path, FP)
    assert spill.load() == {}
    a = make_sessions(1, 3, 4)
    first = spill.save(a)
    assert digest(SessionSpill(tmp_path, FP).load()) == digest(a)
    b = make_sessions(2, 2, 4)
    second = spill.save(b)
    assert not first.exists() and second.name > first.name
    got = SessionSpill(tmp_path, FP).load()
    assert digest(got) == digest(b) and set(got) == {"slot0", "slot1"}
    manifest = json.loads((second / "manifest.json").read_text())
    assert manifest["fingerprint"] == FP and all(len(r["sha256"]) == 64 for r in manifest["sessions"].values())
    spill.clear()
    assert SessionSpill(tmp_path, FP).load() == {}


def test_another_fingerprint_is_dropped_with_a_log_line(tmp_path, caplog):
    SessionSpill(tmp_path, FP).save(make_sessions(1, 2, 4))
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert SessionSpill(tmp_path, "0" * 64).load() == {}
    assert "fingerprint" in caplog.text
    assert SessionSpill(tmp_path, FP).load() == {}      # dropped, not kept for later


def test_a_corrupted_session_is_dropped_the_others_restored(tmp_path, caplog):
    sessions = make_sessions(3, 3, 4)
    gen = SessionSpill(tmp_path, FP).save(sessions)
    f = gen / "session-0001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    spill = SessionSpill(tmp_path, FP)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        got = spill.load()
    assert set(got) == {"slot0", "slot2"} and "slot1" in caplog.text and "sha256" in caplog.text
    want = digest(sessions)
    assert digest(got) == {k: want[k] for k in ("slot0", "slot2")}
    assert (spill.stats().hits, spill.stats().misses) == (2, 1)


def test_kill_9_mid_spill_leaves_the_old_spill(tmp_path):
    d = tmp_path / "spill"
    old = make_sessions(1, 3, 64)
    SessionSpill(d, FP).save(old)
    proc = child(tmp_path, d, seed=2, n=6, kib=512, pause_at=2)
    try:
        wait_for(proc, "file 2")          # two of six files are on disk; the child waits in its callback
    finally:
        kill9(proc)
    unfinished = list(d.glob("spill-*.tmp"))
    assert len(unfinished) == 1 and len(list(unfinished[0].glob("session-*.safetensors"))) == 2
    got = SessionSpill(d, FP).load()
    assert digest(got) == digest(old)
    assert not list(d.glob("spill-*.tmp"))  # the unfinished spill was discarded


def test_kill_9_at_random_instants_leaves_the_old_or_the_new_spill(tmp_path):
    """Forked writers (no interpreter start-up, so many instants are cheap) killed uniformly over a spill's
    whole duration, its commit included."""
    d = tmp_path / "spill"
    current = make_sessions(1, 2, 16)
    SessionSpill(d, FP).save(current)
    timing = make_sessions(99, 16, 128)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            SessionSpill(tmp_path / "timing", FP).save(timing)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    took = time.perf_counter() - t0       # a forked writer's whole spill, fork to exit
    rng = random.Random(7)
    outcomes = {"old": 0, "new": 0}
    for seed in range(11, 19):
        new = make_sessions(seed, 16, 128)
        pid = os.fork()
        if pid == 0:                      # the child writes the spill and nothing else
            try:
                SessionSpill(d, FP).save(new)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 1.3 * took))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        got = digest(SessionSpill(d, FP).load())
        assert got in (digest(current), digest(new)), seed
        outcomes["new" if got == digest(new) else "old"] += 1
        if got == digest(new):
            current = new
    assert sum(outcomes.values()) == 8
    # and a spill left to finish is the one restored
    final = make_sessions(30, 3, 16)
    pid = os.fork()
    if pid == 0:
        try:
            SessionSpill(d, FP).save(final)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert digest(SessionSpill(d, FP).load()) == digest(final)
    print("kill -9 outcomes:", outcomes)


@pytest.mark.parametrize("n", [0, 1])
def test_empty_or_single_spill(tmp_path, n):
    s = make_sessions(4, n, 4)
    SessionSpill(tmp_path, FP).save(s)
    assert digest(SessionSpill(tmp_path, FP).load()) == digest(s)
