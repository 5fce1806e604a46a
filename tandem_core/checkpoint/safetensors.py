"""Reading safetensors checkpoints: one file or shards with an index.

The header is parsed here (not through a library's private state) so the audit can
check every tensor's dtype, shape and byte range against the file before any
tensor is read. Tensors are read with plain file reads (no memory map): onto the CPU
straight into the new tensor's storage; onto a GPU through one page-locked staging
buffer of ``STAGING_BYTES``, slice by slice. A memory-mapped read counts every page it
touches in the process's resident set until the map closes (a 2.5 GB embedding is 2.5 GB
of RSS at once), and safetensors' device read goes through one; a staged read holds at
most the staging buffer on the host, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["TensorInfo", "SafetensorsCheckpoint", "CheckpointError", "ST_DTYPES", "STAGING_BYTES", "read_tensor"]

STAGING_BYTES = 64 * 1024 * 1024    # the host buffer a read onto a GPU goes through, slice by slice

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: named file, named tensor."""


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: Path
    dtype: str          # safetensors dtype string ("BF16")
    shape: tuple[int, ...]
    begin: int          # byte offsets inside the file's data section
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype]


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path.name}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            head = f.read(n)
            if len(head) < n:
                raise CheckpointError(f"{path.name}: truncated inside its header")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    try:
        return json.loads(head), 8 + n
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path.name}: header is not valid JSON ({exc})") from exc


_staging: dict[str, torch.Tensor] = {}
_staging_lock = threading.Lock()


def _staging_buffer(pin: bool) -> torch.Tensor:
    key = "pinned" if pin else "pageable"
    buf = _staging.get(key)
    if buf is None or len(buf) != STAGING_BYTES:
        buf = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin)
        _staging[key] = buf
    return buf


def _read_exact(fd: int, into: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{what}: the file ends inside the tensor (truncated)")
        done += n


def read_tensor(info: TensorInfo, data_start: int, device: str | torch.device = "cpu", *,
                staged: bool | None = None) -> torch.Tensor:
    """Tensor ``info`` of its file, on ``device``, read without a memory map (module docstring). ``staged``
    (default: on any device but the CPU) reads through the staging buffer, slice by slice."""
    dev = torch.device(device)
    if staged is None:
        staged = dev.type != "cpu"
    nbytes = info.end - info.begin
    raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    what = f"{info.file.name}: tensor {info.key!r}"
    try:
        fd = os.open(info.file, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{info.file}: cannot read: {exc}") from exc
    try:
        at = data_start + info.begin
        if not staged:
            if nbytes:
                _read_exact(fd, memoryview(raw.numpy()), at, what)
        else:
            with _staging_lock:     # one staging buffer: loads on several threads take turns
                buf = _staging_buffer(pin=torch.cuda.is_available())
                view = memoryview(buf.numpy())
                step = min(STAGING_BYTES, len(buf))
                for off in range(0, nbytes, step):
                    n = min(step, nbytes - off)
                    _read_exact(fd, view[:n], at + off, what)
                    raw[off:off + n].copy_(buf[:n])     # synchronous: the buffer is free again after it
    finally:
        os.close(fd)
    dtype = info.torch_dtype
    if dtype == torch.bool:
        return raw.view(torch.bool).reshape(info.shape)
    return raw.view(dtype).reshape(info.shape)


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory, by checkpoint key."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index.name}: not a safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        self.files = [self.dir / f for f in files]
        self.infos: dict[str, TensorInfo] = {}
        self.data_start: dict[Path, int] = {}
        for path in self.files:
            if not path.exists():
                raise CheckpointError(f"shard {path.name} named in the index is missing")
            header, start = _read_header(path)
            self.data_start[path] = start
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                b, e = meta["data_offsets"]
                self.infos[key] = TensorInfo(key, path, meta["dtype"], tuple(meta["shape"]), b, e)
        if weight_map is not None:
            for key, fname in weight_map.items():
                info = self.infos.get(key)
                if info is None:
                    raise CheckpointError(f"tensor {key!r} is in the index ({fname}) but not in the shard")

    def keys(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def info(self, key: str) -> TensorInfo:
        try:
            return self.infos[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint at {self.dir}") from None

    def get(self, key: str, device: str | torch.device | None = None) -> torch.Tensor:
        """The tensor ``key``, read straight onto ``device`` (default: the CPU) without a memory map; onto a GPU
        through the staging buffer, so a load holds at most ``STAGING_BYTES`` of weights on the host."""
        info = self.info(key)
        return read_tensor(info, self.data_start[info.file], device or "cpu")

    def nbytes(self, key: str) -> int:
        """The stored bytes of tensor ``key``."""
        info = self.info(key)
        return info.end - info.begin

    def iter_files(self) -> Iterator[Path]:
        return iter(self.files)

    def check_sizes(self) -> None:
        """Every tensor's bytes are inside its file and agree with its dtype and shape."""
        sizes = {p: p.stat().st_size for p in self.files}
        for info in self.infos.values():
            n = 1
            for d in info.shape:
                n *= d
            want = n * _ITEMSIZE.get(info.dtype, 1)
            if info.end - info.begin != want:
                raise CheckpointError(f"tensor {info.key!r} in {info.file.name}: {info.end - info.begin} bytes "
                                      f"for {info.dtype}{list(info.shape)} (needs {want})")
            if self.data_start[info.file] + info.end > sizes[info.file]:
                raise CheckpointError(f"shard {info.file.name} is truncated: tensor {info.key!r} ends at byte "
                                      f"{self.data_start[info.file] + info.end}, the file has {sizes[info.file]}")
