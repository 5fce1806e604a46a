"""The core's dense weight formats, registered through the same hook as any plugin's."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tandem_core.linear import DENSE_DTYPES, DenseLinear
from tandem_core.plugins import hookimpl


def _dense(dtype: torch.dtype) -> Callable[..., DenseLinear]:
    def factory(weight: torch.Tensor, bias: torch.Tensor | None = None, *, device: Any = None) -> DenseLinear:
        w = weight.to(device=device, dtype=dtype)
        b = None if bias is None else bias.to(device=device, dtype=dtype)
        return DenseLinear(w, b)

    return factory


@hookimpl
def tandem_weight_formats(register: Callable[..., None]) -> None:
    for name, dtype in DENSE_DTYPES.items():
        register(name, _dense(dtype))
