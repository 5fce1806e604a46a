"""tandem-llama's hook implementations. Imports nothing heavy: classes are named by import path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.registry import Arch
from tandem_core.settings import Setting

__all__ = ["ARCH", "tandem_architectures", "tandem_settings", "tandem_weight_formats"]

ARCH = Arch(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config="tandem_llama.config:read_config",
    package="tandem-llama",
    serve="tandem_llama.serving:serve",
    runs=(("cpu", ("fp32",)), ("cuda", ("bf16", "fp32"))),
)

# format name -> class, by import path (the factory imports torch only when a weight is made)
_FORMATS = {
    "ggml.f32": "F32Weight",
    "ggml.f16": "F16Weight",
    "ggml.bf16": "BF16Weight",
    "ggml.q8_0": "Q8_0Weight",
    "ggml.q4_1": "Q4_1Weight",
}


def _lazy_format(cls_name: str) -> Callable[..., Any]:
    def factory(raw: Any, *, dense: bool = True) -> Any:
        from tandem_llama import formats

        return getattr(formats, cls_name)(raw, dense=dense)

    factory.__doc__ = f"raw GGML data -> tandem_llama.formats.{cls_name} (dense: keep an fp32 copy)"
    return factory


@hookimpl
def tandem_architectures(register: Callable[[Arch], None]) -> None:
    register(ARCH)


@hookimpl
def tandem_weight_formats(register: Callable[..., None]) -> None:
    for name, cls_name in _FORMATS.items():
        register(name, _lazy_format(cls_name))


tandem_settings = settings_hook(
    Setting(
        "LLAMA_DENSE",
        True,
        "tandem_llama.serving",
        "keep a dense fp32 copy of every quantised Llama weight (fast on a CPU); off: dequantise per "
        "matmul from the quantised rows (less memory)",
        bool,
        arithmetic=True,
    ),
    Setting(
        "LLAMA_CUDA_RUNNER",
        False,
        "tandem_llama.serving",
        "on CUDA, serve with LlamaCudaRunner (decode and verify as CUDA graphs); off: the eager runner. Off by "
        "default until the runner has passed its conformance suite and self-check on a GPU",
        bool,
        arithmetic=True,
    ),
    Setting(
        "LLAMA_PREFILL_CHUNK",
        512,
        "tandem_llama.serving",
        "tokens per prefill chunk of the Llama engine",
        int,
        arithmetic=True,
    ),
)
