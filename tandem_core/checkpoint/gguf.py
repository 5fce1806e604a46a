"""The GGUF header, read without loading the file: enough to tell which architecture a file holds.

A full ``gguf.GGUFReader`` parse of a model with a large vocabulary takes seconds (it
reads every metadata array); the loader only needs ``general.architecture``, which
writers put among the first keys. ``read_metadata(path, keys)`` walks the key/value
section and stops as soon as it has every key asked for.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable

__all__ = ["GGUFHeaderError", "read_metadata", "architecture_of"]

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file, a version this reader does not know, or a header cut short."""


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise GGUFHeaderError(f"{path}: GGUF header is truncated")
    return b


def _u64(f: BinaryIO, path: Path) -> int:
    return int(struct.unpack("<Q", _read(f, 8, path))[0])


def _string(f: BinaryIO, path: Path) -> str:
    return _read(f, _u64(f, path), path).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int, path: Path, keep: bool) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        raw = _read(f, struct.calcsize(fmt), path)
        return struct.unpack(fmt, raw)[0] if keep else None
    if vtype == _STRING:
        if keep:
            return _string(f, path)
        f.seek(_u64(f, path), 1)
        return None
    if vtype == _ARRAY:
        itype = int(struct.unpack("<I", _read(f, 4, path))[0])
        count = _u64(f, path)
        if itype in _SCALARS and not keep:
            f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
            return None
        return [_value(f, itype, path, keep) for _ in range(count)]
    raise GGUFHeaderError(f"{path}: unknown GGUF value type {vtype}")


def read_metadata(path: str | Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values of ``keys`` (those present) from a GGUF file's metadata."""
    p = Path(path)
    want = set(keys)
    out: dict[str, Any] = {}
    try:
        with p.open("rb") as f:
            if _read(f, 4, p) != MAGIC:
                raise GGUFHeaderError(f"{p}: not a GGUF file (bad magic)")
            version = int(struct.unpack("<I", _read(f, 4, p))[0])
            if version not in (2, 3):
                raise GGUFHeaderError(f"{p}: GGUF version {version} (this reader knows 2 and 3)")
            _u64(f, p)  # tensor count
            n_kv = _u64(f, p)
            for _ in range(n_kv):
                key = _string(f, p)
                vtype = int(struct.unpack("<I", _read(f, 4, p))[0])
                keep = key in want
                value = _value(f, vtype, p, keep)
                if keep:
                    out[key] = value
                    if len(out) == len(want):
                        break
    except OSError as exc:
        raise GGUFHeaderError(f"{p}: cannot read: {exc}") from exc
    return out


def architecture_of(path: str | Path) -> str:
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFHeaderError(f"{path}: GGUF metadata has no general.architecture")
    return arch
