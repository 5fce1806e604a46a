"""The plugin's hooks: the ``qwen4_exp`` architecture, its registry entry, its settings. Imports no torch."""

from __future__ import annotations

from importlib.resources import files
from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.registry import Arch
from tandem_core.settings import Setting

__all__ = ["ARCH", "SETTINGS_DECLARED", "tandem_architectures", "tandem_model_entries", "tandem_settings"]

ARCH = Arch(
    name="qwen4_exp",
    architectures=("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM"),
    model_types=("qwen4_exp", "qwen4_exp_text"),
    config="tandem_flashnext.config:read_config",
    package="tandem-flashnext",
    serve="tandem_flashnext.serving:serve",
    # the plain-torch reference runner anywhere; on CUDA with bf16 weights and Triton, FlashNextCudaRunner
    runs=(("cpu", ("fp32", "bf16")), ("cuda", ("bf16", "fp32"))),
)

SETTINGS_DECLARED = (
    Setting("FLASHNEXT_PREFILL_CHUNK", 512, "tandem_flashnext.serving",
            "tokens per prefill chunk of the qwen4_exp engine (a long prompt runs through every layer this "
            "many tokens at a time; the result equals one full forward within fp32 rounding)",
            int, arithmetic=True),
    Setting("FLASHNEXT_CUDA_RUNNER", True, "tandem_flashnext.serving",
            "on CUDA with bf16 weights and Triton, serve qwen4_exp with FlashNextCudaRunner (decode and verify as "
            "CUDA graphs, the Triton kernels, the PLE rows gathered on the host; on by default since its GPU tests "
            "passed on the H200); off: the reference runner there too",
            bool, arithmetic=True),
)


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    register(ARCH)


@hookimpl
def tandem_model_entries(register: Callable[[str], None]) -> None:
    """The plugin's registry folder (``shipped/models/flashnext/model.yaml``)."""
    register(str(files("tandem_flashnext").joinpath("shipped")))


tandem_settings = settings_hook(*SETTINGS_DECLARED)
