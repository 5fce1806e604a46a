"""The qwen4_exp config reader on what transformers 5.24.0 writes, both wrappers, and every field it refuses."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from conftest_flashnext import EOS, flashnext_ckpts  # noqa: F401  (fixture)

from tandem_core.checkpoint.config import ConfigError
from tandem_flashnext.config import TEXT_POLICY, read_config


def test_both_wrappers_read_to_the_same_config(flashnext_ckpts):
    text = read_config(flashnext_ckpts.text.raw_config)
    vl = read_config(flashnext_ckpts.vl.raw_config)
    assert text.architecture == "Qwen4ExpForCausalLM" and vl.architecture == "Qwen4ExpForConditionalGeneration"
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
    assert text.output_gate == "silu" and read_config(flashnext_ckpts.sigmoid.raw_config).output_gate == "sigmoid"
    assert text.eos_token_id == EOS


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
    for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"):
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
