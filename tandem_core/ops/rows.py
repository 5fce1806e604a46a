"""Row-invariant forms: a row's result does not depend on how many rows are computed with it.

A speculative verify computes N rows in one call; plain decode computes one. For
speculation to be lossless, a verified row must equal, bit for bit, the row the
decode step computes at that position (the engine contract's row invariance).
Every op a decode step and a verify share must therefore compute a row the same
way whatever the number of rows beside it.

What was measured on the CPU this was written on (torch 2.13, MKL 2024.2, AVX2,
1 and 2 threads), and what follows from it:

- ``F.linear`` (MKL sgemm/sgemv) is not row invariant: M=1 runs a gemv, M=2 and 3
  form a second class, every M>=4 a third (rows equal among all M>=4). Running the
  decode step in the M>=4 class (padding its one row to four) costs 3-4x a gemv on
  this CPU, so the CPU reference runs every row through the decode step's own M=1
  call instead (``linear_rows``). A row also keeps the decode step's memory
  alignment: MKL's gemv rounds differently for an input that is not 16-byte
  aligned, so a row that is not 64-byte aligned is copied first, in both.
- Element-wise ``exp``, ``log``, ``sqrt``, ``rsqrt``, ``cos``, ``sin``, ``+ - * /``
  give the same bits in ATen's vector body and its tail, so the ``act`` ops built
  from them are row invariant; ATen's ``sigmoid``, ``silu`` and ``softplus`` are not
  (their vector and scalar paths differ) and are not used.
- Row reductions (``sum``/``mean``/``amax`` over the last axis) are row invariant
  while a row has fewer than 32768 elements (ATen's grain): a single longer row is
  split across threads, a batch of them is not. Every norm here reduces a hidden,
  head or channel axis, far below that.
- Attention and the gated delta rule are evaluated per node with the decode
  step's one-row call (``attention_tree``, ``gdn_tree``), so nothing about them
  depends on the tree's size.

A device with a real row-invariant kernel (a GEMM whose reduction order is fixed
for every M) registers it for ``linear_rows`` through ``tandem_core.ops.register``;
decode and verify both call it, so they keep agreeing. The load-time self-check
(``tandem_core.spec.selfcheck``) proves it on the machine that serves.

    linear_rows(lin, x)   x: [M, K] -> [M, N]; row i equals lin.matmul on row i alone
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["linear_rows", "ALIGN"]

ALIGN = 64   # bytes: where the CPU allocator starts every tensor; a decode step's input always starts so


def _as_decoded(x: torch.Tensor) -> torch.Tensor:
    """``x`` laid out as a decode step's freshly computed row: contiguous, starting ``ALIGN``-aligned."""
    if x.is_contiguous() and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def linear_rows(lin: Any, x: torch.Tensor) -> torch.Tensor:
    """``lin.matmul`` of every row of ``x`` (``[M, K]`` -> ``[M, N]``), each row as if it were alone.

    Row ``i`` of the result equals ``linear_rows(lin, x[i:i+1])`` bit for bit, for any ``M``:
    the decode step (``M == 1``) and a verify of ``M`` rows call this one op.
    ``lin`` is a ``tandem_core.linear.Linear``; neither input is mutated.
    """
    if x.dim() != 2:
        raise ValueError(f"linear_rows: x must be [M, K], got shape {tuple(x.shape)}")
    if x.shape[0] == 1:
        return lin.matmul(_as_decoded(x))
    return torch.cat([lin.matmul(_as_decoded(x[i:i + 1])) for i in range(x.shape[0])])
