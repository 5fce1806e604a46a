"""The core's ``tandem`` subcommands, registered through the same hook as a plugin's.

Each command is ``(help, configure, run)``; ``configure`` and ``run`` may be
``"module:function"`` paths so that ``tandem --help`` imports nothing heavy.
"""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl

COMMANDS = {
    "plugins": ("list loaded plugins and what each registered", "tandem_core.cli.info"),
    "models": ("list the registry's models and which are present locally", "tandem_core.cli.info"),
    "registry": ("check the model registry (--check) or print its schema (--schema)", "tandem_core.cli.info"),
    "settings": ("list every TANDEM_* switch with its default, owner and meaning", "tandem_core.cli.info"),
    "run": ("print a greedy continuation of a prompt", "tandem_core.cli.run_cmd"),
    "serve": ("serve a model behind the OpenAI chat completions API", "tandem_core.cli.serve_cmd"),
    "pull": ("fetch a registry model's weights", "tandem_core.cli.pull_cmd"),
    "ledger": ("print the last rows of the usage ledger", "tandem_core.cli.ledger_cmd"),
}


@hookimpl
def tandem_cli_commands(register: Callable[..., None]) -> None:
    for name, (help, module) in COMMANDS.items():
        fn = name.replace("-", "_")
        register(name, help, f"{module}:configure_{fn}", f"{module}:run_{fn}")
