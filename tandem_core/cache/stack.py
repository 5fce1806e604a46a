"""The tiers together for one engine: where a prefill starts, and following the sequence after it.

``CacheStack.prefill(engine, tokens)`` is the cached form of ``spec.loop.prefill``
(``stack.start`` has its signature)::

    plan the resident prefix, ask each lower tier (store, disk, a plugin's) for a further start
    the memory gate (if any) admits the prompt, giving caches back cheapest first
    a displaced session (the new prompt keeps little of it) is offered to the first lower tier
    restore: resume the live state at a resident anchor, or restore a lower tier's snapshot, or reset
    forward the rest in chunks split at anchor points, capturing anchors; an end anchor at the prompt's end
    log "prefill started: resident anchor at 2048 of 2310"

After it, the decode loop tells the stack what the engine committed (``commit``),
rolled back (``rollback``) and where the generation ended (``end_generation``).
A snapshot the store evicts after it served a restore (it came back) is handed to
the next tier down (the disk).

The engine's ``state`` must be its live state: a restore or resume into it is the
engine's sequence (``tandem_core.state``). An engine with ``caps.resume`` is also told
``resume_at(n)`` after its state was taken to ``n``.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from tandem_core.cache.base import (
    GEN_END, PROMPT_END, RESTORED, Anchor, Hit, PrefillStart, Snapshot, SnapshotTier, TierStats, as_tokens,
)
from tandem_core.cache.gate import MemoryGate
from tandem_core.cache.resident import ResidentPrefix, ResumePlan
from tandem_core.engine import Engine, supports_resume
from tandem_core.state import ModelState, StateMismatch

__all__ = ["CacheStack", "Prefilled"]

log = logging.getLogger("tandem.cache")


@runtime_checkable
class EvictsDown(Protocol):
    """A tier that hands each entry it evicts to ``on_evict(snapshot, hits)`` (the stack sets it to offer the
    entry to the next tier down, unless something else already did)."""

    on_evict: Callable[[Snapshot, int], None] | None


@runtime_checkable
class TakesLiveState(Protocol):
    """A tier that takes a live state and its anchors directly (``put`` clones what it keeps), so the stack
    need not copy a snapshot first."""

    def put(self, tokens: Sequence[int] | np.ndarray, state: ModelState, anchors: Sequence[Anchor] = ()) -> Any: ...


class Prefilled(NamedTuple):
    logits: torch.Tensor    # [1, V]: the prompt's last position
    start: PrefillStart


class CacheStack:
    """``resident`` over ``lower`` tiers (searched in order), with an optional memory ``gate``.

    ``chunk``             prefill chunk (tokens), chunks also split at anchor points
    ``keep_displaced``    a resident session losing at least this many tokens to a new
                          prompt is offered to ``lower[0]`` first (0: never)
    ``hand_down_hits``    a store entry evicted after at least this many restores goes to the
                          tier below it
    """

    def __init__(self, resident: ResidentPrefix, lower: Sequence[SnapshotTier] = (), *,
                 gate: MemoryGate | None = None, chunk: int = 512, keep_displaced: int = 256,
                 hand_down_hits: int = 1) -> None:
        self.resident = resident
        self.lower = list(lower)
        self.gate = gate
        self.chunk = chunk
        self.keep_displaced = keep_displaced
        self.hand_down_hits = hand_down_hits
        self.last: PrefillStart | None = None
        for i, tier in enumerate(self.lower[:-1]):
            if isinstance(tier, EvictsDown) and tier.on_evict is None:
                tier.on_evict = partial(self._hand_down, i + 1)

    # -- the prefill ----------------------------------------------------------------------
    def _best_lower(self, toks: np.ndarray, above: int) -> tuple[SnapshotTier, Hit] | None:
        best: tuple[SnapshotTier, Hit] | None = None
        for tier in self.lower:
            hit = tier.lookup(toks, len(toks) - 1)
            if hit is not None and hit.start > (best[1].start if best else above):
                best = (tier, hit)
        return best

    def _plan(self, engine: Engine, toks: np.ndarray) -> tuple[ResumePlan, tuple[SnapshotTier, Hit] | None]:
        while True:
            plan = self.resident.plan(toks, engine.state)
            found = self._best_lower(toks, plan.start)
            if self.gate is None:
                return plan, found
            start = found[1].start if found else plan.start
            if not self.gate.check(len(toks), start).released:
                return plan, found
            # something was given back: the plan may have lost its source, plan again

    def _keep_displaced(self, engine: Engine, plan: ResumePlan, found: tuple[SnapshotTier, Hit] | None) -> None:
        """Offer the resident session to ``lower[0]`` when the new prompt loses enough of it."""
        state = engine.state
        lost = self.resident.length - plan.common
        if not self.lower or not self.keep_displaced or lost < self.keep_displaced:
            return
        if state.length != self.resident.length:
            return
        kinds = (PROMPT_END, GEN_END, RESTORED)
        anchors = [a for a in self.resident.anchors() if a.kind in kinds and 0 < a.position < state.length]
        if self.gate is not None:
            start = found[1].start if found else plan.start
            room = self.gate.available() - self.gate.need(plan.total, start).total
            if state.nbytes + sum(a.nbytes for a in anchors) > room:
                return
        first = self.lower[0]
        if isinstance(first, TakesLiveState):
            first.put(self.resident.tokens, state, anchors)
        else:
            first.offer(self.resident.snapshot(state, kinds=kinds))

    def _told(self, engine: Engine, n: int) -> None:
        if supports_resume(engine):
            engine.resume_at(n)

    def prefill(self, engine: Engine, tokens: Sequence[int] | np.ndarray | torch.Tensor, *,
                between: Callable[[], None] | None = None) -> Prefilled:
        """The engine holds ``tokens`` afterwards; returns the last position's logits and where it started.
        ``between`` (optional) is called between two chunks (a safe point: the engine holds the chunks so
        far and nothing else)."""
        toks = as_tokens(tokens)
        total = len(toks)
        if total == 0:
            raise ValueError("prefill of an empty prompt")
        where: PrefillStart | None = None
        displaced = False
        while where is None:
            plan, found = self._plan(engine, toks)
            if not displaced:       # before the live state is touched; only into room the prompt leaves
                displaced = True
                self._keep_displaced(engine, plan, found)
            if found is None:
                where = self.resident.apply(plan, engine.state, reset=engine.reset)
                if not plan.cold:
                    self._told(engine, plan.start)
                break
            tier, hit = found
            snap_state = tier.load(hit)
            if snap_state is None:
                continue        # the entry was unusable and is gone: plan again
            try:
                engine.state.restore(snap_state)
            except StateMismatch as exc:
                log.warning("%s cache: snapshot does not fit this engine (%s): prefill from cold", tier.name, exc)
                where = self.resident.apply(ResumePlan(0, None, 0, total), engine.state, reset=engine.reset)
                break
            self.resident.restored(toks[:hit.start], engine.state, keep_upto=min(plan.common, hit.start))
            self._told(engine, hit.start)
            where = PrefillStart(tier.name, hit.start, total)
        logits: torch.Tensor | None = None
        for a, b in self.resident.chunks(where.start, total, self.chunk):
            if between is not None and a > where.start:
                between()
            logits = engine.forward(torch.from_numpy(toks[a:b].copy()))
            self.resident.commit(toks[a:b], engine.state)
        self.resident.mark_end(engine.state, PROMPT_END)
        assert logits is not None   # a plan never starts at the prompt's end
        log.info("prefill started: %s", where.describe())
        self.last = where
        return Prefilled(logits, where)

    def start(self, engine: Engine, prompt: Sequence[int], *, between: Callable[[], None] | None = None
              ) -> torch.Tensor:
        """``spec.loop.prefill``'s signature: the prompt's last logits ``[1, V]``."""
        return self.prefill(engine, prompt, between=between).logits

    # -- after the prefill ------------------------------------------------------------------
    def commit(self, engine: Engine, tokens: Sequence[int] | torch.Tensor) -> None:
        """The engine appended (forwarded and committed) ``tokens``."""
        self.resident.commit(tokens, engine.state)

    def rollback(self, engine: Engine, n: int) -> None:
        """The engine rolled back to ``n`` committed tokens."""
        self.resident.rollback(n)

    def end_generation(self, engine: Engine) -> None:
        """The generation ended: an end anchor where the engine's sequence ends."""
        self.resident.mark_end(engine.state, GEN_END)

    def _hand_down(self, below: int, snap: Snapshot, hits: int) -> None:
        if hits >= self.hand_down_hits and below < len(self.lower):
            self.lower[below].offer(snap)

    # -- sessions through a restart ---------------------------------------------------------
    def snapshot(self, engine: Engine) -> Snapshot:
        """The live session, detached on the CPU (for the session spill)."""
        return self.resident.snapshot(engine.state)

    def adopt(self, engine: Engine, snap: Snapshot) -> None:
        """Make a spilled session the live one."""
        self.resident.adopt(snap, engine.state)
        self._told(engine, snap.length)

    def stats(self) -> list[TierStats]:
        out = [self.resident.stats()] + [t.stats() for t in self.lower]
        return out
