"""Tensors read without a memory map equal safetensors' own reading, whole or through the staging buffer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tandem_core.checkpoint.safetensors as st
from tandem_core.checkpoint.safetensors import CheckpointError, SafetensorsCheckpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(1000, 777, generator=g),
        "c.f16": torch.randn(5, generator=g).to(torch.float16),
        "d.i64": torch.randint(-2**40, 2**40, (9, 3), generator=g),
        "e.bool": torch.rand(13, generator=g) > 0.5,
        "f.f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "g.empty": torch.zeros(0, 4),
        "h.scalar": torch.tensor(3.5),
    }


@pytest.fixture()
def ckpt(tmp_path):
    ts = _tensors()
    save_file(ts, str(tmp_path / "model.safetensors"))
    return SafetensorsCheckpoint(tmp_path), load_file(str(tmp_path / "model.safetensors"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64) if t.is_floating_point() else t
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(wide(a), wide(b))


def test_direct_read_equals_safetensors(ckpt):
    reader, ref = ckpt
    for key, want in ref.items():
        assert _same(reader.get(key), want), key


def test_staged_read_in_slices_equals_safetensors(ckpt, monkeypatch):
    reader, ref = ckpt
    monkeypatch.setattr(st, "STAGING_BYTES", 4096)      # the 3 MB tensor crosses the buffer hundreds of times
    for key, want in ref.items():
        info = reader.info(key)
        got = st.read_tensor(info, reader.data_start[info.file], "cpu", staged=True)
        assert _same(got, want), key


def test_truncated_shard_names_the_tensor(tmp_path):
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    reader = SafetensorsCheckpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="tensor 'w'.*truncated"):
        reader.get("w")


SCRIPT = """
import resource, sys, torch
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
d = sys.argv[1]
torch.empty(1, device="cuda")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
w = SafetensorsCheckpoint(d).get("w", "cuda")
torch.cuda.synchronize()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, float(w.float().sum()))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the staged read's host memory)")
def test_gpu_read_holds_only_the_staging_buffer_on_the_host(tmp_path):
    # a fresh process that only reads: its high-water mark grows by the staging buffer, not the 512 MiB
    # tensor (a memory-mapped read, safetensors' device read among them, grows it by the whole tensor)
    save_file({"w": torch.ones(256, 1024, 1024, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grew, total = out.stdout.split()
    assert float(total) == 256 * 1024 * 1024
    assert int(grew) < st.STAGING_BYTES + 96 * 2**20, f"host peak grew {int(grew) / 2**20:.0f} MiB"
