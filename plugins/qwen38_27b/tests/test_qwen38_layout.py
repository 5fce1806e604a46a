"""The qwen3_5 layout: both wrappers, tied and untied heads and sharded checkpoints read to one name set."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest_qwen38 import load_engine, prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.checkpoint.audit import AuditError
from tandem_qwen38.config import read_config
from tandem_qwen38.weights import expected_tensors, open_checkpoint


def keys_of(path) -> list[str]:
    out = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.extend(st.keys())
    return out


def opened(path):
    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, open_checkpoint(path, cfg)


def test_vision_keys_are_skipped_and_counted(qwen38_ckpts):
    path = qwen38_ckpts.vl.path
    vision = [k for k in keys_of(path) if k.startswith("model.visual.")]
    assert vision, "the tiny vision-language checkpoint has a vision tower"
    cfg, ckpt = opened(path)
    assert ckpt.skipped == {"model.visual.": len(vision)}
    assert not any(v.startswith("model.visual.") for v in ckpt.layout.names.values())
    assert set(ckpt.layout.names) == set(expected_tensors(cfg))
    a_log = "layers.0.linear_attn.A_log"
    assert ckpt.layout.names[a_log] == "model.language_model." + a_log
    assert ckpt.layout.names["lm_head.weight"] == "lm_head.weight"


def test_both_wrappers_read_to_the_same_canonical_names(qwen38_ckpts):
    _, text = opened(qwen38_ckpts.text.path)
    _, vl = opened(qwen38_ckpts.vl.path)
    assert set(text.layout.names) == set(vl.layout.names)
    assert text.skipped == {}
    assert text.layout.names["norm.weight"] == "model.norm.weight"
    assert vl.layout.names["norm.weight"] == "model.language_model.norm.weight"


def test_tied_and_untied_heads_read_to_the_same_canonical_names(qwen38_ckpts):
    assert "lm_head.weight" not in keys_of(qwen38_ckpts.tied.path)
    _, untied = opened(qwen38_ckpts.text.path)
    _, tied = opened(qwen38_ckpts.tied.path)
    assert set(tied.layout.names) == set(untied.layout.names)
    assert tied.layout.head_tied and not untied.layout.head_tied
    assert tied.layout.names["lm_head.weight"] == tied.layout.names["embed_tokens.weight"]
    eng = load_engine(qwen38_ckpts.tied.path)
    w = eng.runner.w
    assert w.tied and w.head.weight.data_ptr() == w.embed.data_ptr()
    ids = prompt(33, 320)
    with torch.no_grad():
        ref = qwen38_ckpts.tied.model(ids[None]).logits[0]
    got = eng.forward(ids, all_logits=True)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_a_missing_head_without_tying_is_refused(qwen38_ckpts, tmp_path):
    import shutil

    path = tmp_path / "untied_no_head"
    shutil.copytree(qwen38_ckpts.tied.path, path)
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(AuditError, match="lm_head.weight"):
        opened(path)


def test_sharded_checkpoint_loads_and_equals_the_single_file_one(qwen38_ckpts, tmp_path):
    path = tmp_path / "sharded"
    qwen38_ckpts.text.model.save_pretrained(path, max_shard_size="40KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").exists()
    _, ckpt = opened(path)
    _, single = opened(qwen38_ckpts.text.path)
    assert set(ckpt.layout.names) == set(single.layout.names)
    assert len({ckpt.reader.info(k).file for k in ckpt.layout.names.values()}) == len(shards)
    ids = prompt(45, 320)
    a = load_engine(path).forward(ids, all_logits=True)
    b = load_engine(qwen38_ckpts.text.path).forward(ids, all_logits=True)
    assert torch.equal(a, b)
