"""The dashboard: ``/dash`` (the page), ``/dash/static/*`` (its script and style, shipped in the package),
``/dash/api/state``, ``/dash/api/ledger``, ``/dash/api/setup`` and ``/dash/events`` (server-sent events).

The page and its static files hold no data and need no key; every ``/dash/api/*`` and ``/dash/events`` need
``Authorization: Bearer KEY`` when the server has one, as ``/v1`` does (the page asks for the key once and sends
it with each call). Nothing here carries the text of a prompt or an answer: the rows and the state are counts,
times, sizes, model and backend names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from tandem_core.proxy.hub import Hub, Receive, Scope, Send, error_response

__all__ = ["STATIC", "Dashboard", "setup_tiles"]

STATIC = Path(str(files("tandem_core.proxy").joinpath("static")))
_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript; charset=utf-8",
          ".css": b"text/css; charset=utf-8", ".svg": b"image/svg+xml"}
_SECURITY = [(b"cache-control", b"no-cache"), (b"x-content-type-options", b"nosniff"),
             (b"content-security-policy",
              b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'")]


def _gib(n: float) -> float:
    return round(n / (1 << 30), 3)


def setup_tiles() -> list[dict[str, Any]]:
    """One tile per registry entry (``models/<id>/model.yaml``): profiles, measured table, memory, commands."""
    from tandem_core import catalog

    out = []
    for e in sorted(catalog.entries().values(), key=lambda e: (not e.data.get("default"), e.id)):
        d = e.data
        profiles = [dict(p) for p in d.get("profiles", [])]
        rec = next((p for p in profiles if p.get("recommended")), profiles[0] if profiles else {})
        mem = dict(d.get("memory", {}))
        kv = int(mem.get("kv_bytes_per_token", 0))
        state = int(mem.get("recurrent_state_bytes", 0))
        ctx = int(d.get("context", 0))
        contexts = sorted({c for c in (4096, 32768, ctx) if 0 < c <= ctx}) if ctx else []
        weights = float(rec.get("weights_gib", 0.0))
        memory = [{"context": c, "weights_gib": weights, "kv_gib": _gib(kv * c), "state_gib": _gib(state),
                   "total_gib": round(weights + _gib(kv * c) + _gib(state), 3)} for c in contexts]
        serve = f"tandem serve --model {e.id}"
        if rec.get("device") == "cuda":
            serve += " --device cuda"
        out.append({
            "id": e.id, "name": d.get("name", e.id), "family": d.get("family"), "plugin": d.get("plugin"),
            "default": bool(d.get("default")), "description": d.get("description", ""),
            "params_b": d.get("params"), "context": ctx, "methods": list(d.get("methods", [])),
            "parallel": dict(d.get("parallel", {})), "profiles": profiles, "measured": list(d.get("measured", [])),
            "memory": {"kv_bytes_per_token": kv, "kv_dtype": mem.get("kv_dtype"), "recurrent_state_bytes": state,
                       "table": memory, "profile": rec.get("name")},
            "commands": {"pull": f"tandem pull {e.id}", "serve": serve}})
    return out


class Dashboard:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._tiles: list[dict[str, Any]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if scope.get("method") not in ("GET", "HEAD"):
            await error_response(send, 405, f"{scope.get('method')} is not allowed on {path}",
                                 code="method_not_allowed", headers=[(b"allow", b"GET")])
            return
        if path in ("/dash", "/dash/"):
            await self._file(send, STATIC / "index.html")
            return
        if path.startswith("/dash/static/"):
            name = path[len("/dash/static/"):]
            target = STATIC / name
            if "/" in name or name.startswith(".") or not target.is_file():
                await error_response(send, 404, f"no route GET {path}", code="not_found")
                return
            await self._file(send, target)
            return
        if not self._authorized(scope):
            await error_response(send, 401, "a valid API key is required: Authorization: Bearer <key>",
                                 kind="authentication_error", code="invalid_api_key")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if path == "/dash/api/state":
            await self._json(send, self.hub.snapshot())
        elif path == "/dash/api/ledger":
            by = (query.get("by") or ["model"])[0]
            if by not in ("model", "day"):
                await error_response(send, 400, f"by: {by!r} is not model or day", param="by")
                return
            await self._json(send, await asyncio.to_thread(self.ledger, by, _int(query.get("n"), 200)))
        elif path == "/dash/api/setup":
            if self._tiles is None:
                self._tiles = await asyncio.to_thread(setup_tiles)
            await self._json(send, {"models": self._tiles})
        elif path == "/dash/events":
            await self._events(scope, receive, send)
        else:
            await error_response(send, 404, f"no route GET {path}", code="not_found")

    def _authorized(self, scope: Scope) -> bool:
        key = self.hub.api_key
        if not key:
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return given.startswith(b"Bearer ") and hmac.compare_digest(given[7:], key.encode())

    def ledger(self, by: str, n: int) -> dict[str, Any]:
        led = self.hub.ledger.ledger
        if led is None:
            rows = list(self.hub.rows)[-n:]
            return {"rows": [asdict(r) for r in rows], "groups": [], "totals": None}
        total = led.summary(None)
        return {"rows": [asdict(r) for r in led.last(n)], "by": by, "groups": [asdict(s) for s in led.summary(by)],
                "totals": asdict(total[0]) if total else None}

    async def _file(self, send: Send, path: Path) -> None:
        body = path.read_bytes()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", _TYPES.get(path.suffix, b"application/octet-stream")),
                                (b"content-length", str(len(body)).encode()), *_SECURITY]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Send, data: Any) -> None:
        body = json.dumps(data, default=str).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": body})

    async def _events(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``hello`` (the state and the recent rows), then ``state`` each second, ``start``/``end`` as requests
        come and go, ``row`` as each ledger row is written; a comment every 15 s keeps idle proxies open."""
        hub = self.hub
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        hub.subscribers.add(queue)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        try:
            hello = {"state": hub.snapshot(), "rows": [asdict(r) for r in list(hub.rows)[-200:]]}
            await send({"type": "http.response.body", "body": _event("hello", hello), "more_body": True})
            while not watcher.done():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, watcher}, timeout=15.0, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if not watcher.done():
                        await send({"type": "http.response.body", "body": b": idle\n\n", "more_body": True})
                    continue
                kind, data = getter.result()
                await send({"type": "http.response.body", "body": _event(kind, data), "more_body": True})
        finally:
            hub.subscribers.discard(queue)
            watcher.cancel()
        try:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001, S110 (the client is gone already)
            pass


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n".encode()


def _int(values: list[str] | None, default: int) -> int:
    try:
        return max(1, min(5000, int((values or [str(default)])[0])))
    except ValueError:
        return default
