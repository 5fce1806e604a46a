"""The weight contract: every weight the engine multiplies by is a ``Linear``.

A model calls ``w.matmul(x)`` and never asks which format it holds. A format is
a factory registered by name through the ``tandem_weight_formats`` hook; the
core's own dense formats (bf16, fp16, fp32) register the same way
(``tandem_core.default_formats``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = ["Linear", "DenseLinear", "weight_format", "make_linear", "DENSE_DTYPES"]


@runtime_checkable
class Linear(Protocol):
    """``shape == (N, K)``; ``matmul(x[..., K]) -> [..., N]``; ``nbytes``: bytes read per use.

    ``matmul`` never mutates ``x`` or the weight and returns a new tensor in
    ``x``'s dtype. The result of a row does not depend on how many rows are in
    ``x`` on the device's row-invariant path (verify rows equal decode rows).
    """

    shape: tuple[int, int]
    nbytes: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DenseLinear:
    """A plain dense weight ``[N, K]`` (and optional bias ``[N]``) in one floating dtype."""

    format = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a dense weight is [N, K], got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight rows {weight.shape[0]}")
        self.weight = weight
        self.bias = bias
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, w, b)

    def dense(self) -> torch.Tensor:
        """The weight as a dense ``[N, K]`` tensor (for references and tests)."""
        return self.weight

    def __repr__(self) -> str:
        return f"DenseLinear({self.shape[0]}x{self.shape[1]}, {self.weight.dtype})"


def weight_format(name: str) -> Callable[..., Any]:
    """The registered factory for a weight format, or an error naming the format and every registered one."""
    from tandem_core.plugins import registries

    formats = registries().weight_formats
    try:
        return formats[name]
    except KeyError:
        raise KeyError(f"unknown weight format {name!r}; registered: {', '.join(sorted(formats))}") from None


def make_linear(fmt: str, *args: Any, **kw: Any) -> Linear:
    return weight_format(fmt)(*args, **kw)
