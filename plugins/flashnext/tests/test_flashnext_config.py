"""The qwen4_exp config reader on what transformers 5.24.0 writes, both wrappers, the published field set,
and every field it refuses."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from conftest_flashnext import EOS, flashnext_ckpts  # noqa: F401  (fixture)

from tandem_core.checkpoint.config import ConfigError
from tandem_flashnext.config import TEXT_POLICY, read_config
from tandem_flashnext.ngram import ngram_hashes

# The published Qwen3.8-Flash-Next text_config's field set and values (the FP8 release's config.json, its
# quantization_config left out: no FP8 weight format is registered), wrapped as the vision-language
# checkpoint.
FLASH_NEXT = {
    "architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054, "tie_word_embeddings": False, "transformers_version": "5.24.0",
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen4_exp_vision",
                      "out_hidden_size": 2560},
    "text_config": {
        "model_type": "qwen4_exp_text", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 248044, "eos_token_id": 248044, "dtype": "bfloat16",
        "full_attention_interval": 4, "hc_count": 4, "hc_lowrank": 320, "head_dim": 256,
        "heads_per_ngram": 8, "hidden_act": "silu", "hidden_size": 2560,
        "indexer_budget": 2048, "indexer_compress_ratio": 4, "indexer_head_dim": 128,
        "indexer_kv_heads": 1, "indexer_n_heads": 4, "initializer_range": 0.02,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "make_ngram_vocab_size_divisible_by": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "moe_intermediate_size": 640,
        "mtp": {"hybrid": True, "layer_types": ["full_attention"], "mtp_use_hidden_state_from_layer": None,
                "num_hidden_layers": 1, "rope_theta": 10000000},
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "ngram_size": 3, "ngram_vocab_size_base": 20000000, "num_attention_heads": 24,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
        "num_key_value_heads": 2, "output_gate_type": "sigmoid", "output_router_logits": False,
        "pad_token_id": None, "partial_rotary_factor": 0.25, "ple_conv_kernel_size": 4,
        "ple_embed_dim": 2560, "ple_layer_ids": [2], "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 640,
        "split_ngram_parts": 128, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    },
}


def test_both_wrappers_read_to_the_same_config(flashnext_ckpts):
    text = read_config(flashnext_ckpts.text.raw_config)
    vl = read_config(flashnext_ckpts.vl.raw_config)
    assert text.architecture == "Qwen4ExpForCausalLM"
    assert vl.architecture == "Qwen4ExpForConditionalGeneration"
    assert dataclasses.replace(vl, architecture=text.architecture) == text
    # transformers writes "indexed_attention" for the config's "full_attention"
    assert flashnext_ckpts.text.raw_config["layer_types"][2] == "indexed_attention"
    assert text.layer_types == ("linear_attention", "linear_attention", "indexed_attention",
                                "linear_attention", "indexed_attention")
    assert text.linear_layers == (0, 1, 3) and text.attention_layers == (2, 4)
    assert [text.slot(i) for i in range(5)] == [0, 1, 0, 2, 1]
    assert [text.ple_slot(i) for i in range(5)] == [None, 0, None, 1, None]
    assert text.hc_dim == 3 * 64 and text.ngram_heads == 4 and text.ngram_head_dim == 8
    assert text.ple_conv_tail == 3 * 3 and text.block_topk == 2 and text.rotary_dim == 8
    assert text.output_gate == "silu"
    assert read_config(flashnext_ckpts.sigmoid.raw_config).output_gate == "sigmoid"
    assert text.eos_token_id == EOS


def test_the_published_field_set_reads_and_derives_the_stored_hash_buffers():
    cfg = read_config(FLASH_NEXT)
    assert cfg.num_hidden_layers == 48 and len(cfg.linear_layers) == 36 and len(cfg.attention_layers) == 12
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.block_topk == 512 and cfg.hc_dim == 10240
    assert cfg.output_gate == "sigmoid" and cfg.mtp_num_hidden_layers == 1 and cfg.ple_slot(1) == 0
    assert cfg.ngram_heads == 16 and cfg.ngram_head_dim == 160
    (h,) = ngram_hashes(cfg)
    # the release's stored ngram_heads_vocab_sizes, offsets and layer_multipliers
    assert h.sizes == (20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
                       20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171)
    assert h.offsets[1] == 20000003 and h.offsets[-1] == sum(h.sizes[:-1])
    assert h.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert h.rows == 320001536                        # 95.4 GiB of bf16 rows of 160


@pytest.mark.parametrize("path, value, named", [
    (("mtp", "num_hidden_layers"), 2, "'mtp.num_hidden_layers' = 2 disagrees with mtp_num_hidden_layers = 1"),
    (("mtp", "layer_types"), ["linear_attention"], "'mtp.layer_types'"),
    (("mtp", "rope_theta"), 10000, "'mtp.rope_theta' = 10000 differs"),
    (("mtp", "hybrid"), False, "mtp: field 'hybrid' = False is fixed"),
    (("full_attention_interval",), 3, "'full_attention_interval' = 3 disagrees with layer_types"),
    (("mamba_ssm_dtype",), "bfloat16", "'mamba_ssm_dtype' = 'bfloat16' is fixed"),
    (("quantization_config",), {"quant_method": "fp8"}, "unknown field 'quantization_config'"),
])
def test_a_published_field_with_another_value_is_named(path, value, named):
    raw = copy.deepcopy(FLASH_NEXT)
    node = raw["text_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        read_config(raw)


def test_every_field_transformers_writes_has_a_policy(flashnext_ckpts):
    raw = flashnext_ckpts.text.raw_config
    known = TEXT_POLICY.read | TEXT_POLICY.ignored | set(TEXT_POLICY.fixed)
    assert set(raw) <= known, sorted(set(raw) - known)


def text_raw(ckpts) -> dict:
    return copy.deepcopy(ckpts.text.raw_config)


def test_a_full_attention_entry_is_an_indexed_layer(flashnext_ckpts):
    raw = text_raw(flashnext_ckpts)
    raw["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in raw["layer_types"]]
    assert read_config(raw).attention_layers == (2, 4)


@pytest.mark.parametrize("field, value, named", [
    ("sliding_window", 128, "unknown field 'sliding_window'"),
    ("hidden_act", "gelu", "'hidden_act' = 'gelu' is fixed"),
    ("norm_topk_prob", False, "'norm_topk_prob' = False is fixed"),
    ("indexer_kv_heads", 2, "'indexer_kv_heads' = 2 is fixed"),
    ("output_gate_type", "tanh", "'output_gate_type' = 'tanh'"),
    ("hc_count", 1, "'hc_count' = 1"),
    ("num_experts_per_tok", 7, "'num_experts_per_tok' = 7 exceeds num_experts = 6"),
    ("indexer_budget", 10, "'indexer_budget' = 10 is not a multiple of indexer_compress_ratio = 4"),
    ("indexer_head_dim", 4, "'indexer_head_dim' = 4 is smaller than the attention's 8 rotary channels"),
    ("ple_layer_ids", [3], "names layer 3, a indexed_attention layer"),
    ("ple_layer_ids", [6], "names layer 6: ids are one-indexed"),
    ("ple_embed_dim", 30, "'ple_embed_dim' = 30 is not a multiple of the 4 n-gram heads"),
    ("eos_token_id", None, "'eos_token_id' is required when PLE layers are enabled"),
    ("layer_types", ["linear_attention"] * 4, "must list one type for each of the 5 layers"),
    ("model_type", "qwen3_5_text", "'model_type' = 'qwen3_5_text' is fixed"),
])
def test_a_refused_field_is_named(flashnext_ckpts, field, value, named):
    raw = text_raw(flashnext_ckpts)
    raw[field] = value
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        read_config(raw)


def test_qsa_fields_come_all_or_none(flashnext_ckpts):
    raw = text_raw(flashnext_ckpts)
    del raw["indexer_compress_ratio"]
    with pytest.raises(ConfigError, match="'indexer_compress_ratio' is required with the other QSA fields"):
        read_config(raw)
    raw = text_raw(flashnext_ckpts)
    for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
              "indexer_compress_ratio"):
        del raw[k]
    with pytest.raises(ConfigError, match="'indexer_n_heads' is required: every attention layer"):
        read_config(raw)


def test_unknown_outer_and_rope_fields_are_named(flashnext_ckpts):
    raw = copy.deepcopy(flashnext_ckpts.vl.raw_config)
    raw["audio_config"] = {}
    with pytest.raises(ConfigError, match="config.json: unknown field 'audio_config'"):
        read_config(raw)
    raw = copy.deepcopy(flashnext_ckpts.vl.raw_config)
    raw["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match="text_config rope_parameters: field 'rope_type' = 'yarn' is fixed"):
        read_config(raw)
    raw = copy.deepcopy(flashnext_ckpts.vl.raw_config)
    raw["text_config"]["moe_router_bias"] = True
    with pytest.raises(ConfigError, match="config.json text_config: unknown field 'moe_router_bias'"):
        read_config(raw)
