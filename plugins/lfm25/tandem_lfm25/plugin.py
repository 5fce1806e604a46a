"""The plugin's hooks: the ``lfm2_moe`` and ``lfm2`` architectures. Imports no torch."""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch

__all__ = ["ARCHES", "tandem_architectures"]

# one family, two checkpoint classes: the mixture of experts and the dense model share every layer but the FFN
ARCHES = (
    Arch(
        name="lfm2_moe",
        architectures=("Lfm2MoeForCausalLM",),
        model_types=("lfm2_moe",),
        config="tandem_lfm25.config:read_config",
        engine="tandem_lfm25.model:Lfm2Runner",
        package="tandem-lfm25",
        serve="tandem_lfm25.serving:serve",
    ),
    Arch(
        name="lfm2",
        architectures=("Lfm2ForCausalLM",),
        model_types=("lfm2",),
        config="tandem_lfm25.config:read_config",
        engine="tandem_lfm25.model:Lfm2Runner",
        package="tandem-lfm25",
        serve="tandem_lfm25.serving:serve",
    ),
)


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    for arch in ARCHES:
        register(arch)
