"""The CUDA kernels that keep a reference op's contract, registered per op for device type ``"cuda"``.

``install()`` registers them through ``tandem_core.ops.register`` (idempotent); an
engine on a CUDA device calls it before it resolves its ops, so ``ops.get(name,
"cuda:0")`` returns these. Importing this module imports no Triton and registers
nothing: a kernel is built on its first call (``tandem_core.ops.triton_*``).

Each wrapper takes the reference's arguments and returns what the reference returns
(shapes, dtypes, nothing mutated); an input the kernel does not cover (another dtype,
a CPU tensor, a head size it does not tile) goes to the reference, so a caller sees one
op whatever it passes. Results equal the reference's within rounding:

    gdn_chunk     triton_gdn.gdn_chunk: 64-token chunks, tf32 dots (relative error ~1e-3 of the fp32
                  reference); q, k: [T, Hk, Dk], v: [T, Hv, Dv], Dk and Dv tiled by 16 .. 256
    rms_norm_1p   triton_fused.add_rms_norm_1p without a residual: bf16 rows, fp32 inside, one program
                  a row (row invariant)
    linear_rows   triton_matmul.skinny_matmul: a dense bf16 weight without bias, bf16 rows, up to 128 rows
                  a launch; the kernel's plan depends on the weight's shape only, so a row's bits do not
                  depend on the rows beside it (the op's contract), fp32 partials added in a fixed order
    moe_route     triton_moe.route: one program a row (up to 1024 experts); the experts as int64
    grouped_experts  triton_moe.grouped_experts: bf16 rows and stacked bf16 expert weights, the experts sorted
                  and blocked on the device (no host sync), a plan per expert shape (row invariant)

The other ops have no kernel of the same contract here: the CUDA path of an engine
(a model plugin's CUDA runner) fuses them differently (the gates inside the recurrent
kernel, the output gate inside attention) and calls the ``triton_*`` launchers itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem_core import ops

__all__ = ["DEVICE", "OPS", "gdn_chunk", "grouped_experts", "install", "linear_rows", "moe_route", "rms_norm_1p",
           "uninstall"]

DEVICE = "cuda"


def _tiles(n: int) -> bool:
    p = 1 << max(0, int(n) - 1).bit_length()
    return 16 <= p <= 256


def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, *, scale: float, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule (``tandem_core.ops.gdn.gdn_chunk``'s contract): ``(o [T, Hv, Dv] fp32,
    new_state [Hv, Dk, Dv] fp32)``, nothing mutated. ``chunk`` is the reference's knob: the kernel's chunks
    are 64 tokens whatever it says (the result is the same recurrence within fp32 rounding)."""
    fits = q.dim() == 3 and v.dim() == 3 and _tiles(q.shape[-1]) and _tiles(v.shape[-1]) and q.shape[0] > 0
    if q.is_cuda and fits:
        from tandem_core.ops import triton_gdn

        return triton_gdn.gdn_chunk(q, k, v, g, beta, state, scale=scale)
    return ops.reference("gdn_chunk")(q, k, v, g, beta, state, scale=scale, chunk=chunk)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + w)`` in fp32, returned in ``x``'s dtype (``tandem_core.ops.norm.rms_norm_1p``)."""
    H = x.shape[-1] if x.dim() else 0
    # one weight row for every row only: a weight of several groups ([n, H], Flash-Next's stream norms) broadcast
    # over x goes to the reference (the kernel would read the first group's for all)
    if x.is_cuda and x.dtype == torch.bfloat16 and 0 < H <= 65536 and x.numel() and weight.numel() == H:
        from tandem_core.ops import triton_fused

        rows = x.reshape(-1, H)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        triton_fused.add_rms_norm_1p(rows, None, weight.float().contiguous(), eps, out)
        return out.view(x.shape)
    return ops.reference("rms_norm_1p")(x, weight, eps)


def _dense_bf16(lin: Any) -> torch.Tensor | None:
    from tandem_core.linear import DenseLinear

    if isinstance(lin, DenseLinear) and lin.bias is None and lin.weight.dtype == torch.bfloat16 \
            and lin.weight.is_cuda and lin.weight.stride(-1) == 1:
        return lin.weight
    return None


def linear_rows(lin: Any, x: torch.Tensor) -> torch.Tensor:
    """``lin.matmul`` of every row of ``x`` (``[M, K]`` -> ``[M, N]``), each row as if alone
    (``tandem_core.ops.rows.linear_rows``)."""
    from tandem_core.ops import triton_matmul as tm

    w = _dense_bf16(lin)
    if w is None or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cuda:
        return ops.reference("linear_rows")(lin, x)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    plan = tm.plan_for(N, w.shape[1])
    for r in range(0, M, tm.MAX_ROWS):
        piece = tm.skinny_matmul(x[r:r + tm.MAX_ROWS], w, plan)
        out[r:r + tm.MAX_ROWS] = tm.reduce_parts(piece).to(x.dtype) if piece.dim() == 3 else piece
    return out


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str = "sigmoid",
              renorm: bool = True, scale: float = 1.0, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's top-k (``tandem_core.ops.moe.route``): ``(experts [T, k] int64 ascending, weights [T, k] fp32)``."""
    if logits.is_cuda and logits.dim() == 2 and 0 < logits.shape[1] <= 1024 and logits.shape[0]:
        from tandem_core.ops import triton_moe

        experts, weights = triton_moe.route(logits, bias, top_k, scoring, renorm, scale, eps)
        return experts.long(), weights
    return ops.reference("moe_route")(logits, bias, top_k, scoring, renorm, scale, eps)


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """The selected experts, each once over its rows (``tandem_core.ops.moe.grouped_experts``) -> ``[T, H]``."""
    fits = (x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and
            all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in (x, w_gate_up, w_down)))
    if fits:
        from tandem_core.ops import triton_moe

        return triton_moe.grouped_experts(x, experts, weights.float(), w_gate_up, w_down)
    return ops.reference("grouped_experts")(x, experts, weights, w_gate_up, w_down)


OPS: dict[str, Callable[..., Any]] = {"gdn_chunk": gdn_chunk, "rms_norm_1p": rms_norm_1p,
                                      "linear_rows": linear_rows, "moe_route": moe_route,
                                      "grouped_experts": grouped_experts}


def install() -> None:
    """Register every kernel above for device type ``"cuda"`` (again: no change)."""
    for name, fn in OPS.items():
        ops.register(name, DEVICE, fn)


def uninstall() -> None:
    for name in OPS:
        ops.unregister(name, DEVICE)
