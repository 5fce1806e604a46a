"""The server's caches: a ``CacheStack`` per engine, the lower tiers shared, the spill, the memory gate.

``build_caches(served, engines, options)`` builds them from the registered cache tiers
(the ``tandem_cache_tiers`` hook: the core's ``resident``, ``store``, ``disk`` and
``spill``, and any plugin's):

- every engine gets its own ``resident`` tier (its live sequence and anchors) and its
  own ``CacheStack``; every other tier but ``spill`` is built once and shared by all
  engines, in registration order (the store, then the disk, then a plugin's);
- the fingerprint of what computed the rows is ``engine.manifest().fingerprint()`` with
  the tokenizer's fingerprint;
- the disk tier and the spill live in ``<TANDEM_HOME>/cache/<model id>/`` (``--cache-dir``),
  held by one process at a time (a lock file);
- one memory gate over every engine: the peak is ``--mem-peak`` (or ``TANDEM_MEM_PEAK``;
  0 measures the device), the base is every engine's ``memory_parts()`` (the weights,
  shared by spawned engines, once), and the workspace of a prompt is
  ``workspace_estimate`` (the engine's ``caps.workspace_bytes_per_token`` or a generic one).

Per request, ``EngineCaches.decode_hooks()`` gives the decode loop its prefill
(``start``) and what follows the sequence (``on_forwarded``, ``on_end``); ``admit``
refuses, before anything runs, a prompt the gate can never admit.

An engine whose ``state`` is not live (a restore into it does not move ``kv.length``)
cannot be cached: ``build_caches`` checks that at load and turns the caches off, with a
log line, rather than resume into a state the engine does not read.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import numpy as np

import torch

from tandem_core.cache.base import (
    CacheContext, CostModel, PrefillStart, Releasable, SnapshotTier, TierStats, as_tokens, common_prefix,
)
from tandem_core.cache.gate import GateResult, MemoryGate, MemoryGateError, human_bytes
from tandem_core.cache.resident import ResidentPrefix
from tandem_core.cache.stack import CacheStack
from tandem_core.engine import Engine
from tandem_core.server.cachedir import CacheDirectoryBusy, cache_directory, lock_directory, lock_path, parse_bytes
from tandem_core.serving import Served, Tokenizer
from tandem_core.state import ModelState, StateMismatch, View

__all__ = [
    "CacheOptions", "CacheDirectoryBusy", "EngineCaches", "ServerCaches", "build_caches", "fingerprint",
    "lock_directory",
    "workspace_estimate", "base_bytes", "state_is_live", "parse_bytes", "cache_directory",
    "GENERIC_ROW_BYTES",
]

log = logging.getLogger("tandem.cache")

GENERIC_ROW_BYTES = 16 * 1024   # the least scratch a prefill row is assumed to need (generic estimate)
STOP_WAIT_S = 30.0              # how long shutdown waits for a busy engine before spilling without it
_SESSION = re.compile(r"^engine-(\d+)$")


@dataclass(frozen=True)
class CacheOptions:
    """How the server builds its caches (``tandem serve`` flags).

    ``directory``       this model's disk tier and spill (None: ``<TANDEM_HOME>/cache/<model id>``)
    ``mem_peak``        the declared peak in bytes (None: ``TANDEM_MEM_PEAK``; 0: measure the device)
    ``chunk``           prefill chunk of the cache stack (tokens; chunks also split at anchor points;
                        0: the engine's ``caps.prefill_chunk``, 512 when it says none)
    ``keep_displaced``  a resident session losing at least this many tokens goes to the store first
    ``lock``            the directory's lock, already held (``lock_directory``: ``tandem serve`` takes it
                        before the weights load); None: ``build_caches`` takes it
    """

    directory: Path | None = None
    mem_peak: int | None = None
    chunk: int = 0
    keep_displaced: int = 256
    lock: IO[str] | None = field(default=None, compare=False, repr=False)


def fingerprint(engine: Engine, tokenizer: Tokenizer) -> str:
    """What computed the rows and what the token ids mean: the engine's manifest fingerprint (its model
    files, the settings that change its arithmetic, its extras) with the tokenizer's fingerprint."""
    h = hashlib.sha256()
    h.update(engine.manifest().fingerprint().encode())
    h.update(b"\0" + tokenizer.fingerprint().encode())
    return h.hexdigest()


def workspace_estimate(engine: Engine, chunk: int, vocab: int) -> Callable[[int], int]:
    """The bytes a prefill of ``n`` tokens needs besides the rows it adds to the views.

    It runs at most ``rows = min(n, chunk)`` rows at a time. With the engine's
    ``caps.workspace_bytes_per_token`` (scratch per row, attention included) it is
    ``rows x that``; without it (0), generically ``rows x max(4 x the views' bytes per token,
    16 KiB)`` for the activations plus ``rows x n x 4`` (one fp32 attention score per row
    and position). Both add the last row's fp32 logits twice (``2 x vocab x 4``).
    """
    declared = int(engine.caps.workspace_bytes_per_token)
    per_row = declared if declared > 0 else max(4 * engine.state.view_bytes_per_token(), GENERIC_ROW_BYTES)
    logits = 2 * 4 * int(vocab)
    chunk = max(1, int(chunk))

    def workspace(n: int) -> int:
        rows = min(max(0, n), chunk)
        scores = 0 if declared > 0 else rows * n * 4
        return rows * per_row + scores + logits

    return workspace


def base_bytes(engines: Sequence[Engine]) -> int:
    """What the engines hold besides the caches: their ``memory_parts()``. Spawned engines share the
    weights (``Served.spawn``), so a part named ``weights`` counts once."""
    total = 0
    for i, engine in enumerate(engines):
        for part in engine.memory_parts():
            if i and part.name == "weights":
                continue
            total += int(part.nbytes)
    return total


def state_is_live(engine: Engine) -> bool:
    """Does a restore into ``engine.state`` move ``engine.kv.length`` (the caches' contract)?

    Restores the state's own first row and sections into itself (nothing changes but the
    length), reads ``kv.length``, then resets the engine.
    """
    state = engine.state
    if state.length != engine.kv.length:
        return False
    if any(v.capacity < 1 for v in state.views.values()):
        return False
    if state.length:
        engine.reset()
    probe = ModelState({k: t.detach().clone() for k, t in state.sections.items()},
                       {k: View(v.head(1).detach().clone(), v.axis) for k, v in state.views.items()}, 1)
    try:
        engine.state.restore(probe)
        live = engine.kv.length == 1 and engine.state.length == 1
    except StateMismatch:
        live = False
    engine.reset()
    return live and engine.kv.length == 0


class _SharedGate(MemoryGate):
    """The memory gate of every engine at once: one check at a time."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._lock = threading.RLock()

    def check(self, prompt_len: int, start: int = 0, parked: int = 0) -> GateResult:
        with self._lock:
            return super().check(prompt_len, start, parked)


class EngineCaches:
    """One engine's cache stack, as the decode loop and the server use it."""

    def __init__(self, index: int, engine: Engine, stack: CacheStack, gate: MemoryGate | None) -> None:
        self.index = index
        self.engine = engine
        self.stack = stack
        self.gate = gate
        self.last: PrefillStart | None = None      # the last prefill's start (for /health)
        self.busy = threading.Lock()               # held while a request runs on the engine

    def holds(self, prompt: Sequence[int]) -> int:
        """How many of ``prompt``'s first tokens this engine's resident prefix holds (where its prefill would
        start): the admission sends a request to the engine that holds most of it."""
        held = np.asarray(self.stack.resident.tokens, dtype=np.int64)
        return common_prefix(held, np.asarray(prompt, dtype=np.int64)) if len(held) else 0

    # -- the decode loop's hooks ----------------------------------------------------------
    def decode_hooks(self) -> dict[str, Any]:
        """``Decode(..., **hooks)``: the cached prefill and the hooks that follow the sequence."""
        return {"start": self.start, "on_forwarded": self.forwarded, "on_end": self.ended}

    def start(self, engine: Engine, prompt: Sequence[int], *, between: Callable[[], None] | None = None
              ) -> torch.Tensor:
        """``spec.loop.prefill``'s signature: prefill through the stack, remembering where it started."""
        self.last = None
        pre = self.stack.prefill(engine, prompt, between=between)
        self.last = pre.start
        return pre.logits

    def forwarded(self, tokens: Sequence[int]) -> None:
        self.stack.commit(self.engine, tokens)

    def rolled_back(self, n: int) -> None:
        self.stack.rollback(self.engine, n)

    def ended(self) -> None:
        """An end anchor where the generation ended (skipped if the resident prefix lost step: it forgot)."""
        if self.stack.resident.length == self.engine.state.length:
            self.stack.end_generation(self.engine)

    def forget(self) -> None:
        """After a failed request: the engine's buffers cannot be trusted, so neither the resident prefix."""
        self.stack.resident.reset()
        self.engine.reset()

    # -- before a request runs ------------------------------------------------------------
    def admit(self, prompt: Sequence[int]) -> None:
        """Refuse (``MemoryGateError``) a prompt the gate cannot admit even if every cache is given back.

        Reads only: the prefill's own check gives caches back when it must. Certain only:
        when a lower tier holds entries it might resume further than the resident prefix
        (it is not asked here: a lookup counts), so the prompt is then refused only if it
        does not fit even resuming at its last token.
        """
        gate = self.gate
        if gate is None:
            return
        toks = as_tokens(prompt)
        n = len(toks)
        plan = self.stack.resident.plan(toks, self.engine.state)
        need = gate.need(n, plan.start)
        have = gate.available()
        if have >= need.total:
            return
        releasable = gate.held()
        lower_empty = all(t.stats().entries == 0 for t in self.stack.lower)
        best = plan.start if lower_empty else max(plan.start, n - 1)
        if have + releasable >= gate.need(n, best).total:
            return
        gate.refused += 1
        raise MemoryGateError(n, need, have, releasable, gate.peak)


class ServerCaches:
    """Every engine's caches, the shared lower tiers, the spill and the gate."""

    def __init__(self, engines: list[EngineCaches], lower: list[SnapshotTier], spill: Any,
                 gate: MemoryGate | None, fingerprint: str, directory: Path, lock: IO[str] | None) -> None:
        self.engines = engines
        self.lower = lower
        self.spill = spill
        self.gate = gate
        self.fingerprint = fingerprint
        self.directory = directory
        self._lock_file = lock

    def engine(self, index: int) -> EngineCaches:
        return self.engines[index]

    # -- sessions through a restart ---------------------------------------------------------
    def restore(self) -> int:
        """Adopt the spilled sessions (``engine-<i>`` into engine ``i``; others offered to the first lower
        tier). Returns how many engines resume a session. A spill that cannot be read is dropped, with a
        log line, and the server starts clean."""
        if self.spill is None:
            return 0
        try:
            sessions = self.spill.load()
        except Exception as exc:  # any unreadable spill: never fatal, never used
            log.warning("session spill: unreadable (%s: %s): starting clean", type(exc).__name__, exc)
            return 0
        adopted = 0
        for name, snap in sessions.items():
            m = _SESSION.match(name)
            i = int(m.group(1)) if m else -1
            if not 0 <= i < len(self.engines) or self.engines[i].stack.resident.length:
                if self.lower and self.lower[0].offer(snap):
                    log.info("session spill: session %r (%d tokens) kept in the %s tier", name, snap.length,
                             self.lower[0].name)
                continue
            ec = self.engines[i]
            try:
                ec.stack.adopt(ec.engine, snap)
            except (StateMismatch, ValueError) as exc:
                log.warning("session spill: session %r does not fit engine %d (%s): dropped", name, i, exc)
                ec.forget()
                continue
            adopted += 1
            log.info("session spill: engine %d resumes a session of %d tokens", i, snap.length)
        return adopted

    def save_sessions(self, timeout_s: float = STOP_WAIT_S) -> Path | None:
        """Write every idle engine's resident session (waiting up to ``timeout_s`` for a busy one)."""
        if self.spill is None:
            return None
        deadline = time.monotonic() + timeout_s
        sessions = {}
        held: list[EngineCaches] = []
        try:
            for ec in self.engines:
                if not ec.busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    log.warning("session spill: engine %d still busy: its session is not spilled", ec.index)
                    continue
                held.append(ec)
                n = ec.stack.resident.length
                if n and n == ec.engine.state.length:
                    sessions[f"engine-{ec.index}"] = ec.stack.snapshot(ec.engine)
            if not sessions:
                return None
            t0 = time.perf_counter()
            path = self.spill.save(sessions)
            log.info("session spill: %d sessions written in %.2fs", len(sessions), time.perf_counter() - t0)
            return path
        finally:
            for ec in held:
                ec.busy.release()

    # -- what /health and /metrics show -----------------------------------------------------
    def tier_stats(self) -> list[TierStats]:
        """The resident tiers of every engine summed, then each shared tier, then the spill."""
        res = [ec.stack.resident.stats() for ec in self.engines]
        out = [TierStats(res[0].tier, sum(s.bytes for s in res), sum(s.entries for s in res),
                         sum(s.hits for s in res), sum(s.misses for s in res))]
        out += [t.stats() for t in self.lower]
        if self.spill is not None:
            out.append(self.spill.stats())
        return out

    def health(self) -> dict[str, Any]:
        engines = []
        for ec in self.engines:
            last = ec.last
            engines.append({
                "engine": ec.index, "tokens": ec.stack.resident.length,
                "anchors": len(ec.stack.resident.anchors()),
                "last_prefill": None if last is None else {
                    "tier": last.tier, "start": last.start, "total": last.total, "anchor": last.anchor,
                    "describe": last.describe()}})
        out: dict[str, Any] = {"enabled": True, "directory": str(self.directory),
                               "fingerprint": self.fingerprint,
                               "tiers": [s.as_dict() for s in self.tier_stats()], "engines": engines}
        if self.gate is not None:
            g = self.gate
            out["gate"] = {"peak": g.peak, "base": g.base, "available": g.available(), "held": g.held(),
                           "refused": g.refused, "released_bytes": g.released_bytes,
                           "order": [{"tier": t, "value_per_byte": v if math.isfinite(v) else None}
                                     for t, v in g.value_order()]}
        return out

    def metric_lines(self) -> list[str]:
        """The tiers, the last prefill starts and the gate in the Prometheus text format."""
        stats = self.tier_stats()
        out: list[str] = []
        for name, kind, help_, field in (
                ("tandem_cache_bytes", "gauge", "Bytes each cache tier holds.", "bytes"),
                ("tandem_cache_entries", "gauge", "Entries each cache tier holds (anchors, snapshots).",
                 "entries"),
                ("tandem_cache_hits_total", "counter", "Prefills (or sessions) each cache tier served.",
                 "hits"),
                ("tandem_cache_misses_total", "counter", "Lookups each cache tier could not serve.",
                 "misses")):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            out += [f'{name}{{tier="{s.tier}"}} {getattr(s, field)}' for s in stats]
        out += ["# HELP tandem_prefill_last_start Where each engine's last prefill started (tokens).",
                "# TYPE tandem_prefill_last_start gauge"]
        out += [f'tandem_prefill_last_start{{engine="{ec.index}",tier="{ec.last.tier}"}} {ec.last.start}'
                for ec in self.engines if ec.last is not None]
        out += ["# HELP tandem_prefill_last_total The last prompt's length on each engine (tokens).",
                "# TYPE tandem_prefill_last_total gauge"]
        out += [f'tandem_prefill_last_total{{engine="{ec.index}"}} {ec.last.total}'
                for ec in self.engines if ec.last is not None]
        if self.gate is not None:
            g = self.gate
            out += ["# HELP tandem_memory_gate_available_bytes Bytes a prefill may use now (before caches "
                    "are given back).", "# TYPE tandem_memory_gate_available_bytes gauge",
                    f"tandem_memory_gate_available_bytes {g.available()}",
                    "# HELP tandem_memory_gate_refused_total Prompts the memory gate refused.",
                    "# TYPE tandem_memory_gate_refused_total counter",
                    f"tandem_memory_gate_refused_total {g.refused}",
                    "# HELP tandem_memory_gate_released_bytes_total Cache bytes given back to admit prompts.",
                    "# TYPE tandem_memory_gate_released_bytes_total counter",
                    f"tandem_memory_gate_released_bytes_total {g.released_bytes}"]
        return out

    def close(self) -> None:
        if self._lock_file is not None:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock_file.close()
                self._lock_file = None


def build_caches(served: Served, engines: Sequence[Engine], options: CacheOptions) -> ServerCaches | None:
    """The caches of ``engines`` (all of ``served``'s model), or None (with a log line) when an engine
    cannot be cached. ``CacheDirectoryBusy`` when another process holds the directory."""
    from tandem_core.plugins import import_string, load_plugins, registries
    from tandem_core.settings import SETTINGS

    for i, engine in enumerate(engines):
        if not state_is_live(engine):
            log.warning("caches off: engine %d's state is not live (a restore into engine.state does not "
                        "move kv.length), so no cache can resume it", i)
            return None
    load_plugins()
    tiers = dict(registries().cache_tiers)
    if "resident" not in tiers:
        log.warning("caches off: no 'resident' cache tier is registered")
        return None
    first = engines[0]
    fp = fingerprint(first, served.tokenizer)
    directory = cache_directory(served.model_id, options.directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock = options.lock if options.lock is not None else lock_path(directory)
    try:
        on_gpu = first.caps.device.startswith("cuda")
        # the resident prefix and its anchors live with the engine (device memory); the snapshot store on the
        # host, page-locked when the engine is on a GPU (a restore is then a DMA, not a pageable copy)
        chunk = options.chunk or first.caps.prefill_chunk or 512
        ctx = CacheContext(fp, directory, device="cpu", pin=on_gpu, cost=CostModel(), chunk=chunk)
        lower: list[SnapshotTier] = []
        for name, path in tiers.items():
            if name in ("resident", "spill"):
                continue
            tier = import_string(path).build(ctx)
            if not isinstance(tier, SnapshotTier):
                raise TypeError(f"cache tier {name!r} ({path}) is not a SnapshotTier "
                                f"(lookup, load, offer, stats)")
            lower.append(tier)
        spill = import_string(tiers["spill"]).build(ctx) if "spill" in tiers else None
        resident_cls = import_string(tiers["resident"])
        residents: list[ResidentPrefix] = [resident_cls.build(ctx) for _ in engines]
        peak = int(SETTINGS.get("MEM_PEAK")) if options.mem_peak is None else int(options.mem_peak)
        # the gate measures the engine's device: what it may give back is what lives there (on a GPU, the
        # resident prefixes and their anchors; the host-side store is not device memory)
        gated: list[Releasable] = [*residents, *(t for t in lower if isinstance(t, Releasable) and not on_gpu)]
        gate = _SharedGate(workspace_estimate(first, chunk, served.tokenizer.vocab_size),
                           first.state.view_bytes_per_token(), gated, peak_bytes=peak,
                           base_bytes=base_bytes(engines), device=first.caps.device)
        caches = [EngineCaches(i, e, CacheStack(r, lower, gate=gate, chunk=chunk,
                                                keep_displaced=options.keep_displaced), gate)
                  for i, (e, r) in enumerate(zip(engines, residents))]
    except BaseException:
        lock.close()
        raise
    names = ["resident", *(t.name for t in lower), *(["spill"] if spill is not None else [])]
    log.info("caches: %s for %d engine(s) in %s (fingerprint %s…); memory gate %s", ", ".join(names),
             len(engines), directory, fp[:12],
             f"peak {human_bytes(peak)}" if peak else "measured from the device")
    return ServerCaches(caches, lower, spill, gate, fp, directory, lock)
