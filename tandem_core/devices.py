"""Where a model runs and in what: ``--device auto|cpu|cuda|cuda:N`` and the dtype default for each device.

``resolve_device(spec)`` turns what the user typed into a device torch can address (``"cpu"`` or
``"cuda:N"``): ``auto`` is the first CUDA device torch sees, else the CPU; ``cuda`` is ``cuda:0``;
``cuda:N`` must name a device that exists. ``default_dtype(device)`` is bf16 on CUDA and fp32 on the
CPU. ``check_runs(arch, device, dtype)`` refuses, naming both, a device type or dtype the model's plugin
does not run (its ``Arch.runs``), before any weight is read. Each error is a ``DeviceError`` with one
line that names the value and what would be accepted.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["DeviceError", "DTYPES", "resolve_device", "default_dtype", "device_type", "check_runs",
           "describe_runs"]

DTYPES = ("fp32", "bf16", "fp16")


class DeviceError(ValueError):
    """A device or dtype that cannot be used here (the message names it and the choices)."""


def _cuda_count() -> int:
    import torch

    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except RuntimeError:        # a broken driver: no CUDA device to use
        return 0


def resolve_device(spec: str | None) -> str:
    """``"auto"`` (or None), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` -> ``"cpu"`` or ``"cuda:N"``."""
    s = (spec or "auto").strip().lower()
    if s == "cpu":
        return "cpu"
    count = _cuda_count()
    if s == "auto":
        return "cuda:0" if count else "cpu"
    if s == "cuda" or s.startswith("cuda:"):
        index = 0
        if s != "cuda":
            tail = s[len("cuda:"):]
            if not tail.isdigit():
                raise DeviceError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N (N a device index)")
            index = int(tail)
        if count == 0:
            raise DeviceError(f"--device {spec!r}: torch sees no CUDA device here (torch.cuda.is_available() is "
                              f"false); use --device cpu")
        if index >= count:
            raise DeviceError(f"--device {spec!r}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return f"cuda:{index}"
    raise DeviceError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")


def device_type(device: str) -> str:
    """``"cuda:1"`` -> ``"cuda"``."""
    return device.split(":", 1)[0]


def default_dtype(device: str) -> str:
    """The dtype a model computes in when ``--dtype`` is not given: bf16 on CUDA, fp32 on the CPU."""
    return "bf16" if device_type(device) == "cuda" else "fp32"


def describe_runs(runs: Mapping[str, tuple[str, ...]]) -> str:
    return "; ".join(f"{', '.join(dts)} on {dev}" for dev, dts in runs.items())


def check_runs(arch: Any, device: str, dtype: str) -> None:
    """Refuse a device type or dtype the architecture's plugin does not run, naming both and what it runs."""
    if dtype not in DTYPES:
        raise DeviceError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    runs: Mapping[str, tuple[str, ...]] = dict(arch.runs)
    if not runs:
        return
    kind = device_type(device)
    if kind not in runs or dtype not in runs[kind]:
        raise DeviceError(f"{arch.package} ({arch.name}) cannot run {dtype} on {device}: it runs "
                          f"{describe_runs(runs)}")
