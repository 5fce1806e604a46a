"""A model's cache directory: where it is, its one-process lock, and the sizes ``tandem serve`` reads.

Light on purpose (no torch): ``tandem serve`` takes the lock before it loads any weight, so a
busy directory is refused in milliseconds. ``tandem_core.server.caches`` builds the tiers in it.
"""

from __future__ import annotations

import fcntl
import re
from pathlib import Path
from typing import IO

__all__ = ["CacheDirectoryBusy", "cache_directory", "lock_directory", "lock_path", "parse_bytes"]


class CacheDirectoryBusy(RuntimeError):
    """Another process holds this model's cache directory."""


_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
          "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3, "ti": 1024 ** 4}


def parse_bytes(text: str) -> int:
    """``"24000000000"``, ``"24G"``, ``"22.5GiB"``, ``"512Mi"`` -> bytes. Fails naming the text."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 24000000000, 24G, 22.5GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def cache_directory(model_id: str, directory: Path | None = None) -> Path:
    """``directory``, or ``<TANDEM_HOME>/cache/<model id>`` (the id made safe as one path component)."""
    if directory is not None:
        return Path(directory).expanduser()
    from tandem_core.catalog import home

    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("._") or "model"
    return home() / "cache" / safe


def lock_directory(model_id: str, directory: Path | None = None) -> IO[str]:
    """Take ``cache_directory(model_id, directory)``'s lock (creating the directory); ``CacheDirectoryBusy``
    when another process holds it. Held until the returned file is closed."""
    d = cache_directory(model_id, directory)
    d.mkdir(parents=True, exist_ok=True)
    return lock_path(d)


def lock_path(directory: Path) -> IO[str]:
    """Take ``directory``'s lock file (``CacheDirectoryBusy`` when another process holds it)."""
    f = open(directory / "lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise CacheDirectoryBusy(f"cache directory {directory} is in use by another tandem process; give "
                                 f"this one its own with --cache-dir DIR, or use --no-cache") from None
    return f
