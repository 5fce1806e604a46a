"""The memory gate: before every prefill, does the prompt's workspace fit under the peak?

The prompt needs ``workspace(prompt_len)`` bytes (the engine's function of prompt
length: activations, attention scratch, logits) plus ``view_bytes_per_token`` for each
token the prefill adds to the views. That is checked against what is available:

- with a declared peak (``--mem-peak`` bytes, ``TANDEM_MEM_PEAK``): the peak minus
  ``base_bytes`` (weights and engine buffers, from ``engine.memory_parts()``) minus
  what the gated caches hold now;
- otherwise from the device: ``torch.cuda.mem_get_info`` plus what torch's caching
  allocator holds unused, on a GPU; ``MemAvailable`` of ``/proc/meminfo`` (psutil where
  there is no ``/proc``) on the CPU; plus what the gate has released since it measured.

When the prompt does not fit, caches are given back cheapest first: across every gated
tier, the entry that saves the least recompute time per byte goes first (the gate asks
the tier whose ``value_per_byte()`` is lowest to ``release`` one entry, then ranks again).
A prompt that cannot fit even with every cache given back fails alone, with
``MemoryGateError`` saying how much it needed and how much there was, and nothing is
released for it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from tandem_core.cache.base import Releasable

__all__ = ["MemoryGate", "MemoryGateError", "GateResult", "Need", "device_available", "human_bytes"]

log = logging.getLogger("tandem.cache")


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Need(NamedTuple):
    """Bytes a prefill needs: ``workspace`` + ``views`` (+ ``parked``: a side-lane request's copy of the rows
    and state it displaces) = ``total``."""

    workspace: int
    views: int
    parked: int = 0

    @property
    def total(self) -> int:
        return self.workspace + self.views + self.parked


class GateResult(NamedTuple):
    """A prompt that fits: what it needed, what was available, and what was released for it (tier, bytes)."""

    need: Need
    available: int
    released: tuple[tuple[str, int], ...]


class MemoryGateError(MemoryError):
    """A prompt whose workspace does not fit even with every cache given back (fails that request alone)."""

    def __init__(self, prompt_len: int, need: Need, available: int, releasable: int, peak: int) -> None:
        self.prompt_len, self.need, self.available, self.releasable, self.peak = (
            prompt_len, need, available, releasable, peak)
        where = f"under the declared peak of {human_bytes(peak)}" if peak else "on the device"
        super().__init__(
            f"memory gate: a prompt of {prompt_len} tokens needs {need.total} bytes ({human_bytes(need.total)}: "
            f"workspace {human_bytes(need.workspace)} + views {human_bytes(need.views)}"
            f"{f' + parked state {human_bytes(need.parked)}' if need.parked else ''}) but {available} bytes "
            f"({human_bytes(available)}) are available {where}, and the caches could give back only "
            f"{releasable} bytes ({human_bytes(releasable)})")


def _meminfo_available() -> int | None:
    p = Path("/proc/meminfo")
    if not p.exists():
        return None
    for line in p.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def device_available(device: str) -> int:
    """Bytes a new allocation can take on ``device`` now."""
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        free, _total = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free + cached)
    avail = _meminfo_available()
    if avail is not None:
        return avail
    try:
        import psutil
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return int(psutil.virtual_memory().available)


class MemoryGate:
    """Checks each prefill's workspace against the peak, giving caches back cheapest first.

    ``workspace(prompt_len) -> bytes``  the engine's workspace for a prompt of that length
    ``view_bytes_per_token``            ``engine.state.view_bytes_per_token()``
    ``tiers``                           caches that can give memory back (``Releasable``)
    ``peak_bytes``                      the declared peak (0: measure the device)
    ``base_bytes``                      what the process holds besides the caches (weights, buffers)
    ``available``                       how to measure the device (default ``device_available(device)``)
    """

    def __init__(self, workspace: Callable[[int], int], view_bytes_per_token: int,
                 tiers: Sequence[Releasable] = (), *, peak_bytes: int = 0, base_bytes: int = 0,
                 device: str = "cpu", available: Callable[[], int] | None = None) -> None:
        self.workspace = workspace
        self.view_bytes_per_token = int(view_bytes_per_token)
        self.tiers = list(tiers)
        self.peak = int(peak_bytes)
        self.base = int(base_bytes)
        self.device = device
        self._measure = available or (lambda: device_available(device))
        self.refused = 0
        self.released_bytes = 0

    @classmethod
    def from_settings(cls, workspace: Callable[[int], int], view_bytes_per_token: int,
                      tiers: Sequence[Releasable] = (), *, base_bytes: int = 0, device: str = "cpu") -> "MemoryGate":
        """A gate whose peak is ``TANDEM_MEM_PEAK`` (the server's ``--mem-peak`` sets it; 0: from the device)."""
        from tandem_core.settings import SETTINGS

        return cls(workspace, view_bytes_per_token, tiers, peak_bytes=int(SETTINGS.get("MEM_PEAK")),
                   base_bytes=base_bytes, device=device)

    def need(self, prompt_len: int, start: int = 0, parked: int = 0) -> Need:
        """Bytes a prefill of ``prompt_len`` tokens resuming at ``start`` needs (plus ``parked`` bytes)."""
        return Need(int(self.workspace(prompt_len)), self.view_bytes_per_token * max(0, prompt_len - start),
                    int(parked))

    def held(self) -> int:
        return sum(t.stats().bytes for t in self.tiers)

    def available(self) -> int:
        if self.peak:
            return self.peak - self.base - self.held()
        return int(self._measure())

    def check(self, prompt_len: int, start: int = 0, parked: int = 0) -> GateResult:
        """Admit a prefill, releasing caches cheapest first if needed; ``MemoryGateError`` if it cannot fit.
        ``parked``: bytes held besides for the prefill's sake (a side-lane request's parked state)."""
        need = self.need(prompt_len, start, parked)
        have = self.available()
        if have >= need.total:
            return GateResult(need, have, ())
        releasable = self.held()
        if have + releasable < need.total:
            self.refused += 1
            raise MemoryGateError(prompt_len, need, have, releasable, self.peak)
        released: dict[str, int] = {}
        freed = 0
        dry: set[int] = set()
        while have + freed < need.total:
            live = [t for t in self.tiers if id(t) not in dry and t.stats().bytes > 0]
            if not live:
                break
            tier = min(live, key=lambda t: t.value_per_byte())
            got = tier.release(1)       # its single cheapest entry
            if got <= 0:
                dry.add(id(tier))
                continue
            freed += got
            released[tier.name] = released.get(tier.name, 0) + got
        self.released_bytes += freed
        after = self.available() if self.peak else have + freed
        if after < need.total:
            self.refused += 1
            raise MemoryGateError(prompt_len, need, after, freed, self.peak)
        log.info("memory gate: released %s for a prompt needing %s",
                 ", ".join(f"{k} {human_bytes(v)}" for k, v in released.items()), human_bytes(need.total))
        return GateResult(need, after, tuple(released.items()))

    def value_order(self) -> list[tuple[str, float]]:
        """The gated tiers by the value of their next entry to go (cheapest first), for /health."""
        return sorted(((t.name, t.value_per_byte()) for t in self.tiers), key=lambda x: (x[1], x[0]))

