"""The plugin's hooks: the ``lfm2_moe`` and ``lfm2`` architectures, LFM2's tool-call format (``lfm2_pythonic``),
the plugin's settings and its registry entries (``tandem_lfm25/registry/models/<id>/model.yaml``). Imports no
torch."""

from __future__ import annotations

from importlib.resources import files
from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.registry import Arch
from tandem_core.settings import Setting

__all__ = ["ARCHES", "SETTINGS_DECLARED", "tandem_architectures", "tandem_model_entries", "tandem_settings",
           "tandem_tool_formats"]


def _arch(name: str, architecture: str) -> Arch:
    return Arch(name=name, architectures=(architecture,), model_types=(name,),
                config="tandem_lfm25.config:read_config", package="tandem-lfm25",
                serve="tandem_lfm25.serving:serve", runs=(("cpu", ("fp32", "bf16")), ("cuda", ("bf16", "fp32"))))


# one family, two checkpoint classes: the mixture of experts and the dense model share every layer but the FFN
ARCHES = (_arch("lfm2_moe", "Lfm2MoeForCausalLM"), _arch("lfm2", "Lfm2ForCausalLM"))

SETTINGS_DECLARED = (
    Setting("LFM25_PREFILL_CHUNK", 0, "tandem_lfm25.serving",
            "tokens per prefill chunk of the LFM2 engine (a long prompt runs through every layer this many "
            "tokens at a time; the result equals one full forward within fp32 rounding); 0: by device, 512 on "
            "the CPU, 8192 on CUDA",
            int, arithmetic=True),
    Setting("LFM25_CUDA_RUNNER", True, "tandem_lfm25.serving",
            "on CUDA with bf16 weights and Triton, serve with LfmCudaRunner (decode and verify as CUDA graphs, the "
            "Triton kernels); off: the reference runner there too",
            bool, arithmetic=True),
)


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    for arch in ARCHES:
        register(arch)


@hookimpl
def tandem_tool_formats(register: Callable[[str, str], None]) -> None:
    register("lfm2_pythonic", "tandem_lfm25.toolformat:Lfm2Pythonic")


@hookimpl
def tandem_model_entries(register: Callable[[str], None]) -> None:
    register(str(files("tandem_lfm25").joinpath("registry")))


tandem_settings = settings_hook(*SETTINGS_DECLARED)
