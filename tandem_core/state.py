"""The cache state contract: how every cache tier reads and writes a sequence.

A ``ModelState`` has
- ``sections``: recurrent state by name (``gdn.S``, ``gdn.conv``), copied whole;
- ``views``: position-indexed buffers (``K``, ``V``) with a token axis, of which
  only the first ``length`` positions hold the sequence;
- ``length``: the number of tokens the state holds.

The engine's live state (``engine.state``) wraps the engine's own buffers: the
tensors are the buffers, so a ``restore`` lands where the engine (and any graph
captured on those buffers) reads them. A ``clone()`` is a detached snapshot that
owns its tensors: the views are cut to ``length`` along their token axis, so a
snapshot's size grows with its tokens, not with the buffer's capacity.

``signature()`` names every tensor's dtype and non-token shape; ``restore``
refuses a snapshot whose signature differs, naming the tensor.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Mapping

import torch

__all__ = ["View", "ModelState", "StateMismatch", "copy_to"]


class StateMismatch(ValueError):
    """A restore across shapes or dtypes, or past a view's capacity."""


@dataclass(frozen=True)
class View:
    """A buffer with a token axis. Positions ``[0, length)`` along ``axis`` hold the sequence."""

    tensor: torch.Tensor
    axis: int

    @property
    def capacity(self) -> int:
        return int(self.tensor.shape[self.axis])

    def head(self, n: int) -> torch.Tensor:
        """The first ``n`` positions (a view of the buffer, valid until the buffer is written)."""
        return self.tensor.narrow(self.axis, 0, n)

    def bytes_per_token(self) -> int:
        return self.tensor.numel() // max(1, self.capacity) * self.tensor.element_size()


def copy_to(t: torch.Tensor, device: torch.device | str | None = None, pin: bool = False) -> torch.Tensor:
    """A detached contiguous copy of ``t`` on ``device`` (default: its own); ``pin`` puts a CPU copy in
    page-locked memory (where CUDA is there to pin it)."""
    dev = torch.device(device) if device is not None else t.device
    if pin and dev.type == "cpu" and torch.cuda.is_available():
        return pinned_empty(t.shape, t.dtype).copy_(t.detach())
    return t.detach().to(device=dev, copy=True).contiguous()


REGISTER_MIN_BYTES = 1 << 20     # smaller pinned copies come from torch's caching host allocator


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in page-locked memory of exactly its own bytes.

    ``pin_memory=True`` takes blocks from torch's caching host allocator, which rounds every block up to a power
    of two and keeps freed blocks for reuse: a 2.1 GB snapshot would hold 4 GB of locked host memory, and the
    snapshot store's byte budget would undercount what it holds. Copies of 1 MiB and more are instead ordinary
    allocations page-locked in place (``cudaHostRegister``), unlocked when the tensor goes (after the device's
    queued work, so that no copy from its pages is still in flight) and given back to the system when its
    storage is freed; where registering fails, the caching allocator's block as before."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes < REGISTER_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    cudart = torch.cuda.cudart()
    ptr = out.data_ptr()
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(out, _unregister, ptr)
    return out


def _unregister(ptr: int) -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _sig(t: torch.Tensor, axis: int | None) -> tuple:
    shape = list(t.shape)
    if axis is not None:
        shape[axis] = -1
    return (str(t.dtype), tuple(shape), axis)


@dataclass
class ModelState:
    sections: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    length: int = 0

    # -- description ------------------------------------------------------------------
    def signature(self) -> tuple:
        secs = tuple((k, _sig(v, None)) for k, v in sorted(self.sections.items()))
        views = tuple((k, _sig(v.tensor, v.axis)) for k, v in sorted(self.views.items()))
        return (secs, views)

    def section_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sections.values())

    def view_bytes_per_token(self) -> int:
        return sum(v.bytes_per_token() for v in self.views.values())

    @property
    def nbytes(self) -> int:
        """Bytes this state's sequence occupies: the sections whole, the views up to ``length``."""
        return self.section_bytes() + self.view_bytes_per_token() * self.length

    # -- copies -----------------------------------------------------------------------
    def clone(self, length: int | None = None, device: torch.device | str | None = None, *,
              pin: bool = False) -> "ModelState":
        """A detached snapshot of the first ``length`` tokens (default: all), on ``device`` (default: same);
        ``pin``: in page-locked host memory (``device`` the CPU), so copying it back to a GPU is a fast DMA.

        The sections are copied whole: they describe the state *after* ``self.length``
        tokens, so cloning a shorter ``length`` is only meaningful for a model without
        sections (the caller trims views of a recurrent model at an anchor instead).
        """
        n = self.length if length is None else length
        if n > self.length:
            raise StateMismatch(f"cannot clone {n} tokens of a state holding {self.length}")
        secs = {k: copy_to(v, device, pin) for k, v in self.sections.items()}
        views = {k: View(copy_to(v.head(n), device, pin), v.axis) for k, v in self.views.items()}
        return ModelState(secs, views, n)

    def restore(self, snap: "ModelState", length: int | None = None) -> None:
        """Copy ``snap`` into this state's tensors in place; refuses another shape or dtype, naming the tensor.

        ``length`` (default ``snap.length``): the sequence's length afterwards, when the buffers past
        ``snap.length`` up to it still hold the sequence (a parked state: only the rows something else
        wrote over were kept, the sections are the state after ``length`` tokens)."""
        self.check_compatible(snap)
        n = snap.length if length is None else int(length)
        for k in snap.views:
            mine = self.views[k]
            if max(n, snap.length) > mine.capacity:
                what = f"snapshot of {snap.length}" if snap.length >= n else f"sequence of {n}"
                raise StateMismatch(f"view {k!r}: {what} tokens exceeds capacity {mine.capacity}")
        if n < snap.length:
            raise StateMismatch(f"restore to {n} tokens of a snapshot holding {snap.length}")
        for k, v in snap.sections.items():
            self.sections[k].copy_(v)
        for k, v in snap.views.items():
            self.views[k].head(snap.length).copy_(v.head(snap.length))
        self.length = n

    def resume(self, n: int, sections: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take the sequence back to ``n`` tokens in place: copy ``sections`` (the recurrent state after
        exactly ``n`` tokens, e.g. an anchor's) into this state's sections and cut the views at ``n``.
        The views already hold the first ``n`` positions (a common prefix), so nothing of them is copied.
        A state with sections refuses a resume without them unless ``n`` equals its length."""
        if n > self.length:
            raise StateMismatch(f"cannot resume at {n}: the state holds {self.length} tokens")
        if sections is None:
            if self.sections and n != self.length:
                raise StateMismatch(f"resume at {n} of {self.length} needs the recurrent sections at {n}")
        else:
            if set(sections) != set(self.sections):
                raise StateMismatch(f"anchor sections {sorted(sections)} differ from the state's "
                                    f"{sorted(self.sections)}")
            for k, v in sections.items():
                if _sig(v, None) != _sig(self.sections[k], None):
                    raise StateMismatch(f"section {k!r}: anchor {_sig(v, None)} vs state {_sig(self.sections[k], None)}")
                self.sections[k].copy_(v)
        self.length = n

    def check_compatible(self, snap: "ModelState") -> None:
        mine, theirs = self._sig_map(), snap._sig_map()
        for name in sorted(set(mine) | set(theirs)):
            if name not in mine:
                raise StateMismatch(f"state has no tensor {name!r} (snapshot has {theirs[name]})")
            if name not in theirs:
                raise StateMismatch(f"snapshot lacks tensor {name!r} (state has {mine[name]})")
            if mine[name] != theirs[name]:
                raise StateMismatch(f"tensor {name!r}: snapshot {theirs[name]} vs state {mine[name]}")

    def _sig_map(self) -> Mapping[str, tuple]:
        out = {f"section:{k}": _sig(v, None) for k, v in self.sections.items()}
        out.update({f"view:{k}": _sig(v.tensor, v.axis) for k, v in self.views.items()})
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a flat name (views cut to ``length``), for serialisation."""
        out = {f"section.{k}": v for k, v in self.sections.items()}
        out.update({f"view.{k}": v.head(self.length) for k, v in self.views.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], axes: Mapping[str, int], length: int) -> "ModelState":
        secs = {k[len("section."):]: v for k, v in tensors.items() if k.startswith("section.")}
        views = {k[len("view."):]: View(v, axes[k[len("view."):]]) for k, v in tensors.items() if k.startswith("view.")}
        return cls(secs, views, length)
