"""The FastAPI app: ``build_app(served, options)`` puts the server's pieces together.

Where each piece lives:

- ``state.py``: ``ServerOptions`` and ``ServerState``, what the routes share (the engines, their queue
  and side lanes, the caches, speculation, the ledger and metrics) and the bridge from the event loop
  to the engine threads (``launch``, ``side``, ``record``)
- ``routes/info.py``: ``/health``, ``/openapi.json``, ``/v1/models``, ``/metrics``
- ``routes/generation.py``: ``/v1/chat/completions`` and ``/v1/completions``
- ``errors.py``: every error in OpenAI's shape; ``auth.py``: the API key

The app's lifespan restores the spilled sessions at start (before the socket listens)
and, at shutdown (SIGTERM/SIGINT through uvicorn), stops the running generations and
spills every engine's session.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI

from tandem_core.server.auth import BearerAuth
from tandem_core.server.errors import openai_errors
from tandem_core.server.routes import ROUTERS
from tandem_core.server.state import ParallelUnavailable, ServerOptions, ServerState
from tandem_core.serving import Served

__all__ = ["ServerOptions", "ServerState", "build_app", "ParallelUnavailable"]


def build_app(served: Served, options: ServerOptions, state: ServerState | None = None) -> Any:
    """The ASGI app serving ``served`` (a ``state`` built beforehand is used as given)."""
    shared = state or ServerState(served, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(shared.start)
        try:
            yield
        finally:
            await asyncio.to_thread(shared.stop)
            shared.close()

    app = FastAPI(title="TandemLLM", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.tandem = shared
    openai_errors(app)
    if options.api_key:
        app.add_middleware(BearerAuth, key=options.api_key)
    for router in ROUTERS:
        app.include_router(router)
    return app
