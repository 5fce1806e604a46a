"""RMS norms in fp32: plain, Qwen's zero-centred ``x * (1 + w)``, gated by ``silu(gate)``, and the L2 norm.

Each computes in fp32 and returns the input's dtype. ``x: [..., D]``, ``w: [D]``.
"""

from __future__ import annotations

import torch

from tandem_core.ops.act import silu

__all__ = ["rms_norm", "rms_norm_1p", "gated_rms_norm", "l2_norm"]


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D] -> fp32 [..., D], unit root-mean-square along D
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * w``."""
    return (_normed(x, eps) * weight.float()).to(x.dtype)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + w)``: the weight is stored centred on zero (Qwen3.5, Qwen3-Next)."""
    return (_normed(x, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * w * silu(gate)`` (the Gated DeltaNet output norm). ``gate`` has ``x``'s shape."""
    return (_normed(x, eps) * weight.float() * silu(gate)).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` along the last axis, in fp32 (returned in fp32)."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)
