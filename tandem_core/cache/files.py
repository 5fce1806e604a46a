"""Snapshot files: safetensors with a JSON header, written atomically, read only when their sum matches.

A snapshot file is a plain safetensors file (any safetensors reader opens it):

- tensors ``section.<name>`` and ``view.<name>`` (the state; views cut to its length)
  and ``anchor.<position>.<name>`` (the anchors' sections);
- ``__metadata__["tandem"]``: JSON with ``format``, ``tokens``, ``length``, ``axes``
  (each view's token axis), ``signature`` (``ModelState.signature()``), ``anchors``
  (``[position, kind]``) and whatever the tier adds (``fingerprint``).

It is streamed tensor by tensor (a tensor on the GPU is copied to the host one at a
time), hashed while it is written, fsync'd, and renamed from a temporary name into
place, then the directory is fsync'd: a reader sees the old file or the new one,
never a part of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import load as st_load

from tandem_core.cache.base import Anchor, Snapshot
from tandem_core.state import ModelState

__all__ = [
    "FORMAT", "write_safetensors", "write_atomic", "read_verified", "read_header", "file_sha256",
    "write_json_atomic", "fsync_dir", "snapshot_payload", "snapshot_from_payload", "CorruptFile",
]

FORMAT = 1
_META_KEY = "tandem"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


class CorruptFile(ValueError):
    """A cache file whose sum, header or tensors do not match what was written; it must not be used."""


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _raw(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, int]:
    """Stream ``tensors`` to ``path`` in safetensors layout and fsync it; returns (sha256 hex, bytes written)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    h = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(blob)), blob):
            f.write(part)
            h.update(part)
            total += len(part)
        for t in tensors.values():
            raw = _raw(t).data
            f.write(raw)
            h.update(raw)
            total += raw.nbytes
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest(), total


def write_atomic(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, int]:
    """``write_safetensors`` to ``<path>.tmp``, rename into ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        digest, size = write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return digest, size


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a temporary name, fsync, rename into ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _header(data: bytes, path: Path) -> dict[str, Any]:
    if len(data) < 8:
        raise CorruptFile(f"{path.name}: {len(data)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise CorruptFile(f"{path.name}: header of {n} bytes runs past the file's {len(data)}")
    try:
        header = json.loads(data[8:8 + n])
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFile(f"{path.name}: unreadable header ({exc})") from None
    if not isinstance(meta, dict):
        raise CorruptFile(f"{path.name}: header is not an object")
    return meta


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a snapshot file, reading only the file's head (no sum check)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFile(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        return _header(head + f.read(n), path)


def read_verified(path: Path, sha256: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The file's tensors and JSON header, if its sha256 is ``sha256``; else ``CorruptFile`` naming both sums."""
    data = path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise CorruptFile(f"{path.name}: sha256 {found[:16]}… does not match the manifest's {sha256[:16]}…")
    meta = _header(data, path)
    try:
        tensors = st_load(data)
    except Exception as exc:  # the safetensors reader's own error, whatever its type
        raise CorruptFile(f"{path.name}: unreadable tensors ({exc})") from None
    return tensors, meta


def _jsonable(sig: Any) -> Any:
    return json.loads(json.dumps(sig))


def snapshot_payload(snap: Snapshot, **extra: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors metadata that store ``snap`` (``extra`` goes into the JSON header)."""
    tensors = dict(snap.state.tensors())
    for a in snap.anchors:
        for name, t in a.sections.items():
            tensors[f"anchor.{a.position}.{name}"] = t
    meta = {
        "format": FORMAT,
        "tokens": snap.tokens.tolist(),
        "length": snap.length,
        "axes": {k: v.axis for k, v in snap.state.views.items()},
        "signature": _jsonable(snap.state.signature()),
        "anchors": [[a.position, a.kind] for a in snap.anchors],
        **extra,
    }
    return tensors, {_META_KEY: json.dumps(meta, separators=(",", ":"))}


def snapshot_from_payload(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], name: str) -> Snapshot:
    """Rebuild the snapshot a file holds; ``CorruptFile`` (naming ``name``) when its parts disagree."""
    try:
        if meta.get("format") != FORMAT:
            raise CorruptFile(f"{name}: format {meta.get('format')!r}, expected {FORMAT}")
        tokens = np.asarray(meta["tokens"], dtype=np.int64)
        length = int(meta["length"])
        axes = {str(k): int(v) for k, v in meta["axes"].items()}
        kinds = {int(p): str(k) for p, k in meta["anchors"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFile(f"{name}: header field missing or malformed ({exc})") from None
    if length != len(tokens):
        raise CorruptFile(f"{name}: header length {length} but {len(tokens)} tokens")
    state_t = {k: v for k, v in tensors.items() if k.startswith(("section.", "view."))}
    missing = {k for k in axes if f"view.{k}" not in tensors}
    if missing:
        raise CorruptFile(f"{name}: views {sorted(missing)} named in the header are not in the file")
    state = ModelState.from_tensors(state_t, axes, length)
    for k, view in state.views.items():
        if view.capacity != length:
            raise CorruptFile(f"{name}: view {k!r} holds {view.capacity} positions, header says {length}")
    if _jsonable(state.signature()) != meta.get("signature"):
        raise CorruptFile(f"{name}: tensors' signature differs from the header's")
    secs: dict[int, dict[str, torch.Tensor]] = {p: {} for p in kinds}
    for k, t in tensors.items():
        if k.startswith("anchor."):
            pos, _, sec = k[len("anchor."):].partition(".")
            if not pos.isdigit() or int(pos) not in secs:
                raise CorruptFile(f"{name}: tensor {k!r} belongs to no anchor in the header")
            secs[int(pos)][sec] = t
    anchors = []
    for p in sorted(kinds):
        if set(secs[p]) != set(state.sections):
            raise CorruptFile(f"{name}: anchor at {p} has sections {sorted(secs[p])}, "
                              f"the state {sorted(state.sections)}")
        anchors.append(Anchor(p, secs[p], kinds[p]))
    try:
        return Snapshot(tokens, state, tuple(anchors))
    except ValueError as exc:
        raise CorruptFile(f"{name}: {exc}") from None
