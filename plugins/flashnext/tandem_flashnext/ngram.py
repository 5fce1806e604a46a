"""Per-layer n-gram embeddings (PLE): the hashing of token n-grams into rows of very large tables.

Each PLE module (on a Gated DeltaNet layer, ``cfg.ple_layer_ids``, one-indexed) owns
``heads = (ngram_size - 1) * heads_per_ngram`` hashed heads: ``heads_per_ngram`` for each
n-gram order ``g = 2 .. ngram_size``. Head ``h`` of PLE module ``m`` has its own prime
vocabulary: the ``(m * heads + h + 1)``-th prime >= ``ngram_vocab_size_base``; the heads'
vocabularies lie end to end in one table (``offsets``), padded to a multiple of
``make_ngram_vocab_size_divisible_by`` rows of ``ple_embed_dim // heads`` features.

For the token ``t_j`` at position ``j``, the shifted tokens are ``s_0 = t_j`` and, for
``u = 1 .. ngram_size - 1``, ``s_u = t_{j-u}`` unless an end-of-sequence token
(``cfg.eos_token_id``) lies in ``t_{j-u} .. t_{j-1}`` (the n-gram would cross a
segment boundary) or ``j - u < 0``: then ``s_u = eos``. An order-``g`` head's row is

    (s_0 * m_0  XOR  s_1 * m_1  XOR ...  XOR  s_{g-1} * m_{g-1})  mod  vocab_h   +  offset_h

with the module's odd multipliers ``m_u`` (splitmix64 of ``seed + 10007 * m`` and ``u``,
each below ``2^63 / vocab_size`` so no product overflows int64). The embedding of a
token is its ``heads`` rows side by side (``[ple_embed_dim]``).

Only the ``ngram_size - 1`` tokens before a step matter, so the runner keeps them as a
section (``ngram.ctx``: each token id plus one, 0 before the sequence's first token, so a
zeroed section is a fresh sequence; ``read_context`` turns it into ids, 0 into ``eos``, which
is how the hashing treats the start): a step's rows are computed from ``windows`` of
``ngram_size`` tokens (the context then the token, oldest first) whatever the step's size,
and a tree node's window is its own path's.

The tables are the largest tensors of the checkpoint (~95 GiB in bf16 at the published
shape): ``RowTable`` memory-maps them from the safetensors shards and gathers the few
rows a step needs on the host; nothing else of them is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tandem_core.ops._tree import ancestors, as_parents

from tandem_flashnext.config import FlashNextConfig

__all__ = ["NGramHash", "ngram_hashes", "table_rows", "layer_multipliers", "windows", "tree_windows",
           "context_after", "read_context", "RowTable", "MappedPart"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15          # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007                # the seed's step between PLE modules


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> tuple[int, ...]:
    """The odd multipliers ``m_0 .. m_{ngram_size-1}`` of PLE module ``ple_index``."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return tuple(2 * (_splitmix64((base + _GAMMA * (u + 1)) & _MASK64) % half) + 1 for u in range(ngram_size))


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n below 3.3e24, far past any vocabulary)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes >= ``start``."""
    out: list[int] = []
    n = start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


@dataclass(frozen=True)
class NGramHash:
    """One PLE module's hashing: its multipliers and its heads' vocabularies and offsets in the table."""

    ple_index: int
    eos: int
    multipliers: tuple[int, ...]       # [ngram_size]
    sizes: tuple[int, ...]             # [heads] prime vocabulary of each head
    offsets: tuple[int, ...]           # [heads] first row of each head in the table
    heads_per_ngram: int
    rows: int                          # the table's rows (padded)

    @property
    def ngram_size(self) -> int:
        return len(self.multipliers)

    def ids(self, win: torch.Tensor) -> torch.Tensor:
        """``win: [T, ngram_size]`` int64 (each row the tokens before a position, oldest first, then its own)
        -> table rows ``[T, heads]`` int64. Row by row: a row's result depends on its window only."""
        n, eos = self.ngram_size, self.eos
        shifted = [win[:, n - 1]]                                   # s_0: the token itself
        crossed = torch.zeros_like(win[:, 0], dtype=torch.bool)     # an eos in t_{j-u} .. t_{j-1}
        for u in range(1, n):
            prev = win[:, n - 1 - u]
            crossed = crossed | (prev == eos)
            shifted.append(torch.where(crossed, torch.full_like(prev, eos), prev))
        dev = win.device
        blocks = []
        for g in range(2, n + 1):
            mixed = shifted[0] * self.multipliers[0]
            for u in range(1, g):
                mixed = torch.bitwise_xor(mixed, shifted[u] * self.multipliers[u])
            lo = (g - 2) * self.heads_per_ngram
            size = torch.tensor(self.sizes[lo:lo + self.heads_per_ngram], dtype=torch.long, device=dev)
            off = torch.tensor(self.offsets[lo:lo + self.heads_per_ngram], dtype=torch.long, device=dev)
            blocks.append(torch.remainder(mixed[:, None], size[None, :]) + off[None, :])
        return torch.cat(blocks, dim=1)                             # [T, heads]


def ngram_hashes(cfg: FlashNextConfig) -> tuple[NGramHash, ...]:
    """Every PLE module's hashing, in ``cfg.ple_layer_ids`` order."""
    if not cfg.ple_layer_ids:
        return ()
    heads = cfg.ngram_heads
    primes = _primes_from(cfg.ngram_vocab_size_base, heads * len(cfg.ple_layer_ids))
    out = []
    for m in range(len(cfg.ple_layer_ids)):
        sizes = tuple(primes[m * heads:(m + 1) * heads])
        offsets = tuple(int(x) for x in np.cumsum((0,) + sizes[:-1]))
        divisor = cfg.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(sizes) / divisor) * divisor
        mult = layer_multipliers(cfg.vocab_size, cfg.ngram_size, m, cfg.seed)
        out.append(NGramHash(m, cfg.eos_token_id, mult, sizes, offsets, cfg.heads_per_ngram, rows))
    return tuple(out)


def table_rows(cfg: FlashNextConfig, ple_index: int) -> int:
    """Rows of PLE module ``ple_index``'s table (without hashing anything else)."""
    return ngram_hashes(cfg)[ple_index].rows


# -- windows: the tokens each new row's n-grams read ------------------------------------------------------
def windows(ctx: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``ctx: [n-1]`` the tokens before the step, ``ids: [T]`` the step's -> ``[T, n]`` (row j: the n-1 tokens
    before token j, oldest first, then token j)."""
    hist = torch.cat([ctx.to(ids.device), ids])                     # [n-1+T]
    n = ctx.numel() + 1
    return hist.unfold(0, n, 1)                                      # [T, n]


def read_context(section: torch.Tensor, eos: int) -> torch.Tensor:
    """The ``ngram.ctx`` section (ids plus one, 0 before the sequence) as token ids (eos before it)."""
    return torch.where(section > 0, section - 1, torch.full_like(section, eos))


def context_after(ctx: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The context after appending ``ids`` (the last ``n-1`` tokens of ``ctx ++ ids``)."""
    hist = torch.cat([ctx.to(ids.device), ids])
    return hist[hist.numel() - ctx.numel():]


def tree_windows(ctx: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Node ``i``'s window over its own path: the ``n-1`` tokens before it (its ancestors, nearest last, then
    the committed ``ctx``) and its token. ``[N, n]``; row i equals ``windows``'s row for the node's token
    after committing its path."""
    par = as_parents(parents)
    n1 = ctx.numel()
    src = torch.cat([ctx.to(ids.device), ids])                      # [n-1+N]: ctx rows first
    index = []
    for i in range(len(par)):
        anc = ancestors(par, i, n1)                                  # nearest first
        path = [n1 + a for a in reversed(anc)] + [n1 + i]
        index.append(list(range(len(path) - 1, n1)) + path)         # the ctx's last rows before the path
    return src[torch.tensor(index, dtype=torch.long, device=ids.device)]


# -- the tables: memory-mapped from the shards --------------------------------------------------------------
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


@dataclass(frozen=True)
class MappedPart:
    """Rows ``first .. first + rows - 1`` of a table: one tensor of a safetensors file, by its byte range."""

    file: Path
    offset: int                       # the tensor's first byte in the file
    rows: int
    width: int
    dtype: torch.dtype


class RowTable:
    """A ``[rows, width]`` table whose rows are gathered on the host: memory-mapped parts (the checkpoint's
    shards, read only where a gathered row lies) or, for tools and tests, in-memory tensors.

    ``gather(idx)`` -> ``idx.shape + [width]`` in ``dtype`` on the host; never mutates the table."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        if not parts:
            raise ValueError("a row table needs at least one part")
        widths = {int(p.shape[1]) for p in parts}
        if len(widths) != 1 or any(p.dim() != 2 for p in parts):
            raise ValueError(f"row table parts must be [rows, width] of one width, got "
                             f"{[tuple(p.shape) for p in parts]}")
        self.parts = tuple(parts)
        self.starts = tuple(int(x) for x in np.cumsum([0] + [int(p.shape[0]) for p in parts]))
        self.rows = self.starts[-1]
        self.width = widths.pop()

    @classmethod
    def mapped(cls, parts: Sequence[MappedPart]) -> "RowTable":
        tensors = []
        for p in parts:
            arr = np.memmap(p.file, dtype=_NP[p.dtype], mode="c", offset=p.offset, shape=(p.rows, p.width))
            # copy-on-write pages: the file is never written
            t = torch.from_numpy(arr)
            tensors.append(t.view(torch.bfloat16) if p.dtype == torch.bfloat16 else t)
        return cls(tensors)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def gather(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = idx.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise IndexError(f"row table: row {int(flat.max())} is outside its {self.rows} rows")
        out = torch.empty(flat.numel(), self.width, dtype=dtype)
        for part, lo, hi in zip(self.parts, self.starts, self.starts[1:]):
            inside = ((flat >= lo) & (flat < hi)).nonzero().reshape(-1)
            if inside.numel():
                out[inside] = part[flat[inside] - lo].to(dtype)
        return out.reshape(*idx.shape, self.width)
