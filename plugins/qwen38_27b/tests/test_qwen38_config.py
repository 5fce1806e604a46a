"""The qwen3_5 config reader on what transformers 5.24.0 writes, and on the published 27B's field set."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from conftest_qwen38 import qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.checkpoint.config import ConfigError
from tandem_core.registry import architecture
from tandem_qwen38.config import read_config

# The field set of the published Qwen3.5-27B config.json (sizes as DESIGN.md gives the 27B).
QWEN35_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24, "num_hidden_layers": 64,
        "num_key_value_heads": 4, "output_gate_type": "swish", "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "model_type": "qwen3_5", "num_heads": 16, "out_hidden_size": 5120},
}


def test_both_wrappers_read_to_the_same_config(qwen38_ckpts):
    text = read_config(qwen38_ckpts.text.raw_config)
    vl = read_config(qwen38_ckpts.vl.raw_config)
    assert text.architecture == "Qwen3_5ForCausalLM" and vl.architecture == "Qwen3_5ForConditionalGeneration"
    assert dataclasses.replace(vl, architecture=text.architecture) == text
    assert text.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert text.linear_layers == (0, 1, 2) and text.attention_layers == (3,)
    assert [text.slot(i) for i in range(4)] == [0, 1, 2, 0]
    assert text.rotary_dim == 8 and text.rope_theta == 10000.0 and text.mrope_section == (2, 1, 1)
    assert text.conv_dim == 2 * 2 * 16 + 4 * 24
    assert not text.tie_word_embeddings and read_config(qwen38_ckpts.tied.raw_config).tie_word_embeddings


def test_the_published_27b_field_set_reads():
    cfg = read_config(QWEN35_27B)
    assert cfg.num_hidden_layers == 64 and len(cfg.linear_layers) == 48 and len(cfg.attention_layers) == 16
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.mrope_section == (11, 11, 10)
    assert cfg.conv_dim == 2 * 16 * 128 + 48 * 128 and cfg.eos_token_ids == (248044,)
    assert architecture(QWEN35_27B).name == "qwen3_5"


def test_partial_rotary_disagreement_is_named():
    raw = copy.deepcopy(QWEN35_27B)
    raw["text_config"]["partial_rotary_factor"] = 0.5
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        read_config(raw)


def test_missing_size_is_named():
    raw = copy.deepcopy(QWEN35_27B)
    del raw["text_config"]["linear_num_value_heads"]
    with pytest.raises(ConfigError, match="'linear_num_value_heads' is required"):
        read_config(raw)


def test_heads_that_do_not_group_are_named():
    raw = copy.deepcopy(QWEN35_27B)
    raw["text_config"]["linear_num_value_heads"] = 40
    raw["text_config"]["linear_num_key_heads"] = 16
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        read_config(raw)


def test_the_mtp_heads_fields_are_read_and_a_dedicated_embedding_refused():
    assert read_config(QWEN35_27B).mtp_num_hidden_layers == 1
    raw = copy.deepcopy(QWEN35_27B)
    raw["text_config"]["mtp_use_dedicated_embeddings"] = True
    with pytest.raises(ConfigError, match="'mtp_use_dedicated_embeddings' = True is fixed at False"):
        read_config(raw)
    raw = copy.deepcopy(QWEN35_27B)
    raw["text_config"]["mtp_num_hidden_layers"] = -1
    with pytest.raises(ConfigError, match="'mtp_num_hidden_layers' = -1 is not a non-negative integer"):
        read_config(raw)
