"""The qwen3_5 audit and strict config: each broken checkpoint fails before loading, naming what is wrong."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest_qwen38 import qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.checkpoint.audit import AuditError
from tandem_core.checkpoint.config import ConfigError
from tandem_core.checkpoint.safetensors import CheckpointError
from tandem_qwen38.config import read_config
from tandem_qwen38.weights import open_checkpoint


def open_dir(path):
    return open_checkpoint(path, read_config(json.loads((path / "config.json").read_text())))


@pytest.fixture
def text_copy(qwen38_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(qwen38_ckpts.text.path, path)
    return path


def test_a_clean_checkpoint_passes(text_copy):
    ckpt = open_dir(text_copy)
    assert ckpt.identity and len(ckpt.identity) == 64


def test_missing_tensor_is_named(text_copy):
    tensors = load_file(str(text_copy / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, str(text_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AuditError, match=r"missing tensor 'layers\.1\.linear_attn\.A_log'"):
        open_dir(text_copy)


def test_wrong_shape_is_named(text_copy):
    tensors = load_file(str(text_copy / "model.safetensors"))
    key = "model.layers.3.self_attn.q_proj.weight"
    tensors[key] = tensors[key][:128]
    save_file(tensors, str(text_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AuditError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight.*shape"):
        open_dir(text_copy)


def test_unknown_tensor_is_named(text_copy):
    tensors = load_file(str(text_copy / "model.safetensors"))
    tensors["model.layers.0.linear_attn.extra_proj.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(text_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AuditError, match=r"model\.layers\.0\.linear_attn\.extra_proj\.weight"):
        open_dir(text_copy)


def test_truncated_shard_is_named(qwen38_ckpts, tmp_path):
    path = tmp_path / "sharded"
    qwen38_ckpts.text.model.save_pretrained(path, max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is truncated"):
        open_dir(path)


def test_wrong_sha256_is_named(text_copy):
    good = hashlib.sha256((text_copy / "model.safetensors").read_bytes()).hexdigest()
    (text_copy / "SHA256SUMS").write_text(f"{good}  model.safetensors\n")
    open_dir(text_copy)  # the right sum passes
    bad = ("0" if good[0] != "0" else "1") + good[1:]
    (text_copy / "SHA256SUMS").write_text(f"{bad}  model.safetensors\n")
    with pytest.raises(AuditError, match=r"file model\.safetensors: sha256 .* does not match SHA256SUMS"):
        open_dir(text_copy)


def test_a_sums_file_naming_a_missing_file_is_named(text_copy):
    (text_copy / "SHA256SUMS").write_text(f"{'a' * 64}  model-00002-of-00002.safetensors\n")
    with pytest.raises(AuditError, match=r"model-00002-of-00002\.safetensors listed in SHA256SUMS is "
                                         r"missing"):
        open_dir(text_copy)


# -- the strict config --------------------------------------------------------------------------
@pytest.mark.parametrize("wrapper", ["text", "vl"])
def test_unknown_config_field_is_named(qwen38_ckpts, wrapper):
    raw = copy.deepcopy(getattr(qwen38_ckpts, wrapper).raw_config)
    text = raw.get("text_config", raw)
    text["sliding_window_size"] = 4096
    with pytest.raises(ConfigError, match="unknown field 'sliding_window_size'"):
        read_config(raw)


def test_unknown_outer_field_is_named(qwen38_ckpts):
    raw = copy.deepcopy(qwen38_ckpts.vl.raw_config)
    raw["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(ConfigError, match="unknown field 'quantization_config'"):
        read_config(raw)


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("attn_output_gate", False),
    ("output_gate_type", "sigmoid"),
    ("mamba_ssm_dtype", "bfloat16"),
    ("model_type", "qwen3_next"),
])
def test_fixed_field_with_another_value_is_named(qwen38_ckpts, field, value):
    raw = copy.deepcopy(qwen38_ckpts.text.raw_config)
    raw[field] = value
    with pytest.raises(ConfigError, match=f"field '{field}' = .* is fixed at"):
        read_config(raw)


def test_fixed_rope_type_is_named(qwen38_ckpts):
    raw = copy.deepcopy(qwen38_ckpts.vl.raw_config)
    raw["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError,
                       match=r"text_config rope_parameters: field 'rope_type' = 'yarn' is fixed"):
        read_config(raw)


def test_bad_layer_type_is_named(qwen38_ckpts):
    raw = copy.deepcopy(qwen38_ckpts.text.raw_config)
    raw["layer_types"][2] = "sliding_attention"
    with pytest.raises(ConfigError, match=r"'layer_types'\[2\] = 'sliding_attention'"):
        read_config(raw)
