"""Opening a safetensors checkpoint for a model family: headers, layout, audit and identity, nothing loaded.

Every family does the same four things before a weight is read; they live here once:

- ``open_checkpoint(directory, layout, expected, tied=..., family=...)`` reads the headers, resolves the
  family's ``Layout`` (canonical names, skipped prefixes counted), audits the files against what the config
  says must be there (``expected``), and refuses a tensor the family does not read, naming it;
- ``weights_identity(reader)``: what identifies the weights without reading them (the pack's ``SHA256SUMS``
  when it has one, else every tensor's name, dtype, shape and byte range with each file's size);
- ``WEIGHT_DTYPES`` / ``normalise_dtype``: the requested dtype's weight format and activation dtype.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from tandem_core.checkpoint.audit import AuditError, Expect, audit, read_sums
from tandem_core.checkpoint.layout import Layout, LayoutResult
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint

__all__ = ["Checkpoint", "open_checkpoint", "weights_identity", "WEIGHT_DTYPES", "normalise_dtype"]

# requested dtype -> (weight format registered through tandem_weight_formats, activation dtype)
WEIGHT_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("fp32", torch.float32),
    "bf16": ("bf16", torch.bfloat16),
    "fp16": ("fp16", torch.float16),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def normalise_dtype(dtype: str, family: str) -> str:
    """``"bfloat16"`` -> ``"bf16"``; a dtype no weight format holds is refused, naming the family."""
    name = _ALIASES.get(dtype, dtype)
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(WEIGHT_DTYPES)} for the {family} engine")
    return name


@dataclass(frozen=True)
class Checkpoint:
    """An audited checkpoint: its reader, the resolved layout, what was expected, and its identity."""

    reader: SafetensorsCheckpoint
    layout: LayoutResult
    expected: dict[str, Expect]
    identity: str

    @property
    def skipped(self) -> dict[str, int]:
        """Tensors skipped by prefix (a vision tower, a draft head), counted."""
        return dict(self.layout.skipped)


def weights_identity(reader: SafetensorsCheckpoint) -> str:
    """sha256 of what identifies the weights: the ``SHA256SUMS`` manifest when the pack has one, else every
    tensor's name, dtype, shape and byte range with each file's name and size (no tensor bytes read)."""
    h = hashlib.sha256()
    sums = read_sums(reader.dir)
    if sums is not None:
        for name in sorted(sums):
            h.update(f"{name} {sums[name]}\n".encode())
        return h.hexdigest()
    for path in reader.files:
        h.update(f"file {path.name} {path.stat().st_size}\n".encode())
    for key in sorted(reader.infos):
        info = reader.infos[key]
        h.update(f"{key} {info.file.name} {info.dtype} {list(info.shape)} {info.begin} {info.end}\n".encode())
    return h.hexdigest()


def open_checkpoint(directory: str | Path, layout: Layout, expected: Mapping[str, Expect], *, tied: bool,
                    family: str) -> Checkpoint:
    """Read the headers, resolve ``layout``, audit against ``expected``; a tensor the layout names but the family
    does not read is refused (its config does not describe the checkpoint). Nothing is loaded; a failure names
    its tensor or file."""
    reader = SafetensorsCheckpoint(directory)
    try:
        resolved = layout.resolve(reader.keys(), tied)
    except ValueError as exc:
        raise AuditError(f"checkpoint {reader.dir}: {exc}") from exc
    want = dict(expected)
    audit(reader, want, resolved.names)
    unknown = sorted(set(resolved.names) - set(want))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise AuditError(f"checkpoint {reader.dir}: tensor {resolved.names[unknown[0]]!r} is not one the "
                         f"{family} engine reads{more}; its config does not describe this checkpoint")
    return Checkpoint(reader, resolved, want, weights_identity(reader))
