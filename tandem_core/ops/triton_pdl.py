"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a CUDA graph step.

A step is hundreds of launches in a row; most of the small ones are latency-bound, and
every weight matmul ramps up and drains. With PDL a kernel is launched while the one before
it still runs: its programs start, then wait at ``griddepcontrol.wait`` until the previous
grid has finished and its writes are visible.

Contract for every kernel launched here with ``launch_pdl``:

- it takes ``PDL: tl.constexpr`` and, when set, calls ``gdc_wait()`` before it reads
  anything an earlier kernel writes or writes anything an earlier kernel reads, then
  ``gdc_launch_dependents()`` (the next kernel may start once all programs got here);
- so every kernel waits for its predecessor's completion, and by induction for all earlier
  ones: ordering is the same as without PDL, only the launch latency overlaps.

``enabled()`` is off by default; the CUDA runner switches it on with ``TANDEM_CUDA_PDL`` on a
device of compute capability >= 9. Measured on an H200 at the 27B shape (``tools/gpu_lab.py``):
decode 14.59 -> 14.53 ms, verify of 16 nodes 15.74 -> 16.40 ms, and an L2 prefetch of each
matmul program's first weight tiles before the wait made the matmuls slower (12.67 -> 12.89 ms
at two tiles), so the setting's default is off. The Triton interpreter never uses it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enabled", "set_enabled", "launch_kw", "jit_helpers", "bind"]

_ON = {"on": False}
_H: dict[str, Any] = {}


def enabled() -> bool:
    return _ON["on"]


def set_enabled(flag: bool) -> None:
    """Launch the step kernels with PDL (set before any graph is captured)."""
    _ON["on"] = bool(flag)


def launch_kw() -> dict[str, Any]:
    """Launch options and the ``PDL`` constexpr for one launch."""
    return {"launch_pdl": True, "PDL": True} if _ON["on"] else {"PDL": False}


def jit_helpers() -> dict[str, Any]:
    """``{"pdl_wait": fn}``: the Triton helper every step kernel calls first, ``pdl_wait(PDL)`` (a no-op unless
    ``PDL``). A kernel module puts it in its globals when it builds its kernels (Triton is imported here then)."""
    if not _H:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        globals().update(tl=tl, gdc_wait=gdc_wait, gdc_launch_dependents=gdc_launch_dependents)

        @triton.jit
        def pdl_wait(PDL: tl.constexpr):
            if PDL:
                gdc_wait()
                gdc_launch_dependents()

        _H["pdl_wait"] = pdl_wait
    return _H


def bind(module_globals: dict[str, Any]) -> Any:
    """Import Triton for a kernel module's ``_build``: the module's globals get ``tl`` and ``pdl_wait`` (Triton
    resolves a kernel's callees and names in its module's globals); returns the ``triton`` module."""
    import triton
    import triton.language as tl

    module_globals.update(tl=tl, pdl_wait=jit_helpers()["pdl_wait"])
    return triton
