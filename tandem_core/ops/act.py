"""Activations written with exp, log, division and sums only, in fp32.

ATen's own ``sigmoid``, ``softplus``, ``log1p`` and ``softmax`` take different
code paths on different CPU vector widths (their bytes differ between the AVX2
and the baseline kernels), while ``exp``, ``log``, division, square roots and
sums agree. These references are built from the latter, so a CPU run's bytes do
not depend on which kernels the CPU selects (the refactor gate relies on it).
Each returns fp32.

    sigmoid(x)  = 1 / (1 + exp(-x))
    silu(x)     = x / (1 + exp(-x))
    softplus(x) = log(1 + exp(x)), = x past 20 (as torch), log1p done exactly (Goldberg)
    softmax(x)  = exp(x - max) / sum(exp(x - max)) along the last axis (-inf entries give 0)
"""

from __future__ import annotations

import torch

__all__ = ["sigmoid", "silu", "softplus", "softmax"]


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return 1.0 / (1.0 + torch.exp(-xf))


def silu(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf / (1.0 + torch.exp(-xf))


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    xf = x.float()
    e = torch.exp(torch.clamp(xf, max=threshold))
    u = 1.0 + e
    # log1p(e) = log(u) * e / (u - 1), exact to a few ulp; e itself where 1 + e rounds to 1
    small = u == 1.0
    log1p = torch.where(small, e, torch.log(u) * (e / torch.where(small, torch.ones_like(u), u - 1.0)))
    return torch.where(xf > threshold, xf, log1p)


def softmax(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    m = xf.amax(dim=-1, keepdim=True)
    # a fully masked row: exp(-inf - 0) = 0 everywhere, 0/0 -> nan, as torch
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(xf - m)
    return e / e.sum(dim=-1, keepdim=True)
