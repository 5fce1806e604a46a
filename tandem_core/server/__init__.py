"""The OpenAI-compatible server: app, field policy, chat template, admission, stream, ledger, metrics.

``build_app(served, options)`` (in ``tandem_core.server.app``) is the entry point;
``tandem serve`` builds the options from its command line.
"""

__all__: list[str] = []
