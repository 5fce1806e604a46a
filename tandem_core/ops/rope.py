"""Rotary position embedding on the leading ``rotary_dim`` channels of each head (rotate-half layout).

Qwen3.5's multimodal rope (``mrope_section`` over temporal, height and width
positions) gives text tokens the same position in all three sections, and then
every frequency sees that one position: it is this plain rope.

    inv_freq(rotary_dim, theta)  -> [rotary_dim/2] fp32
    cos_sin(positions, inv_freq) -> cos, sin [T, rotary_dim] fp32
    apply_rope(x, cos, sin)      x: [T, H, D] -> [T, H, D] (channels past rotary_dim pass through)
"""

from __future__ import annotations

import torch

__all__ = ["inv_freq", "cos_sin", "apply_rope"]


def inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return (1.0 / (theta ** exponents)).to(device)


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T] int -> angles [T, rotary_dim/2] -> cos, sin [T, rotary_dim] (halves share a frequency)
    angles = positions.to(freqs.device).float()[:, None] * freqs[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, H, D]``; ``cos, sin: [T, R]``, ``R <= D`` even. Computed in fp32, returned in x's dtype."""
    R = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :R], xf[..., R:]
    c, s = cos[:, None, :], sin[:, None, :]                     # [T, 1, R]
    half = R // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + rotated * s, rest], dim=-1).to(x.dtype)
