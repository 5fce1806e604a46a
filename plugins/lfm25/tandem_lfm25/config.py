"""The strict config reader for LFM2-family checkpoints: ``lfm2_moe`` (LFM2.5-24B-A2B, LFM2-8B-A1B) and ``lfm2``.

Both are text-only (keys at the top level). Every field is READ, IGNORED (training
or bookkeeping only) or FIXED (the only value the engine's arithmetic implements);
an unknown field, or a FIXED one with another value, raises ``ConfigError`` naming
it. ``rope_parameters`` is read the same way with its own lists.

What the reference (transformers 5.24.0 ``lfm2_moe`` / ``lfm2``) derives from the
config, and this reader derives the same way:

- ``tie_embedding`` (the name LiquidAI's first configs use) overrides
  ``tie_word_embeddings`` when present.
- ``lfm2``: ``block_ff_dim`` overrides ``intermediate_size``; with
  ``block_auto_adjust_ff_dim`` the MLP is ``int(2 * I / 3)``, times
  ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``.
  Without ``layer_types``, ``full_attn_idxs`` names the attention layers (all of
  them when absent too).
- ``lfm2_moe``: the first ``num_dense_layers`` layers have a dense MLP of
  ``intermediate_size``, the rest a mixture of ``num_experts`` experts of
  ``moe_intermediate_size``; ``layer_types`` is required (the reference indexes it).
- ``head_dim``: the field when present, else ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tandem_core.checkpoint.config import ConfigError, FieldPolicy, read_strict
from tandem_core.checkpoint.config import int_field as _int, float_field as _float, bool_field as _bool, token_ids as _ids

__all__ = ["Lfm2Config", "read_config", "MOE_POLICY", "DENSE_POLICY", "ROPE_POLICY", "CONV", "ATTENTION",
           "LAYER_KINDS", "MODEL_TYPES"]

CONV = "conv"
ATTENTION = "full_attention"
LAYER_KINDS = (CONV, ATTENTION)
MODEL_TYPES = ("lfm2_moe", "lfm2")

_COMMON_READ = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "norm_eps", "max_position_embeddings", "layer_types", "conv_L_cache",
    "rope_parameters", "rope_theta", "tie_word_embeddings", "tie_embedding", "eos_token_id", "bos_token_id",
    "pad_token_id",
)
_COMMON_IGNORED = ("architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range",
                   "use_cache")

MOE_POLICY = FieldPolicy(
    read=_COMMON_READ + (
        "moe_intermediate_size", "num_dense_layers", "num_experts", "num_experts_per_tok", "use_expert_bias",
        "routed_scaling_factor", "norm_topk_prob",
    ),
    ignored=_COMMON_IGNORED + ("output_router_logits",),      # the router's logits as a training output
    fixed={"model_type": "lfm2_moe", "conv_bias": False},
)

DENSE_POLICY = FieldPolicy(
    read=_COMMON_READ + (
        "block_ff_dim", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of",
        "full_attn_idxs",
        # duplicates of other fields in LiquidAI's first configs: read to check they agree
        "block_dim", "conv_dim", "conv_dim_out", "num_heads",
    ),
    ignored=_COMMON_IGNORED + (
        # initialisation only
        "block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init", "conv_use_xavier_init",
        # not read by the reference, whose norms all take norm_eps
        "block_norm_eps",
    ),
    fixed={"model_type": "lfm2", "conv_bias": False, "block_use_swiglu": True, "use_pos_enc": True},
)

ROPE_POLICY = FieldPolicy(read=("rope_theta",), fixed={"rope_type": "default"})


@dataclass(frozen=True)
class Lfm2Config:
    """Every size the engine needs. Field names follow the checkpoint's config where it has one."""

    architecture: str                  # the class the checkpoint was written from
    model_type: str                    # "lfm2_moe" or "lfm2"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]       # "conv" or "full_attention", one a layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    conv_L_cache: int                  # the short conv's taps (its state keeps the last conv_L_cache - 1 inputs)
    tie_word_embeddings: bool
    intermediate_size: int             # the dense MLP's width, as the reference computes it
    num_dense_layers: int              # layers 0 .. num_dense_layers - 1 have the dense MLP
    num_experts: int = 0               # 0: no mixture of experts (lfm2)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    use_expert_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    # -- derived sizes ------------------------------------------------------------------
    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CONV)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    def is_conv(self, layer: int) -> bool:
        return self.layer_types[layer] == CONV

    def is_moe(self, layer: int) -> bool:
        """The layer's feed-forward is the mixture of experts."""
        return self.num_experts > 0 and layer >= self.num_dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    def slot(self, layer: int) -> int:
        """The layer's index among layers of its kind (its row in the conv tails or the K/V buffers)."""
        kind = self.layer_types[layer]
        return sum(1 for t in self.layer_types[:layer] if t == kind)

    @property
    def conv_state_width(self) -> int:
        """Conv inputs a layer's state keeps: the last ``conv_L_cache - 1`` (all its next row reads)."""
        return self.conv_L_cache - 1










def _layer_types(raw: Mapping[str, Any], n_layers: int, where: str, dense: bool) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        if not dense:
            raise ConfigError(f"{where}: field 'layer_types' is required (one of {list(LAYER_KINDS)} a layer)")
        idxs = raw.get("full_attn_idxs")
        if idxs is None:
            return (ATTENTION,) * n_layers
        if not isinstance(idxs, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in idxs):
            raise ConfigError(f"{where}: field 'full_attn_idxs' = {idxs!r} is not a list of layer indices "
                              f"below num_hidden_layers = {n_layers}")
        return tuple(ATTENTION if i in idxs else CONV for i in range(n_layers))
    if not isinstance(types, (list, tuple)) or len(types) != n_layers:
        raise ConfigError(f"{where}: field 'layer_types' must list one type for each of the "
                          f"{n_layers} layers")
    for i, t in enumerate(types):
        if t not in LAYER_KINDS:
            raise ConfigError(f"{where}: field 'layer_types'[{i}] = {t!r} is not one of {list(LAYER_KINDS)}")
    return tuple(types)


def _dense_mlp_width(raw: Mapping[str, Any], where: str) -> int:
    """The dense LFM2 MLP's width as the reference computes it from the config."""
    width = _int(raw, "block_ff_dim" if "block_ff_dim" in raw else "intermediate_size", where, default=12288)
    if _bool(raw, "block_auto_adjust_ff_dim", where, True):
        # the reference's config refuses a null multiplier, so the rounding always applies
        multiplier = _float(raw, "block_ffn_dim_multiplier", where, 1.0)
        multiple = _int(raw, "block_multiple_of", where, default=256)
        width = int(multiplier * int(2 * width / 3))
        width = multiple * ((width + multiple - 1) // multiple)
    if width <= 0:
        raise ConfigError(f"{where}: the dense MLP's width comes out at {width} (block_ff_dim / "
                          f"intermediate_size and the block_* fields)")
    return width


def _agrees(raw: Mapping[str, Any], key: str, want: int, other: str, where: str) -> None:
    if key in raw and raw[key] != want:
        raise ConfigError(f"{where}: field {key!r} = {raw[key]!r} disagrees with {other} = {want}")


def read_config(raw: Mapping[str, Any]) -> Lfm2Config:
    """``config.json`` -> ``Lfm2Config``; ``ConfigError`` names any field it refuses."""
    where = "config.json"
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: field 'model_type' = {model_type!r} is not one of {list(MODEL_TYPES)}")
    dense = model_type == "lfm2"
    text = read_strict(raw, DENSE_POLICY if dense else MOE_POLICY, where)

    rope_raw = text.get("rope_parameters") or {}
    if not isinstance(rope_raw, Mapping):
        raise ConfigError(f"{where}: field 'rope_parameters' = {rope_raw!r} is not a mapping")
    rope = read_strict(rope_raw, ROPE_POLICY, f"{where} rope_parameters")
    theta = _float(rope, "rope_theta", f"{where} rope_parameters", _float(text, "rope_theta", where, 1e6))

    n_layers = _int(text, "num_hidden_layers", where)
    n_heads = _int(text, "num_attention_heads", where)
    n_kv = _int(text, "num_key_value_heads", where)
    hidden = _int(text, "hidden_size", where)
    if n_heads % n_kv:
        raise ConfigError(f"{where}: field 'num_attention_heads' = {n_heads} is not a multiple of "
                          f"num_key_value_heads = {n_kv}")
    head_dim = _int(text, "head_dim", where, default=hidden // n_heads)
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim {head_dim} is odd (rotary embedding needs an even head_dim)")
    conv_taps = _int(text, "conv_L_cache", where, default=3)
    if conv_taps < 2:
        raise ConfigError(f"{where}: field 'conv_L_cache' = {conv_taps} keeps no conv state (the engine "
                          f"implements 2 taps or more)")
    tie = _bool(text, "tie_embedding" if "tie_embedding" in text else "tie_word_embeddings", where, True)

    if dense:
        for key in ("block_dim", "conv_dim", "conv_dim_out"):
            _agrees(text, key, hidden, "hidden_size", where)
        _agrees(text, "num_heads", n_heads, "num_attention_heads", where)
        moe: dict[str, Any] = {}
        width, n_dense = _dense_mlp_width(text, where), n_layers
    else:
        width = _int(text, "intermediate_size", where)
        n_dense = _int(text, "num_dense_layers", where, default=2, minimum=0)
        experts = _int(text, "num_experts", where, default=32)
        top_k = _int(text, "num_experts_per_tok", where, default=4)
        if n_dense > n_layers:
            raise ConfigError(f"{where}: field 'num_dense_layers' = {n_dense} exceeds num_hidden_layers = "
                              f"{n_layers}")
        if top_k > experts:
            raise ConfigError(f"{where}: field 'num_experts_per_tok' = {top_k} exceeds num_experts = {experts}")
        moe = dict(
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=_int(text, "moe_intermediate_size", where, default=1792),
            use_expert_bias=_bool(text, "use_expert_bias", where, True),
            norm_topk_prob=_bool(text, "norm_topk_prob", where, True),
            routed_scaling_factor=_float(text, "routed_scaling_factor", where, 1.0),
        )

    default_arch = "Lfm2ForCausalLM" if dense else "Lfm2MoeForCausalLM"
    archs = raw.get("architectures") or [default_arch]
    return Lfm2Config(
        architecture=str(archs[0]),
        model_type=str(model_type),
        vocab_size=_int(text, "vocab_size", where, default=65536),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=_layer_types(text, n_layers, where, dense),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        norm_eps=_float(text, "norm_eps", where, 1e-5),
        rope_theta=theta,
        max_position_embeddings=_int(text, "max_position_embeddings", where, default=128000),
        conv_L_cache=conv_taps,
        tie_word_embeddings=tie,
        intermediate_size=width,
        num_dense_layers=n_dense,
        eos_token_ids=_ids(text.get("eos_token_id"), "eos_token_id", where),
        bos_token_id=(_ids(text.get("bos_token_id"), "bos_token_id", where) or (None,))[0],
        pad_token_id=(_ids(text.get("pad_token_id"), "pad_token_id", where) or (None,))[0],
        **moe,
    )
