"""The qwen4_exp layout and audit: both wrappers read to one name set, the experts and PLE table shards as
save_pretrained writes them, the vision keys skipped and counted, every broken checkpoint refused by name;
the PLE tables memory-mapped, never read whole."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_flashnext import flashnext_ckpts, open_dir  # noqa: F401  (fixture)

from tandem_core.checkpoint.audit import AuditError
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
from tandem_flashnext.ngram import ngram_hashes
from tandem_flashnext.layout import expected_tensors
from tandem_flashnext.weights import load_weights


@pytest.fixture
def text_copy(flashnext_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(flashnext_ckpts.text.path, path)
    return path


def rewrite(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_vision_keys_are_skipped_and_counted_and_both_wrappers_read_alike(flashnext_ckpts):
    keys = SafetensorsCheckpoint(flashnext_ckpts.vl.path).keys()
    vision = [k for k in keys if k.startswith("model.visual.")]
    assert vision, "the tiny vision-language checkpoint has a vision tower"
    cfg, vl = open_dir(flashnext_ckpts.vl.path)
    _, text = open_dir(flashnext_ckpts.text.path)
    assert vl.skipped == {"model.visual.": len(vision)} and text.skipped == {}
    assert set(vl.layout.names) == set(text.layout.names)
    assert set(expected_tensors(cfg)) < set(text.layout.names)
    name = "layers.3.mlp.experts.5.down_proj.weight"
    assert vl.layout.names[name] == "model.language_model." + name
    assert text.layout.names[name] == "model." + name


def test_the_ple_tables_are_read_from_their_uneven_shards(flashnext_ckpts):
    cfg, ckpt = open_dir(flashnext_ckpts.text.path)
    hashes = ngram_hashes(cfg)
    # primes from 50: 53+59+61+67, 71+73+79+83 padded to 8
    assert [h.rows for h in hashes] == [240, 312]
    assert sorted(ckpt.tables) == [1, 3]
    assert len(ckpt.tables[3]) == 5                        # torch.chunk of 312 rows in 5: 63, 63, 63, 63, 60
    rows = [ckpt.reader.info(ckpt.layout.names[n]).shape[0] for n in ckpt.tables[3]]
    assert rows == [63, 63, 63, 63, 60]
    ref = flashnext_ckpts.text.model.model.layers[3].ple.ple_embedding
    assert list(hashes[1].multipliers) == ref.layer_multipliers.tolist()
    assert list(hashes[1].sizes) == ref.ngram_heads_vocab_sizes.tolist()
    assert list(hashes[1].offsets) == ref.ngram_heads_offsets.tolist()


def test_load_maps_the_tables_and_counts_every_parameter(flashnext_ckpts, monkeypatch):
    cfg, ckpt = open_dir(flashnext_ckpts.text.path)
    tables = {ckpt.layout.names[n] for parts in ckpt.tables.values() for n in parts}
    real_get = ckpt.reader.get

    def get(key):
        assert key not in tables, f"the loader read the PLE table part {key} (it must map it)"
        return real_get(key)

    monkeypatch.setattr(ckpt.reader, "get", get)
    w = load_weights(ckpt, cfg)
    model = flashnext_ckpts.text.model
    assert w.parameter_count() == sum(p.numel() for p in model.parameters())
    ref = model.model.layers[3].ple.ple_embedding.ngram_embedding.weight
    idx = torch.tensor([[0, 62, 63, 311], [125, 126, 250, 252]])
    assert torch.equal(w.layers[3].ple.table.gather(idx, torch.float32), ref[idx])
    assert w.table_bytes == (240 + 312) * 8 * 4
    assert w.nbytes + w.table_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.pop("model.layers.2.mlp.experts.4.up_proj.weight"),
     r"missing tensor 'layers\.2\.mlp\.experts\.4\.up_proj\.weight'"),
    (lambda t: t.update({"model.layers.4.self_attn.indexer.index_qk_proj.weight":
                         t["model.layers.4.self_attn.indexer.index_qk_proj.weight"][:32]}),
     r"'model\.layers\.4\.self_attn\.indexer\.index_qk_proj\.weight' has shape \[32, 64\], "
     r"the config needs \[48, 64\]"),
    (lambda t: t.update({"model.layers.0.mlp.experts.6.up_proj.weight":
                         t["model.layers.0.mlp.experts.5.up_proj.weight"].clone()}),
     r"tensor 'model\.layers\.0\.mlp\.experts\.6\.up_proj\.weight' is not one the qwen4_exp model reads"),
    (lambda t: t.pop("model.layers.3.ple.ple_embedding.ngram_embedding.shard_2.weight"),
     r"PLE layer 3: table shard layers\.3\.ple\.ple_embedding\.ngram_embedding\.shard_2\.weight is missing"),
    (lambda t: t.update({"model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight":
                         t["model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight"][:40]}),
     r"PLE layer 1: the table's shards hold 232 rows, the config's n-gram vocabularies need 240"),
    (lambda t: t["model.layers.1.ple.ple_embedding.layer_multipliers"].add_(2),
     r"'model\.layers\.1\.ple\.ple_embedding\.layer_multipliers' = .* differs from what the config derives"),
])
def test_a_broken_checkpoint_is_refused_by_name(text_copy, edit, named):
    rewrite(text_copy, edit)
    with pytest.raises(AuditError, match=named):
        open_dir(text_copy)


def test_an_unsplit_table_reads_as_its_shards(text_copy, flashnext_ckpts):
    def join(t):
        pre = "model.layers.1.ple.ple_embedding.ngram_embedding."
        parts = [t.pop(f"{pre}shard_{i}.weight") for i in range(5)]
        t[pre + "weight"] = torch.cat(parts)

    rewrite(text_copy, join)
    cfg, ckpt = open_dir(text_copy)
    assert ckpt.tables[1] == ["layers.1.ple.ple_embedding.ngram_embedding.weight"]
    w = load_weights(ckpt, cfg)
    ref = flashnext_ckpts.text.model.model.layers[1].ple.ple_embedding.ngram_embedding.weight
    assert torch.equal(w.layers[1].ple.table.gather(torch.arange(240), torch.float32), ref)
