"""The session spill: the resident sessions written out at shutdown, restored at start.

Layout, in ``directory``::

    spill-00000007/            a complete spill (a generation)
        manifest.json          fingerprint, sessions: name -> file, sha256, bytes, tokens
        session-0000.safetensors ...
    spill-00000008.tmp/        a spill being written (or one a crash interrupted)

ATOMICITY. A spill is written into ``spill-<n>.tmp/``: each session file written and
fsync'd, then the manifest, then the directory fsync'd, then renamed to ``spill-<n>``
in one ``rename`` (and the parent fsync'd), and only then are older generations
removed. A ``kill -9`` at any instant therefore leaves the newest complete
generation either the old spill or the new one; a ``.tmp`` directory is never read
and is removed at the next ``load``/``save``. ``load`` takes the newest generation
whose manifest reads and whose fingerprint is this engine's, and checks every file's
sha256: a session whose file does not verify is dropped with a log line (the others
are restored); a generation under another fingerprint is dropped whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from tandem_core.cache.base import CacheContext, Snapshot, TierStats
from tandem_core.cache.files import (
    CorruptFile, fsync_dir, read_verified, snapshot_from_payload, snapshot_payload, write_safetensors,
)

__all__ = ["SessionSpill"]

log = logging.getLogger("tandem.cache")

_GEN = re.compile(r"^spill-(\d{8})(\.tmp)?$")
MANIFEST = "manifest.json"


class SessionSpill:
    """Whole sessions (``Snapshot``s by name) through a restart, for engine ``fingerprint``."""

    name = "spill"

    def __init__(self, directory: Path | str, fingerprint: str) -> None:
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self.hits = 0       # sessions restored
        self.misses = 0     # sessions dropped (sum, fingerprint, unreadable)
        self._bytes = 0
        self._entries = 0

    @classmethod
    def build(cls, ctx: CacheContext) -> "SessionSpill":
        return cls(ctx.directory / "spill", ctx.fingerprint)

    # -- generations --------------------------------------------------------------------
    def _generations(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(complete generations newest first, unfinished .tmp directories)."""
        done: list[tuple[int, Path]] = []
        tmp: list[Path] = []
        if not self.dir.is_dir():
            return done, tmp
        for p in self.dir.iterdir():
            m = _GEN.match(p.name)
            if m and p.is_dir():
                if m.group(2):
                    tmp.append(p)
                else:
                    done.append((int(m.group(1)), p))
        return sorted(done, reverse=True), tmp

    def _discard_unfinished(self, tmp: list[Path]) -> None:
        for p in tmp:
            log.info("session spill: discarded an unfinished spill %s", p.name)
            shutil.rmtree(p, ignore_errors=True)

    # -- out ------------------------------------------------------------------------------
    def save(self, sessions: Mapping[str, Snapshot],
             on_file: Callable[[str, int, int], None] | None = None) -> Path:
        """Write ``sessions`` as a new generation; returns its directory.

        ``on_file(name, done, total)`` is called after each session's file is on disk
        (progress for the shutdown log).
        """
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            done, tmp = self._generations()
            self._discard_unfinished(tmp)
            gen = (done[0][0] + 1) if done else 1
            work = self.dir / f"spill-{gen:08d}.tmp"
            final = self.dir / f"spill-{gen:08d}"
            work.mkdir()
            records: dict[str, dict] = {}
            total = 0
            for i, (name, snap) in enumerate(sessions.items()):
                fname = f"session-{i:04d}.safetensors"
                tensors, meta = snapshot_payload(snap, fingerprint=self.fingerprint, session=name)
                digest, size = write_safetensors(work / fname, tensors, meta)
                records[name] = {"file": fname, "sha256": digest, "bytes": size, "tokens": snap.length}
                total += size
                if on_file is not None:
                    on_file(name, i + 1, len(sessions))
            with open(work / MANIFEST, "w") as f:
                json.dump({"format": 1, "fingerprint": self.fingerprint, "created": time.time(),
                           "sessions": records}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(work)
            os.rename(work, final)         # the commit point
            fsync_dir(self.dir)
            for _, old in done:
                shutil.rmtree(old, ignore_errors=True)
            self._bytes, self._entries = total, len(records)
            log.info("session spill: %d sessions, %d bytes in %s", len(records), total, final.name)
            return final

    # -- in -------------------------------------------------------------------------------
    def load(self) -> dict[str, Snapshot]:
        """The sessions of the newest usable spill (an empty dict when there is none)."""
        with self._lock:
            done, tmp = self._generations()
            self._discard_unfinished(tmp)
            for _, gen in done:
                try:
                    manifest = json.loads((gen / MANIFEST).read_text())
                    records = dict(manifest["sessions"])
                    fp = manifest["fingerprint"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("session spill: dropped %s: manifest unreadable (%s)", gen.name, exc)
                    shutil.rmtree(gen, ignore_errors=True)
                    continue
                if fp != self.fingerprint:
                    log.warning("session spill: dropped %s: computed under fingerprint %s…, this engine's is %s…",
                                gen.name, str(fp)[:12], self.fingerprint[:12])
                    self.misses += len(records)
                    shutil.rmtree(gen, ignore_errors=True)
                    continue
                out: dict[str, Snapshot] = {}
                total = 0
                for name, rec in records.items():
                    try:
                        tensors, meta = read_verified(gen / rec["file"], rec["sha256"])
                        if meta.get("fingerprint") != self.fingerprint or meta.get("session") != name:
                            raise CorruptFile(f"{rec['file']}: header names another session or fingerprint")
                        out[name] = snapshot_from_payload(tensors, meta, rec["file"])
                        total += int(rec["bytes"])
                    except (CorruptFile, OSError, KeyError, TypeError, ValueError) as exc:
                        log.warning("session spill: dropped session %r of %s: %s", name, gen.name, exc)
                        self.misses += 1
                self.hits += len(out)
                self._bytes, self._entries = total, len(out)
                log.info("session spill: restored %d of %d sessions from %s", len(out), len(records), gen.name)
                return out
            return {}

    def clear(self) -> None:
        """Remove every spill (after the sessions were restored and are live again, if wanted)."""
        with self._lock:
            done, tmp = self._generations()
            for p in [p for _, p in done] + tmp:
                shutil.rmtree(p, ignore_errors=True)
            self._bytes = self._entries = 0

    def stats(self) -> TierStats:
        return TierStats(self.name, self._bytes, self._entries, self.hits, self.misses)
