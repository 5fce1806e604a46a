"""How a Flash-Next checkpoint names its tensors and what shapes the config says they have.

Canonical names: the language model's own naming with the wrapper prefix taken off
(``embed_tokens.weight``, ``lm_head.weight``, ``hyper_connection_mixer.*``,
``layers.N.<module>.<proj>.weight``); the vision tower (``model.visual.*``) is skipped and
counted. The MTP head's keys keep their own names (``mtp.fc.weight``, ``mtp.layers.J.*``):
the target's layout leaves them to the head.

The experts are stored one module each (``mlp.experts.E.{gate,up,down}_proj.weight``, as
``save_pretrained`` writes them: transformers fuses them on load); each PLE table as
``ngram_embedding.shard_K.weight`` row ranges (``torch.chunk``'s sizes, at most
``split_ngram_parts`` of them) or one ``ngram_embedding.weight``.

The MTP head (``mtp.*``) follows vLLM's published qwen4_exp MTP (``Qwen4ExpMultiTokenPredictor``):
``pre_fc_norm_embedding`` [H], ``pre_fc_norm_hidden`` [n*H] (one RMS over the streams side by
side), ``fc_embedding`` and ``fc_hidden`` [H, H] (the latter shared by the streams),
``layers.J`` qwen4_exp decoder layers of the attention kind without PLE (hyper-connections, QSA
attention with ``self_attn.indexer.*``, the sparse MoE), and ``hyper_connection_mixer``; the
embedding and head are the target's. Any other tensor under ``mtp.`` is refused by name.

``unused_tensors``: what a checkpoint may carry that nothing reads, accepted (shape checked) and
counted: a final mixer's ``block_inject_weight`` (the target's or the head's; a final mixer injects
nothing, and vLLM drops it too).
"""

from __future__ import annotations

import re
from typing import Iterable

from tandem_core.checkpoint.audit import AuditError, Expect
from tandem_core.checkpoint.layout import Layout

from tandem_flashnext.config import FlashNextConfig

__all__ = ["LAYOUT", "MTP_PREFIX", "unused_tensors", "HASH_BUFFERS", "expected_tensors",
           "expected_mtp_tensors",
           "mtp_layer_count", "table_names", "table_prefix"]

HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

MTP_PREFIX = "mtp."
LAYOUT = Layout(
    prefixes=("model.language_model.", "language_model.model.", "language_model.", "model."),
    skip=("model.visual.", "visual.", MTP_PREFIX),
    head_names=("lm_head.weight", "language_model.lm_head.weight"),
)


# -- what the config says the checkpoint holds ---------------------------------------------------
def _hyper(cfg: FlashNextConfig, combine: bool) -> dict[str, tuple[int, ...]]:
    n, nh, r = cfg.hc_count, cfg.hc_dim, cfg.hc_lowrank
    out = {"hc_norm.weight": (nh,), "input_mix_weight_down.weight": (r, nh),
           "input_mix_weight_up.weight": (nh, r)}
    if combine:
        out["block_inject_weight.weight"] = (n, nh)
    return out


def _gdn(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv.weight": (cfg.conv_dim, H), "in_proj_z.weight": (cfg.gdn_value_dim, H),
        "in_proj_b.weight": (hv, H), "in_proj_a.weight": (hv, H),
        "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "A_log": (hv,), "dt_bias": (hv,), "norm.weight": (cfg.linear_value_head_dim,),
        "out_proj.weight": (H, cfg.gdn_value_dim),
    }


def _attention(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, D, Di = cfg.hidden_size, cfg.head_dim, cfg.indexer_head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {
        "q_proj.weight": (2 * q, H),   # each head's query, then its output gate
        "k_proj.weight": (kv, H), "v_proj.weight": (kv, H), "o_proj.weight": (H, q),
        "q_norm.weight": (D,), "k_norm.weight": (D,),
        # the heads' queries, then one key
        "indexer.index_qk_proj.weight": ((cfg.indexer_n_heads + 1) * Di, H),
        "indexer.q_layernorm.weight": (Di,), "indexer.k_layernorm.weight": (Di,),
    }


def _moe(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, I, Is = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = {"gate.weight": (cfg.num_experts, H), "shared_expert_gate.weight": (1, H),
           "shared_expert.gate_proj.weight": (Is, H), "shared_expert.up_proj.weight": (Is, H),
           "shared_expert.down_proj.weight": (H, Is)}
    for e in range(cfg.num_experts):
        out.update({f"experts.{e}.gate_proj.weight": (I, H), f"experts.{e}.up_proj.weight": (I, H),
                    f"experts.{e}.down_proj.weight": (H, I)})
    return out


def _ple(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    nh, E = cfg.hc_dim, cfg.ple_embed_dim
    return {"key_proj.weight": (nh, E), "value_proj.weight": (cfg.hidden_size, E), "norm_key.weight": (nh,),
            "norm_query.weight": (nh,), "norm_conv.weight": (nh,),
            "conv1d.weight": (nh, 1, cfg.ple_conv_kernel_size)}


def expected_tensors(cfg: FlashNextConfig) -> dict[str, Expect]:
    """Canonical name -> expected shape, for every tensor the model reads but the PLE tables
    (``table_names``) and the optional PLE hashing buffers."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)}
    out.update({"hyper_connection_mixer." + k: s for k, s in _hyper(cfg, combine=False).items()})
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
            out.update({p + hc + k: s for k, s in _hyper(cfg, combine=True).items()})
        if cfg.is_linear(i):
            out.update({p + "linear_attn." + k: s for k, s in _gdn(cfg).items()})
        else:
            out.update({p + "self_attn." + k: s for k, s in _attention(cfg).items()})
        out.update({p + "mlp." + k: s for k, s in _moe(cfg).items()})
        if cfg.ple_slot(i) is not None:
            out.update({p + "ple." + k: s for k, s in _ple(cfg).items()})
    return {k: Expect(s) for k, s in out.items()}


def table_prefix(layer: int) -> str:
    return f"layers.{layer}.ple.ple_embedding."


def table_names(names: Iterable[str], layer: int) -> list[str]:
    """The canonical names holding PLE layer ``layer``'s table, in row order: ``ngram_embedding.shard_0..``
    (numbered without a gap) or the one ``ngram_embedding.weight``."""
    pre = table_prefix(layer) + "ngram_embedding."
    shard = re.compile(re.escape(pre) + r"shard_(\d+)\.weight")
    found = {int(m.group(1)): n for n in names if (m := shard.fullmatch(n))}
    whole = pre + "weight"
    if found and whole in names:
        raise AuditError(f"PLE layer {layer}: both {whole!r} and its shards are in the checkpoint")
    if not found:
        return [whole] if whole in names else []
    order = sorted(found)
    if order != list(range(len(order))):
        gap = next(i for i in range(len(order) + 1) if i not in found)
        raise AuditError(f"PLE layer {layer}: table shard {pre}shard_{gap}.weight is missing "
                         f"(shards {order} are there)")
    return [found[i] for i in order]




_MTP_LAYER = re.compile(re.escape(MTP_PREFIX) + r"layers\.(\d+)\.")


def mtp_layer_count(keys: Iterable[str]) -> int:
    """The MTP head's decoder layers, by its keys (``mtp.layers.J.*``: ``max J + 1``; 0 without a head)."""
    found = [int(m.group(1)) for k in keys if (m := _MTP_LAYER.match(k))]
    return max(found) + 1 if found else 0


def unused_tensors(cfg: FlashNextConfig) -> dict[str, Expect]:
    """Name (canonical for the target, ``mtp.*`` for the head) -> shape, of the tensors accepted but never
    read."""
    inject = Expect((cfg.hc_count, cfg.hc_dim))
    return {"hyper_connection_mixer.block_inject_weight.weight": inject,
            MTP_PREFIX + "hyper_connection_mixer.block_inject_weight.weight": inject}


def expected_mtp_tensors(cfg: FlashNextConfig, layers: int) -> dict[str, Expect]:
    """Key -> expected shape, for every tensor of an MTP head of ``layers`` decoder layers."""
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "pre_fc_norm_embedding.weight": (H,), "pre_fc_norm_hidden.weight": (cfg.hc_dim,),
        "fc_embedding.weight": (H, H), "fc_hidden.weight": (H, H),
    }
    out.update({"hyper_connection_mixer." + k: s for k, s in _hyper(cfg, combine=False).items()})
    for j in range(layers):
        p = f"layers.{j}."
        for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
            out.update({p + hc + k: s for k, s in _hyper(cfg, combine=True).items()})
        out.update({p + "self_attn." + k: s for k, s in _attention(cfg).items()})
        out.update({p + "mlp." + k: s for k, s in _moe(cfg).items()})
    return {MTP_PREFIX + k: Expect(s) for k, s in out.items()}
