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

    def read(self, events: list[Any], delta: Delta) -> None:
        from tandem_core.server import parse as p

        for ev in events:
            if isinstance(ev, p.Content):
                delta.content += ev.text
            elif isinstance(ev, p.Reasoning):
                delta.reasoning += ev.text
            elif isinstance(ev, p.ToolCallBegin):
                delta.tool_calls.append(ToolDelta(ev.index, ev.id, ev.name, ""))
            elif isinstance(ev, p.ToolCallArgs):
                if delta.tool_calls and delta.tool_calls[-1].index == ev.index:
                    last = delta.tool_calls[-1]
                    delta.tool_calls[-1] = ToolDelta(last.index, last.id, last.name, last.arguments + ev.delta)
                else:
                    delta.tool_calls.append(ToolDelta(ev.index, None, None, ev.delta))
            elif isinstance(ev, p.ToolCallEnd):
                self.calls_ended += 1
            elif isinstance(ev, p.Malformed):
                log.warning("req=%s malformed tool call: %s", self.rid, ev.reason)


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

    def started() -> PrefillStart | None:
        return caches.last if caches is not None else PrefillStart("cold", 0, len(req.prompt))

    chunks = dec.run()
    try:
        try:
            for chunk in chunks:
                delta = Delta()
                if reader is not None:
                    reader.read(reader.parser.feed(chunk.text) if chunk.text else [], delta)
                    if chunk.finish is not None and chunk.finish != FINISH_CANCELLED:
                        reader.read(reader.parser.finish(), delta)
                    if delta.reasoning and not delta.content and not delta.tool_calls:
                        reasoning_tokens += len(chunk.tokens)
                else:
                    delta.content = chunk.text
                if job.logprobs:
                    delta.logprobs = token_logprobs(served.tokenizer, chunk.picks, req.stop_ids)
                if not delta.empty():
                    emit(delta)
                if chunk.finish is not None:
                    finish = chunk.finish
                elif reader is not None and not job.parallel_tool_calls and reader.calls_ended:
                    # one call asked for, and it is complete: the answer ends here
                    tail = Delta()
                    reader.read(reader.parser.finish(), tail)
                    if not tail.empty():
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
    if finish == FINISH_STOP and reader is not None and reader.calls_ended:
        finish = "tool_calls"
    stats = speculative.finish_stats() if speculative is not None else None
    return Outcome(finish, len(req.prompt), dec.completion_tokens, reasoning_tokens, dec.t_first,
                   dec.decode_rate(), prefill=started(), spec=stats)
