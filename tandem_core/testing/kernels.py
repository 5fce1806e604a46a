"""For the GPU kernel tests: whether Triton is installed, and whether it runs kernels in its CPU interpreter."""

from __future__ import annotations

import importlib.util

__all__ = ["has_triton", "triton_interpreting"]


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Triton's own switch (``TRITON_INTERPRET=1``, read through its knobs): its kernels run on the CPU."""
    if not has_triton():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)
