"""Admission: which engine a request runs on, and how long it waits for one.

``Admission(engines, queue)`` holds the engines (one sequence each) and a bounded
FIFO of waiters. ``enter()`` either hands a free engine at once, queues the
request, or refuses it (``QueueFull``, with a Retry-After estimate) when ``queue``
requests already wait. Every method runs on the event loop; worker threads give
an engine back through ``loop.call_soon_threadsafe(admission.release, slot)``.

Wait estimates use the mean duration of the last requests served.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem_core.engine import Engine

__all__ = ["Slot", "Ticket", "QueueFull", "Admission"]


@dataclass(frozen=True)
class Slot:
    index: int
    engine: Engine


class QueueFull(Exception):
    """Every engine is busy and the queue is full: answer 429 with ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {waiting} requests already wait; retry in about {retry_after} s")
        self.retry_after = retry_after


class Ticket:
    """One request's place: ``slot`` resolves to its engine."""

    def __init__(self, future: asyncio.Future[Slot]) -> None:
        self.slot = future


class Admission:
    def __init__(self, engines: Sequence[Engine], queue: int, *, history: int = 20) -> None:
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.free: deque[Slot] = deque(self.slots)
        self.waiting: deque[asyncio.Future[Slot]] = deque()
        self.limit = queue
        self.durations: deque[float] = deque(maxlen=history)

    @property
    def busy(self) -> int:
        return len(self.slots) - len(self.free)

    def enter(self, affinity: Callable[[Slot], int] | None = None) -> Ticket:
        """A ticket whose slot is ready now or later; ``QueueFull`` if the queue is full. ``affinity(slot)``: how
        much of the request an engine already holds (its resident prefix); of the free engines the request
        gets the one that holds most (the first free one on a tie), so a session's next turn lands where its
        previous turn left its state."""
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        if self.free and not self.waiting:
            best = self.free[0]
            if affinity is not None and len(self.free) > 1:
                best = max(self.free, key=affinity)          # max keeps the first of equal scores
            self.free.remove(best)
            fut.set_result(best)
        elif len(self.waiting) >= self.limit:
            raise QueueFull(len(self.waiting), self.retry_after(len(self.waiting) + 1))
        else:
            self.waiting.append(fut)
        return Ticket(fut)

    def release(self, slot: Slot) -> None:
        """An engine is free again: the oldest waiter gets it."""
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)

    def leave(self, ticket: Ticket) -> None:
        """The request gave up (its client went away): drop it from the queue, or give back its unused slot."""
        fut = ticket.slot
        if fut in self.waiting:
            self.waiting.remove(fut)
            fut.cancel()
        elif fut.done() and not fut.cancelled():
            self.release(fut.result())

    def position(self, ticket: Ticket) -> int:
        """1 for the next in line; 0 when it holds a slot."""
        try:
            return list(self.waiting).index(ticket.slot) + 1
        except ValueError:
            return 0

    def served(self, seconds: float) -> None:
        """Record how long a request held its engine (for the wait estimates)."""
        self.durations.append(seconds)

    def estimate(self, position: int) -> float | None:
        """Seconds until a waiter at ``position`` gets an engine; None before any request was served."""
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        return mean * math.ceil(position / len(self.slots))

    def retry_after(self, position: int) -> int:
        est = self.estimate(position)
        return max(1, math.ceil(est)) if est is not None else 10
