"""The hub: routes by ``model``, the backends' health, the requests in flight, the event bus of the dashboard.

``Hub`` holds what the proxy and the dashboard share: the backends file, the routing table (each backend's
models, listed or read from its ``GET /v1/models``), every backend's health, the requests in flight (local and
relayed, counts only), the recent ledger rows and the subscribers of ``/dash/events``. ``HubMiddleware`` is the
ASGI layer in front of the app: ``/dash*`` goes to the dashboard, ``GET /v1/models`` gets the union, a
completion for a backend's model is relayed (``tandem_core.proxy.relay``), and everything else reaches the app
untouched (its body replayed byte for byte).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem_core.proxy.config import Backend, Backends
from tandem_core.server.ledger import Ledger, UsageRow

__all__ = ["Hub", "HubMiddleware", "LedgerTap", "attach_to_app", "error_response"]

log = logging.getLogger("tandem.proxy")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MAX_BODY = 64 << 20
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def error_response(send: Send, status: int, message: str, *, kind: str = "invalid_request_error",
                         param: str | None = None, code: str | None = None,
                         headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """An OpenAI-shaped error, written straight to ASGI's ``send``."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Health:
    """One backend's last health check (``GET /v1/models``) and its counters."""

    name: str
    url: str
    ok: bool | None = None          # None: not checked yet
    latency_ms: float | None = None
    checked: float | None = None    # unix time
    error: str | None = None
    models: list[str] = field(default_factory=list)
    requests: int = 0
    failures: int = 0               # 502/504 the proxy gave for it
    inflight: int = 0


@dataclass
class Flight:
    """A request in flight: what it is, never what it says."""

    id: int
    model: str
    backend: str
    endpoint: str
    stream: bool
    since: float                    # unix time
    first: float | None = None      # unix time of its first answer byte (relayed) or None


class LedgerTap:
    """The server's ledger, with every written row also sent to the hub (the dashboard's live rows)."""

    def __init__(self, ledger: Ledger | None, hub: Hub) -> None:
        self.ledger = ledger
        self.hub = hub

    def write(self, row: UsageRow) -> None:
        try:
            if self.ledger is not None:
                self.ledger.write(row)
        finally:
            self.hub.row_done(row)

    def last(self, n: int = 20) -> list[UsageRow]:
        return self.ledger.last(n) if self.ledger is not None else list(self.hub.rows)[-n:]

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


class Hub:
    def __init__(self, backends: Backends | None, ledger: Ledger | None, *, state: Any = None,
                 api_key: str | None = None) -> None:
        self.backends = backends
        self.by_name: dict[str, Backend] = {b.name: b for b in (backends.backends if backends else ())}
        self.health: dict[str, Health] = {b.name: Health(b.name, b.shown) for b in self.by_name.values()}
        self.ledger = LedgerTap(ledger, self)
        self.state = state              # the local ServerState, or None (tandem-dash)
        self.local_model: str | None = state.served.model_id if state is not None else None
        self.api_key = api_key
        self.rows: deque[UsageRow] = deque(maxlen=500)
        self.flights: dict[int, Flight] = {}
        self._next = 0
        self.subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.clients: dict[str, Any] = {}
        self._poller: asyncio.Task[None] | None = None
        self._first: asyncio.Future[Any] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._asked = 0.0
        self.started = time.time()

    # -- routing ---------------------------------------------------------------------------------------

    def routes(self) -> dict[str, str]:
        """model -> backend name: the listed models, then those the ``ask`` backends reported."""
        out: dict[str, str] = {}
        for b in self.by_name.values():
            for m in b.models or ():
                out.setdefault(m, b.name)
        for b in self.by_name.values():
            if b.ask:
                for m in self.health[b.name].models:
                    out.setdefault(m, b.name)
        if self.local_model is not None:
            out.pop(self.local_model, None)     # the local model stays local
        return out

    async def route(self, model: Any) -> Backend | None:
        if not isinstance(model, str) or not self.by_name or model == self.local_model:
            return None
        await self.ready()
        name = self.routes().get(model)
        if name is None and any(b.ask for b in self.by_name.values()) and time.monotonic() - self._asked > 2.0:
            self._asked = time.monotonic()      # a model an ask backend may have gained: ask once, then route
            await asyncio.gather(*(self.check(b) for b in self.by_name.values() if b.ask))
            name = self.routes().get(model)
        return self.by_name.get(name) if name else None

    def client(self, b: Backend) -> Any:
        import httpx

        c = self.clients.get(b.name)
        if c is None:
            c = httpx.AsyncClient(timeout=httpx.Timeout(connect=b.connect_s, read=b.read_s, write=b.read_s,
                                                        pool=b.connect_s),
                                  limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
                                  trust_env=False, follow_redirects=False)
            self.clients[b.name] = c
        return c

    # -- health ----------------------------------------------------------------------------------------

    async def check(self, b: Backend) -> None:
        """``GET /v1/models`` of one backend: up or down, its latency, and its models (for ``ask``)."""
        import httpx

        h = self.health[b.name]
        headers = {"accept": "application/json"}
        if b.api_key:
            headers["authorization"] = f"Bearer {b.api_key}"
        t0 = time.perf_counter()
        try:
            r = await self.client(b).get(b.url + "/models", headers=headers, timeout=b.health_s)
            if r.status_code != 200:
                raise RuntimeError(f"GET /models answered {r.status_code}")
            data = r.json().get("data", [])
            h.models = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
            h.ok, h.error = True, None
        except (httpx.HTTPError, RuntimeError, ValueError, AttributeError) as exc:
            h.ok, h.error = False, describe(exc, b)
        h.latency_ms = round((time.perf_counter() - t0) * 1000, 2)
        h.checked = time.time()

    def failed(self, b: Backend, message: str) -> None:
        h = self.health[b.name]
        h.ok, h.error, h.checked = False, message, time.time()
        h.failures += 1

    async def start(self) -> None:
        """At the app's start: the first health checks run in the background (a backend that does not answer
        never holds up the server's start); ``/v1/models`` and routing wait for them (``ready``)."""
        self.loop = asyncio.get_running_loop()
        if self.by_name:
            self._first = asyncio.ensure_future(asyncio.gather(*(self.check(b) for b in self.by_name.values())))
            self._poller = asyncio.create_task(self._poll())
        self._ticker = asyncio.create_task(self._tick())

    async def ready(self) -> None:
        """The first health checks are done (each bounded by its backend's health timeout)."""
        first = self._first
        if first is not None and not first.done():
            await asyncio.shield(first)

    async def _poll(self) -> None:
        last = {n: time.monotonic() for n in self.by_name}
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            due = [b for b in self.by_name.values() if now - last[b.name] >= b.health_every_s]
            for b in due:
                last[b.name] = now
            if due:
                await asyncio.gather(*(self.check(b) for b in due))

    async def _tick(self) -> None:
        """The dashboard's state once a second, to every subscriber."""
        while True:
            await asyncio.sleep(1.0)
            if self.subscribers:
                self._put("state", self.snapshot())

    async def stop(self) -> None:
        for t in (self._first, self._poller, self._ticker):
            if t is not None:
                t.cancel()
        for c in list(self.clients.values()):
            await c.aclose()
        self.clients.clear()

    # -- the live side ---------------------------------------------------------------------------------

    def bind(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()

    def flight(self, model: str, backend: str, endpoint: str, stream: bool) -> Flight:
        self._next += 1
        f = Flight(self._next, model, backend, endpoint, stream, time.time())
        self.flights[f.id] = f
        if backend in self.health:
            self.health[backend].inflight += 1
            self.health[backend].requests += 1
        self._put("start", asdict(f))
        return f

    def landed(self, f: Flight) -> None:
        if self.flights.pop(f.id, None) is not None:
            if f.backend in self.health:
                self.health[f.backend].inflight -= 1
            self._put("end", {"id": f.id})

    def row_done(self, row: UsageRow) -> None:
        """A ledger row was written (any thread): keep it for the plots and tell the subscribers."""
        self.rows.append(row)
        loop = self.loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._put, "row", asdict(row))
        except RuntimeError:    # the loop is gone (shutdown)
            pass

    def _put(self, kind: str, data: Any) -> None:
        for q in list(self.subscribers):
            if q.qsize() < 1000:    # a subscriber that does not read loses events, never memory
                q.put_nowait((kind, data))

    def snapshot(self) -> dict[str, Any]:
        """What the dashboard draws: requests in flight, the local engine's queue, side lane, caches, memory,
        speculation and self-check, and the backends' health (counts and sizes, never text)."""
        out: dict[str, Any] = {"now": time.time(), "started": self.started, "local": None,
                               "flights": [asdict(f) for f in self.flights.values()],
                               "backends": [asdict(h) | {"models": self._models_of(n)}
                                            for n, h in self.health.items()]}
        st = self.state
        if st is not None:
            out["local"] = _local(st)
        return out

    def _models_of(self, name: str) -> list[str]:
        b = self.by_name[name]
        return list(b.models) if b.models is not None else list(self.health[name].models)

    def write_row(self, row: UsageRow) -> None:
        try:
            self.ledger.write(row)
        except Exception as exc:  # noqa: BLE001 (the ledger never fails a request)
            log.error("req=%s ledger write failed: %s", row.request_id, exc)


def _local(st: Any) -> dict[str, Any]:
    adm = st.admission
    local: dict[str, Any] = {
        "model": st.served.model_id, "engines": len(adm.slots), "busy": adm.busy,
        "waiting": len(adm.waiting), "queue": adm.limit,
        "side_lane": {"waiting": sum(len(lane) for lane in st.lanes), "served": sum(lane.total for lane in st.lanes)},
    }
    parts: dict[str, int] = {}
    for slot in adm.slots:
        for p in slot.engine.memory_parts():
            parts[p.name] = parts.get(p.name, 0) + int(p.nbytes)
    local["memory"] = [{"name": k, "bytes": v} for k, v in parts.items()]
    try:
        local["caches"] = st.caches.health() if st.caches is not None else {"enabled": False}
    except Exception as exc:  # noqa: BLE001 (a tier that cannot report now: said so, the rest still drawn)
        local["caches"] = {"enabled": True, "error": type(exc).__name__}
    try:
        local["speculation"] = st.spec.health()
    except Exception as exc:  # noqa: BLE001 (the same for speculation)
        local["speculation"] = {"enabled": False, "reason": type(exc).__name__}
    return local


def describe(exc: BaseException, b: Backend) -> str:
    """Why a backend did not answer, in words (no request text)."""
    import httpx

    if isinstance(exc, httpx.ConnectTimeout):
        return f"backend {b.name} ({b.shown}) accepted no connection within {b.connect_s:g} s"
    if isinstance(exc, httpx.ConnectError):
        return f"backend {b.name} ({b.shown}) is not reachable: {_short(exc) or 'connection refused'}"
    if isinstance(exc, httpx.ReadTimeout):
        return f"backend {b.name} ({b.shown}) sent nothing for {b.read_s:g} s"
    if isinstance(exc, httpx.PoolTimeout):
        return f"backend {b.name} ({b.shown}) had no free connection within {b.connect_s:g} s"
    if isinstance(exc, httpx.TimeoutException):
        return f"backend {b.name} ({b.shown}) timed out"
    if isinstance(exc, httpx.HTTPError):
        return f"backend {b.name} ({b.shown}) failed: {type(exc).__name__}: {_short(exc) or 'connection closed'}"
    return f"backend {b.name} ({b.shown}): {type(exc).__name__}: {_short(exc)}"


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def is_timeout(exc: BaseException) -> bool:
    import httpx

    return isinstance(exc, httpx.TimeoutException)


class HubMiddleware:
    """The ASGI layer in front of ``tandem serve``'s app (or tandem-dash's): dashboard, union, relay, tracking."""

    def __init__(self, app: Any, hub: Hub) -> None:
        self.app = app
        self.hub = hub
        from tandem_core.proxy.dash import Dashboard

        self.dash = Dashboard(hub)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.hub.bind()
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == "/dash" or path.startswith("/dash/"):
            await self.dash(scope, receive, send)
        elif path == "/v1/models" and method == "GET" and self.hub.by_name:
            await self._models(scope, receive, send)
        elif path in ENDPOINTS and method == "POST":
            await self._completion(scope, receive, send, ENDPOINTS[path])
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub = self.hub

        async def rcv() -> dict[str, Any]:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await hub.start()
            elif msg["type"] == "lifespan.shutdown":
                await hub.stop()
            return msg

        await self.app(scope, rcv, send)

    async def _completion(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > MAX_BODY:
                await error_response(send, 413, f"the request body is larger than {MAX_BODY} bytes",
                                     code="body_too_large")
                return
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        # a large body (a long prompt) is parsed off the event loop; without backends only its model and
        # stream flags are wanted (the in-flight list), so one past 1 MiB is not parsed at all
        if len(body) > 1 << 20 and not self.hub.by_name:
            data = None
        elif len(body) > 1 << 18:
            data = await asyncio.to_thread(_json_object, body)
        else:
            data = _json_object(body)
        model = data.get("model") if data is not None else None
        backend = await self.hub.route(model)
        if backend is not None:
            from tandem_core.proxy.relay import relay

            assert data is not None
            await relay(self.hub, backend, scope, receive, send, body, data, endpoint)
            return
        if self.hub.state is None:      # tandem-dash: no local model to take it
            await self._unrouted(send, model, endpoint)
            return
        await self._local(scope, receive, send, body, data, endpoint)

    async def _unrouted(self, send: Send, model: Any, endpoint: str) -> None:
        known = ", ".join(sorted(self.hub.routes())) or "none"
        if model is None:
            status, message = 400, f"model: required (the proxy routes by it); the models here are {known}"
        else:
            status, message = 404, f"model: {str(model)[:200]!r} is served by no backend here; the models are {known}"
        f = self.hub.flight(str(model)[:200] if model is not None else "", "none", endpoint, False)
        self.hub.landed(f)
        await error_response(send, status, message, param="model", code="model_not_found" if model else None)
        self.hub.write_row(UsageRow(
            ts=f.since, request_id=f"refused-{f.id}-{int(f.since * 1000)}", model=f.model, endpoint=endpoint,
            prompt_tokens=0, completion_tokens=0, finish_reason="refused", ttft_s=None, decode_tps=None,
            queued_s=0.0, duration_s=0.0, max_tokens=0, capped_from=None, stream=False, backend="none", cost=0.0,
            status=status))

    async def _local(self, scope: Scope, receive: Receive, send: Send, body: bytes, data: dict[str, Any] | None,
                     endpoint: str) -> None:
        """The app answers (its body replayed unchanged); the request is in flight until its answer ends, and a
        refusal before it ran (400, 404, 429: the app writes no row for those) gets its ledger row here."""
        hub = self.hub
        model = data.get("model") if data is not None else None
        name = model if isinstance(model, str) else (hub.local_model or "")
        f = hub.flight(name[:200], "local", endpoint, bool(data.get("stream")) if data else False)
        replayed = False
        status = 0
        t0 = time.perf_counter()

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def tracked(msg: dict[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif f.first is None and msg.get("body"):
                f.first = time.time()
            await send(msg)

        try:
            await self.app(scope, replay, tracked)
        finally:
            hub.landed(f)
            if status in (400, 404, 413, 422, 429):
                hub.write_row(UsageRow(
                    ts=f.since, request_id=f"refused-{f.id}-{int(f.since * 1000)}", model=name[:200],
                    endpoint=endpoint, prompt_tokens=0, completion_tokens=0, finish_reason="refused",
                    ttft_s=None, decode_tps=None, queued_s=0.0, duration_s=time.perf_counter() - t0,
                    max_tokens=0, capped_from=None, stream=f.stream, backend="local", cost=0.0, status=status))

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models``: the app's own list (when there is a local model) and every backend's."""
        data: list[dict[str, Any]] = []
        await self.hub.ready()
        if self.hub.local_model is not None:
            status, headers, raw = await _capture(self.app, scope, receive)
            if status != 200:
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": raw})
                return
            data = list(json.loads(raw).get("data", []))
        have = {m.get("id") for m in data}
        for model, name in sorted(self.hub.routes().items(), key=lambda kv: (kv[1], kv[0])):
            if model not in have:
                data.append({"id": model, "object": "model", "created": int(self.hub.started), "owned_by": name})
        body = json.dumps({"object": "list", "data": data}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _capture(app: Any, scope: Scope, receive: Receive) -> tuple[int, list[Any], bytes]:
    status = 500
    headers: list[Any] = []
    parts: list[bytes] = []

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status, headers
        if msg["type"] == "http.response.start":
            status, headers = int(msg["status"]), list(msg.get("headers", []))
        elif msg["type"] == "http.response.body":
            parts.append(msg.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(parts)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def count_tokens(hub: Hub, texts: Iterable[str]) -> int:
    """Tokens of text a backend did not count: the local model's tokenizer when there is one, else a quarter of
    the UTF-8 bytes (rounded up). The text is counted and dropped, never kept."""
    text = "".join(texts)
    if not text:
        return 0
    st = hub.state
    if st is not None:
        try:
            return len(st.served.tokenizer.encode(text))
        except Exception:  # noqa: BLE001, S110 (a tokenizer that cannot take this text: the byte estimate)
            pass
    return math.ceil(len(text.encode("utf-8", "replace")) / 4)


def attach_to_app(app: Any, state: Any, options: Any) -> None:
    """``tandem serve``: the hub over its state (its ledger tapped for the live rows) as the app's middleware."""
    backends = getattr(options, "backends", None)
    if backends is not None:
        backends.check_local(state.served.model_id)
    hub = Hub(backends, None, state=state, api_key=options.api_key)
    hub.ledger = LedgerTap(state.ledger, hub)
    if state.ledger is not None:
        hub.rows.extend(state.ledger.last(200))     # the plots start from the ledger's recent history
    state.ledger = hub.ledger
    app.state.hub = hub
    app.add_middleware(HubMiddleware, hub=hub)
