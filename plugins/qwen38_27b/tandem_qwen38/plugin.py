"""The plugin's hooks: the ``qwen3_5`` architecture, Qwen's ``qwen_xml`` tool-call format and the plugin's
settings. Imports no torch."""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.registry import Arch
from tandem_core.settings import Setting

__all__ = ["ARCH", "SETTINGS_DECLARED", "tandem_architectures", "tandem_settings", "tandem_tool_formats"]

ARCH = Arch(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    model_types=("qwen3_5", "qwen3_5_text"),
    config="tandem_qwen38.config:read_config",
    package="tandem-qwen38",
    serve="tandem_qwen38.serving:serve",
    runs=(("cpu", ("fp32", "bf16")), ("cuda", ("bf16", "fp32"))),
)

SETTINGS_DECLARED = (
    Setting("QWEN38_PREFILL_CHUNK", 0, "tandem_qwen38.serving",
            "tokens per prefill chunk of the qwen3_5 engine (a long prompt runs through every layer this "
            "many tokens at a time; the result equals one full forward within fp32 rounding); 0: by device, "
            "512 on the CPU, 8192 on CUDA",
            int, arithmetic=True),
)


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    register(ARCH)


@hookimpl
def tandem_tool_formats(register: Callable[[str, str], None]) -> None:
    register("qwen_xml", "tandem_qwen38.toolformat:QwenXml")


tandem_settings = settings_hook(*SETTINGS_DECLARED)
