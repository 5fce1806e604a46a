"""The side lane: a short request does not wait for the running generation, it is served inside it.

A *short* request (``is_short``: at most ``SHORT_PROMPT_TOKENS`` prompt tokens, at most
``SHORT_OUTPUT_TOKENS`` output tokens, thinking off: a title, a commit message, a
classification an agent asks for while its long turn runs) that finds every engine busy
is handed to the ``SideLane`` of a busy engine instead of the queue. The generation
running there calls ``SideLane.serve`` at every safe point (``Decode(safe_point=...)``:
between two prefill chunks and between two decode steps, where the engine holds exactly
the committed sequence). ``serve``:

1. parks the engine's sequence (``Parked``): the recurrent sections whole and the first
   ``rows`` rows of every view, where ``rows`` covers every position the side requests can
   write (prompt + output tokens); rows past them are never touched, so they are not copied;
2. runs each waiting request to its end on the engine, plainly (cold prefill, no caches, no
   drafters: the running generation's drafters and cache tiers follow its own sequence);
3. restores the parked sequence byte for byte (``ModelState.restore(snap, length)``, then
   ``resume_at``), so the running generation continues exactly as if nothing had run.

Parking needs an engine whose whole sequence is its ``state`` and that takes a restored state
back (``caps.resume``: the contract the cache tiers rely on too); on any other engine short
requests queue like the rest.

A request whose client left before its turn is answered ``cancelled`` without touching the
engine. With a memory gate, each side request is checked with its parked bytes counted
(``MemoryGate.check(..., parked=...)``); one that does not fit fails alone (507).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem_core.cache.gate import MemoryGateError
from tandem_core.engine import Engine, restore_state
from tandem_core.server.generate import Outcome, run_job
from tandem_core.server.prepare import Job
from tandem_core.server.stream import Delta
from tandem_core.serving import Served
from tandem_core.state import ModelState

__all__ = ["SHORT_PROMPT_TOKENS", "SHORT_OUTPUT_TOKENS", "is_short", "Parked", "SideJob", "SideLane"]

log = logging.getLogger("tandem.server")

SHORT_PROMPT_TOKENS = 2048
SHORT_OUTPUT_TOKENS = 64


def is_short(job: Job) -> bool:
    """At most 2,048 prompt tokens, at most 64 output tokens (after any cap), thinking off."""
    thinking = job.parse is not None and job.parse.reasoning
    return (len(job.decode.prompt) <= SHORT_PROMPT_TOKENS and job.decode.max_tokens <= SHORT_OUTPUT_TOKENS
            and not thinking)


class Parked:
    """An engine's sequence put aside while something else uses the engine.

    ``rows``: the positions the other use may write (its tokens); the first ``min(rows, length)``
    rows of every view are copied, the sections whole. ``restore`` puts them back and tells the
    engine (``resume_at``) that its sequence is ``length`` tokens again."""

    def __init__(self, engine: Engine, rows: int) -> None:
        state = engine.state
        self.length = int(state.length)
        self.snap: ModelState = state.clone(min(self.length, max(0, int(rows))))

    @staticmethod
    def bytes_for(engine: Engine, rows: int) -> int:
        """What parking ``rows`` rows of ``engine``'s sequence would hold."""
        state = engine.state
        return state.section_bytes() + state.view_bytes_per_token() * min(int(state.length), max(0, int(rows)))

    @property
    def nbytes(self) -> int:
        return self.snap.nbytes

    def restore(self, engine: Engine) -> None:
        restore_state(engine, self.snap, self.length)


@dataclass
class SideJob:
    """A short request waiting in a side lane. ``done(outcome)`` is called once, from the worker thread."""

    job: Job
    emit: Callable[[Delta], None]
    done: Callable[[Outcome], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    t_offer: float = field(default_factory=time.perf_counter)
    t_start: float | None = None        # when a safe point took it up

    @property
    def waited(self) -> float:
        """Seconds from the offer to the safe point that took it up (so far, before that)."""
        return (self.t_start if self.t_start is not None else time.perf_counter()) - self.t_offer

    @property
    def rows(self) -> int:
        """Positions its decode can write: the prompt and every output token."""
        return len(self.job.decode.prompt) + self.job.decode.max_tokens


class SideLane:
    """One engine's side lane. ``offer`` (event loop) while a generation runs there (``open``);
    ``serve(engine)`` (the worker thread, at a safe point) runs what waits."""

    def __init__(self, served: Served, limit: int, gate: Any = None, *, enabled: bool = True) -> None:
        self.served = served
        self.enabled = enabled              # the engine takes a parked state back (``caps.resume``)
        self.limit = int(limit)
        self.gate = gate                    # the caches' MemoryGate, or None
        self.open = False                   # a generation runs on the engine and will call serve
        self.total = 0                      # side requests served (any outcome)
        self._jobs: deque[SideJob] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def has_room(self) -> bool:
        return self.enabled and self.open and len(self._jobs) < self.limit

    def offer(self, side: SideJob) -> bool:
        """Queue ``side`` for the next safe point; False when the lane is closed or full."""
        with self._lock:
            if not self.has_room():
                return False
            self._jobs.append(side)
            return True

    def serve(self, engine: Engine) -> None:
        """At a safe point: run every waiting request on ``engine`` and give its sequence back."""
        if not self._jobs:
            return
        with self._lock:
            batch = list(self._jobs)
            self._jobs.clear()
        live: list[SideJob] = []
        now = time.perf_counter()
        for side in batch:
            side.t_start = now
            if side.cancel.is_set():
                self._finish(side, Outcome("cancelled", len(side.job.decode.prompt), 0, 0, None, None))
            else:
                live.append(side)
        if self.gate is not None:
            parked = Parked.bytes_for(engine, max((s.rows for s in live), default=0))
            admitted = []
            for side in live:
                n = len(side.job.decode.prompt)
                try:
                    self.gate.check(n, 0, parked)
                except MemoryGateError as exc:
                    log.warning("req=%s side lane: %s", side.job.rid, exc)
                    self._finish(side, Outcome("error", n, 0, 0, None, None, str(exc), None, 507))
                    continue
                admitted.append(side)
            live = admitted
        if not live:
            return
        rows = max(s.rows for s in live)
        t0 = time.perf_counter()
        try:
            parked_state = Parked(engine, rows)
        except Exception as exc:   # the copy failed (memory): the engine is untouched, the generation goes on
            log.error("side lane: parking failed: %s: %s", type(exc).__name__, exc)
            for side in live:
                self._fail(side, exc)
            return
        pending = list(live)
        try:
            while pending:
                side = pending[0]
                outcome = run_job(engine, side.job, self.served, side.emit, side.cancel)
                pending.pop(0)
                self._finish(side, outcome)
        finally:
            for side in pending:   # only when something raised past run_job (it catches errors)
                self._fail(side, RuntimeError("the side lane stopped"))
            parked_state.restore(engine)
        log.info("side lane: %d request(s) served inside a generation of %d tokens in %.3fs (parked %d bytes)",
                 len(live), parked_state.length, time.perf_counter() - t0, parked_state.nbytes)

    def _fail(self, side: SideJob, exc: BaseException) -> None:
        self._finish(side, Outcome("error", len(side.job.decode.prompt), 0, 0, None, None,
                                   f"{type(exc).__name__}: {exc}"))

    def _finish(self, side: SideJob, outcome: Outcome) -> None:
        self.total += 1
        side.done(outcome)
