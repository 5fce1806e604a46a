"""The API key: plain ASGI middleware in front of every route."""

from __future__ import annotations

import hmac
from typing import Any

from tandem_core.server.errors import error

__all__ = ["BearerAuth"]


class BearerAuth:
    """Plain ASGI middleware: ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <key>``; ``/health`` does not."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not (given.startswith(b"Bearer ") and hmac.compare_digest(given[7:], self.key)):
                response = error(401, "a valid API key is required: Authorization: Bearer <key>",
                                 kind="authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

