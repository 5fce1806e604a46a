"""The plugin's hooks: the lookup and MTP drafters, the ``tandem corpus`` command and the plugin's settings.

Imports nothing heavy: the drafter and the command are named by import path.
"""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.settings import Setting

__all__ = ["DRAFTERS", "SETTINGS_DECLARED", "tandem_drafters", "tandem_cli_commands", "tandem_settings"]

DRAFTERS = {
    "lookup": "tandem_drafters.lookup:LookupDrafter",
    "mtp": "tandem_drafters.mtp:MTPDrafter",
}

SETTINGS_DECLARED = (
    Setting("LOOKUP_CORPUS", "", "tandem_drafters.lookup",
            "a lookup corpus store (built by `tandem corpus build`) the lookup drafter also reads; "
            "empty: none. Refused at load when built with another tokenizer than the model's"),
)


@hookimpl
def tandem_drafters(register: Callable[[str, str], None]) -> None:
    for name, path in DRAFTERS.items():
        register(name, path)


@hookimpl
def tandem_cli_commands(register: Callable[..., None]) -> None:
    register("corpus", "build (or inspect) a lookup drafter corpus store from text files",
             "tandem_drafters.corpus_cli:configure_corpus", "tandem_drafters.corpus_cli:run_corpus")


tandem_settings = settings_hook(*SETTINGS_DECLARED)
