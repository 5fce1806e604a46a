"""The pack audit, before anything loads.

A missing tensor, a truncated shard, a tensor of the wrong shape or dtype, or —
where the pack carries a manifest of sha256 sums (``SHA256SUMS`` in
``sha256sum`` format) — a file whose sum differs stops the load, naming the
tensor or the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from tandem_core.checkpoint.safetensors import CheckpointError, SafetensorsCheckpoint

__all__ = ["AuditError", "Expect", "audit", "sha256_file", "read_sums"]

SUMS_FILE = "SHA256SUMS"


class AuditError(CheckpointError):
    """The checkpoint does not hold what the model needs."""


@dataclass(frozen=True)
class Expect:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def read_sums(directory: Path) -> dict[str, str] | None:
    path = directory / SUMS_FILE
    if not path.exists():
        return None
    sums: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise AuditError(f"{SUMS_FILE} line {n} is not '<sha256>  <file>'")
        sums[parts[1].lstrip("*").strip()] = parts[0].lower()
    return sums


def audit(ckpt: SafetensorsCheckpoint, expected: Mapping[str, Expect], names: Mapping[str, str]) -> None:
    """Check ``expected`` (canonical name -> Expect) against the checkpoint, through ``names``
    (canonical -> checkpoint key, from the Layout). Raises ``AuditError`` naming the first problem."""
    sums = read_sums(ckpt.dir)
    if sums is not None:
        for fname, want in sums.items():
            path = ckpt.dir / fname
            if not path.exists():
                raise AuditError(f"file {fname} listed in {SUMS_FILE} is missing")
            got = sha256_file(path)
            if got != want:
                raise AuditError(f"file {fname}: sha256 {got} does not match {SUMS_FILE} ({want})")
    ckpt.check_sizes()
    missing = [c for c in expected if c not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AuditError(f"checkpoint {ckpt.dir} is missing tensor {missing[0]!r}{more}")
    for canon, exp in expected.items():
        info = ckpt.info(names[canon])
        if tuple(info.shape) != tuple(exp.shape):
            raise AuditError(f"tensor {info.key!r} has shape {list(info.shape)}, the config needs {list(exp.shape)}")
        if info.torch_dtype not in exp.dtypes:
            raise AuditError(f"tensor {info.key!r} has dtype {info.dtype}, "
                             f"expected one of {[str(d).replace('torch.', '') for d in exp.dtypes]}")
