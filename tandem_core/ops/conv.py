"""Depthwise causal convolution over time with its tail state (Gated DeltaNet's and LFM2's short conv).

``causal_conv(x, tail, weight)``: ``x: [T, C]`` the new inputs, ``tail: [C, K-1]``
the ``K-1`` inputs before them (oldest first; zeros at the start of a sequence),
``weight: [C, K]``. Output ``y[t, c] = act(sum_k weight[c, k] * xx[t + k, c])``
where ``xx = [tail^T; x]``, and the new tail is the last ``K-1`` rows of ``xx``.
The taps are summed in a fixed order in fp32 (no library convolution, whose
kernel choice depends on the CPU).
"""

from __future__ import annotations

import torch

from tandem_core.ops.act import silu

__all__ = ["causal_conv"]


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
                activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y [T, C] in x's dtype, new_tail [C, K-1] in tail's dtype)``; neither input is mutated."""
    T = x.shape[0]
    K = weight.shape[1]
    xx = torch.cat([tail.t().to(x.dtype), x], dim=0)     # xx: [K-1+T, C]
    xf = xx.float()
    w = weight.float()                                   # w: [C, K]
    y = xf[0:T] * w[:, 0]                                 # y: [T, C]
    for k in range(1, K):
        y = y + xf[k:k + T] * w[:, k]
    if activation == "silu":
        y = silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv: unknown activation {activation!r}")
    new_tail = xx[T:].t().to(tail.dtype)                  # new_tail: [C, K-1]
    return y.to(x.dtype), new_tail
