"""``tandem-dash``: the proxy and the dashboard with no model loaded.

``tandem-dash --backends FILE [--host 127.0.0.1] [--port 8100] [--api-key KEY] [--ledger PATH]`` relays every
request by its ``model`` to the backend that serves it, writes a ledger row for each, and serves ``/dash``.
A request for a model no backend serves is a 404 naming the models there are. A bad backends file is one line
naming the file, the line and the key, exit 2; a taken port one line, exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem_core.proxy.hub import ENDPOINTS, Hub, HubMiddleware, Receive, Scope, Send, error_response

__all__ = ["build_dash_app", "main", "parser"]


class _Fallback:
    """What no backend takes: ``/health``, an unknown model's 404, the OpenAI-shaped 404/405 of other paths."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == "/health" and method == "GET":
            snap = self.hub.snapshot()
            body = json.dumps({"status": "ok", "model": None, "backends": snap["backends"],
                               "in_flight": len(snap["flights"]), "started": self.hub.started}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if path == "/v1/models" and method == "GET":   # no backends at all cannot happen (the file needs one)
            await error_response(send, 404, "no backend lists a model", code="not_found")
            return
        if path in ENDPOINTS and method != "POST":
            await error_response(send, 405, f"{method} is not allowed on {path}", code="method_not_allowed",
                                 headers=[(b"allow", b"POST")])
            return
        await error_response(send, 404, f"no route {method} {path}", code="not_found")


class _Bearer:
    """``/v1/*`` needs ``Authorization: Bearer KEY`` when a key is set (``/health`` and ``/dash`` decide alone)."""

    def __init__(self, app: Any, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import hmac

        if self.key and scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not (given.startswith(b"Bearer ") and hmac.compare_digest(given[7:], self.key)):
                await error_response(send, 401, "a valid API key is required: Authorization: Bearer <key>",
                                     kind="authentication_error", code="invalid_api_key")
                return
        await self.app(scope, receive, send)


def build_dash_app(hub: Hub) -> Any:
    return _Bearer(HubMiddleware(_Fallback(hub), hub), hub.api_key)


def parser() -> argparse.ArgumentParser:
    from tandem_core.cli.main import _Parser

    p = _Parser(prog="tandem-dash", description="TandemLLM's proxy and dashboard, with no model loaded: requests "
                                                "are relayed by their model to the backends of --backends")
    p.add_argument("--backends", required=True, metavar="FILE", help="the backends file (YAML; docs/proxy.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and the dashboard's data")
    p.add_argument("--ledger", help="the usage ledger's SQLite file (default: $TANDEM_HOME/ledger.sqlite)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from tandem_core.cli import LoadFailed
    from tandem_core.cli.serve_cmd import _bind, _logging
    from tandem_core.proxy.config import BackendsError, load_backends
    from tandem_core.server.ledger import Ledger, default_path

    _logging()
    try:
        backends = load_backends(args.backends)
    except BackendsError as exc:
        print(f"tandem-dash: --backends {exc}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except LoadFailed as exc:
        print(f"tandem-dash: {exc}", file=sys.stderr)
        return 1
    try:
        ledger = Ledger(Path(args.ledger).expanduser() if args.ledger else default_path())
    except Exception as exc:  # noqa: BLE001 (a ledger that cannot be opened: one line)
        sock.close()
        print(f"tandem-dash: the ledger cannot be opened: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    hub = Hub(backends, ledger, api_key=args.api_key)
    hub.rows.extend(ledger.last(200))       # the plots start from the ledger's recent history
    host = f"[{args.host}]" if ":" in args.host else args.host
    ready = (f"tandem-dash: relaying {len(backends.backends)} backend(s) at http://{host}:{args.port}/v1, "
             f"dashboard at http://{host}:{args.port}/dash")
    t0 = time.perf_counter()

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(f"{ready} (ready in {time.perf_counter() - t0:.1f}s)", flush=True)

    try:
        config = uvicorn.Config(build_dash_app(hub), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        server = _Server(config)
        server.run(sockets=[sock])
        return 0 if server.started else 1
    finally:
        sock.close()
        ledger.close()


if __name__ == "__main__":
    sys.exit(main())
