"""The strict config readers: Hugging Face ``config.json`` of ``LlamaForCausalLM``, and a GGUF's
``llama.*`` keys.

Both end in one ``LlamaConfig``. Each source has its own ``FieldPolicy``: the
fields the engine READS, those it IGNORES (training or bookkeeping), and those
FIXED at the only value the engine's arithmetic implements. An unknown field,
or a fixed one with another value, stops the load naming the field.

``read_config(raw)`` is the ``Arch``'s config reader: ``raw`` is the parsed
``config.json``, or, for a ``.gguf`` file, ``{"model_type": ..., "format": "gguf",
"gguf_path": ...}`` (the core's loader maps a file to that), in which case the
metadata is read from the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tandem_core.checkpoint.config import ConfigError, FieldPolicy, read_strict

__all__ = [
    "GGUF_POLICY",
    "HF_POLICY",
    "LlamaConfig",
    "RopeScaling",
    "from_gguf",
    "from_hf",
    "inv_freq",
    "read_config",
]


@dataclass(frozen=True)
class RopeScaling:
    """``kind``: ``"linear"`` (positions divided by ``factor``) or ``"llama3"`` (Llama 3.1's band-wise
    scaling)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = "hf"  # "hf" or "gguf"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} is odd: rotary embedding needs pairs")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


# -- Hugging Face config.json --------------------------------------------------------------------

HF_POLICY = FieldPolicy(
    read={
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    },
    ignored={
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "initializer_range",
        "use_cache",
        "pad_token_id",
        "attention_dropout",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "unk_token_id",
        "sep_token_id",
        "cls_token_id",
    },
    fixed={
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "is_decoder": (True, False),
    },
)

_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}


def _hf_rope(raw: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    if raw.get("rope_scaling"):
        params = {**dict(raw["rope_scaling"]), **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    for k in params:
        if k not in _ROPE_KEYS:
            raise ConfigError(f"{where}: unknown rope field {k!r}: the engine does not know what it changes")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise ConfigError(f"{where}: rope type {kind!r} is not implemented (default, linear, llama3)")


def from_hf(raw: Mapping[str, Any], where: str = "config.json") -> LlamaConfig:
    if raw.get("model_type", "llama") != "llama":
        raise ConfigError(f"{where}: model_type {raw.get('model_type')!r} is not 'llama'")
    r = read_strict(raw, HF_POLICY, where)
    try:
        heads = int(r["num_attention_heads"])
        hidden = int(r["hidden_size"])
        eos = r.get("eos_token_id")
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
        theta, scaling = _hf_rope(raw, where)
        return LlamaConfig(
            vocab_size=int(r["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(r["intermediate_size"]),
            num_layers=int(r["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(r.get("num_key_value_heads") or heads),
            head_dim=int(r.get("head_dim") or hidden // heads),
            rms_norm_eps=float(r.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(r.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_token_id=r.get("bos_token_id"),
            eos_token_ids=eos_ids,
            source="hf",
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from None


# -- GGUF metadata (llama.*) ---------------------------------------------------------------------

GGUF_POLICY = FieldPolicy(
    read={
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
        "rope.freq_base",
        "rope.dimension_count",
        "vocab_size",
        "attention.key_length",
        "attention.value_length",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
    },
    ignored={"rope.scaling.finetuned", "tensor_data_layout"},
    fixed={"expert_count": 0, "expert_used_count": 0},
)


def from_gguf(meta: Mapping[str, Any], *, n_vocab: int, tied: bool, where: str = "GGUF") -> LlamaConfig:
    """``meta``: the ``llama.*`` keys without the prefix; ``n_vocab``: the tokenizer's size (when
    ``vocab_size`` is absent); ``tied``: the file has no ``output.weight``."""
    r = read_strict(meta, GGUF_POLICY, where + " metadata llama.*")
    try:
        hidden = int(r["embedding_length"])
        heads = int(r["attention.head_count"])
        head_dim = int(r.get("attention.key_length", hidden // heads))
        if int(r.get("attention.value_length", head_dim)) != head_dim:
            raise ConfigError(
                f"{where}: llama.attention.value_length {r['attention.value_length']} differs from "
                f"the key length {head_dim}"
            )
        if int(r.get("rope.dimension_count", head_dim)) != head_dim:
            raise ConfigError(
                f"{where}: llama.rope.dimension_count {r['rope.dimension_count']} is not the head "
                f"dimension {head_dim} (partial rotary is not Llama)"
            )
        scaling = None
        kind = r.get("rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling("linear", float(r["rope.scaling.factor"]))
        elif kind not in ("none", None):
            raise ConfigError(
                f"{where}: llama.rope.scaling.type {kind!r} is not implemented (none, linear; "
                f"Llama 3 scaling comes as the rope_freqs.weight tensor)"
            )
        kv = r.get("attention.head_count_kv", heads)
        return LlamaConfig(
            vocab_size=int(r.get("vocab_size", n_vocab)),
            hidden_size=hidden,
            intermediate_size=int(r["feed_forward_length"]),
            num_layers=int(r["block_count"]),
            num_heads=heads,
            num_kv_heads=int(kv),
            head_dim=head_dim,
            rms_norm_eps=float(r.get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(r.get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(r.get("context_length", 2048)),
            tie_word_embeddings=tied,
            rope_scaling=scaling,
            source="gguf",
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing metadata llama.{exc.args[0]}") from None
    except TypeError as exc:  # a per-layer array where a number belongs (e.g. head_count_kv per layer)
        raise ConfigError(f"{where}: metadata value of an unsupported shape ({exc})") from None


def read_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """The ``Arch``'s config reader: a ``config.json`` dict, or the core's ``{"format": "gguf", ...}``
    record."""
    if raw.get("format") == "gguf":
        from tandem_llama.gguf_reader import GGUFFile

        gf = GGUFFile(raw["gguf_path"])
        return config_of(gf)
    return from_hf(raw)


def config_of(gf: Any) -> LlamaConfig:
    """The config of an open ``GGUFFile``."""
    if gf.architecture != "llama":
        raise ConfigError(f"{gf.path.name}: general.architecture {gf.architecture!r} is not 'llama'")
    names = gf.tensors
    embd = names.get("token_embd.weight")
    n_vocab = embd.shape[0] if embd is not None else len(gf.array("tokenizer.ggml.tokens") or ())
    return from_gguf(
        gf.arch_metadata(), n_vocab=n_vocab, tied="output.weight" not in names, where=gf.path.name
    )


def inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``[head_dim / 2]`` (fp32) after the config's scaling
    (transformers' formulas)."""

    from tandem_core.ops.rope import inv_freq as base_inv_freq

    inv = base_inv_freq(cfg.head_dim, cfg.rope_theta)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc.kind == "linear":
        return inv / sc.factor
    # llama3: long wavelengths divided by factor, short ones kept, the band between interpolated
    old = sc.original_max_position_embeddings
    low_wl = old / sc.low_freq_factor
    high_wl = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)
