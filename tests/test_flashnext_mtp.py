"""Flash-Next's MTP head against its reference forward (``tests/mtp_reference.py``: the published Qwen3-Next /
Qwen3.5 MTP design on transformers' own qwen4_exp modules, since transformers drops ``mtp.*``), on a tiny random
head in the ``mtp.*`` layout: every position's hidden rows and logits in both forms, chained drafts, and every
malformed head refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest_flashnext import flashnext_ckpts, load_model, per_position, prompt, rel_err  # noqa: F401

from tandem_core.checkpoint.audit import AuditError
from tandem_flashnext.config import read_config
from tandem_flashnext.mtp import MTPHead, load_mtp
from tandem_flashnext.weights import load_weights, open_checkpoint

T = 40               # positions: five times the QSA budget, so the head's own selection matters


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def head(flashnext_ckpts):
    path = flashnext_ckpts.mtp.path
    cfg = read_config(json.loads((path / "config.json").read_text()))
    ckpt = open_checkpoint(path, cfg)
    assert ckpt.mtp_layers == 1 and ckpt.skipped == {}
    target = load_weights(ckpt, cfg)
    return MTPHead(cfg, target, load_mtp(ckpt, cfg), max_context=128)


@pytest.fixture(scope="module")
def inputs(flashnext_ckpts):
    """The target's hidden rows h_0..h_{T-1} (transformers') and the next tokens x_1..x_T."""
    ids = prompt(T + 1, seed=13)
    with torch.no_grad():
        hidden = flashnext_ckpts.text.model.model(ids[None, :T]).last_hidden_state[0]
    return ids[1:], hidden


def test_a_checkpoint_without_a_head_has_none(flashnext_ckpts):
    path = flashnext_ckpts.text.path
    cfg = read_config(json.loads((path / "config.json").read_text()))
    ckpt = open_checkpoint(path, cfg)
    assert ckpt.mtp_layers == 0 and load_mtp(ckpt, cfg) is None


def test_the_heads_prefill_equals_the_reference_at_every_position(flashnext_ckpts, head, inputs):
    nxt, hidden = inputs
    ref_h, ref_logits = flashnext_ckpts.head(nxt, hidden)
    got = head.forward(nxt, hidden, 0)
    assert float(per_position(got.logits, ref_logits).max()) < 1e-4
    assert rel_err(got.hidden, ref_h) < 1e-4


def test_the_heads_decode_form_equals_the_reference(flashnext_ckpts, head, inputs):
    nxt, hidden = inputs
    _, ref_logits = flashnext_ckpts.head(nxt, hidden)
    head.forward(nxt[:25], hidden[:25], 0)
    rows = [head.forward(nxt[t:t + 1], hidden[t:t + 1], t).logits for t in range(25, T)]
    assert float(per_position(torch.cat(rows), ref_logits[25:]).max()) < 1e-4


def test_a_chained_draft_equals_the_reference_fed_its_own_outputs(flashnext_ckpts, head, inputs):
    nxt, hidden = inputs
    head.forward(nxt[:T - 1], hidden[:T - 1], 0)
    draft = head.draft(int(nxt[T - 1]), hidden[T - 1], T - 1, depth=4)
    assert draft.tokens.shape == draft.probs.shape == (4, 2)
    tokens, states = nxt.clone(), hidden.clone()
    for k in range(4):                                   # the reference over the whole sequence, one depth longer
        ref_h, ref_logits = flashnext_ckpts.head(tokens, states)
        p = torch.softmax(ref_logits[-1], dim=-1)
        top = p.topk(2)
        assert draft.tokens[k].tolist() == top.indices.tolist(), f"depth {k}"
        assert torch.allclose(draft.probs[k], top.values, atol=1e-5), f"depth {k}"
        tokens = torch.cat([tokens, top.indices[:1]])
        states = torch.cat([states, ref_h[-1:]])
    assert (draft.probs[:, 0] >= draft.probs[:, 1]).all()


def test_the_target_reads_the_same_with_its_head(flashnext_ckpts):
    ids = prompt(30)
    with_head = load_model(flashnext_ckpts.mtp.path).prefill(ids, 0).logits
    without = load_model(flashnext_ckpts.text.path).prefill(ids, 0).logits
    assert torch.equal(with_head, without)


@pytest.fixture
def mtp_copy(flashnext_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(flashnext_ckpts.mtp.path, path)
    return path


@pytest.mark.parametrize("key, value, named", [
    ("mtp.fc.weight", torch.zeros(64, 192), r"tensor 'mtp\.fc\.weight' has shape \[64, 192\], the config needs \[64, 128\]"),
    ("mtp.layers.0.self_attn.q_proj.weight", torch.zeros(128, 64),
     r"tensor 'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape \[128, 64\], the config needs \[256, 64\]"),
    ("mtp.layers.0.mlp.experts.3.down_proj.weight", None,
     r"missing tensor 'mtp\.layers\.0\.mlp\.experts\.3\.down_proj\.weight'"),
    ("mtp.embed_tokens.weight", torch.zeros(320, 64),
     r"tensor 'mtp\.embed_tokens\.weight' is not one the qwen4_exp model reads"),
    ("mtp.layers.1.input_layernorm.weight", torch.zeros(64),
     r"missing tensor 'mtp\.layers\.1\.post_attention_layernorm\.weight'"),
])
def test_a_malformed_head_is_refused_by_name(mtp_copy, key, value, named):
    from safetensors.torch import load_file, save_file

    data = load_file(str(mtp_copy / "model.safetensors"))
    if value is None:
        data.pop(key)
    else:
        data[key] = value
    save_file(data, str(mtp_copy / "model.safetensors"), metadata={"format": "pt"})
    cfg = read_config(json.loads((mtp_copy / "config.json").read_text()))
    with pytest.raises(AuditError, match=named):
        open_checkpoint(mtp_copy, cfg)


def test_a_head_the_config_counts_otherwise_is_refused(mtp_copy):
    raw = json.loads((mtp_copy / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 2
    with pytest.raises(AuditError, match="the MTP head has 1 decoder layers .* mtp_num_hidden_layers is 2"):
        open_checkpoint(mtp_copy, read_config(raw))
