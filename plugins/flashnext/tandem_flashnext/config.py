"""The strict config reader for Flash-Next checkpoints (transformers' ``qwen4_exp``).

Reads both wrappers transformers writes:

- ``Qwen4ExpForConditionalGeneration`` (model_type ``qwen4_exp``): the text model
  under ``text_config``; the outer keys name the vision tower and its tokens, which
  the text model does not read.
- ``Qwen4ExpForCausalLM`` (model_type ``qwen4_exp_text``): the keys at the top level.

Every field is READ, IGNORED (training or bookkeeping only) or FIXED (the only value
the arithmetic implements). An unknown field, or a FIXED one with another value,
raises ``ConfigError`` naming it. ``rope_parameters`` is read the same way with its
own lists. The checks transformers' ``validate_architecture`` makes are made here
too, each naming its field (QSA fields all or none, the budget a whole number of
blocks, PLE only on Gated DeltaNet layers, ...).

Layer kinds: ``linear_attention`` (Gated DeltaNet) and ``indexed_attention`` (gated
attention restricted by the QSA indexer). A checkpoint's ``full_attention`` entries
are indexed attention layers (transformers reads them so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tandem_core.checkpoint.config import ConfigError, FieldPolicy, read_strict, split_text_config
from tandem_core.checkpoint.config import int_field as _int, token_ids as _ids

__all__ = ["FlashNextConfig", "read_config", "TEXT_POLICY", "OUTER_POLICY", "ROPE_POLICY", "MTP_POLICY",
           "LINEAR", "INDEXED"]

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
_KINDS = (LINEAR, INDEXED, "full_attention")
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")

TEXT_POLICY = FieldPolicy(
    read=(
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "max_position_embeddings", "layer_types", "full_attention_interval",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "rope_parameters", "rope_theta", "partial_rotary_factor",
        "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "output_gate_type",
        # the mixture of experts
        "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
        # hyper-connections
        "hc_count", "hc_lowrank",
        # per-layer n-gram embeddings (PLE)
        "ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram",
        "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "seed", "split_ngram_parts",
        # QSA, the indexer of the attention layers
        "indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio",
        # the MTP head's decoder layers (the mtp.* tensors; tandem_flashnext.mtp), and its sub-config
        "mtp_num_hidden_layers", "mtp",
    ),
    ignored=(
        "architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
        "attention_dropout", "output_router_logits", "router_aux_loss_coef",
        # derived by transformers from ple_layer_ids (how many conv states its cache keeps)
        "number_of_conv_states",
    ),
    fixed={
        "model_type": "qwen4_exp_text",
        "hidden_act": "silu",
        "attention_bias": False,
        "norm_topk_prob": True,              # the top-k routing weights are renormalised to sum to 1
        "indexer_kv_heads": (1, None),       # QSA pools one key head (transformers refuses another)
        "mtp_use_dedicated_embeddings": (False, None),   # the MTP head reads the target's embedding
        "mamba_ssm_dtype": "float32",        # the recurrent state is held in fp32
    },
)

# the published checkpoint's "mtp" sub-config (Qwen3.8-Flash-Next): one full-attention (QSA) layer
MTP_POLICY = FieldPolicy(
    read=("num_hidden_layers", "layer_types", "rope_theta"),
    fixed={"hybrid": True, "mtp_use_hidden_state_from_layer": None},
)

OUTER_POLICY = FieldPolicy(
    read=("tie_word_embeddings",),
    ignored=(
        "architectures", "transformers_version", "dtype", "torch_dtype", "vision_config",
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
        # a copy of text_config's (vLLM's Qwen4ExpConfig drops it there too; the table shards are counted
        # by the text model's)
        "split_ngram_parts",
    ),
    fixed={"model_type": "qwen4_exp"},
)

ROPE_POLICY = FieldPolicy(
    read=("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"),
    fixed={"rope_type": "default"},
)


@dataclass(frozen=True)
class FlashNextConfig:
    """Every size the model needs. Field names follow the checkpoint's config where it has one."""

    architecture: str                  # the wrapper the checkpoint was written from
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]       # "linear_attention" or "indexed_attention", one a layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    output_gate: str                   # the Gated DeltaNet norm's gate: "silu" or "sigmoid"
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    hc_count: int                      # residual streams
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]     # ONE-indexed decoder layers with a PLE module, sorted
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    indexer_n_heads: int               # 0 when the model has no attention layer
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int | None = None   # as the config says (None: not said; the keys decide)

    # -- derived sizes ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def slot(self, layer: int) -> int:
        """The layer's index among layers of its kind (its row in the GDN or the attention buffers)."""
        kind = self.layer_types[layer]
        return sum(1 for t in self.layer_types[:layer] if t == kind)

    def ple_slot(self, layer: int) -> int | None:
        """The (zero-based) layer's index among the PLE layers (its hashing index), or None without PLE."""
        return self.ple_layer_ids.index(layer + 1) if layer + 1 in self.ple_layer_ids else None

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's causal conv: q, k and v side by side."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def hc_dim(self) -> int:
        """Features of the residual streams, side by side: ``hc_count * hidden_size``."""
        return self.hc_count * self.hidden_size

    @property
    def ngram_heads(self) -> int:
        """Hashed embedding heads of one PLE module: ``heads_per_ngram`` for every order 2..ngram_size."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_dilation(self) -> int:
        return self.ngram_size

    @property
    def ple_conv_tail(self) -> int:
        """Inputs the dilated PLE conv keeps: ``(kernel - 1) * dilation``."""
        return (self.ple_conv_kernel_size - 1) * self.ple_conv_dilation

    @property
    def block_topk(self) -> int:
        """Blocks the indexer selects per query: ``indexer_budget // indexer_compress_ratio``."""
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def eos_token_id(self) -> int:
        """The id PLE's n-gram hashing treats as a segment end (the first eos id)."""
        if not self.eos_token_ids:
            raise ConfigError("config.json: field 'eos_token_id' is required when PLE layers are enabled")
        return self.eos_token_ids[0]






def _layer_types(text: Mapping[str, Any], n_layers: int, where: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = _int(text, "full_attention_interval", where, default=4)
        return tuple(LINEAR if (i + 1) % interval else INDEXED for i in range(n_layers))
    if not isinstance(types, (list, tuple)) or len(types) != n_layers:
        raise ConfigError(f"{where}: field 'layer_types' must list one type for each of the {n_layers} "
                          f"layers")
    for i, t in enumerate(types):
        if t not in _KINDS:
            raise ConfigError(f"{where}: field 'layer_types'[{i}] = {t!r} is not one of {list(_KINDS)}")
    out = tuple(LINEAR if t == LINEAR else INDEXED for t in types)
    interval = text.get("full_attention_interval")
    if interval is not None and out != tuple(LINEAR if (i + 1) % _int(text, "full_attention_interval", where)
                                             else INDEXED for i in range(n_layers)):
        raise ConfigError(f"{where}: field 'full_attention_interval' = {interval!r} disagrees with "
                          f"layer_types")
    return out


def _mtp(text: Mapping[str, Any], where: str, theta: float) -> int | None:
    """The MTP head's layer count as the config gives it (``mtp_num_hidden_layers`` and/or the ``mtp``
    sub-config, which must agree and describe full-attention layers at the target's rope), or None."""
    count = None if text.get("mtp_num_hidden_layers") is None else \
        _int(text, "mtp_num_hidden_layers", where, minimum=0)
    sub = text.get("mtp")
    if sub is None:
        return count
    if not isinstance(sub, Mapping):
        raise ConfigError(f"{where}: field 'mtp' = {sub!r} is not a mapping")
    mtp = read_strict(sub, MTP_POLICY, f"{where} mtp")
    n = _int(mtp, "num_hidden_layers", f"{where} mtp", default=count if count is not None else 1, minimum=0)
    if count is not None and n != count:
        raise ConfigError(f"{where}: field 'mtp.num_hidden_layers' = {n} disagrees with "
                          f"mtp_num_hidden_layers = {count}")
    kinds = mtp.get("layer_types", ["full_attention"] * n)
    if not isinstance(kinds, (list, tuple)) or len(kinds) != n or any(k != "full_attention" for k in kinds):
        raise ConfigError(f"{where}: field 'mtp.layer_types' = {kinds!r}: the MTP head's layers are "
                          f"full_attention (QSA) layers, one each")
    if "rope_theta" in mtp and float(mtp["rope_theta"]) != theta:
        raise ConfigError(f"{where}: field 'mtp.rope_theta' = {mtp['rope_theta']!r} differs from the "
                          f"target's {theta!r} (the head rotates at the target's positions)")
    return n


def _rope(text: Mapping[str, Any], where: str) -> tuple[float, float]:
    rope_raw = text.get("rope_parameters") or {}
    if not isinstance(rope_raw, Mapping):
        raise ConfigError(f"{where}: field 'rope_parameters' = {rope_raw!r} is not a mapping")
    rope = read_strict(rope_raw, ROPE_POLICY, f"{where} rope_parameters")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    if "partial_rotary_factor" in rope and "partial_rotary_factor" in text and \
            float(text["partial_rotary_factor"]) != partial:
        raise ConfigError(f"{where}: field 'partial_rotary_factor' = {text['partial_rotary_factor']!r} "
                          f"disagrees with rope_parameters' {partial!r}")
    return theta, partial


def _qsa(text: Mapping[str, Any], kv_heads: Any, where: str, has_attention: bool,
         rotary: int) -> dict[str, int]:
    # indexer_kv_heads is FIXED (read_strict checked its value), the others READ: all five or none
    given = {k: text.get(k) for k in _QSA if text.get(k) is not None}
    if kv_heads is not None:
        given["indexer_kv_heads"] = kv_heads
    if not given:
        if has_attention:
            raise ConfigError(f"{where}: field 'indexer_n_heads' is required: every attention layer of "
                              f"qwen4_exp is a QSA indexed attention layer")
        return {"indexer_n_heads": 0, "indexer_head_dim": 0, "indexer_budget": 0, "indexer_compress_ratio": 0}
    missing = [k for k in _QSA if k not in given]
    if missing:
        raise ConfigError(f"{where}: field {missing[0]!r} is required with the other QSA fields "
                          f"({', '.join(sorted(given))})")
    out = {k: _int(text, k, where) for k in _QSA if k != "indexer_kv_heads"}
    if out["indexer_budget"] % out["indexer_compress_ratio"]:
        raise ConfigError(f"{where}: field 'indexer_budget' = {out['indexer_budget']} is not a multiple of "
                          f"indexer_compress_ratio = {out['indexer_compress_ratio']}")
    if rotary > out["indexer_head_dim"]:
        raise ConfigError(f"{where}: field 'indexer_head_dim' = {out['indexer_head_dim']} is smaller than "
                          f"the attention's {rotary} rotary channels (the indexer's queries and keys are "
                          f"rotated too)")
    return out


def _ple(text: Mapping[str, Any], where: str, types: tuple[str, ...], hidden: int,
         eos: tuple[int, ...]) -> dict[str, Any]:
    raw_ids = text.get("ple_layer_ids") or []
    if not isinstance(raw_ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in raw_ids):
        raise ConfigError(f"{where}: field 'ple_layer_ids' = {raw_ids!r} is not a list of layer ids")
    ids = tuple(sorted(set(raw_ids)))
    out: dict[str, Any] = {
        "ple_layer_ids": ids,
        "ple_embed_dim": _int(text, "ple_embed_dim", where, default=hidden),
        "ple_conv_kernel_size": _int(text, "ple_conv_kernel_size", where, default=4),
        "ngram_size": _int(text, "ngram_size", where, default=3),
        "heads_per_ngram": _int(text, "heads_per_ngram", where, default=8),
        "ngram_vocab_size_base": _int(text, "ngram_vocab_size_base", where, default=20_000_000),
        "make_ngram_vocab_size_divisible_by": _int(text, "make_ngram_vocab_size_divisible_by", where,
                                                   default=128),
        "seed": _int(text, "seed", where, default=1234, minimum=0),
        "split_ngram_parts": _int(text, "split_ngram_parts", where, default=512),
    }
    if not ids:
        return out
    heads = (out["ngram_size"] - 1) * out["heads_per_ngram"]
    if heads <= 0 or out["ple_embed_dim"] % heads:
        raise ConfigError(f"{where}: field 'ple_embed_dim' = {out['ple_embed_dim']} is not a multiple of the "
                          f"{heads} n-gram heads ((ngram_size - 1) * heads_per_ngram)")
    for i in ids:
        if not 1 <= i <= len(types):
            raise ConfigError(f"{where}: field 'ple_layer_ids' names layer {i}: ids are one-indexed, in "
                              f"[1, {len(types)}]")
        if types[i - 1] != LINEAR:
            raise ConfigError(f"{where}: field 'ple_layer_ids' names layer {i}, a {types[i - 1]} layer: "
                              f"PLE is only on linear_attention layers")
    if not eos:
        raise ConfigError(f"{where}: field 'eos_token_id' is required when PLE layers are enabled (the "
                          f"n-gram hashing starts a segment after it)")
    return out


def read_config(raw: Mapping[str, Any]) -> FlashNextConfig:
    """``config.json`` (either wrapper) -> ``FlashNextConfig``; ``ConfigError`` names any field it refuses."""
    text_raw, outer_raw = split_text_config(raw)
    if outer_raw:
        outer = read_strict(outer_raw, OUTER_POLICY, "config.json")
        where = "config.json text_config"
    else:
        outer = {}
        where = "config.json"
    text = read_strict(text_raw, TEXT_POLICY, where)
    theta, partial = _rope(text, where)

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
    if not 0 < partial <= 1 or rotary % 2 or rotary < 2:
        raise ConfigError(f"{where}: field 'partial_rotary_factor' = {partial!r} gives {rotary} rotary "
                          f"channels of head_dim {head_dim} (needs an even number, at least 2)")
    types = _layer_types(text, n_layers, where)

    gate = text.get("output_gate_type") or "silu"
    if gate not in ("silu", "sigmoid"):
        raise ConfigError(f"{where}: field 'output_gate_type' = {gate!r} is not 'silu' or 'sigmoid'")
    n_experts = _int(text, "num_experts", where, default=512)
    top_k = _int(text, "num_experts_per_tok", where, default=10)
    if top_k > n_experts:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' = {top_k} exceeds num_experts = {n_experts}")
    hc = _int(text, "hc_count", where, default=4)
    if hc < 2:
        raise ConfigError(f"{where}: field 'hc_count' = {hc}: qwen4_exp needs at least 2 residual streams")
    eos = _ids(text.get("eos_token_id"), "eos_token_id", where)

    tie = outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json: field 'tie_word_embeddings' = {tie!r} is not a boolean")
    default_arch = "Qwen4ExpForConditionalGeneration" if outer_raw else "Qwen4ExpForCausalLM"
    archs = raw.get("architectures") or [default_arch]
    return FlashNextConfig(
        architecture=str(archs[0]),
        vocab_size=_int(text, "vocab_size", where),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=types,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        partial_rotary_factor=partial,
        max_position_embeddings=_int(text, "max_position_embeddings", where, default=32768),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=_int(text, "linear_key_head_dim", where),
        linear_value_head_dim=_int(text, "linear_value_head_dim", where),
        linear_conv_kernel_dim=_int(text, "linear_conv_kernel_dim", where),
        output_gate=gate,
        moe_intermediate_size=_int(text, "moe_intermediate_size", where, default=512),
        shared_expert_intermediate_size=_int(text, "shared_expert_intermediate_size", where, default=512),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        hc_count=hc,
        hc_lowrank=_int(text, "hc_lowrank", where, default=320),
        **_ple(text, where, types, hidden, eos),
        **_qsa(text, text_raw.get("indexer_kv_heads"), where, INDEXED in types, rotary),
        tie_word_embeddings=tie,
        eos_token_ids=eos,
        bos_token_id=(_ids(text.get("bos_token_id"), "bos_token_id", where) or (None,))[0],
        pad_token_id=(_ids(text.get("pad_token_id"), "pad_token_id", where) or (None,))[0],
        mtp_num_hidden_layers=_mtp(text, where, theta),
    )
