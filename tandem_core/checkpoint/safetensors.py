"""Reading safetensors checkpoints: one file or shards with an index.

The header is parsed here (not through a library's private state) so the audit can
check every tensor's dtype, shape and byte range against the file before any
tensor is read; tensors themselves are read with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["TensorInfo", "SafetensorsCheckpoint", "CheckpointError", "ST_DTYPES"]

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
        """The tensor ``key``, read straight onto ``device`` (default: the CPU): one tensor's bytes pass through
        the host at a time, so loading a checkpoint never holds a whole host copy of it."""
        from safetensors import safe_open

        info = self.info(key)
        with safe_open(str(info.file), framework="pt", device=str(device or "cpu")) as f:
            return f.get_tensor(key)

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
