"""The plugin's hooks: the ``lfm2_moe`` and ``lfm2`` architectures. Imports no torch."""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch

__all__ = ["ARCHES", "tandem_architectures"]


def _arch(name: str, architecture: str) -> Arch:
    return Arch(name=name, architectures=(architecture,), model_types=(name,),
                config="tandem_lfm25.config:read_config", engine="tandem_lfm25.model:Lfm2Runner",
                package="tandem-lfm25", serve="tandem_lfm25.serving:serve")


# one family, two checkpoint classes: the mixture of experts and the dense model share every layer but the FFN
ARCHES = (_arch("lfm2_moe", "Lfm2MoeForCausalLM"), _arch("lfm2", "Lfm2ForCausalLM"))


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    for arch in ARCHES:
        register(arch)
