"""The extension surface: every hook TandemLLM calls, each taking a ``register`` callback.

A plugin implements any of these with ``@tandem_core.hookimpl``. It hands over
factories (named by ``"module:Class"`` import paths where a class is heavy) and
never receives the engine. ``docs/plugins.md`` documents each hook; a test checks
that every hook here appears there.
"""

import pluggy

hookspec = pluggy.HookspecMarker("tandem")


@hookspec
def tandem_architectures(register):
    """Register model architectures: ``register(Arch(...))``."""


@hookspec
def tandem_weight_formats(register):
    """Register weight formats: ``register(name, factory)``, ``factory(tensor, **kw) -> Linear``."""


@hookspec
def tandem_drafters(register):
    """Register drafters: ``register(name, "module:Class")``."""


@hookspec
def tandem_tool_formats(register):
    """Register tool-call formats: ``register(name, "module:Class")``, a ``server.toolformat.ToolFormat``."""


@hookspec
def tandem_cache_tiers(register):
    """Register cache tiers: ``register(name, "module:Class")``."""


@hookspec
def tandem_cli_commands(register):
    """Register ``tandem`` subcommands: ``register(name, help, configure, run)``."""


@hookspec
def tandem_settings(register):
    """Declare ``TANDEM_*`` switches: ``register(Setting(...))``."""


@hookspec
def tandem_model_entries(register):
    """Register folders holding ``models/<id>/model.yaml`` entries: ``register(path)``."""
