"""The plain decode loop: prefill, then one token a step, until a stop.

Read ``Decode.step`` first: forward, sample, commit, emit. Speculation
(``spec.speculate``) replaces ``forward`` + ``sample`` (one token) by propose,
verify, walk (several tokens); ``commit`` and ``emit`` take a list of tokens.

The loop owns no engine buffers: ``engine.reset()`` + ``engine.forward(prompt)``
(``prefill``, one place, so a prefix cache can replace it) leave the engine
holding the prompt, and every committed token is forwarded once. The caller's
``cancel`` event is read before every step; a cancelled decode ends with finish
``"cancelled"`` and leaves the engine free.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from tandem_core.engine import Engine
from tandem_core.spec.sampler import Pick, Sampler, SamplingParams

__all__ = [
    "DecodeRequest", "Chunk", "Decode", "StopStrings", "Constraint", "Detokenizer", "prefill",
    "FINISH_STOP", "FINISH_LENGTH", "FINISH_CANCELLED",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"


class Detokenizer(Protocol):
    """Token ids in, newly completed text out (holds back incomplete characters)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Constraint(Protocol):
    """Constrained decoding: which tokens may come next, told what came.

    ``allowed(vocab)`` -> bool ``[vocab]`` (True: allowed) or None (no constraint now);
    ``advance(token)`` records a committed token; ``done()`` is True when the grammar
    admits nothing more (the answer is complete).
    """

    def allowed(self, vocab: int) -> torch.Tensor | None: ...

    def advance(self, token: int) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class DecodeRequest:
    """One generation: the prompt's ids, the sampling, and when to stop."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


class Chunk(NamedTuple):
    """What one step produced: the committed tokens, the text now safe to send, the picks
    (with logprobs when asked), and the finish reason on the last chunk."""

    tokens: tuple[int, ...]
    text: str
    picks: tuple[Pick, ...]
    finish: str | None


def prefill(engine: Engine, prompt: Sequence[int], *, between: Callable[[], None] | None = None) -> torch.Tensor:
    """Start a sequence: the engine holds ``prompt``; returns the last position's logits ``[1, V]``.

    ``between`` (optional) is called between two prefill chunks (a safe point): the prompt is then
    forwarded in pieces of the engine's ``caps.prefill_chunk`` rows, which the engine would have run one
    at a time anyway, so the rows are the same bits. An engine that does not say its chunk runs whole."""
    engine.reset()
    ids = torch.as_tensor(list(prompt), dtype=torch.long)  # [T]
    piece = engine.caps.prefill_chunk
    if between is None or piece <= 0 or len(ids) <= piece:
        return engine.forward(ids)
    for s in range(0, len(ids) - piece, piece):
        engine.forward(ids[s:s + piece])
        between()
    return engine.forward(ids[(len(ids) - 1) // piece * piece:])


class StopStrings:
    """Cuts the text at the first stop string; holds back a tail that may begin one.

    ``feed(text) -> (safe, hit)``: ``safe`` is text that can go out now; ``hit`` is True
    when a stop string completed (``safe`` ends where it began, the rest is dropped).
    ``flush()`` releases the held tail at the end of a generation that did not stop on one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Decode:
    """One request's decode on one engine (batch 1). Iterate ``run()`` for its chunks.

    ``engine`` is held for the whole decode; ``detok`` turns committed ids into text;
    ``constraint`` (optional) masks the sampler; ``cancel`` is read before each step;
    ``start`` is the prefill (``prefill``, or a cache stack's ``start``: same signature, and with a
    ``safe_point`` it is called with it as the keyword ``between``);
    ``on_forwarded(tokens)`` is told each time the engine appended committed tokens after the
    prefill (a cache tier follows the sequence through it); ``on_end()`` is called once when the
    generation ends without an error (a finish, a cancel, or the caller closing ``run()``);
    ``safe_point()`` (optional) is called at every safe point: between two prefill chunks (``start``
    gets it as ``between``) and before every step. There the engine holds exactly the committed
    sequence (nothing verified or pending in it), so whatever runs there may use the engine if it
    gives the state back byte for byte (the server's side lane does).
    """

    def __init__(self, engine: Engine, request: DecodeRequest, detok: Detokenizer, *,
                 constraint: Constraint | None = None, cancel: threading.Event | None = None,
                 start: Callable[[Engine, Sequence[int]], torch.Tensor] = prefill,
                 on_forwarded: Callable[[Sequence[int]], None] | None = None,
                 on_end: Callable[[], None] | None = None,
                 safe_point: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.req = request
        self.detok = detok
        self.constraint = constraint
        self.cancel = cancel or threading.Event()
        self.start = start
        self.on_forwarded = on_forwarded
        self.on_end = on_end
        self.safe_point = safe_point
        self.sampler = Sampler(request.sampling)
        self.stops = StopStrings(request.stop_strings)
        self.generated: list[int] = []
        self.pending: list[int] = []       # committed, not yet forwarded
        self.fresh: list[Pick] = []        # the last step's committed picks
        self.finish: str | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self._logits: torch.Tensor | None = None

    # -- the loop -------------------------------------------------------------------------------------

    def run(self) -> Iterator[Chunk]:
        try:
            yield from self._run()
        except GeneratorExit:
            self._ended()
            raise
        self._ended()

    def _ended(self) -> None:
        if self.on_end is not None:
            self.on_end()

    def _run(self) -> Iterator[Chunk]:
        with torch.inference_mode():
            if self.safe_point is None:
                self._logits = self.start(self.engine, self.req.prompt)  # [1, V]
            else:
                self._logits = self.start(self.engine, self.req.prompt, between=self.safe_point)
            while self.finish is None:
                if self.safe_point is not None:
                    self.safe_point()
                if self.cancel.is_set():
                    self.finish = FINISH_CANCELLED
                    yield Chunk((), "", (), FINISH_CANCELLED)
                    return
                yield self.step()

    def step(self) -> Chunk:
        logits = self.forward()         # the next-token distribution, [1, V]
        picks = self.sample(logits)     # keyed by (seed, position): the same draw however batched
        self.commit(picks)              # counts, grammar, stop ids, max_tokens
        return self.emit()              # the text now safe to send (a stop string never leaves)

    # -- the details ----------------------------------------------------------------------------------

    def forward(self) -> torch.Tensor:
        if self.pending:
            ids = torch.tensor(self.pending, dtype=torch.long)  # [P]
            self.pending = []
            self._logits = self.engine.forward(ids)
            self.forwarded(ids.tolist())
        assert self._logits is not None
        return self._logits

    def forwarded(self, tokens: Sequence[int]) -> None:
        """The engine now also holds ``tokens`` (a cache tier follows the sequence through this)."""
        if self.on_forwarded is not None and tokens:
            self.on_forwarded(list(tokens))

    def sample(self, logits: torch.Tensor) -> list[Pick]:
        row = logits[-1]  # [V]
        mask = self.constraint.allowed(row.numel()) if self.constraint is not None else None
        position = len(self.req.prompt) + len(self.generated)
        return [self.sampler.pick(row, position, mask)]

    def commit(self, picks: Sequence[Pick]) -> None:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.fresh = []
        for p in picks:
            self.fresh.append(p)
            self.generated.append(p.token)
            self.sampler.accept(p.token)
            if self.constraint is not None:
                self.constraint.advance(p.token)
            if p.token in self.req.stop_ids:
                self.finish = FINISH_STOP
                return
            self.pending.append(p.token)
            if self.constraint is not None and self.constraint.done():
                self.finish = FINISH_STOP
                return
            if len(self.generated) >= self.req.max_tokens:
                self.finish = FINISH_LENGTH
                return

    def emit(self) -> Chunk:
        picks = self.fresh  # what the last commit kept
        text = "".join(self.detok.push(p.token) for p in picks if p.token not in self.req.stop_ids)
        if self.finish is not None:
            text += self.detok.flush()
        safe, hit = self.stops.feed(text)
        if hit:
            self.finish = FINISH_STOP
        elif self.finish is not None:
            safe += self.stops.flush()
        return Chunk(tuple(p.token for p in picks), safe, tuple(picks), self.finish)

    def inject(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` as if they had been drawn (a conductor's hidden text, at a safe point): the engine
        gets them at the next step; they are never emitted (the caller knows their text)."""
        for t in tokens:
            self.generated.append(int(t))
            self.sampler.accept(int(t))
            if self.constraint is not None:
                self.constraint.advance(int(t))
            self.pending.append(int(t))

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def decode_rate(self) -> float | None:
        """Tokens per second after the first (None before two tokens)."""
        if self.t_first is None or self.t_last is None or len(self.generated) < 2 or self.t_last <= self.t_first:
            return None
        return (len(self.generated) - 1) / (self.t_last - self.t_first)

