"""The lookup drafter's persistent corpus store: token documents and their n-gram tables, in one file.

A store is built once from text (``tandem corpus build``, ``tools/build_corpus.py``)
with one tokenizer, and its token ids mean nothing under another: the header
records the tokenizer's sha256 (``Tokenizer.fingerprint()``) and ``open`` refuses
a store whose fingerprint is not the target's, naming both.

File layout (little-endian)::

    offset 0   8 bytes   magic b"TDLOOKUP"
    offset 8   uint32    layout version (1)
    offset 12  uint32    header length H in bytes
    offset 16  H bytes   header, UTF-8 JSON (below)
               zero padding to a multiple of 64: the payload starts there
    payload    sections at the header's offsets (relative to the payload, 64-aligned)

    header = {
      "format": "tandem-lookup-corpus", "version": 1,
      "tokenizer_sha256": "<64 hex>",
      "orders": [1, 2, 3, 4, 6, 8, 12, 16], "hash_base": <int>,
      "n_tokens": N, "n_docs": D,
      "payload_bytes": P, "payload_sha256": "<64 hex>",
      "sections": {"tokens": {"offset": o, "dtype": "<u4", "count": N}, "keys.K": {...}, "pos.K": {...}, ...},
      "meta": {...}                                   # what built it: files, tool; free-form
    }

``tokens`` is every document's ids, each followed by the separator 0xFFFFFFFF.
For each order K, ``keys.K`` (``<u8``) is the sorted key of every K-gram that
lies inside one document and has a next token, and ``pos.K`` (``<i4``) the
position of that next token; positions ascend within one key, so the most
recent occurrences of a key are the end of its run. Keys are the hash of
``tandem_drafters.ngram``. ``open`` checks the magic, the header, the file's
length and (unless told not to) the payload's sha256: a truncated or altered
file is refused with what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from tandem_drafters.ngram import DEFAULT_ORDERS, HASH_BASE, prefix_hashes, window_keys

__all__ = ["MAGIC", "FORMAT", "VERSION", "CorpusError", "TokenizerMismatch", "CorpusStore", "build_store"]

MAGIC = b"TDLOOKUP"
FORMAT = "tandem-lookup-corpus"
VERSION = 1
SEP = 0xFFFFFFFF
_ALIGN = 64
_CHUNK = 1 << 20
_MAX_KEY = (1 << 64) - 1


class CorpusError(ValueError):
    """A file that is not a store, or is truncated or corrupt (the message names the file and the fault)."""


class TokenizerMismatch(CorpusError):
    """A store built with another tokenizer than the one it is opened for."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def build_store(docs: Iterable[Sequence[int]], out: str | Path, tokenizer_sha256: str, *,
                orders: Sequence[int] = DEFAULT_ORDERS, meta: dict[str, Any] | None = None) -> Path:
    """Write a store of ``docs`` (each a list of token ids) to ``out``; returns the path.

    Written to a temporary name and renamed, so a crash never leaves a half store under ``out``.
    """
    orders = tuple(sorted(set(int(k) for k in orders)))
    if not orders or orders[0] < 1:
        raise ValueError(f"orders must be >= 1, got {list(orders)}")
    parts: list[np.ndarray] = []
    n_docs = 0
    for d in docs:
        a = np.asarray(d, dtype=np.int64)
        if len(a) and (a.min() < 0 or a.max() >= SEP):
            raise ValueError(f"document {n_docs}: token ids must lie in [0, {SEP})")
        parts.append(a.astype(np.uint32))
        parts.append(np.array([SEP], dtype=np.uint32))
        n_docs += 1
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    n = len(tokens)
    sep = tokens == SEP
    x = np.where(sep, 0, tokens.astype(np.uint64) + np.uint64(1)).astype(np.uint64)
    h = np.concatenate([np.zeros(1, dtype=np.uint64), prefix_hashes(x)])              # [n + 1]
    seps_before = np.concatenate([[0], np.cumsum(sep, dtype=np.int64)])               # [n + 1]
    sections: dict[str, np.ndarray] = {"tokens": tokens.astype("<u4")}
    for k in orders:
        ends = np.arange(k, n, dtype=np.int64)                                        # a next token exists
        ok = (seps_before[ends] - seps_before[ends - k] == 0) & ~sep[ends]
        ends = ends[ok]
        keys = window_keys(h, ends, k)
        order = np.argsort(keys, kind="stable")
        sections[f"keys.{k}"] = keys[order].astype("<u8")
        sections[f"pos.{k}"] = ends[order].astype("<i4")
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, arr in sections.items():
        table[name] = {"offset": offset, "dtype": arr.dtype.str, "count": int(len(arr))}
        offset += arr.nbytes + _pad(arr.nbytes)
    digest = hashlib.sha256()
    for arr in sections.values():
        digest.update(arr.tobytes())
        digest.update(b"\0" * _pad(arr.nbytes))
    header = {"format": FORMAT, "version": VERSION, "tokenizer_sha256": tokenizer_sha256,
              "orders": list(orders), "hash_base": HASH_BASE, "n_tokens": n, "n_docs": n_docs,
              "payload_bytes": offset, "payload_sha256": digest.hexdigest(), "sections": table,
              "meta": meta or {}}
    hb = json.dumps(header, sort_keys=True).encode()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<II", VERSION, len(hb)) + hb)
        f.write(b"\0" * _pad(16 + len(hb)))
        for arr in sections.values():
            f.write(arr.tobytes())
            f.write(b"\0" * _pad(arr.nbytes))
    tmp.replace(path)
    return path


@dataclass
class _Order:
    keys: np.ndarray   # [M] uint64 sorted
    pos: np.ndarray    # [M] int32


class CorpusStore:
    """An open store (memory-mapped, read-only). ``occurrences`` and ``continuation`` as ``NgramIndex``'s."""

    def __init__(self, path: Path, header: dict[str, Any], tokens: np.ndarray,
                 tables: dict[int, _Order]) -> None:
        self.path = path
        self.header = header
        self.tokens = tokens
        self._tables = tables
        self.orders = tuple(sorted(tables))

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.header["tokenizer_sha256"])

    @property
    def n_tokens(self) -> int:
        return int(self.header["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.header["n_docs"])

    @classmethod
    def open(cls, path: str | Path, tokenizer_sha256: str | None = None, *,
             verify: bool = True) -> "CorpusStore":
        """Open ``path``; refuse it (``TokenizerMismatch``) when ``tokenizer_sha256`` is given and differs,
        and (``CorpusError``) when it is not a sound store."""
        p = Path(path)
        try:
            size = p.stat().st_size
            with open(p, "rb") as f:
                head = f.read(16)
                if len(head) < 16 or head[:8] != MAGIC:
                    raise CorpusError(f"{p}: not a lookup corpus store "
                                      f"(magic {head[:8]!r}, expected {MAGIC!r})")
                version, hlen = struct.unpack("<II", head[8:16])
                if version != VERSION:
                    raise CorpusError(f"{p}: store layout version {version}; this reader knows {VERSION}")
                if 16 + hlen > size:
                    raise CorpusError(f"{p}: truncated (header of {hlen} bytes does not fit in {size})")
                try:
                    header = json.loads(f.read(hlen))
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise CorpusError(f"{p}: corrupt header ({exc})") from exc
        except OSError as exc:
            raise CorpusError(f"{p}: cannot read ({exc})") from exc
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CorpusError(f"{p}: header 'format' is not {FORMAT!r}")
        for key in ("tokenizer_sha256", "orders", "hash_base", "n_tokens", "payload_bytes", "payload_sha256",
                    "sections"):
            if key not in header:
                raise CorpusError(f"{p}: header has no {key!r}")
        stored = header["tokenizer_sha256"]
        if tokenizer_sha256 is not None and stored != tokenizer_sha256:
            raise TokenizerMismatch(
                f"{p}: this lookup store was built with tokenizer sha256 {stored}, but the target's "
                f"tokenizer is sha256 {tokenizer_sha256}; rebuild it with `tandem corpus build` and the "
                "target's tokenizer")
        if header["hash_base"] != HASH_BASE:
            raise CorpusError(f"{p}: header 'hash_base' {header['hash_base']} "
                              f"is not this reader's {HASH_BASE}")
        start = 16 + hlen + _pad(16 + hlen)
        payload = int(header["payload_bytes"])
        if size != start + payload:
            raise CorpusError(f"{p}: truncated or padded: {size} bytes, the header says {start + payload}")
        if verify:
            digest = hashlib.sha256()
            with open(p, "rb") as f:
                f.seek(start)
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
            if digest.hexdigest() != header["payload_sha256"]:
                raise CorpusError(f"{p}: corrupt: payload sha256 {digest.hexdigest()} is not the header's "
                                  f"{header['payload_sha256']}")
        arrays: dict[str, np.ndarray] = {}
        for name, sec in header["sections"].items():
            try:
                dt = np.dtype(sec["dtype"])
                off, count = int(sec["offset"]), int(sec["count"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CorpusError(f"{p}: section {name!r} is malformed ({exc})") from exc
            if off < 0 or count < 0 or off + count * dt.itemsize > payload:
                raise CorpusError(f"{p}: section {name!r} lies outside the payload")
            # a plain ndarray view of the mapping: indexing it costs what an in-memory array's does
            if count:
                mm = np.memmap(p, dtype=dt, mode="r", offset=start + off, shape=(count,))
                arrays[name] = mm.view(np.ndarray)
            else:
                arrays[name] = np.zeros(0, dtype=dt)
        tables: dict[int, _Order] = {}
        for k in header["orders"]:
            if f"keys.{k}" not in arrays or f"pos.{k}" not in arrays or "tokens" not in arrays:
                raise CorpusError(f"{p}: order {k} has no keys/pos section")
            tables[int(k)] = _Order(arrays[f"keys.{k}"], arrays[f"pos.{k}"])
        if len(arrays["tokens"]) != int(header["n_tokens"]):
            raise CorpusError(f"{p}: 'tokens' holds {len(arrays['tokens'])} ids, "
                              f"the header says {header['n_tokens']}")
        return cls(p, header, arrays["tokens"], tables)

    def occurrences(self, tail: Sequence[int], keys: dict[int, int], limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` occurrences ``(e, k)`` of ``tail``'s suffix, longest order first, latest first."""
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        for k in reversed(self.orders):
            key = keys.get(k)
            if key is None:
                continue
            t = self._tables[k]
            if key == _MAX_KEY:
                lo, hi = int(np.searchsorted(t.keys, key)), len(t.keys)
            else:
                lo, hi = np.searchsorted(t.keys, np.array([key, key + 1], dtype=np.uint64)).tolist()
            if lo == hi:
                continue
            want = list(tail[-k:])
            checked = False  # one checked match vouches for its key's run (no 64-bit collision expected)
            for e in t.pos[max(lo, hi - 4 * limit):hi][::-1].tolist():
                if e in seen:
                    continue
                if not checked:
                    if self.tokens[e - k:e].tolist() != want:
                        continue
                    checked = True
                seen.add(e)
                out.append((e, k))
                if len(out) >= limit:
                    return out
        return out

    def continuation(self, e: int, depth: int) -> list[int]:
        c = self.tokens[e:e + depth].tolist()
        if SEP in c:
            c = c[:c.index(SEP)]
        return c
