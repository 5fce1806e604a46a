"""An incremental n-gram index over a growing token sequence: where did the context's suffix occur before?

For every order ``k`` (default 1, 2, 3, 4, 6, 8, 12, 16) and every position the
index records the k-gram ending there, keyed by a 64-bit polynomial hash, as a
linked list from the most recent occurrence backwards::

    last[k][key]  -> e      the most recent continuation start e (tokens[e-k:e] has this key)
    prev[k][e]    -> e'     the occurrence before e with the same key, -1 when none

Appending a token costs one dict update per order; asking for the most recent
occurrences of the context's suffix costs a dict lookup per order and a step
per occurrence, whatever the sequence's length. Truncating (a new turn that
rewrites the tail) unlinks the removed positions in reverse. Long inputs
(a prompt) are indexed in bulk with numpy.

Hash: ``key(w_1..w_k) = sum_i (w_i + 1) * B^(k-i) mod 2^64`` (``B`` odd), so the
key of the window ending at ``e`` is ``H[e] - H[e-k] * B^k`` over prefix hashes
``H``. Every occurrence found is checked token by token against the suffix, so a
hash collision never yields a wrong continuation.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Sequence

import numpy as np

__all__ = ["DEFAULT_ORDERS", "HASH_BASE", "SENTINEL", "NgramIndex", "suffix_keys", "window_keys",
           "prefix_hashes"]

DEFAULT_ORDERS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
HASH_BASE = 0x9E3779B97F4A7C15            # odd, so invertible mod 2^64
_MASK = (1 << 64) - 1
_BINV = pow(HASH_BASE, -1, 1 << 64)
SENTINEL = -1                              # separates documents / turns; never a token, never matched
_BULK = 256                                # appends at least this long go through numpy


def _pow(k: int) -> int:
    return pow(HASH_BASE, k, 1 << 64)


_POW = [_pow(j) for j in range(257)]       # B^j for the suffix keys (orders up to 256)


def suffix_keys(tail: Sequence[int], orders: Iterable[int]) -> dict[int, int]:
    """The key of the last ``k`` tokens of ``tail`` for each order ``k`` that fits."""
    n = len(tail)
    out: dict[int, int] = {}
    h, done = 0, 0
    for k in sorted(orders):
        if k > n:
            break
        for j in range(done + 1, k + 1):  # add the j-th newest token with weight B^(j-1)
            h += (tail[n - j] + 1) * _POW[j - 1]
        done = k
        out[k] = h & _MASK
    return out


def prefix_hashes(x: np.ndarray, start: int = 0) -> np.ndarray:
    """[m] uint64: the prefix hashes continuing ``start`` over ``x`` (``x`` holds token + 1, uint64)."""
    m = len(x)
    if m == 0:
        return np.zeros(0, dtype=np.uint64)
    pow_b = np.cumprod(np.full(m, HASH_BASE, dtype=np.uint64), dtype=np.uint64)      # B^1 .. B^m
    pow_i = np.cumprod(np.full(m, _BINV, dtype=np.uint64), dtype=np.uint64)          # B^-1 .. B^-m
    s = np.cumsum(x * pow_i, dtype=np.uint64)
    return pow_b * (np.full(m, start, dtype=np.uint64) + s)


def window_keys(h: np.ndarray, ends: np.ndarray, k: int) -> np.ndarray:
    """[len(ends)] uint64 keys of the windows ``[e - k, e)`` from prefix hashes ``h`` (``h[0]``: empty)."""
    pk = np.full(len(ends), _pow(k), dtype=np.uint64)
    return h[ends] - h[ends - k] * pk


class NgramIndex:
    """The index over one token sequence (``tokens``), appended to and truncated in place."""

    def __init__(self, orders: Sequence[int] = DEFAULT_ORDERS) -> None:
        if not orders or min(orders) < 1:
            raise ValueError(f"n-gram orders must be >= 1, got {list(orders)}")
        self.orders = tuple(sorted(set(int(k) for k in orders)))
        self.max_order = self.orders[-1]
        self._pk = {k: _pow(k) for k in self.orders}
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []
        self._h = array("Q", [0])                              # [n + 1] prefix hashes
        self._prev = {k: array("q", [-1]) for k in self.orders}  # [n + 1] by continuation start e
        self._last: dict[int, dict[int, int]] = {k: {} for k in self.orders}

    def __len__(self) -> int:
        return len(self.tokens)

    # -- growing and shrinking ----------------------------------------------------------------------

    def extend(self, tokens: Iterable[int]) -> None:
        toks = [int(t) for t in tokens]
        if not toks:
            return
        n0 = len(self.tokens)
        self.tokens.extend(toks)
        if len(toks) >= _BULK:
            self._extend_bulk(n0, toks)
        else:
            self._extend_scalar(n0, toks)

    def _extend_scalar(self, n0: int, toks: list[int]) -> None:
        H = self._h
        h = H[-1]
        for j, t in enumerate(toks):
            h = (h * HASH_BASE + t + 1) & _MASK
            H.append(h)
            e = n0 + j + 1
            for k in self.orders:
                prev = self._prev[k]
                if e < k:
                    prev.append(-1)
                    continue
                key = (h - H[e - k] * self._pk[k]) & _MASK
                last = self._last[k]
                prev.append(last.get(key, -1))
                last[key] = e

    def _extend_bulk(self, n0: int, toks: list[int]) -> None:
        m = len(toks)
        x = np.asarray(toks, dtype=np.int64).astype(np.uint64) + np.uint64(1)
        self._h.frombytes(prefix_hashes(x, self._h[-1]).tobytes())
        lo = max(0, n0 + 1 - self.max_order)
        h = np.frombuffer(self._h[lo:].tobytes(), dtype=np.uint64)    # h[i] = H[lo + i] (a copy)
        for k in self.orders:
            ends = np.arange(max(n0 + 1, k), n0 + m + 1, dtype=np.int64)
            prev_new = np.full(m, -1, dtype=np.int64)                 # for e = n0+1 .. n0+m
            if len(ends):
                keys = window_keys(h, ends - lo, k)
                order = np.argsort(keys, kind="stable")                 # ends ascend within a key
                sk, se = keys[order], ends[order]
                same = np.zeros(len(sk), dtype=bool)
                same[1:] = sk[1:] == sk[:-1]
                pv = np.full(len(sk), -1, dtype=np.int64)
                pv[1:] = np.where(same[1:], se[:-1], -1)
                last = self._last[k]
                if last:  # link each key's first new occurrence to its latest old one
                    first = ~same
                    pv[first] = [last.get(q, -1) for q in sk[first].tolist()]
                back = np.empty(len(ends), dtype=np.int64)
                back[order] = pv
                prev_new[ends - (n0 + 1)] = back
                last.update(zip(keys.tolist(), ends.tolist()))          # the latest end wins
            self._prev[k].frombytes(prev_new.tobytes())

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens."""
        cur = len(self.tokens)
        if n >= cur:
            return
        if n < cur - n:  # cheaper to rebuild what is kept
            keep = self.tokens[:n]
            self.clear()
            self.extend(keep)
            return
        H = self._h
        for e in range(cur, n, -1):
            for k in self.orders:
                if e < k:
                    continue
                key = (H[e] - H[e - k] * self._pk[k]) & _MASK
                p = self._prev[k][e]
                if p < 0:
                    del self._last[k][key]
                else:
                    self._last[k][key] = p
        del self.tokens[n:]
        del H[n + 1:]
        for k in self.orders:
            del self._prev[k][n + 1:]

    # -- asking -------------------------------------------------------------------------------------

    def end_keys(self, extra: Sequence[int] = ()) -> dict[int, int]:
        """``suffix_keys(tokens + extra, orders)``, from the prefix hashes (a few operations an order)."""
        H = self._h
        n = len(self.tokens)
        ext: list[int] = []
        h = H[n]
        for t in extra:
            h = (h * HASH_BASE + int(t) + 1) & _MASK
            ext.append(h)
        e = n + len(ext)
        out: dict[int, int] = {}
        for k in self.orders:
            if k > e:
                break
            s = e - k
            out[k] = (h - (H[s] if s <= n else ext[s - n - 1]) * self._pk[k]) & _MASK
        return out


    def occurrences(self, tail: Sequence[int], keys: dict[int, int], limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` earlier occurrences of ``tail``'s suffix, longest match first, most recent first
        within an order: ``(e, k)`` where ``tokens[e-k:e] == tail[-k:]`` and ``tokens[e]`` exists.

        ``keys`` is ``suffix_keys(tail, orders)``. Each ``e`` appears once, with its longest order.
        """
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        n = len(self.tokens)
        toks = self.tokens
        for k in reversed(self.orders):
            key = keys.get(k)
            if key is None:
                continue
            e = self._last[k].get(key, -1)
            if e < 0:
                continue
            want = list(tail[-k:])
            prev = self._prev[k]
            while e >= 0 and len(out) < limit:
                if e < n and e not in seen and toks[e - k:e] == want:
                    seen.add(e)
                    out.append((e, k))
                e = prev[e]
            if len(out) >= limit:
                break
        return out

    def continuation(self, e: int, depth: int) -> list[int]:
        """The up to ``depth`` tokens from ``e``, stopping at a ``SENTINEL``."""
        c = self.tokens[e:e + depth]
        if SENTINEL in c:
            c = c[:c.index(SENTINEL)]
        return c
