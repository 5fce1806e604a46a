"""The strict config reader for Qwen3.5-architecture checkpoints (Qwen3.8 27B and siblings).

Reads both wrappers transformers writes:

- ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``): the text model
  under ``text_config``; the outer keys name the vision tower and its tokens,
  which the text engine does not read.
- ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``): the keys at the top level.

Every field is READ, IGNORED (training or bookkeeping only) or FIXED (the only
value the engine's arithmetic implements). An unknown field, or a FIXED one with
another value, raises ``ConfigError`` naming it. ``rope_parameters`` is read the
same way with its own lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tandem_core.checkpoint.config import ConfigError, FieldPolicy, read_strict, split_text_config
from tandem_core.checkpoint.config import int_field as _int, token_ids as _ids

__all__ = ["Qwen38Config", "read_config", "TEXT_POLICY", "OUTER_POLICY", "ROPE_POLICY", "LAYER_KINDS"]

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_KINDS = (LINEAR, FULL)

TEXT_POLICY = FieldPolicy(
    read=(
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "layer_types",
        "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "rope_parameters", "rope_theta",
        "partial_rotary_factor", "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id",
        # the multi-token-prediction head's decoder layers (the mtp.* tensors; tandem_qwen38.mtp)
        "mtp_num_hidden_layers",
    ),
    ignored=(
        "architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
        "attention_dropout",
    ),
    fixed={
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "attention_bias": False,
        "attn_output_gate": True,            # q_proj carries a per-head sigmoid gate for the output
        "output_gate_type": ("swish", "silu"),  # the Gated DeltaNet norm's gate: silu(z)
        "mamba_ssm_dtype": "float32",        # the recurrent state is held in fp32
        "mtp_use_dedicated_embeddings": False,  # the MTP head reads the target's embedding
    },
)

OUTER_POLICY = FieldPolicy(
    read=("tie_word_embeddings",),
    ignored=(
        "architectures", "transformers_version", "dtype", "torch_dtype", "vision_config",
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    ),
    fixed={"model_type": "qwen3_5"},
)

ROPE_POLICY = FieldPolicy(
    read=("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"),
    fixed={"rope_type": "default"},
)


@dataclass(frozen=True)
class Qwen38Config:
    """Every size the engine needs. Field names follow the checkpoint's config where it has one."""

    architecture: str                  # the wrapper the checkpoint was written from
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]       # "linear_attention" (Gated DeltaNet) or "full_attention", one a layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]     # text positions are equal in every section: plain rope
    mrope_interleaved: bool
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int | None = None   # as the config says (None: not said; the mtp.* keys decide)

    # -- derived sizes ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def slot(self, layer: int) -> int:
        """The layer's index among layers of its kind (its row in the GDN or the KV buffers)."""
        kind = self.layer_types[layer]
        return sum(1 for t in self.layer_types[:layer] if t == kind)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of the Gated DeltaNet, side by side."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim






def _layer_types(text: Mapping[str, Any], n_layers: int, where: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = _int(text, "full_attention_interval", where, default=4)
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))
    if not isinstance(types, (list, tuple)) or len(types) != n_layers:
        raise ConfigError(f"{where}: field 'layer_types' must list one type for each of the "
                          f"{n_layers} layers")
    for i, t in enumerate(types):
        if t not in LAYER_KINDS:
            raise ConfigError(f"{where}: field 'layer_types'[{i}] = {t!r} is not one of {list(LAYER_KINDS)}")
    return tuple(types)


def read_config(raw: Mapping[str, Any]) -> Qwen38Config:
    """``config.json`` (either wrapper) -> ``Qwen38Config``; ``ConfigError`` names any field it refuses."""
    text_raw, outer_raw = split_text_config(raw)
    if outer_raw:
        outer = read_strict(outer_raw, OUTER_POLICY, "config.json")
        where = "config.json text_config"
    else:
        outer = {}
        where = "config.json"
    text = read_strict(text_raw, TEXT_POLICY, where)

    rope_raw = text.get("rope_parameters") or {}
    if not isinstance(rope_raw, Mapping):
        raise ConfigError(f"{where}: field 'rope_parameters' = {rope_raw!r} is not a mapping")
    rope = read_strict(rope_raw, ROPE_POLICY, f"{where} rope_parameters")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    if "partial_rotary_factor" in rope and "partial_rotary_factor" in text and \
            float(text["partial_rotary_factor"]) != partial:
        raise ConfigError(f"{where}: field 'partial_rotary_factor' = {text['partial_rotary_factor']!r} "
                          f"disagrees with rope_parameters' {partial!r}")

    n_layers = _int(text, "num_hidden_layers", where)
    n_heads = _int(text, "num_attention_heads", where)
    n_kv = _int(text, "num_key_value_heads", where)
    hidden = _int(text, "hidden_size", where)
    head_dim = _int(text, "head_dim", where, default=hidden // n_heads)
    k_heads = _int(text, "linear_num_key_heads", where)
    v_heads = _int(text, "linear_num_value_heads", where)
    if n_heads % n_kv:
        raise ConfigError(f"{where}: field 'num_attention_heads' = {n_heads} is not a multiple of "
                          f"num_key_value_heads = {n_kv}")
    if v_heads % k_heads:
        raise ConfigError(f"{where}: field 'linear_num_value_heads' = {v_heads} is not a multiple of "
                          f"linear_num_key_heads = {k_heads}")
    rotary = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary % 2:
        raise ConfigError(f"{where}: field 'partial_rotary_factor' = {partial!r} gives {rotary} rotary "
                          f"channels of head_dim {head_dim} (needs an even number, at least 2)")

    tie = outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json: field 'tie_word_embeddings' = {tie!r} is not a boolean")
    default_arch = "Qwen3_5ForConditionalGeneration" if outer_raw else "Qwen3_5ForCausalLM"
    archs = raw.get("architectures") or [default_arch]
    section = rope.get("mrope_section", ())
    return Qwen38Config(
        architecture=str(archs[0]),
        vocab_size=_int(text, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(text, "intermediate_size", where),
        num_hidden_layers=n_layers,
        layer_types=_layer_types(text, n_layers, where),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        partial_rotary_factor=partial,
        mrope_section=tuple(int(s) for s in section),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        max_position_embeddings=_int(text, "max_position_embeddings", where, default=32768),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=_int(text, "linear_key_head_dim", where),
        linear_value_head_dim=_int(text, "linear_value_head_dim", where),
        linear_conv_kernel_dim=_int(text, "linear_conv_kernel_dim", where),
        tie_word_embeddings=tie,
        eos_token_ids=_ids(text.get("eos_token_id"), "eos_token_id", where),
        bos_token_id=(_ids(text.get("bos_token_id"), "bos_token_id", where) or (None,))[0],
        pad_token_id=(_ids(text.get("pad_token_id"), "pad_token_id", where) or (None,))[0],
        mtp_num_hidden_layers=None if text.get("mtp_num_hidden_layers") is None else
        _int(text, "mtp_num_hidden_layers", where, minimum=0),
    )
