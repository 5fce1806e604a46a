"""The core's dense weight formats, registered through the same hook as any plugin's.

Registering imports nothing heavy: torch is imported when a factory first builds a weight.
"""

from __future__ import annotations

from typing import Any, Callable

from tandem_core.plugins import hookimpl

DENSE = ("bf16", "fp16", "fp32")


def _dense(name: str) -> Callable[..., Any]:
    def factory(weight: Any, bias: Any = None, *, device: Any = None) -> Any:
        """``weight [N, K]`` (and ``bias [N]``) in this format's dtype, on ``device``."""
        from tandem_core.linear import DENSE_DTYPES, DenseLinear

        dtype = DENSE_DTYPES[name]
        w = weight.to(device=device, dtype=dtype)
        b = None if bias is None else bias.to(device=device, dtype=dtype)
        return DenseLinear(w, b)

    factory.__name__ = f"dense_{name}"
    return factory


@hookimpl
def tandem_weight_formats(register: Callable[..., None]) -> None:
    for name in DENSE:
        register(name, _dense(name))
