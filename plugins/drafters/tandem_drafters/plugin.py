"""The plugin's hooks: the lookup, block and MTP drafters, ``tandem corpus`` and the plugin's settings.

Imports nothing heavy: the drafter and the command are named by import path.
"""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.settings import Setting

__all__ = ["DRAFTERS", "SETTINGS_DECLARED", "tandem_drafters", "tandem_cli_commands", "tandem_settings"]

DRAFTERS = {
    "lookup": "tandem_drafters.lookup:LookupDrafter",
    "block": "tandem_drafters.block:BlockDrafter",
    "mtp": "tandem_drafters.mtp:MTPDrafter",
}

SETTINGS_DECLARED = (
    Setting("LOOKUP_CORPUS", "", "tandem_drafters.lookup",
            "a lookup corpus store (built by `tandem corpus build`) the lookup drafter also reads; "
            "empty: none. Refused at load when built with another tokenizer than the model's"),
    Setting("BLOCK_DRAFTER", "", "tandem_drafters.block",
            "a block drafter folder (config.json + model.safetensors, the DFlash layout) for --spec block; empty: "
            "the one the model's registry entry ships (tandem pull). Refused at load when built for another target"),
)


@hookimpl
def tandem_drafters(register: Callable[[str, str], None]) -> None:
    for name, path in DRAFTERS.items():
        register(name, path)


@hookimpl
def tandem_cli_commands(register: Callable[..., None]) -> None:
    register("corpus", "build (or inspect) a lookup drafter corpus store from text files",
             "tandem_drafters.corpus_cli:configure_corpus", "tandem_drafters.corpus_cli:run_corpus")
    register("train-drafter", "train a block drafter for a model by self-distillation (resumable)",
             "tandem_drafters.train_cli:configure_train", "tandem_drafters.train_cli:run_train")
    register("fetch-drafter", "download a published DFlash block drafter (config.json + model.safetensors)",
             "tandem_drafters.train_cli:configure_fetch", "tandem_drafters.train_cli:run_fetch")


tandem_settings = settings_hook(*SETTINGS_DECLARED)
