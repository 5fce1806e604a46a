"""The server's routes, one module per concern, each an ``APIRouter`` that ``build_app`` includes.

- ``info``: ``/health``, ``/openapi.json``, ``/v1/models``, ``/metrics``
- ``generation``: ``/v1/chat/completions`` and ``/v1/completions`` (prepare, admit, run, answer)

A route reads the server's shared state from ``request.app.state.tandem`` (a ``ServerState``).
"""

from tandem_core.server.routes import generation, info

ROUTERS = (info.router, generation.router)

__all__ = ["ROUTERS", "generation", "info"]
