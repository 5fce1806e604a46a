"""GGML weight formats as ``Linear`` classes: Q4_1, Q8_0, F16, BF16, F32.

Each class takes the tensor's raw data as stored (``[N, bytes per row]`` uint8
for block formats, ``[N, K]`` floats otherwise) and dequantises it exactly as
``gguf.quants.dequantize`` does, bit for bit (Q4_1: ``d * q + m``; Q8_0:
``q * d``; both rounded once per operation, in fp32).

Two ways to hold a weight (``dense``):

- ``dense=True`` (the default, fastest on a CPU): dequantise once at load into
  a dense fp32 copy and multiply with one ``F.linear``. ``nbytes`` is the dense
  copy's size, which is what every use reads.
- ``dense=False`` (memory-lean): keep the quantised rows and dequantise them
  per matmul in chunks of rows into a scratch tile. ``nbytes`` is the quantised
  size.

``stored_nbytes`` is always the size of the quantised data. ``rows(ids)``
dequantises whole rows (an embedding lookup). Rows are independent in every
format, so a row permutation or a row concatenation of the raw data is exact
(``take_rows``, ``concat_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "FORMATS",
    "FORMAT_OF_QTYPE",
    "BF16Weight",
    "F16Weight",
    "F32Weight",
    "GGMLWeight",
    "Q4_1Weight",
    "Q8_0Weight",
    "RowConcat",
    "as_raw",
    "concat_rows",
]

_CHUNK_ELEMS = 1 << 22  # lean mode: dequantise at most this many weights at a time (16 MiB of fp32)


def as_raw(data: Any) -> torch.Tensor:
    """A torch tensor owning a copy of ``data`` (a numpy array, possibly a read-only memory map, or a
    tensor)."""
    if isinstance(data, torch.Tensor):
        return data.contiguous()
    return torch.from_numpy(np.array(data, copy=True, order="C"))


class GGMLWeight:
    """A weight ``[N, K]`` in one GGML format. Subclasses say how rows dequantise (``_dequant``)."""

    format: str = ""
    block: int = 1  # weights per block
    type_size: int = 4  # bytes per block

    def __init__(self, raw: Any, *, dense: bool = True) -> None:
        raw = as_raw(raw)
        if raw.dim() != 2:
            raise ValueError(f"{self.format}: raw data must be [N, row], got shape {tuple(raw.shape)}")
        self._check(raw)
        self.raw = raw
        n = int(raw.shape[0])
        k = self._k_of(raw)
        self.shape = (n, k)
        self.stored_nbytes = raw.numel() * raw.element_size()
        self.dense_mode = dense
        self._w: torch.Tensor | None = None
        if dense:
            self._w = self._dequant(raw)
            self.raw = None  # type: ignore[assignment]  # the dense copy is all a matmul reads
            self.nbytes = self._w.numel() * self._w.element_size()
        else:
            self.nbytes = self.stored_nbytes

    # -- per-format ---------------------------------------------------------------------------
    def _check(self, raw: torch.Tensor) -> None:
        if raw.dtype != torch.uint8 or raw.shape[1] % self.type_size:
            raise ValueError(
                f"{self.format}: raw rows must be uint8 with a multiple of {self.type_size} bytes, "
                f"got {raw.dtype} {tuple(raw.shape)}"
            )

    def _k_of(self, raw: torch.Tensor) -> int:
        return int(raw.shape[1]) // self.type_size * self.block

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw rows ``[n, row]`` -> fp32 ``[n, K]``, equal bit for bit to ``gguf.quants.dequantize``."""
        raise TypeError(f"{type(self).__name__} does not define _dequant")

    # -- the Linear contract ------------------------------------------------------------------
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self._w is not None:
            return _linear(x, self._w)
        n, k = self.shape
        step = max(1, _CHUNK_ELEMS // k)
        out = x.new_empty(*x.shape[:-1], n)
        for s in range(0, n, step):
            e = min(n, s + step)
            out[..., s:e] = _linear(x, self._dequant(self.raw[s:e]))
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ([T] int64) dequantised: ``[T, K]`` fp32 (an embedding lookup)."""
        if self._w is not None:
            return F.embedding(ids, self._w)
        return self._dequant(self.raw.index_select(0, ids))

    def dense(self) -> torch.Tensor:
        """The whole weight ``[N, K]`` in fp32 (the dense copy itself in dense mode: do not write to it)."""
        return self._w if self._w is not None else self._dequant(self.raw)

    def row_block(self, start: int, end: int) -> GGMLWeight:
        """Rows ``start:end`` (``[end - start, K]``) as a weight of their own over this one's storage (no
        copy): a view of the dense copy in dense mode, of the quantised rows in lean mode."""
        if not 0 <= start < end <= self.shape[0]:
            raise ValueError(f"row_block({start}, {end}): the weight has {self.shape[0]} rows")
        if self._w is not None:
            return F32Weight(self._w[start:end], dense=True)
        return type(self)(self.raw[start:end], dense=False)

    def __repr__(self) -> str:
        mode = "dense fp32" if self._w is not None else "lean"
        return f"{type(self).__name__}({self.shape[0]}x{self.shape[1]}, {mode})"


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == w.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


class F32Weight(GGMLWeight):
    format = "ggml.f32"

    def _check(self, raw: torch.Tensor) -> None:
        if raw.dtype != torch.float32:
            raise ValueError(f"{self.format}: raw data must be float32, got {raw.dtype}")

    def _k_of(self, raw: torch.Tensor) -> int:
        return int(raw.shape[1])

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        return raw  # already fp32 (the dense copy is the raw tensor itself)


class F16Weight(F32Weight):
    format = "ggml.f16"

    def _check(self, raw: torch.Tensor) -> None:
        if raw.dtype != torch.float16:
            raise ValueError(f"{self.format}: raw data must be float16, got {raw.dtype}")

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.to(torch.float32)


class BF16Weight(GGMLWeight):
    """bfloat16, as torch ``bfloat16`` or as GGUF's raw bytes (uint8 ``[N, 2K]``) or int16."""

    format = "ggml.bf16"

    def __init__(self, raw: Any, *, dense: bool = True) -> None:
        t = as_raw(raw)
        if t.dtype in (torch.uint8, torch.int16, torch.uint16):
            t = t.view(torch.bfloat16)
        super().__init__(t, dense=dense)

    def _check(self, raw: torch.Tensor) -> None:
        if raw.dtype != torch.bfloat16:
            raise ValueError(f"{self.format}: raw data must be bfloat16, got {raw.dtype}")

    def _k_of(self, raw: torch.Tensor) -> int:
        return int(raw.shape[1])

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.to(torch.float32)  # the high 16 bits of an fp32: exact


class Q8_0Weight(GGMLWeight):
    """Blocks of 32: an fp16 scale ``d`` and 32 int8 ``q``; a weight is ``q * d``."""

    format = "ggml.q8_0"
    block, type_size = 32, 34

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        n = raw.shape[0]
        b = raw.reshape(n, -1, 34)
        d = b[..., :2].view(torch.float16).to(torch.float32)  # [n, nb, 1]
        q = b[..., 2:].view(torch.int8).to(torch.float32)  # [n, nb, 32]
        return q.mul_(d).reshape(n, -1)


class Q4_1Weight(GGMLWeight):
    """Blocks of 32: fp16 ``d`` and ``m``, then 16 bytes of 4-bit ``q`` (low nibbles are weights 0-15,
    high nibbles 16-31); a weight is ``d * q + m``."""

    format = "ggml.q4_1"
    block, type_size = 32, 20

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        n = raw.shape[0]
        b = raw.reshape(n, -1, 20)
        dm = b[..., 0:4].view(torch.float16).to(torch.float32)  # [n, nb, 2]: d, m
        qs = b[..., 4:]  # [n, nb, 16]
        q = torch.empty(*qs.shape[:-1], 32, dtype=torch.float32)  # [n, nb, 32]
        torch.bitwise_and(qs, 0x0F, out=q[..., :16])  # low nibbles: weights 0-15
        torch.bitwise_right_shift(qs, 4, out=q[..., 16:])  # high nibbles: 16-31
        return q.mul_(dm[..., 0:1]).add_(dm[..., 1:2]).reshape(n, -1)  # (d * q) + m, two roundings


class RowConcat:
    """Weights of different formats stacked along N, for the memory-lean mode: one matmul per part."""

    format = "rowconcat"

    def __init__(self, parts: Sequence[GGMLWeight]) -> None:
        ks = {p.shape[1] for p in parts}
        if len(ks) != 1:
            raise ValueError(f"cannot stack weights of different K {sorted(ks)}")
        self.parts = tuple(parts)
        self.shape = (sum(p.shape[0] for p in parts), ks.pop())
        self.nbytes = sum(p.nbytes for p in parts)
        self.stored_nbytes = sum(p.stored_nbytes for p in parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts], dim=0)


FORMATS: dict[str, type[GGMLWeight]] = {
    c.format: c for c in (F32Weight, F16Weight, BF16Weight, Q8_0Weight, Q4_1Weight)
}
FORMAT_OF_QTYPE = {
    "F32": "ggml.f32",
    "F16": "ggml.f16",
    "BF16": "ggml.bf16",
    "Q8_0": "ggml.q8_0",
    "Q4_1": "ggml.q4_1",
}


def concat_rows(parts: Sequence[GGMLWeight], *, dense: bool) -> Any:
    """``parts`` stacked along N as one Linear: one dense fp32 weight (dense mode), or a ``RowConcat``."""
    if dense:
        return F32Weight(torch.cat([p.dense() for p in parts], dim=0), dense=True)
    return RowConcat(parts)
