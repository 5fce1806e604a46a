"""The resident prefix: the live sequence's tokens, and anchors to resume it mid-way.

The engine's own buffers hold the live sequence (``engine.state``). This tier
remembers which tokens they hold and keeps ANCHORS: clones of the state's
``sections`` (the recurrent state) at exact positions: every ``every`` tokens (grid),
at the end of each prompt and at the end of the last generation. Views need no
anchor: their first ``n`` rows are the sequence's first ``n`` rows whatever came
after, so resuming at ``n`` only cuts them.

A new prompt is planned against it::

    plan = resident.plan(tokens, engine.state)      # ResumePlan(start, anchor, common, total)
    resident.apply(plan, engine.state, reset=engine.reset)
    for a, b in resident.chunks(plan.start, len(tokens), chunk):  # split at anchor points
        engine.forward(tokens[a:b]); resident.commit(tokens[a:b], engine.state)
    resident.mark_end(engine.state, PROMPT_END)

``plan`` takes the longest common prefix with the resident tokens (never the whole
prompt: the last token is always forwarded, for its logits), then the latest anchor
at or before it; a model without sections resumes at the common prefix itself.
``commit`` records tokens the engine committed (prefill chunks, decode steps, a
verified speculation path) and captures a grid anchor when the length lands on one;
``rollback(n)`` forgets tokens past ``n`` (speculation rolled back).

In an agent session turn n+1 is turn n's prompt + answer + tool result: the end
anchor of the last generation (``mark_end(state, GEN_END)``) sits exactly where the
resident tokens end, so the next prefill starts there and forwards only what is new.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from tandem_core.cache.base import (
    GEN_END, GRID, RESTORED, Anchor, CacheContext, CostModel, PrefillStart, Snapshot, TierStats,
    as_tokens, clone_sections, common_prefix,
)
from tandem_core.state import ModelState

__all__ = ["ResidentPrefix", "ResumePlan", "grid_spacing"]

log = logging.getLogger("tandem.cache")


class ResumePlan(NamedTuple):
    """Where a prompt of ``total`` tokens resumes: ``start`` (0: cold), at ``anchor`` (None: views only).

    ``common`` is the longest common prefix with the resident tokens (``start <= common``).
    """

    start: int
    anchor: Anchor | None
    common: int
    total: int

    @property
    def cold(self) -> bool:
        return self.start == 0

    def describe(self) -> PrefillStart:
        if self.cold:
            return PrefillStart("cold", 0, self.total)
        return PrefillStart("resident", self.start, self.total, anchor=self.anchor is not None)


def grid_spacing(every: int, chunk: int) -> int:
    """The anchor grid for an engine that forwards ``chunk`` rows at a time: ``every`` tokens, widened to the
    smallest multiple of ``every`` that is at least ``chunk``. A grid point inside a chunk would cut the forward
    there (the anchor is the state at that point); on the 27B shape 1,024-row pieces prefill about a quarter
    slower than 8,192-row chunks, so the grid follows the chunk (as hybrid-model caches elsewhere align their
    state blocks to the scheduler's chunks). The prompt's and the generation's end anchors are unaffected."""
    if every < 1:
        raise ValueError(f"anchor spacing must be >= 1 token, not {every}")
    if chunk <= every:
        return every
    return -(-chunk // every) * every


class ResidentPrefix:
    """The live sequence's tokens and anchors (one engine, one sequence).

    ``every``         grid anchor spacing in tokens (default 1,024)
    ``anchor_budget`` bytes the anchors may hold (0: no limit); over it, the least
                      valuable anchors go (the latest one last)
    ``cost``          the recompute price of a token (values anchors for the memory gate)

    Anchors live on the state's device (a resume copies them straight into the
    engine's buffers). Thread-safe: ``stats()`` may be read from another thread.
    """

    name = "resident"

    def __init__(self, every: int = 1024, *, anchor_budget: int = 0, cost: CostModel | None = None) -> None:
        if every < 1:
            raise ValueError(f"anchor spacing must be >= 1 token, not {every}")
        self.every = every
        self.anchor_budget = anchor_budget
        self.cost = cost or CostModel()
        self._tokens: list[int] = []
        self._anchors: dict[int, Anchor] = {}
        self._recurrent: bool | None = None   # learnt from the first state seen
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def build(cls, ctx: CacheContext) -> "ResidentPrefix":
        from tandem_core.settings import SETTINGS

        every = grid_spacing(int(SETTINGS.get("CACHE_ANCHOR_EVERY")), ctx.chunk)
        return cls(every, anchor_budget=int(SETTINGS.get("CACHE_ANCHOR_BYTES")), cost=ctx.cost)

    # -- what it holds ------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._tokens)

    def anchors(self) -> list[Anchor]:
        with self._lock:
            return [self._anchors[p] for p in sorted(self._anchors)]

    # -- planning -----------------------------------------------------------------------
    def plan(self, tokens: Sequence[int] | np.ndarray, state: ModelState | None = None) -> ResumePlan:
        """Where a prefill of ``tokens`` can start from the resident sequence.

        With ``state`` (the live state), tokens past ``state.length`` are not resident
        even if this tier was not told of a rollback.
        """
        new = as_tokens(tokens)
        total = len(new)
        with self._lock:
            held = len(self._tokens) if state is None else min(len(self._tokens), state.length)
            common = common_prefix(np.asarray(self._tokens[:held], dtype=np.int64), new)
            usable = min(common, total - 1)
            if usable <= 0:
                return ResumePlan(0, None, common, total)
            if self._recurrent is False or (state is not None and not state.sections):
                return ResumePlan(usable, None, common, total)
            best = max((p for p in self._anchors if p <= usable), default=0)
            if best == 0:
                return ResumePlan(0, None, common, total)
            return ResumePlan(best, self._anchors[best], common, total)

    def apply(self, plan: ResumePlan, state: ModelState, reset: Callable[[], None] | None = None) -> PrefillStart:
        """Take ``state`` to ``plan.start`` in place; a cold plan calls ``reset()`` (the engine's).

        After it the state and this tier hold the prompt's first ``plan.start`` tokens;
        the caller forwards the rest.
        """
        with self._lock:
            if plan.cold:
                if reset is None:
                    raise ValueError("a cold plan needs reset= (the engine's reset) to empty the state")
                reset()
                self._tokens.clear()
                self._anchors.clear()
                self.misses += 1
                return plan.describe()
            if plan.anchor is None or (plan.start == state.length and plan.start == len(self._tokens)):
                state.resume(plan.start)      # views cut; sections already at plan.start
            else:
                state.resume(plan.start, plan.anchor.sections)
            self._truncate(plan.start)
            self.hits += 1
            return plan.describe()

    def anchor_points(self, start: int, end: int) -> list[int]:
        """Positions in ``(start, end]`` where a chunked prefill must stop to capture an anchor:
        every grid multiple of ``every``, and ``end`` (the prompt's end)."""
        first = (start // self.every + 1) * self.every
        points = list(range(first, end, self.every))
        if end > start:
            points.append(end)
        return points

    def chunks(self, start: int, end: int, chunk: int) -> list[tuple[int, int]]:
        """``[a, b)`` prefill chunks covering ``[start, end)``, at most ``chunk`` long, split at anchor points."""
        out: list[tuple[int, int]] = []
        a = start
        for p in self.anchor_points(start, end):
            while a < p:
                b = min(p, a + chunk)
                out.append((a, b))
                a = b
        return out

    # -- following the live sequence ------------------------------------------------------
    def commit(self, tokens: Sequence[int] | torch.Tensor | np.ndarray, state: ModelState) -> None:
        """Record ``tokens`` the engine just appended (``state.length`` must now equal the resident length).

        Lands on a grid position: captures that anchor.
        """
        new = as_tokens(tokens).tolist()
        with self._lock:
            self._tokens.extend(new)
            if len(self._tokens) != state.length:
                # a caller skipped a commit or a rollback: nothing here can be trusted any more
                log.warning("resident prefix out of step (%d tokens recorded, the state holds %d): forgotten",
                            len(self._tokens), state.length)
                self._tokens.clear()
                self._anchors.clear()
                return
            if new and state.length % self.every == 0 and state.length not in self._anchors:
                self.capture(state.length, state, GRID)

    def capture(self, n: int, state: ModelState, kind: str = GRID) -> Anchor | None:
        """Keep an anchor at ``n`` (the state must hold exactly ``n`` tokens). None for a model without sections."""
        with self._lock:
            if state.length != n or len(self._tokens) != n:
                raise ValueError(f"anchor at {n}: the state holds {state.length} tokens, "
                                 f"the resident prefix {len(self._tokens)}")
            self._recurrent = bool(state.sections)
            if not state.sections or n == 0:
                return None
            anchor = Anchor(n, clone_sections(state.sections), kind)
            self._anchors[n] = anchor
            self._enforce_budget()
            return anchor

    def mark_end(self, state: ModelState, kind: str = GEN_END) -> Anchor | None:
        """An end anchor where the sequence ends now: ``PROMPT_END`` after a prefill, ``GEN_END`` after a generation."""
        return self.capture(state.length, state, kind)

    def rollback(self, n: int) -> None:
        """Forget tokens (and anchors) past ``n``: speculation rolled back to ``n`` committed tokens."""
        with self._lock:
            self._truncate(n)

    def reset(self) -> None:
        with self._lock:
            self._tokens.clear()
            self._anchors.clear()

    def restored(self, tokens: Sequence[int] | np.ndarray, state: ModelState, keep_upto: int = 0) -> None:
        """The state was restored from a lower tier to hold ``tokens``: follow it.

        Anchors at or before ``keep_upto`` (the common prefix of the old resident tokens
        with the new ones) stay valid; an anchor is captured at the restored length.
        """
        new = as_tokens(tokens).tolist()
        with self._lock:
            self._anchors = {p: a for p, a in self._anchors.items() if p <= min(keep_upto, len(new))}
            self._tokens = new
            self.misses += 1
            self.capture(len(new), state, RESTORED)

    def _truncate(self, n: int) -> None:
        del self._tokens[n:]
        for p in [p for p in self._anchors if p > n]:
            del self._anchors[p]

    # -- whole-session images (store, spill) ---------------------------------------------
    def snapshot(self, state: ModelState, *, device: torch.device | str | None = "cpu",
                 kinds: Sequence[str] | None = None) -> Snapshot:
        """A detached image of the live session: its tokens, the whole state, and its anchors
        (all, or those of ``kinds``), on ``device``."""
        with self._lock:
            n = min(len(self._tokens), state.length)
            anchors = tuple(Anchor(a.position, clone_sections(a.sections, device), a.kind)
                            for p, a in sorted(self._anchors.items())
                            if 0 < p < n and (kinds is None or a.kind in kinds))
            return Snapshot(np.asarray(self._tokens[:n], dtype=np.int64), state.clone(n, device=device), anchors)

    def adopt(self, snap: Snapshot, state: ModelState) -> None:
        """Restore a session image into the live ``state`` and follow it (tokens and anchors)."""
        with self._lock:
            state.restore(snap.state)
            self._tokens = snap.tokens.tolist()
            self._recurrent = bool(state.sections)
            device = next(iter(state.sections.values())).device if state.sections else None
            self._anchors = {a.position: Anchor(a.position, clone_sections(a.sections, device), a.kind)
                             for a in snap.anchors}
            self.capture(len(self._tokens), state, RESTORED)

    # -- memory -------------------------------------------------------------------------
    def _order(self) -> list[tuple[bool, float, int]]:
        """Anchors cheapest first: (is the latest, recompute seconds saved per byte, position)."""
        ps = sorted(self._anchors)
        out = []
        for i, p in enumerate(ps):
            prev = ps[i - 1] if i else 0
            value = self.cost.seconds(prev, p) / max(1, self._anchors[p].nbytes)
            out.append((i == len(ps) - 1, value, p))
        return sorted(out)

    def _drop_cheapest(self) -> int:
        order = self._order()
        if not order:
            return 0
        return self._anchors.pop(order[0][2]).nbytes

    def _enforce_budget(self) -> None:
        while self.anchor_budget and self.nbytes > self.anchor_budget and len(self._anchors) > 1:
            self._drop_cheapest()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._anchors.values())

    def value_per_byte(self) -> float:
        """Recompute seconds per byte the next released anchor saves (dropping anchor p costs the
        tokens back to the anchor before it); ``inf`` when there is none."""
        with self._lock:
            order = self._order()
            return order[0][1] if order else math.inf

    def release(self, bytes_needed: int) -> int:
        """Drop anchors cheapest first (the latest last) until ``bytes_needed`` are freed or none is left."""
        freed = 0
        with self._lock:
            while freed < bytes_needed and self._anchors:
                freed += self._drop_cheapest()
        return freed

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.nbytes, len(self._anchors), self.hits, self.misses)
