"""The FastAPI app: routes, authentication, and the bridge from the event loop to the engine threads.

``build_app(served, options)`` returns the ASGI app. Requests are checked and
prepared off the event loop (``prepare``), admitted (``admission``, then the memory
gate), decoded in a worker thread per engine (``generate``), through that engine's
cache stack (``caches``), and answered whole or as server-sent events (``stream``).
After each request: one log line (counts, times and where the prefill started, never
text), one ledger row, and the metrics.

The app's lifespan restores the spilled sessions at start (before the socket listens)
and, at shutdown (SIGTERM/SIGINT through uvicorn), stops the running generations and
spills every engine's session.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tandem_core.cache.gate import MemoryGateError
from tandem_core.server.admission import Admission, QueueFull, Slot, Ticket
from tandem_core.server.caches import CacheOptions, ServerCaches, build_caches
from tandem_core.server.conduct import Conduct
from tandem_core.server.speculation import SpecOptions, build_speculation
from tandem_core.server.fields import FieldError
from tandem_core.server.generate import Outcome, run_job
from tandem_core.server.grammar import Grammars
from tandem_core.server.ledger import Ledger, UsageRow
from tandem_core.server.metrics import Metrics
from tandem_core.server.openapi import openapi
from tandem_core.server.prepare import Job, ModelNotServed, prepare_chat, prepare_completion
from tandem_core.server.sidelane import SideJob, SideLane, is_short
from tandem_core.server.stream import (
    SSE_DONE, ChatAnswer, ChatChunks, Delta, TextAnswer, TextChunks, Usage, sse, sse_comment,
)
from tandem_core.serving import Served

__all__ = ["ServerOptions", "ServerState", "build_app", "ParallelUnavailable"]

log = logging.getLogger("tandem.server")


class ParallelUnavailable(ValueError):
    """``--parallel N`` asked for more engines than the model can build (its ``spawn`` is None)."""


@dataclass(frozen=True)
class ServerOptions:
    parallel: int = 1
    queue: int = 8
    api_key: str | None = None
    max_context: int = 8192
    ledger: Path | None = None          # None: no ledger
    wait_comment_s: float = 10.0        # TANDEM_WAIT_COMMENT_S
    side_lane: bool = True              # TANDEM_SIDE_LANE: short requests served at safe points
    caches: CacheOptions | None = None  # None: no caches (every prefill cold)
    spec: SpecOptions | None = None     # None: plain decoding
    conductor: Path | None = None       # --conductor: the profile file (None: no conductor)


def _engines(served: Served, n: int) -> list[Any]:
    if n < 1:
        raise ParallelUnavailable(f"--parallel {n}: at least one engine is needed")
    if n > 1 and served.spawn is None:
        raise ParallelUnavailable(f"--parallel {n}: model {served.model_id} cannot build more than one engine "
                                  f"(its plugin gives no spawn); serve it with --parallel 1")
    engines = [served.engine]
    while len(engines) < n:
        assert served.spawn is not None
        engines.append(served.spawn())
    return engines


class ServerState:
    """Everything the routes share: the model, the engines and their queue, the books."""

    def __init__(self, served: Served, options: ServerOptions) -> None:
        self.served = served
        self.options = options
        engines = _engines(served, options.parallel)
        # before the caches: the self-check leaves the engine reset
        self.spec = build_speculation(served, engines, options.spec or SpecOptions(drafters=()),
                                      profile=served.engine.caps.dtype)
        try:
            self.caches: ServerCaches | None = (build_caches(served, engines, options.caches)
                                                if options.caches is not None else None)
        except BaseException:
            self.spec.wait()    # its background self-check must not outlive a state that never started
            raise
        self.admission = Admission(engines, options.queue)
        gate = self.caches.gate if self.caches is not None else None
        self.lanes = [SideLane(served, options.queue, gate, enabled=options.side_lane and e.caps.resume)
                      for e in engines]
        self.pool = ThreadPoolExecutor(len(engines), thread_name_prefix="tandem-engine")
        cap = served.engine.caps.max_context
        self.max_context = min(options.max_context, cap) if cap > 0 else options.max_context
        self.grammars = Grammars(served.tokenizer, served.stop_ids)
        self.ledger = Ledger(options.ledger) if options.ledger is not None else None
        self.metrics = Metrics(self._gauges, self._metric_lines)
        self.started = int(time.time())
        self.tokenizer_fingerprint = served.tokenizer.fingerprint()
        self.active: set[threading.Event] = set()
        self.conduct = Conduct(self, options.conductor)     # turn planning and the monitor (server.conduct)

    def _metric_lines(self) -> list[str]:
        lines = self.spec.metric_lines()
        lines += ["# HELP tandem_side_lane_total Short requests served inside a running generation.",
                  "# TYPE tandem_side_lane_total counter",
                  f"tandem_side_lane_total {sum(lane.total for lane in self.lanes)}",
                  "# HELP tandem_side_lane_waiting Short requests waiting for a safe point.",
                  "# TYPE tandem_side_lane_waiting gauge",
                  f"tandem_side_lane_waiting {sum(len(lane) for lane in self.lanes)}"]
        if self.caches is not None:
            lines += self.caches.metric_lines()
        return lines + self.conduct.metric_lines() + self._engine_lines()

    def _engine_lines(self) -> list[str]:
        """Where the engines run, their memory by part and device, and the widths captured as graphs."""
        caps = self.served.engine.caps
        lines = ["# HELP tandem_engine_info The engines' device, dtype and widest verify (value 1).",
                 "# TYPE tandem_engine_info gauge",
                 f'tandem_engine_info{{device="{caps.device}",dtype="{caps.dtype}",max_tree="{caps.max_tree}"}} 1',
                 "# HELP tandem_engine_memory_bytes Memory each engine holds, by part and device.",
                 "# TYPE tandem_engine_memory_bytes gauge"]
        for i, slot in enumerate(self.admission.slots):
            for part in slot.engine.memory_parts():
                lines.append(f'tandem_engine_memory_bytes{{engine="{i}",part="{part.name}",device="{part.device}"}} '
                             f"{part.nbytes}")
        lines += ["# HELP tandem_engine_graph_widths Verify widths captured as CUDA graphs (none: eager).",
                  "# TYPE tandem_engine_graph_widths gauge"]
        lines += [f'tandem_engine_graph_widths{{width="{w}"}} 1' for w in caps.graph_widths]
        return lines

    def _gauges(self) -> dict[str, float]:
        return {"engines": len(self.admission.slots), "engines_busy": self.admission.busy,
                "queue_waiting": len(self.admission.waiting), "queue_limit": self.admission.limit}

    # -- running a job ---------------------------------------------------------------------------------

    def launch(self, job: Job, slot: Slot, emit: Callable[[Delta], None], queued_s: float
               ) -> tuple[asyncio.Future[Outcome], threading.Event]:
        """Start ``job`` on ``slot``'s engine in its worker thread; the slot comes back when it ends."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        self.active.add(cancel)

        caches = self.caches.engine(slot.index) if self.caches is not None else None
        lane = self.lanes[slot.index]
        lane.open = True            # short requests may now wait for this generation's safe points

        def work() -> Outcome:
            t0 = time.perf_counter()
            try:
                spec = self.spec.for_slot(slot.index)
                with caches.busy if caches is not None else nullcontext():
                    outcome = run_job(slot.engine, job, self.served, emit, cancel, caches, spec=spec,
                                      safe_point=lambda: lane.serve(slot.engine))
                    lane.serve(slot.engine)     # what came during the last step
                self.record(job, outcome, queued_s)
                return outcome
            finally:
                held = time.perf_counter() - t0
                try:
                    loop.call_soon_threadsafe(self._returned, slot, held, cancel)
                except RuntimeError:  # the loop is gone (shutdown)
                    pass

        return loop.run_in_executor(self.pool, work), cancel

    def _returned(self, slot: Slot, held: float, cancel: threading.Event) -> None:
        self.active.discard(cancel)
        self.admission.served(held)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        """On the event loop: close the slot's side lane and give the slot back, unless a short request
        came after the worker's last look (offers run on this loop too): then serve it first."""
        lane = self.lanes[slot.index]
        if len(lane):
            loop = asyncio.get_running_loop()
            caches = self.caches.engine(slot.index) if self.caches is not None else None

            def drain() -> None:
                try:
                    with caches.busy if caches is not None else nullcontext():
                        lane.serve(slot.engine)
                finally:
                    try:
                        loop.call_soon_threadsafe(self._free, slot)
                    except RuntimeError:  # the loop is gone (shutdown)
                        pass

            self.pool.submit(drain)
            return
        lane.open = False
        self.admission.release(slot)

    def side_room(self) -> bool:
        """Whether a running generation's side lane can take a short request now."""
        return any(lane.has_room() for lane in self.lanes)

    def side(self, job: Job, emit: Callable[[Delta], None]) -> tuple[asyncio.Future[Outcome], threading.Event]:
        """A short request served by a running generation at its next safe point (on the event loop, right
        after ``side_room`` said yes: nothing can close a lane in between)."""
        lane = min((lane for lane in self.lanes if lane.has_room()), key=len)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        def done(outcome: Outcome) -> None:
            self.record(job, outcome, side.waited, lane="side")
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(outcome))
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        side = SideJob(job, emit, done)
        taken = lane.offer(side)
        assert taken, "a side lane closed between side_room and side"
        self.active.add(side.cancel)
        fut.add_done_callback(lambda _f: self.active.discard(side.cancel))
        return fut, side.cancel

    def affinity(self, job: Job) -> Callable[[Slot], int] | None:
        """How much of ``job``'s prompt each engine's resident prefix holds (None without caches)."""
        if self.caches is None or len(self.admission.slots) < 2:
            return None
        caches = self.caches
        return lambda slot: caches.engine(slot.index).holds(job.decode.prompt)

    def admit(self, job: Job, slot: Slot) -> None:
        """The memory gate before the request runs: ``MemoryGateError`` for a prompt that can never fit."""
        if self.caches is not None:
            self.caches.engine(slot.index).admit(job.decode.prompt)

    def refused(self, job: Job, exc: MemoryGateError) -> None:
        """The log line and metrics of a request the memory gate refused before it ran."""
        log.info("req=%s endpoint=%s prompt=%d refused=memory_gate need=%d available=%d releasable=%d",
                 job.rid, job.endpoint, len(job.decode.prompt), exc.need.total, exc.available, exc.releasable)
        self.metrics.reject("memory_gate")

    def record(self, job: Job, out: Outcome, queued_s: float, lane: str | None = None) -> None:
        """The request's log line, metrics and ledger row (counts and times, never text)."""
        now = time.perf_counter()
        ttft = None if out.t_first is None else out.t_first - job.t_arrival
        capped = f" capped_max_tokens={job.capped_from}->{job.decode.max_tokens}" if job.capped_from else ""
        pre = out.prefill
        prefill = "-" if pre is None else f"{pre.tier}:{pre.start}/{pre.total}"
        spec = ("" if out.spec is None or not out.spec.rounds else
                f" spec_rounds={out.spec.rounds} tokens_per_round={out.spec.tokens_per_round:.2f}"
                f" acceptance={out.spec.acceptance:.2f}")
        log.info("req=%s endpoint=%s prompt=%d completion=%d finish=%s prefill=%s ttft=%s decode=%s "
                 "queued=%.2fs total=%.2fs%s%s%s%s", job.rid, job.endpoint, out.prompt_tokens,
                 out.completion_tokens, out.finish,
                 prefill, "-" if ttft is None else f"{ttft:.3f}s",
                 "-" if out.decode_rate is None else f"{out.decode_rate:.1f}tok/s", queued_s, now - job.t_arrival,
                 spec, capped, f" lane={lane}" if lane else "", f" error={out.error.split(':')[0]}" if out.error else "")
        if out.status == 507:
            self.metrics.reject("memory_gate")
        self.metrics.request(job.endpoint, out.finish, out.prompt_tokens, out.completion_tokens, ttft,
                             out.decode_rate)
        if pre is not None:
            self.metrics.prefill(pre.tier, pre.start, pre.total)
        if self.ledger is not None and job.endpoint != "conductor":    # a conductor's hidden request: no row
            try:
                self.ledger.write(UsageRow(
                    ts=job.ts, request_id=job.rid, model=job.model, endpoint=job.endpoint,
                    prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    finish_reason=out.finish, ttft_s=ttft, decode_tps=out.decode_rate, queued_s=queued_s,
                    duration_s=now - job.t_arrival, max_tokens=job.decode.max_tokens,
                    capped_from=job.capped_from, stream=job.stream))
            except Exception as exc:  # the ledger never fails a request
                log.error("req=%s ledger write failed: %s", job.rid, exc)

    def start(self) -> None:
        """At start, before the socket listens: the spilled sessions become the engines' own again."""
        if self.caches is not None:
            self.caches.restore()

    def stop(self) -> None:
        """At shutdown: stop the running generations, then spill every engine's session."""
        for ev in list(self.active):
            ev.set()
        if self.caches is not None:
            try:
                self.caches.save_sessions()
            except Exception as exc:  # a failed spill leaves the previous one; the shutdown goes on
                log.error("session spill failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        for ev in list(self.active):
            ev.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.conduct.close()
        if self.ledger is not None:
            self.ledger.close()
        if self.caches is not None:
            self.caches.close()


# -- responses ---------------------------------------------------------------------------------------------

def _error(status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict[str, str] | None = None) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _openai_errors(app: Any) -> None:
    """Every error on every route and method in OpenAI's shape: ``{"error": {message, type, param, code}}``
    (FastAPI's own 404/405/422 say ``{"detail": ...}``, an unhandled exception plain text)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

    async def http_error(request: Request, exc: HTTPException) -> Any:
        what = {404: f"no route {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return _error(exc.status_code, what, code=codes.get(exc.status_code),
                      headers=dict(exc.headers) if exc.headers else None)

    async def validation_error(request: Request, exc: RequestValidationError) -> Any:
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(422, f"{where or 'request'}: {first.get('msg', 'invalid')}", param=where)

    async def internal_error(request: Request, exc: Exception) -> Any:
        log.error("%s %s failed: %s", request.method, request.url.path, type(exc).__name__)
        return _error(500, "the server failed on this request (see its log)", kind="server_error")

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def _prompt_field(job: Job) -> str:
    return "messages" if job.endpoint == "chat" else "prompt"


def _memory_error(job: Job, message: str) -> Any:
    """507: the prompt does not fit under the memory gate (the message: what it needs, what there is)."""
    return _error(507, message, param=_prompt_field(job), kind="server_error", code="memory_gate")


def _json(body: Any) -> Any:
    return Response(json.dumps(body, default=str), media_type="application/json")


async def _disconnected(request: Any) -> bool:
    try:
        return bool(await request.is_disconnected())
    except Exception:
        return True


class ClientGone(Exception):
    """The client disconnected while its request waited for an engine."""


async def _wait_slot(request: Any, ticket: Ticket, timeout: float | None) -> Slot | None:
    """The ticket's slot; None after ``timeout`` s; ``ClientGone`` if the client went away."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
        done, _ = await asyncio.wait({ticket.slot}, timeout=step)
        if done:
            return ticket.slot.result()
        if await _disconnected(request):
            raise ClientGone()
        if deadline is not None and time.monotonic() >= deadline:
            return None


def _wait_line(state: ServerState, ticket: Ticket) -> str:
    pos = state.admission.position(ticket)
    est = state.admission.estimate(max(pos, 1))
    about = f"about {est:.0f} s" if est is not None else "no estimate yet"
    return f"waiting for the engine: {pos} in line, {about}"


class _GuardedStream(StreamingResponse):
    """A streamed answer that gives its ticket back if the body never starts (the client left first)."""

    def __init__(self, body: AsyncIterator[bytes], on_unstarted: Callable[[], None], **kw: Any) -> None:
        self.started = False

        async def tracked() -> AsyncIterator[bytes]:
            self.started = True
            try:
                async for part in body:
                    yield part
            finally:
                await body.aclose()  # type: ignore[attr-defined]

        super().__init__(tracked(), **kw)
        self._on_unstarted = on_unstarted

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.started:
                self._on_unstarted()


class _BearerAuth:
    """Plain ASGI middleware: ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <key>``; ``/health`` does not."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not (given.startswith(b"Bearer ") and hmac.compare_digest(given[7:], self.key)):
                response = _error(401, "a valid API key is required: Authorization: Bearer <key>",
                                  kind="authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(served: Served, options: ServerOptions, state: ServerState | None = None) -> Any:
    state = state or ServerState(served, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(state.start)
        try:
            yield
        finally:
            await asyncio.to_thread(state.stop)
            state.close()

    app = FastAPI(title="TandemLLM", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.tandem = state
    _openai_errors(app)

    if options.api_key:
        app.add_middleware(_BearerAuth, key=options.api_key)

    @app.get("/health")
    async def health() -> Any:
        info = dict(served.info)
        eng = served.engine
        return _json({
            "status": "ok", "model": served.model_id,
            "weights": info.get("weights", info.get("path")),
            "fingerprints": {"tokenizer": state.tokenizer_fingerprint, **(info.get("fingerprints") or {})},
            "load_stages": info.get("load_stages", []),
            "memory": [{"name": m.name, "bytes": m.nbytes, "device": m.device} for m in eng.memory_parts()],
            "engine": {"device": eng.caps.device, "dtype": eng.caps.dtype, "max_context": state.max_context,
                       "graph_widths": list(eng.caps.graph_widths), "max_tree": eng.caps.max_tree,
                       "engines": len(state.admission.slots), "busy": state.admission.busy,
                       "waiting": len(state.admission.waiting), "queue": state.admission.limit,
                       "side_lane": {"waiting": sum(len(lane) for lane in state.lanes),
                                     "served": sum(lane.total for lane in state.lanes)}},
            "caches": state.caches.health() if state.caches is not None else {"enabled": False},
            "speculation": state.spec.health(),
            "conductor": state.conduct.health(),
            "info": info,
        })

    @app.get("/openapi.json")
    async def openapi_doc() -> Any:
        return _json(openapi(served.model_id))

    @app.get("/v1/models")
    async def models() -> Any:
        return _json({"object": "list", "data": [{
            "id": state.conduct.model_name, "object": "model", "created": state.started, "owned_by": "tandem",
            "max_model_len": state.max_context}]})

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def handle(request: Request, endpoint: str) -> Any:
        raw = await request.body()

        def prepare(body: Any) -> Job:      # read_body's: the depth limit before anything recurses into it
            if endpoint == "chat":
                return prepare_chat(body, served, state.max_context, state.grammars)
            return prepare_completion(body, served, state.max_context)

        try:
            job = await state.conduct.prepare(request.headers, endpoint, raw, prepare)
        except FieldError as exc:
            return _error(400, exc.message, param=exc.field)
        except ModelNotServed as exc:
            return _error(404, str(exc), param="model", code="model_not_found")
        if is_short(job) and not state.admission.free and state.side_room():
            return await side(request, job)     # no await before it is offered: the lane cannot close first
        try:
            ticket = state.admission.enter(state.affinity(job))
        except QueueFull as exc:
            state.metrics.reject("queue_full")
            return _error(429, str(exc), kind="rate_limit_error", code="queue_full",
                          headers={"Retry-After": str(exc.retry_after)})
        t_queue = time.perf_counter()
        try:
            if job.stream:
                slot = await _wait_slot(request, ticket, options.wait_comment_s)
                if slot is not None:
                    await asyncio.to_thread(state.admit, job, slot)
                return _GuardedStream(streamed(job, ticket, slot, t_queue), lambda: state.admission.leave(ticket),
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})
            slot = await _wait_slot(request, ticket, None)
            assert slot is not None
            await asyncio.to_thread(state.admit, job, slot)
        except ClientGone:
            state.admission.leave(ticket)
            return _error(499, "the client closed the request while it waited", kind="client_closed")
        except MemoryGateError as exc:
            state.admission.leave(ticket)
            state.refused(job, exc)
            return _memory_error(job, str(exc))
        except BaseException:
            state.admission.leave(ticket)
            raise
        return await whole(request, job, lambda emit: state.launch(job, slot, emit, time.perf_counter() - t_queue))

    async def side(request: Request, job: Job) -> Any:
        """A short request while every engine is busy: served at a running generation's next safe point."""
        if not job.stream:
            return await whole(request, job, lambda emit: state.side(job, emit))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()
        fut, cancel = state.side(job, lambda d: loop.call_soon_threadsafe(queue.put_nowait, d))
        fut.add_done_callback(lambda _f: queue.put_nowait(None))
        return _GuardedStream(relayed(job, fut, cancel, queue), cancel.set, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})

    async def whole(request: Request, job: Job,
                    launch: Callable[[Callable[[Delta], None]], tuple[asyncio.Future[Outcome], threading.Event]]
                    ) -> Any:
        answer: ChatAnswer | TextAnswer
        if job.endpoint == "chat":
            answer = ChatAnswer(job.rid, job.model, job.created, logprobs=job.logprobs)
        else:
            answer = TextAnswer(job.rid, job.model, job.created, logprobs=job.logprobs)
        fut, cancel = launch(answer.add)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.25)
                if done:
                    break
                if await _disconnected(request):
                    cancel.set()
        finally:
            if not fut.done():
                cancel.set()
        out = fut.result()
        if out.finish == "error" and out.status == 507:
            return _memory_error(job, out.error or "memory gate")
        if out.finish == "error":
            return _error(500, f"generation failed: {out.error}", kind="server_error")
        usage = Usage(out.prompt_tokens, out.completion_tokens, out.reasoning_tokens)
        return _json(answer.body(out.finish, usage))

    async def streamed(job: Job, ticket: Ticket, slot: Slot | None, t_queue: float) -> AsyncIterator[bytes]:
        cancel: threading.Event | None = None
        try:
            if slot is None:
                while slot is None:
                    yield sse_comment(_wait_line(state, ticket))
                    done, _ = await asyncio.wait({ticket.slot}, timeout=options.wait_comment_s)
                    if done:
                        slot = ticket.slot.result()
                try:
                    await asyncio.to_thread(state.admit, job, slot)
                except MemoryGateError as exc:
                    state.refused(job, exc)
                    yield sse({"error": {"message": str(exc), "type": "server_error",
                                         "param": _prompt_field(job), "code": "memory_gate"}})
                    yield SSE_DONE
                    return
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Delta | None] = asyncio.Queue()
            fut, cancel = state.launch(job, slot, lambda d: loop.call_soon_threadsafe(queue.put_nowait, d),
                                       time.perf_counter() - t_queue)
            fut.add_done_callback(lambda _f: queue.put_nowait(None))
            async for part in answer_events(job, fut, queue):
                yield part
        finally:
            if cancel is not None:
                cancel.set()  # a no-op after a finished decode; stops one whose client went away
            else:
                state.admission.leave(ticket)

    async def relayed(job: Job, fut: asyncio.Future[Outcome], cancel: threading.Event,
                      queue: asyncio.Queue[Delta | None]) -> AsyncIterator[bytes]:
        try:
            async for part in answer_events(job, fut, queue):
                yield part
        finally:
            cancel.set()  # a no-op after a finished decode; stops one whose client went away

    async def answer_events(job: Job, fut: asyncio.Future[Outcome], queue: asyncio.Queue[Delta | None]
                            ) -> AsyncIterator[bytes]:
        """A launched generation's events: the first chunk, its deltas, the finish (or error), usage, DONE."""
        chunks: ChatChunks | TextChunks
        if job.endpoint == "chat":
            chunks = ChatChunks(job.rid, job.model, job.created, include_usage=job.include_usage,
                                logprobs=job.logprobs)
            yield sse(chunks.first())
        else:
            chunks = TextChunks(job.rid, job.model, job.created, include_usage=job.include_usage,
                                logprobs=job.logprobs)
        while (d := await queue.get()) is not None:
            yield sse(chunks.delta(d))
        out = fut.result()
        if out.finish == "error" and out.status == 507:
            yield sse({"error": {"message": out.error, "type": "server_error",
                                 "param": _prompt_field(job), "code": "memory_gate"}})
        elif out.finish == "error":
            yield sse({"error": {"message": f"generation failed: {out.error}", "type": "server_error",
                                 "param": None, "code": None}})
        else:
            yield sse(chunks.finish(out.finish))
            if job.include_usage:
                yield sse(chunks.usage(Usage(out.prompt_tokens, out.completion_tokens, out.reasoning_tokens)))
        yield SSE_DONE

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, "completions")

    return app
