"""Running one job on one engine (in a worker thread), turning decode chunks into answer deltas.

``run_job(engine, job, served, emit, cancel, caches)`` decodes, reads the text through
the model's output parser (reasoning, tool calls) and calls ``emit(delta)`` for every
step that adds something. It returns an ``Outcome``: counts, finish reason, times and
where the prefill started. It never raises for a decode error: the outcome says
``error`` and the log line names the exception type (never the text).

With ``spec`` (the engine's ``Speculation``) the decode is ``SpecDecode``: drafters, one
verify forward a round, the walk; the output is the plain decode's token for token.

With ``safe_point`` the decode calls it at every safe point (the server's side lane serves
short requests there; ``server.sidelane``).

With ``caches`` (the engine's ``server.caches.EngineCaches``) the prefill goes through the
cache stack and the stack follows every token the engine commits; the generation's end
anchors the session, also when it was cancelled. A prompt the memory gate refuses
fails alone (``status`` 507, the gate's message with the sizes) and leaves the engine's
session as it was; any other error forgets it (the engine's buffers cannot be trusted).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tandem_core.cache.base import PrefillStart
from tandem_core.cache.gate import MemoryGateError
from tandem_core.engine import Engine
from tandem_core.server.caches import EngineCaches
from tandem_core.server.prepare import Job
from tandem_core.server.stream import Delta, TokenLogprob, ToolDelta
from tandem_core.serving import Served, Tokenizer
from tandem_core.spec.loop import FINISH_CANCELLED, FINISH_STOP, Decode
from tandem_core.spec.sampler import Pick
from tandem_core.spec.speculate import SpecDecode, Speculation, SpecStats

__all__ = ["Outcome", "run_job", "token_logprobs"]

log = logging.getLogger("tandem.server")


@dataclass(frozen=True)
class Outcome:
    finish: str                 # stop, length, tool_calls, cancelled, error
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    t_first: float | None       # perf_counter of the first token
    decode_rate: float | None   # tokens/s after the first
    error: str | None = None    # the exception's type and message when finish is "error"
    prefill: PrefillStart | None = None  # where the prefill started (None: it did not run)
    status: int = 500           # the HTTP status of an error (507: refused by the memory gate)
    spec: SpecStats | None = None  # speculation's rounds and acceptance (None: plain decoding)


def token_logprobs(tok: Tokenizer, picks: Sequence[Pick], stop_ids: frozenset[int]) -> list[TokenLogprob]:
    """The logprob records of the picks that became text (a stop token is not reported)."""
    out = []
    for p in picks:
        if p.token in stop_ids or p.logprob is None:
            continue
        text = tok.decode([p.token])
        top = tuple((s, lp, list(s.encode())) for s, lp in ((tok.decode([i]), lp) for i, lp in p.top))
        out.append(TokenLogprob(text, p.logprob, list(text.encode()), top))
    return out


class _Reader:
    """The chat answer's text -> deltas, through the model's ``OutputParser``."""

    def __init__(self, job: Job) -> None:
        from tandem_core.server.parse import OutputParser

        spec = job.parse
        assert spec is not None
        self.parser = OutputParser(spec.tool_format, spec.reasoning, spec.think_in_prompt, spec.tools,
                                   keep_malformed=not spec.forced, think_tags=spec.think_tags)
        self.rid = job.rid
        self.calls_ended = 0
        self.hold_malformed = job.watch is not None     # a watch gets a malformed call's text (to repair it)
        self._raw_next = False
        self.malformed: list[str] = []
        self._calls: dict[int, list[str]] = {}
        self.completed: list[Any] = []                  # conduct.Call, for the watch

    def read(self, events: list[Any], delta: Delta) -> None:
        from tandem_core.server import parse as p

        for ev in events:
            if isinstance(ev, p.Content) and self._raw_next:
                self._raw_next = False
                self.malformed.append(ev.text)
            elif isinstance(ev, p.Content):
                delta.content += ev.text
            elif isinstance(ev, p.Reasoning):
                delta.reasoning += ev.text
            elif isinstance(ev, p.ToolCallBegin):
                delta.tool_calls.append(ToolDelta(ev.index, ev.id, ev.name, ""))
                if self.hold_malformed:
                    self._calls[ev.index] = [ev.id, ev.name, ""]
            elif isinstance(ev, p.ToolCallArgs):
                if ev.index in self._calls:
                    self._calls[ev.index][2] += ev.delta
                if delta.tool_calls and delta.tool_calls[-1].index == ev.index:
                    last = delta.tool_calls[-1]
                    delta.tool_calls[-1] = ToolDelta(last.index, last.id, last.name, last.arguments + ev.delta)
                else:
                    delta.tool_calls.append(ToolDelta(ev.index, None, None, ev.delta))
            elif isinstance(ev, p.ToolCallEnd):
                self.calls_ended += 1
                if ev.index in self._calls:
                    from tandem_core.server.conduct import Call

                    cid, name, args = self._calls.pop(ev.index)
                    self.completed.append(Call(ev.index, cid, name, args))
            elif isinstance(ev, p.Malformed):
                log.warning("req=%s malformed tool call: %s", self.rid, ev.reason)
                self._raw_next = self.hold_malformed


def run_job(engine: Engine, job: Job, served: Served, emit: Callable[[Delta], None],
            cancel: threading.Event, caches: EngineCaches | None = None, *,
            spec: Speculation | None = None, safe_point: Callable[[], None] | None = None) -> Outcome:
    from tandem_core.server.detok import StreamDetokenizer

    req = job.decode
    hooks: dict[str, Any] = caches.decode_hooks() if caches is not None else {}
    if safe_point is not None:
        hooks["safe_point"] = safe_point
    detok = StreamDetokenizer(served.tokenizer)
    dec: Decode
    speculative: SpecDecode | None = None
    if spec is not None:
        dec = speculative = SpecDecode(engine, req, detok, constraint=job.constraint, cancel=cancel,
                                       speculation=spec, **hooks)
    else:
        dec = Decode(engine, req, detok, constraint=job.constraint, cancel=cancel, **hooks)
    reader = _Reader(job) if job.parse is not None else None
    reasoning_tokens = 0
    finish = None
    watch = job.watch
    gen: Any = None
    if watch is not None:      # the conductor's monitor: the first safe point, before the prefill
        from tandem_core.server.conduct import Generation

        gen = Generation(job, dec, served, emit, reader.parser if reader is not None else None,
                         caches.holds(req.prompt) if caches is not None else 0)
        watch.before_prefill(gen)
    sent_calls = False

    def send(d: Delta | None) -> None:
        nonlocal sent_calls
        if d is not None and not d.empty():
            sent_calls = sent_calls or bool(d.tool_calls)
            emit(d)

    def watched(d: Delta) -> None:
        """After a committed block: the watch rewrites what goes out, sees complete and malformed calls."""
        send(watch.after_block(gen, d))
        if reader is not None:
            while reader.malformed:
                send(watch.malformed(gen, reader.malformed.pop(0)))
            if reader.completed:
                calls, reader.completed = reader.completed, []
                send(watch.calls_complete(gen, calls))

    def started() -> PrefillStart | None:
        return caches.last if caches is not None else PrefillStart("cold", 0, len(req.prompt))

    chunks = dec.run()
    try:
        try:
            for chunk in chunks:
                delta = Delta()
                ending = chunk.finish is not None and chunk.finish != FINISH_CANCELLED
                if reader is not None:
                    reader.read(reader.parser.feed(chunk.text) if chunk.text else [], delta)
                    if ending and gen is None:
                        reader.read(reader.parser.finish(), delta)
                    if delta.reasoning and not delta.content and not delta.tool_calls:
                        reasoning_tokens += len(chunk.tokens)
                else:
                    delta.content = chunk.text
                if job.logprobs:
                    delta.logprobs = token_logprobs(served.tokenizer, chunk.picks, req.stop_ids)
                if gen is None:
                    if not delta.empty():
                        emit(delta)
                else:
                    watched(delta)
                    at_end_token = (chunk.finish == FINISH_STOP and bool(chunk.tokens)
                                    and chunk.tokens[-1] in req.stop_ids)   # not a stop string, not a grammar
                    if at_end_token and not gen.stopped and watch.at_end(gen):
                        continue                # the end token's safe point: the watch made the turn go on
                    if ending or gen.stopped:
                        if reader is not None:
                            tail = Delta()
                            reader.read(reader.parser.finish(), tail)
                            watched(tail)
                        send(watch.flush(gen))
                        if chunk.finish is None:
                            finish = FINISH_STOP    # the watch ended the answer
                            break
                if chunk.finish is not None:
                    finish = chunk.finish
                elif reader is not None and not job.parallel_tool_calls and reader.calls_ended:
                    # one call asked for, and it is complete: the answer ends here
                    tail = Delta()
                    reader.read(reader.parser.finish(), tail)
                    if gen is not None:
                        watched(tail)
                        send(watch.flush(gen))
                    elif not tail.empty():
                        emit(tail)
                    finish = FINISH_STOP
                    break
        finally:
            chunks.close()      # a generation left early still ends (its end anchor)
    except MemoryGateError as exc:  # refused before the engine was touched: the session stays
        log.warning("req=%s %s", job.rid, exc)
        return Outcome("error", len(req.prompt), 0, 0, None, None, str(exc), None, 507)
    except Exception as exc:  # the log names the failure, never the text
        log.exception("req=%s decode failed: %s", job.rid, type(exc).__name__)
        if caches is not None:
            caches.forget()
        return Outcome("error", len(req.prompt), dec.completion_tokens, reasoning_tokens, dec.t_first,
                       dec.decode_rate(), f"{type(exc).__name__}: {exc}", caches.last if caches else None)
    assert finish is not None
    if finish == FINISH_STOP and reader is not None and (sent_calls if gen is not None else reader.calls_ended):
        finish = "tool_calls"
    stats = speculative.finish_stats() if speculative is not None else None
    hidden = gen.hidden if gen is not None else 0     # what a watch put in is never in the usage
    outcome = Outcome(finish, len(req.prompt), dec.completion_tokens - hidden, reasoning_tokens, dec.t_first,
                      dec.decode_rate(), prefill=started(), spec=stats)
    if gen is not None:
        try:
            watch.finished(gen, outcome)
        except Exception as exc:  # the journal never fails a request
            log.error("req=%s conductor: %s", job.rid, type(exc).__name__)
    return outcome
