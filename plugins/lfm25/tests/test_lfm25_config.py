"""The LFM2 family's strict config reader, layout and audit: what reads, what it derives, and what fails naming it."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_lfm25 import lfm25_ckpts, load_engine, load_weights_of, prompt  # noqa: F401  (fixture)

from tandem_core.checkpoint.audit import AuditError
from tandem_core.checkpoint.config import ConfigError
from tandem_core.checkpoint.safetensors import CheckpointError
from tandem_lfm25.config import read_config
from tandem_lfm25.weights import expected_tensors, open_checkpoint

# LiquidAI/LFM2-8B-A1B's published config.json (the model card's repository)
LFM2_8B_A1B = {
    "architectures": ["Lfm2MoeForCausalLM"], "bos_token_id": 1, "conv_L_cache": 3, "conv_bias": False,
    "dtype": "bfloat16", "eos_token_id": 7, "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 7168,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv",
                    "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                    "full_attention", "conv", "conv", "full_attention", "conv", "conv"],
    "max_position_embeddings": 128000, "model_type": "lfm2_moe", "moe_intermediate_size": 1792,
    "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 32, "num_dense_layers": 2,
    "num_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "pad_token_id": 0, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "routed_scaling_factor": 1.0, "tie_word_embeddings": True, "transformers_version": "5.3.0",
    "use_cache": True, "use_expert_bias": True, "vocab_size": 65536,
}
# LiquidAI/LFM2-700M's published config.json (LiquidAI's first field names: block_*, tie_embedding, num_heads)
LFM2_700M = {
    "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 1536,
    "block_ff_dim": 10240, "block_ffn_dim_multiplier": 1.0, "block_mlp_init_scale": 1.0, "block_multiple_of": 256,
    "block_norm_eps": 1e-05, "block_out_init_scale": 1.0, "block_use_swiglu": True, "block_use_xavier_init": True,
    "bos_token_id": 1, "conv_L_cache": 3, "conv_bias": False, "conv_dim": 1536, "conv_dim_out": 1536,
    "conv_use_xavier_init": True, "eos_token_id": 7, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 1536,
    "initializer_range": 0.02, "max_position_embeddings": 128000, "model_type": "lfm2", "norm_eps": 1e-05,
    "num_attention_heads": 24, "num_heads": 24, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pad_token_id": 0, "rope_theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0.dev0", "use_cache": True, "use_pos_enc": True, "vocab_size": 65536,
}


def open_dir(path):
    return open_checkpoint(path, read_config(json.loads((path / "config.json").read_text())))


def test_the_tiny_checkpoints_read_to_their_configs(lfm25_ckpts):
    moe = read_config(lfm25_ckpts.moe.raw_config)
    assert (moe.model_type, moe.architecture) == ("lfm2_moe", "Lfm2MoeForCausalLM")
    assert moe.conv_layers == (0, 2, 3) and moe.attention_layers == (1, 4)
    assert moe.moe_layers == (1, 2, 3, 4) and not moe.is_moe(0)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (6, 3, 32)
    assert moe.use_expert_bias and moe.norm_topk_prob and moe.routed_scaling_factor == 1.5
    assert (moe.head_dim, moe.conv_state_width, moe.rope_theta, moe.tie_word_embeddings) == (16, 2, 10000.0, True)
    assert moe.slot(3) == 2 and moe.slot(4) == 1
    untied = read_config(lfm25_ckpts.moe_untied.raw_config)
    assert not untied.tie_word_embeddings and not untied.use_expert_bias and untied.num_dense_layers == 2
    dense = read_config(lfm25_ckpts.dense.raw_config)
    assert dense.model_type == "lfm2" and dense.num_experts == 0 and dense.moe_layers == ()
    assert dense.intermediate_size == lfm25_ckpts.dense.model.model.layers[0].feed_forward.w1.out_features == 96


def _reference_mlp_width(raw: dict) -> int:
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    with torch.device("meta"):
        return Lfm2MLP(Lfm2Config(**keep)).w1.out_features


def test_the_published_configs_read_as_transformers_reads_them():
    big = read_config(LFM2_8B_A1B)
    assert (big.num_hidden_layers, len(big.conv_layers), len(big.attention_layers)) == (24, 18, 6)
    assert (big.head_dim, big.num_experts, big.num_experts_per_tok, big.num_dense_layers) == (64, 32, 4, 2)
    assert big.eos_token_ids == (7,) and big.tie_word_embeddings
    small = read_config(LFM2_700M)
    assert small.attention_layers == (2, 5, 8, 10, 12, 14) and small.tie_word_embeddings
    assert small.intermediate_size == _reference_mlp_width(LFM2_700M) == 6912      # block_ff_dim 10240 adjusted
    halved = dict(LFM2_700M, block_ffn_dim_multiplier=0.5)
    assert read_config(halved).intermediate_size == _reference_mlp_width(halved) == 3584
    unadjusted = dict(LFM2_700M, block_auto_adjust_ff_dim=False)
    assert read_config(unadjusted).intermediate_size == _reference_mlp_width(unadjusted) == 10240
    n_moe = sum(1 for n in expected_tensors(big) if ".experts." in n)
    assert n_moe == 22 * 32 * 3


@pytest.mark.parametrize("change,message", [
    ({"frobnicate": 1}, r"unknown field 'frobnicate'"),
    ({"conv_bias": True}, r"field 'conv_bias' = True is fixed at False"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, r"'rope_type' = 'yarn' is fixed"),
    ({"layer_types": ["conv"] * 23 + ["sliding_attention"]}, r"'layer_types'\[23\] = 'sliding_attention'"),
    ({"layer_types": ["conv"] * 3}, r"one type for each of the 24 layers"),
    ({"layer_types": None}, r"'layer_types' is required"),
    ({"num_experts_per_tok": 40}, r"'num_experts_per_tok' = 40 exceeds num_experts = 32"),
    ({"num_dense_layers": 30}, r"'num_dense_layers' = 30 exceeds num_hidden_layers = 24"),
    ({"num_key_value_heads": 5}, r"'num_attention_heads' = 32 is not a multiple of num_key_value_heads = 5"),
    ({"hidden_size": None}, r"'hidden_size' is required"),
    ({"conv_L_cache": 1}, r"'conv_L_cache' = 1 keeps no conv state"),
    ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' = 'yes' is not a boolean"),
])
def test_a_config_the_engine_would_misread_is_refused_naming_the_field(change, message):
    raw = copy.deepcopy(LFM2_8B_A1B)
    raw.update(change)
    with pytest.raises(ConfigError, match=message):
        read_config(raw)


@pytest.mark.parametrize("change,message", [
    ({"conv_dim": 1024}, r"'conv_dim' = 1024 disagrees with hidden_size = 1536"),
    ({"num_heads": 16}, r"'num_heads' = 16 disagrees with num_attention_heads = 24"),
    ({"use_pos_enc": False}, r"'use_pos_enc' = False is fixed at True"),
    ({"full_attn_idxs": [2, 40]}, r"'full_attn_idxs' = \[2, 40\] is not a list of layer indices"),
    ({"model_type": "lfm3"}, r"'model_type' = 'lfm3' is not one of"),
    ({"block_ffn_dim_multiplier": None}, r"'block_ffn_dim_multiplier' = None is not a number"),
])
def test_a_dense_config_the_engine_would_misread_is_refused(change, message):
    raw = dict(LFM2_700M, **change)
    with pytest.raises(ConfigError, match=message):
        read_config(raw)


# -- layout and audit ------------------------------------------------------------------------------
@pytest.fixture
def moe_copy(lfm25_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(lfm25_ckpts.moe.path, path)
    return path


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_tied_and_untied_heads_read_to_canonical_names(lfm25_ckpts):
    tied = open_dir(lfm25_ckpts.moe.path)
    assert tied.layout.head_tied and tied.layout.names["lm_head.weight"] == "model.embed_tokens.weight"
    assert tied.layout.names["layers.2.feed_forward.experts.5.w2.weight"] == \
        "model.layers.2.feed_forward.experts.5.w2.weight"
    assert tied.layout.names["embedding_norm.weight"] == "model.embedding_norm.weight"
    untied = open_dir(lfm25_ckpts.moe_untied.path)
    assert not untied.layout.head_tied and untied.layout.names["lm_head.weight"] == "lm_head.weight"
    assert "layers.2.feed_forward.expert_bias" not in untied.expected
    assert set(untied.layout.names) == set(untied.expected)
    assert len(tied.identity) == 64 and tied.identity != untied.identity


def test_missing_expert_is_named(moe_copy):
    _rewrite(moe_copy, lambda t: t.pop("model.layers.3.feed_forward.experts.4.w3.weight"))
    with pytest.raises(AuditError, match=r"missing tensor 'layers\.3\.feed_forward\.experts\.4\.w3\.weight'"):
        open_dir(moe_copy)


def test_missing_expert_bias_is_named(moe_copy):
    _rewrite(moe_copy, lambda t: t.pop("model.layers.1.feed_forward.expert_bias"))
    with pytest.raises(AuditError, match=r"missing tensor 'layers\.1\.feed_forward\.expert_bias'"):
        open_dir(moe_copy)


def test_wrong_shape_is_named(moe_copy):
    def edit(t):
        t["model.layers.0.conv.in_proj.weight"] = t["model.layers.0.conv.in_proj.weight"][:128]
    _rewrite(moe_copy, edit)
    with pytest.raises(AuditError, match=r"model\.layers\.0\.conv\.in_proj\.weight.*shape \[128, 64\].*\[192, 64\]"):
        open_dir(moe_copy)


def test_fused_expert_tensors_are_not_read_silently(moe_copy):
    def edit(t):
        t["model.layers.1.feed_forward.experts.gate_up_proj"] = torch.zeros(6, 64, 64)
    _rewrite(moe_copy, edit)
    with pytest.raises(AuditError, match=r"'model\.layers\.1\.feed_forward\.experts\.gate_up_proj' is not one the "
                                         r"lfm2_moe engine reads"):
        open_dir(moe_copy)


def test_an_untied_config_without_a_head_is_refused(lfm25_ckpts, tmp_path):
    path = tmp_path / "headless"
    shutil.copytree(lfm25_ckpts.moe_untied.path, path)
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(AuditError, match="no lm_head.weight and its config does not tie"):
        open_dir(path)


def test_truncated_shard_is_named(lfm25_ckpts, tmp_path):
    path = tmp_path / "sharded"
    lfm25_ckpts.moe.model.save_pretrained(path, max_shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is truncated"):
        open_dir(path)


def test_sharded_checkpoint_loads_and_equals_the_single_file_one(lfm25_ckpts, tmp_path):
    path = tmp_path / "sharded"
    lfm25_ckpts.moe.model.save_pretrained(path, max_shard_size="60KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    ids = prompt(19)
    one = load_engine(lfm25_ckpts.moe.path).forward(ids, all_logits=True)
    assert torch.equal(load_engine(path).forward(ids, all_logits=True), one)


def test_wrong_sha256_is_named(moe_copy):
    good = hashlib.sha256((moe_copy / "model.safetensors").read_bytes()).hexdigest()
    (moe_copy / "SHA256SUMS").write_text(f"{good}  model.safetensors\n")
    open_dir(moe_copy)
    bad = ("0" if good[0] != "0" else "1") + good[1:]
    (moe_copy / "SHA256SUMS").write_text(f"{bad}  model.safetensors\n")
    with pytest.raises(AuditError, match=r"file model\.safetensors: sha256 .* does not match SHA256SUMS"):
        open_dir(moe_copy)


def test_the_weights_count_what_the_reference_holds(lfm25_ckpts):
    for kind in ("moe", "moe_untied", "dense"):
        ck = getattr(lfm25_ckpts, kind)
        _, weights = load_weights_of(ck.path)
        persistent = dict(ck.model.state_dict())
        if ck.model.config.tie_word_embeddings:
            persistent.pop("lm_head.weight", None)
        assert weights.parameter_count() == sum(t.numel() for t in persistent.values()), kind
    _, moe = load_weights_of(lfm25_ckpts.moe.path)
    per_expert = 3 * 32 * 64
    assert moe.parameter_count() - moe.active_parameter_count(3) == 4 * (6 - 3) * per_expert
