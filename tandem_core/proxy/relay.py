"""One relayed request: the body to the backend, the answer's bytes back as they arrive, one ledger row.

The request's headers that matter go along (content type, accept, the SDK's own ``x-stainless-*`` and
``openai-*``, the user agent); the client's ``Authorization`` (this server's key) does not: the backend's key
from its ``api_key_env`` takes its place. The body goes unchanged, except that a streamed request without
``stream_options.include_usage`` gets it (so the ledger has the backend's own counts) and the usage chunk the
client did not ask for is not passed on. The answer goes back unchanged: its status, its headers (less the
hop-by-hop ones), and its bytes, a server-sent event at a time as each arrives, never re-encoded.

A backend that cannot be reached, or that answers nothing within its timeouts, gets a 502 or 504 in OpenAI's
error shape naming it; once the answer has started, an SSE ``error`` event ends the stream instead. A client
that goes away closes the connection to the backend at once (the backend sees the disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from tandem_core.proxy.config import Backend
from tandem_core.proxy.hub import (
    Hub,
    Receive,
    Scope,
    Send,
    count_tokens,
    describe,
    error_response,
    is_timeout,
)
from tandem_core.server.ledger import UsageRow

__all__ = ["relay"]

log = logging.getLogger("tandem.proxy")

_DROP_REQUEST = {b"host", b"content-length", b"authorization", b"connection", b"keep-alive", b"transfer-encoding",
                 b"accept-encoding", b"cookie", b"te", b"upgrade", b"proxy-authorization", b"proxy-connection",
                 b"expect"}
_DROP_RESPONSE = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"content-encoding",
                  b"date", b"server", b"set-cookie", b"proxy-connection", b"upgrade", b"trailer"}
_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


class _Tally:
    """What the answer said about itself: status, first token, usage, finish (its text counted, then dropped)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.status = 0
        self.started = False            # http.response.start sent
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.chunks = 0                 # chunks that carried answer text or tool-call arguments
        self.texts: list[str] = []      # the answer's text, only to count it when the backend sends no usage
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.error_status = 0

    def choices(self, obj: dict[str, Any], now: float) -> None:
        u = obj.get("usage")
        if isinstance(u, dict):
            self.usage = u
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            if c.get("finish_reason"):
                self.finish = str(c["finish_reason"])
            d = c.get("delta") if isinstance(c.get("delta"), dict) else c.get("message")
            pieces: list[str] = []
            if isinstance(d, dict):
                for k in ("content", "reasoning_content", "reasoning", "refusal"):
                    if isinstance(d.get(k), str):
                        pieces.append(d[k])
                for tc in d.get("tool_calls") or ():
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if isinstance(fn, dict):
                        pieces += [v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str)]
            if isinstance(c.get("text"), str):
                pieces.append(c["text"])
            if any(pieces):
                self.texts += pieces
                self.chunks += 1
                if self.t_first is None:
                    self.t_first = now
                self.t_last = now


def _forwarded(scope: Scope, b: Backend) -> list[tuple[bytes, bytes]]:
    out = [(k.lower(), v) for k, v in scope.get("headers") or [] if k.lower() not in _DROP_REQUEST]
    out.append((b"accept-encoding", b"identity"))   # the bytes come back as the backend wrote them
    if b.api_key:
        out.append((b"authorization", f"Bearer {b.api_key}".encode()))
    return out


def _split(buf: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each with its blank line) and the rest."""
    events: list[bytes] = []
    while True:
        cut = min(((i, s) for s in _SEPARATORS if (i := buf.find(s)) >= 0), default=None)
        if cut is None:
            return events, buf
        end = cut[0] + len(cut[1])
        events.append(buf[:end])
        buf = buf[end:]


def _event_json(event: bytes) -> dict[str, Any] | None:
    lines = [ln[5:].lstrip() for ln in event.splitlines() if ln.startswith(b"data:")]
    if not lines:
        return None
    payload = b"\n".join(lines)
    if payload.strip() == b"[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _prompt_texts(data: dict[str, Any]) -> list[str]:
    """The prompt's text, only to count it when the backend sends no usage."""
    out: list[str] = []
    p = data.get("prompt")
    if isinstance(p, str):
        out.append(p)
    elif isinstance(p, list):
        out += [x for x in p if isinstance(x, str)]
    for m in data.get("messages") or ():
        if not isinstance(m, dict):
            continue
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out += [x["text"] for x in c if isinstance(x, dict) and isinstance(x.get("text"), str)]
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                out.append(fn["arguments"])
    return out


async def _watch(receive: Receive) -> None:
    """Returns when the client disconnects."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def relay(hub: Hub, b: Backend, scope: Scope, receive: Receive, send: Send, body: bytes,
                data: dict[str, Any], endpoint: str) -> None:
    t0 = time.perf_counter()
    ts = time.time()
    stream = data.get("stream") is True
    injected = False
    if stream and b.stream_usage:
        so = data.get("stream_options")
        if not (isinstance(so, dict) and so.get("include_usage") is True):
            body = json.dumps({**data, "stream_options": {**(so if isinstance(so, dict) else {}),
                                                          "include_usage": True}}).encode()
            injected = True
    flight = hub.flight(str(data.get("model"))[:200], b.name, endpoint, stream)
    tally = _Tally(t0)
    task = asyncio.ensure_future(_exchange(hub, b, scope, send, body, stream, injected, tally, flight))
    watcher = asyncio.ensure_future(_watch(receive))
    cancelled = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():         # the client went away: closing the backend's response tells the backend
            cancelled = True
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not cancelled:
                raise
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        hub.landed(flight)
        _record(hub, b, data, endpoint, stream, tally, ts, t0, cancelled)


async def _exchange(hub: Hub, b: Backend, scope: Scope, send: Send, body: bytes, stream: bool, injected: bool,
                    tally: _Tally, flight: Any) -> None:
    import httpx

    path = scope["path"][len("/v1"):]
    url = b.url + path + (("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else "")
    client = hub.client(b)
    request = client.build_request("POST", url, content=body, headers=_forwarded(scope, b))
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        message = describe(exc, b)
        status = 504 if is_timeout(exc) else 502
        hub.failed(b, message)
        log.info("backend=%s relay failed before an answer: status=%d %s", b.name, status, type(exc).__name__)
        tally.status, tally.error, tally.error_status = status, message, status
        await error_response(send, status, message, kind="server_error", param="model",
                             code="backend_timeout" if status == 504 else "backend_unavailable",
                             headers=[(b"x-tandem-backend", b.name.encode())])
        tally.started = True
        return
    try:
        tally.status = response.status_code
        headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]
        headers.append((b"x-tandem-backend", b.name.encode()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        tally.started = True
        sse = stream and response.status_code == 200 and \
            response.headers.get("content-type", "").startswith("text/event-stream")
        buf = b""
        whole: list[bytes] = []
        try:
            async for part in response.aiter_raw():
                now = time.perf_counter()
                if flight.first is None:
                    flight.first = time.time()
                if not sse:
                    whole.append(part)
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    continue
                events, buf = _split(buf + part)
                out = []
                for ev in events:
                    obj = _event_json(ev)
                    if obj is not None:
                        tally.choices(obj, now)
                        if injected and obj.get("usage") is not None and not obj.get("choices"):
                            continue    # the usage chunk the client did not ask for
                    out.append(ev)
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        except httpx.HTTPError as exc:
            message = describe(exc, b)
            status = 504 if is_timeout(exc) else 502
            hub.failed(b, message)
            tally.error, tally.error_status = message, status
            log.info("backend=%s relay failed mid-answer: status=%d %s", b.name, status, type(exc).__name__)
            if sse:
                err = {"error": {"message": message, "type": "server_error", "param": "model",
                                 "code": "backend_timeout" if status == 504 else "backend_unavailable"}}
                buf += b"data: " + json.dumps(err).encode() + b"\n\n"
        if not sse and whole and response.status_code == 200:
            try:
                tally.choices(json.loads(b"".join(whole)), time.perf_counter())
            except (ValueError, UnicodeDecodeError, AttributeError):
                pass
        await send({"type": "http.response.body", "body": buf, "more_body": False})
    finally:
        await response.aclose()


def _record(hub: Hub, b: Backend, data: dict[str, Any], endpoint: str, stream: bool, tally: _Tally, ts: float,
            t0: float, cancelled: bool) -> None:
    now = time.perf_counter()
    u = tally.usage or {}
    counted = not (isinstance(u.get("prompt_tokens"), int) and isinstance(u.get("completion_tokens"), int))
    if counted:
        prompt = count_tokens(hub, _prompt_texts(data))
        completion = max(tally.chunks, count_tokens(hub, tally.texts))
    else:
        prompt, completion = int(u["prompt_tokens"]), int(u["completion_tokens"])
    tally.texts.clear()
    ttft = None if tally.t_first is None or not stream else tally.t_first - t0
    rate = None
    if stream and tally.t_first is not None and tally.t_last is not None and tally.t_last > tally.t_first \
            and completion > 1:
        rate = (completion - 1) / (tally.t_last - tally.t_first)
    if cancelled:
        status, finish = 499, "cancelled"
    elif tally.error_status:
        status, finish = tally.error_status, "error"
    else:
        status, finish = tally.status, (tally.finish or ("error" if tally.status != 200 else "stop"))
    mt = data.get("max_completion_tokens", data.get("max_tokens"))
    rid = f"relay-{uuid.uuid4().hex[:24]}"
    log.info("req=%s backend=%s endpoint=%s status=%d prompt=%d completion=%d%s finish=%s ttft=%s decode=%s "
             "total=%.2fs cost=%.6f", rid, b.name, endpoint, status, prompt, completion, " counted" if counted else "",
             finish, "-" if ttft is None else f"{ttft:.3f}s", "-" if rate is None else f"{rate:.1f}tok/s",
             now - t0, b.cost(prompt, completion))
    hub.write_row(UsageRow(
        ts=ts, request_id=rid, model=str(data.get("model"))[:200], endpoint=endpoint, prompt_tokens=prompt,
        completion_tokens=completion, finish_reason=finish, ttft_s=ttft, decode_tps=rate, queued_s=0.0,
        duration_s=now - t0, max_tokens=int(mt) if isinstance(mt, int) and not isinstance(mt, bool) else 0,
        capped_from=None, stream=stream, backend=b.name, cost=b.cost(prompt, completion), status=status,
        counted=counted))
