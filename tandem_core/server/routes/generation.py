"""The generation routes: ``/v1/chat/completions`` and ``/v1/completions``.

A request is checked and prepared off the event loop (``prepare``), then either served in
a running generation's side lane (a short request while every engine is busy) or admitted
to the queue, passed through the memory gate and run in its engine's worker thread
(``ServerState.launch``); the answer goes back whole (``whole``) or as server-sent events
(``streamed``, ``relayed``, ``answer_events``). A stream that waits for an engine opens
with SSE comments saying where it stands in line.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem_core.cache.gate import MemoryGateError
from tandem_core.server.admission import QueueFull, Slot, Ticket
from tandem_core.server.body import read_body
from tandem_core.server.errors import error, json_response, memory_error, prompt_field
from tandem_core.server.fields import FieldError
from tandem_core.server.generate import Outcome
from tandem_core.server.prepare import Job, ModelNotServed, prepare_chat, prepare_completion
from tandem_core.server.sidelane import is_short
from tandem_core.server.state import ServerState
from tandem_core.server.stream import (
    SSE_DONE, ChatAnswer, ChatChunks, Delta, TextAnswer, TextChunks, Usage, sse, sse_comment,
)

__all__ = ["router", "handle", "ClientGone"]

router = APIRouter()


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


async def handle(request: Request, endpoint: str) -> Any:
    """Prepare the body off the event loop, admit it, run it; answer whole or as a stream."""
    state: ServerState = request.app.state.tandem
    served = state.served
    raw = await request.body()

    def prepare() -> Job:
        body = read_body(raw)           # the depth limit before anything recurses into it
        if endpoint == "chat":
            return prepare_chat(body, served, state.max_context, state.grammars)
        return prepare_completion(body, served, state.max_context)

    try:
        job = await asyncio.to_thread(prepare)
    except FieldError as exc:
        return error(400, exc.message, param=exc.field)
    except ModelNotServed as exc:
        return error(404, str(exc), param="model", code="model_not_found")
    if is_short(job) and not state.admission.free and state.side_room():
        return await side(state, request, job)     # no await before it is offered: the lane cannot close first
    try:
        ticket = state.admission.enter(state.affinity(job))
    except QueueFull as exc:
        state.metrics.reject("queue_full")
        return error(429, str(exc), kind="rate_limit_error", code="queue_full",
                      headers={"Retry-After": str(exc.retry_after)})
    t_queue = time.perf_counter()
    try:
        if job.stream:
            slot = await _wait_slot(request, ticket, state.options.wait_comment_s)
            if slot is not None:
                await asyncio.to_thread(state.admit, job, slot)
            return _GuardedStream(streamed(state, job, ticket, slot, t_queue), lambda: state.admission.leave(ticket),
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})
        slot = await _wait_slot(request, ticket, None)
        assert slot is not None
        await asyncio.to_thread(state.admit, job, slot)
    except ClientGone:
        state.admission.leave(ticket)
        return error(499, "the client closed the request while it waited", kind="client_closed")
    except MemoryGateError as exc:
        state.admission.leave(ticket)
        state.refused(job, exc)
        return memory_error(job, str(exc))
    except BaseException:
        state.admission.leave(ticket)
        raise
    return await whole(request, job, lambda emit: state.launch(job, slot, emit, time.perf_counter() - t_queue))


async def side(state: ServerState, request: Request, job: Job) -> Any:
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
        return memory_error(job, out.error or "memory gate")
    if out.finish == "error":
        return error(500, f"generation failed: {out.error}", kind="server_error")
    usage = Usage(out.prompt_tokens, out.completion_tokens, out.reasoning_tokens)
    return json_response(answer.body(out.finish, usage))


async def streamed(state: ServerState, job: Job, ticket: Ticket, slot: Slot | None, t_queue: float
                   ) -> AsyncIterator[bytes]:
    cancel: threading.Event | None = None
    try:
        if slot is None:
            while slot is None:
                yield sse_comment(_wait_line(state, ticket))
                done, _ = await asyncio.wait({ticket.slot}, timeout=state.options.wait_comment_s)
                if done:
                    slot = ticket.slot.result()
            try:
                await asyncio.to_thread(state.admit, job, slot)
            except MemoryGateError as exc:
                state.refused(job, exc)
                yield sse({"error": {"message": str(exc), "type": "server_error",
                                     "param": prompt_field(job), "code": "memory_gate"}})
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
                             "param": prompt_field(job), "code": "memory_gate"}})
    elif out.finish == "error":
        yield sse({"error": {"message": f"generation failed: {out.error}", "type": "server_error",
                             "param": None, "code": None}})
    else:
        yield sse(chunks.finish(out.finish))
        if job.include_usage:
            yield sse(chunks.usage(Usage(out.prompt_tokens, out.completion_tokens, out.reasoning_tokens)))
    yield SSE_DONE

@router.post("/v1/chat/completions")
async def chat(request: Request) -> Any:
    return await handle(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await handle(request, "completions")
