"""The disk tier: files + manifest, sums and fingerprints checked, bad files dropped with a log line."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from safetensors import safe_open

from test_cache_toys import LAYOUTS, TinyEngine, assert_same_state, cold, tokens

from tandem_core.cache import CacheStack, DiskTier, ResidentPrefix
from tandem_core.cache.files import CorruptFile, read_verified, write_atomic

FP = "a" * 64


def session(layout: str = "odd-views", n: int = 150, seed: int = 1):
    eng = TinyEngine(**LAYOUTS[layout])
    stack = CacheStack(ResidentPrefix(64), chunk=40)
    toks = tokens(n, seed=seed)
    stack.prefill(eng, toks)
    return eng, stack, toks


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_roundtrip_through_files_keeps_every_byte_and_dtype(layout, tmp_path):
    eng, stack, toks = session(layout)
    snap = stack.snapshot(eng)
    assert DiskTier(tmp_path, FP, 1 << 30).offer(snap)
    disk = DiskTier(tmp_path, FP, 1 << 30)
    assert disk.stats().entries == 1
    hit = disk.lookup(np.asarray(toks + [3]), len(toks))
    assert hit.start == len(toks)
    assert_same_state(disk.load(hit), eng.state)
    # a plain safetensors file, its JSON header carrying tokens, length, view axes, signature, fingerprint
    (key,) = disk.entries()
    with safe_open(str(disk.path(key)), "pt") as f:
        meta = json.loads(f.metadata()["tandem"])
        assert set(f.keys()) == {f"section.{k}" for k in eng.state.sections} | {
            f"view.{k}" for k in eng.state.views} | {
            f"anchor.{a.position}.{k}" for a in snap.anchors for k in a.sections}
    assert meta["tokens"] == toks and meta["length"] == len(toks) and meta["fingerprint"] == FP
    assert meta["axes"] == {k: v.axis for k, v in eng.state.views.items()}
    assert meta["signature"] == json.loads(json.dumps(eng.state.signature()))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    rec = manifest["entries"][key]
    assert rec["fingerprint"] == FP and len(rec["sha256"]) == 64 and rec["length"] == len(toks)


def test_a_corrupted_file_is_dropped_with_a_log_line_and_the_prefill_is_still_right(tmp_path, caplog):
    eng, stack, toks = session("hybrid")
    DiskTier(tmp_path, FP, 1 << 30).offer(stack.snapshot(eng))
    disk = DiskTier(tmp_path, FP, 1 << 30)
    (key,) = disk.entries()
    path = disk.path(key)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01                                     # one bit of one tensor
    path.write_bytes(bytes(raw))
    prompt = toks + tokens(30, seed=2)
    eng2 = TinyEngine(**LAYOUTS["hybrid"])
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        out = CacheStack(ResidentPrefix(64), [disk], chunk=40).prefill(eng2, prompt)
    assert out.start.tier == "cold"
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and path.name in lines[0] and "sha256" in lines[0]
    assert not path.exists() and disk.stats().entries == 0
    assert disk.lookup(np.asarray(prompt), len(prompt) - 1) is None
    ref, ref_eng = cold(LAYOUTS["hybrid"], prompt)
    assert torch.equal(out.logits, ref)
    assert_same_state(eng2.state, ref_eng.state)
    assert key not in json.loads((tmp_path / "manifest.json").read_text())["entries"]


def test_a_changed_fingerprint_drops_every_file_with_a_log_line(tmp_path, caplog):
    eng, stack, toks = session("hybrid")
    DiskTier(tmp_path, FP, 1 << 30).offer(stack.snapshot(eng))
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        disk = DiskTier(tmp_path, "b" * 64, 1 << 30)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and files[0].name in lines[0] and "fingerprint" in lines[0]
    assert disk.lookup(np.asarray(toks + [1]), len(toks)) is None and disk.stats().entries == 0
    assert not files[0].exists()


def test_a_header_fingerprint_that_disagrees_with_the_manifest_is_never_used(tmp_path, caplog):
    eng, stack, toks = session("hybrid")
    disk = DiskTier(tmp_path, FP, 1 << 30)
    disk.offer(stack.snapshot(eng))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for rec in manifest["entries"].values():
        rec["fingerprint"] = "c" * 64                   # the manifest lies about a foreign file
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        other = DiskTier(tmp_path, "c" * 64, 1 << 30)
    assert other.stats().entries == 0 and "does not match" in caplog.text


def test_interrupted_writes_and_unknown_files_are_removed_at_open(tmp_path, caplog):
    eng, stack, toks = session("attention-only")
    DiskTier(tmp_path, FP, 1 << 30).offer(stack.snapshot(eng))
    (tmp_path / "0123.safetensors.tmp").write_bytes(b"half a file")
    (tmp_path / "4567.safetensors").write_bytes(b"not in the manifest")
    (tmp_path / "notes.txt").write_text("someone else's")
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        disk = DiskTier(tmp_path, FP, 1 << 30)
    assert disk.stats().entries == 1
    assert not (tmp_path / "0123.safetensors.tmp").exists() and not (tmp_path / "4567.safetensors").exists()
    assert (tmp_path / "notes.txt").exists()
    assert caplog.text.count("not in the manifest") == 2


def test_an_unreadable_manifest_drops_the_files(tmp_path, caplog):
    eng, stack, toks = session("attention-only")
    DiskTier(tmp_path, FP, 1 << 30).offer(stack.snapshot(eng))
    (tmp_path / "manifest.json").write_text("{ torn")
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        disk = DiskTier(tmp_path, FP, 1 << 30)
    assert disk.stats().entries == 0 and not list(tmp_path.glob("*.safetensors"))
    assert "unreadable" in caplog.text


def test_budget_evicts_the_least_valuable_file(tmp_path):
    snaps = []
    for n, seed in ((60, 1), (200, 2), (120, 3)):
        eng, stack, _ = session("hybrid", n=n, seed=seed)
        snaps.append(stack.snapshot(eng))
    sizer = DiskTier(tmp_path / "sizes", FP, 1 << 30)
    sizes = []
    for s in snaps:
        sizer.offer(s)
        sizes.append(max(e.bytes for e in sizer.entries().values() if e.length == s.length))
    budget = sizes[1] + sizes[2]                    # room for the 200- and 120-token files, not all three
    disk = DiskTier(tmp_path / "d", FP, budget)
    assert disk.offer(snaps[0]) and disk.offer(snaps[1])
    assert disk.offer(snaps[2])                     # pushes out the 60-token one: least saved per byte
    assert sorted(e.length for e in disk.entries().values()) == [120, 200]
    assert len(list((tmp_path / "d").glob("*.safetensors"))) == 2
    assert disk.stats().bytes <= budget
    assert not DiskTier(tmp_path / "z", FP, 0).offer(snaps[0])    # a zero budget keeps nothing


def test_atomic_write_leaves_nothing_behind_when_it_fails(tmp_path):
    with pytest.raises(ValueError, match="complex"):
        write_atomic(tmp_path / "x.safetensors", {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.complex64)},
                     {"tandem": "{}"})
    assert list(tmp_path.iterdir()) == []
    digest, size = write_atomic(tmp_path / "y.safetensors", {"a": torch.arange(4.0)}, {"tandem": "{}"})
    assert list(p.name for p in tmp_path.iterdir()) == ["y.safetensors"]
    tensors, meta = read_verified(tmp_path / "y.safetensors", digest)
    assert torch.equal(tensors["a"], torch.arange(4.0)) and meta == {}
    with pytest.raises(CorruptFile, match="sha256"):
        read_verified(tmp_path / "y.safetensors", "0" * 64)
