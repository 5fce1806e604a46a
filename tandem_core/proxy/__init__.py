"""The proxy and the dashboard: requests routed by their ``model`` to other OpenAI-compatible backends, a costed
ledger row for every request, and ``/dash``.

``attach(app, state, options)`` adds both to ``tandem serve``'s app (``tandem_core.server.app``);
``tandem-dash`` (``tandem_core.proxy.dash_cli``) runs them with no model loaded.
"""

from __future__ import annotations

from tandem_core.proxy.config import Backend, Backends, BackendsError, load_backends

__all__ = ["Backend", "Backends", "BackendsError", "attach", "load_backends"]


def attach(app: object, state: object, options: object) -> None:
    """Mount the dashboard and, with ``options.backends``, the proxy onto ``tandem serve``'s FastAPI app."""
    from tandem_core.proxy.hub import attach_to_app

    attach_to_app(app, state, options)
