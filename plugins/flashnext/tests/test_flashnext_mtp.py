"""Flash-Next's MTP head against its reference forward (``tests/mtp_reference.py``: vLLM's published qwen4_exp
MTP design on transformers' own qwen4_exp modules, since transformers drops ``mtp.*``), on a tiny random head
in the ``mtp.*`` layout: every position's rows in both forms, chained drafts, the target's streams it reads
(its tap and the ``mtp.h_last`` section), every malformed head refused by name; the shared MTP drafter
(``tandem_drafters.mtp``) over the engine's head, its drafts through a round against the reference, and
speculative decoding with it equal to plain decoding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_flashnext import (  # noqa: F401  (fixtures)
    flashnext_ckpts, load_engine, one_thread, open_dir, per_position, prompt, rel_err)
from mtp_reference import target_streams

from tandem_core.checkpoint.audit import AuditError
from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.engine import supports_mtp
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.testing.trees import flat_prices
from tandem_flashnext.config import read_config
from tandem_flashnext.mtp import MTPHead, load_mtp
from tandem_flashnext.weights import load_weights, open_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

T = 40               # positions: five times the QSA budget, so the head's own selection matters


@pytest.fixture(scope="module")
def head(flashnext_ckpts):
    cfg, ckpt = open_dir(flashnext_ckpts.mtp.path)
    assert ckpt.mtp_layers == 1 and ckpt.skipped == {}
    return MTPHead(cfg, load_weights(ckpt, cfg), load_mtp(ckpt, cfg), max_context=128)


@pytest.fixture(scope="module")
def inputs(flashnext_ckpts):
    """The target's streams s_0..s_{T-1} before its final mixer (transformers') and the tokens x_0..x_T."""
    ids = prompt(T + 1, seed=13)
    return ids, target_streams(flashnext_ckpts.text.model, ids[:T])


def test_a_checkpoint_without_a_head_has_none(flashnext_ckpts):
    cfg, ckpt = open_dir(flashnext_ckpts.text.path)
    assert ckpt.mtp_layers == 0 and load_mtp(ckpt, cfg) is None


def test_the_target_gives_the_head_its_streams(flashnext_ckpts, inputs):
    """The last layer's tap is the target's streams before its final mixer (transformers'); ``mtp.h_last`` is
    the last committed token's, after a prefill, a decode step and a commit."""
    ids, streams = inputs
    eng = load_engine(flashnext_ckpts.mtp.path, last_streams=True)
    last = eng.runner.cfg.num_hidden_layers - 1
    eng.tap([last])
    eng.forward(ids[:T - 3])
    h_last = eng.state.sections["mtp.h_last"]
    assert rel_err(eng.hidden_at(last), streams[:T - 3]) < 1e-4
    assert torch.equal(h_last, eng.hidden_at(last)[-1])
    eng.forward(ids[T - 3:T - 2])
    assert torch.equal(h_last, eng.hidden_at(last)[0])
    eng.forward_tree(ids[T - 2:T + 1], [-1, 0, -1])
    verified = eng.hidden_at(last).clone()
    eng.commit_tree([0, 1])
    assert torch.equal(h_last, verified[1]) and rel_err(verified[1], streams[T - 1]) < 1e-4
    eng.trim_pending(1)                                       # taken back: the streams of the token before
    assert torch.equal(h_last, verified[0])


def test_the_target_reads_the_same_with_its_head(flashnext_ckpts):
    ids = prompt(30)
    assert torch.equal(load_engine(flashnext_ckpts.mtp.path).forward(ids, all_logits=True),
                       load_engine(flashnext_ckpts.text.path).forward(ids, all_logits=True))


def test_the_heads_prefill_equals_the_reference_at_every_position(flashnext_ckpts, head, inputs):
    ids, streams = inputs
    ref_h, ref_s, ref_logits = flashnext_ckpts.head(ids[1:], streams)
    got = head.forward(ids[1:], streams, 0)
    assert float(per_position(got.logits, ref_logits).max()) < 1e-4
    assert rel_err(got.hidden, ref_h) < 1e-4 and rel_err(got.streams, ref_s) < 1e-4


def test_the_heads_decode_form_equals_the_reference(flashnext_ckpts, head, inputs):
    ids, streams = inputs
    _, _, ref_logits = flashnext_ckpts.head(ids[1:], streams)
    head.forward(ids[1:26], streams[:25], 0)
    rows = [head.forward(ids[t + 1:t + 2], streams[t:t + 1], t).logits for t in range(25, T)]
    assert float(per_position(torch.cat(rows), ref_logits[25:]).max()) < 1e-4


def test_a_chained_draft_equals_the_reference_fed_its_own_outputs(flashnext_ckpts, head, inputs):
    ids, streams = inputs
    head.forward(ids[1:T], streams[:T - 1], 0)
    draft = head.draft(int(ids[T]), streams[T - 1], T - 1, depth=4)
    assert draft.tokens.shape == draft.probs.shape == (4, 2)
    tokens, states = ids[1:].clone(), streams.clone()
    # the reference over the whole sequence, one depth longer
    for k in range(4):
        _, ref_s, ref_logits = flashnext_ckpts.head(tokens, states)
        top = torch.softmax(ref_logits[-1], dim=-1).topk(2)
        assert draft.tokens[k].tolist() == top.indices.tolist(), f"depth {k}"
        assert torch.allclose(draft.probs[k], top.values, atol=1e-5), f"depth {k}"
        tokens = torch.cat([tokens, top.indices[:1]])
        states = torch.cat([states, ref_s[-1:]])
    assert (draft.probs[:, 0] >= draft.probs[:, 1]).all()


@pytest.fixture
def mtp_copy(flashnext_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(flashnext_ckpts.mtp.path, path)
    return path


def edit(path, key, value) -> None:
    data = load_file(str(path / "model.safetensors"))
    if value is None:
        data.pop(key)
    else:
        data[key] = value
    save_file(data, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("key, value, named", [
    ("mtp.fc_hidden.weight", torch.zeros(64, 192),
     r"tensor 'mtp\.fc_hidden\.weight' has shape \[64, 192\], the config needs \[64, 64\]"),
    ("mtp.pre_fc_norm_hidden.weight", torch.zeros(64),
     r"tensor 'mtp\.pre_fc_norm_hidden\.weight' has shape \[64\], the config needs \[192\]"),
    ("mtp.layers.0.self_attn.q_proj.weight", torch.zeros(128, 64),
     r"tensor 'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape \[128, 64\], "
     r"the config needs \[256, 64\]"),
    ("mtp.layers.0.mlp.experts.3.down_proj.weight", None,
     r"missing tensor 'mtp\.layers\.0\.mlp\.experts\.3\.down_proj\.weight'"),
    ("mtp.fc.weight", torch.zeros(64, 128), r"tensor 'mtp\.fc\.weight' is not one the qwen4_exp model reads"),
    ("mtp.layers.1.attn_hyper_connection.hc_norm.weight", torch.zeros(192),
     r"missing tensor 'mtp\.layers\.1\.attn_hyper_connection\.input_mix_weight_down\.weight'"),
])
def test_a_malformed_head_is_refused_by_name(mtp_copy, key, value, named):
    edit(mtp_copy, key, value)
    with pytest.raises(AuditError, match=named):
        open_dir(mtp_copy)


def test_a_final_mixers_unused_inject_weight_is_counted_and_its_shape_checked(mtp_copy):
    edit(mtp_copy, "mtp.hyper_connection_mixer.block_inject_weight.weight", torch.zeros(3, 192))
    edit(mtp_copy, "model.hyper_connection_mixer.block_inject_weight.weight", torch.zeros(3, 192))
    _, ckpt = open_dir(mtp_copy)
    assert ckpt.skipped == {"mtp.hyper_connection_mixer.block_inject_weight.weight": 1,
                            "model.hyper_connection_mixer.block_inject_weight.weight": 1}
    edit(mtp_copy, "mtp.hyper_connection_mixer.block_inject_weight.weight", torch.zeros(4, 192))
    named = r"'mtp\.hyper_connection_mixer\.block_inject_weight\.weight' has shape"
    with pytest.raises(AuditError, match=named):
        open_dir(mtp_copy)


def test_a_head_the_config_counts_otherwise_is_refused(mtp_copy):
    raw = json.loads((mtp_copy / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 2
    with pytest.raises(AuditError, match="the MTP head has 1 decoder layers .* mtp_num_hidden_layers is 2"):
        open_checkpoint(mtp_copy, read_config(raw))


# -- the shared MTP drafter over the engine's head ---------------------------------------------------------
def reference_drafts(ref, next_tokens: torch.Tensor, streams: torch.Tensor, depth: int):
    """The reference over the whole sequence, fed its own top token and streams one depth at a time."""
    toks, rows, out = next_tokens.clone(), streams.clone(), []
    for _ in range(depth):
        _, carry, logits = ref(toks, rows)
        top = torch.softmax(logits[-1], dim=-1).topk(2)
        out.append((top.indices, top.values))
        toks, rows = torch.cat([toks, top.indices[:1]]), torch.cat([rows, carry[-1:]])
    return out


def test_the_drafters_drafts_equal_the_reference_through_a_round(flashnext_ckpts):
    """After the prefill, after a committed tree path of four tokens and after a plain decode step, the shared
    drafter's drafts (the engine's head, fed the last layer's streams its verify and forwards tapped) equal
    the reference run over the whole sequence on transformers' target streams."""
    model, ref = flashnext_ckpts.text.model, flashnext_ckpts.head
    eng = load_engine(flashnext_ckpts.mtp.path)
    assert supports_mtp(eng) and eng.caps.mtp == 1
    drafter = build_drafter("mtp", TargetInfo.of(eng.caps, tokenizer=None, vocab_size=320, engine=eng),
                            depth=3, branch_below=1.0)
    p = prompt(24, seed=17).tolist()
    greedy = model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, 24:].tolist()

    def check(seq: list[int], pending: int) -> None:
        proposal = drafter.propose([*seq, pending], 16)
        want = reference_drafts(ref, torch.tensor([*seq[1:], pending]),
                                target_streams(model, torch.tensor(seq)), 3)
        draft = drafter.read()
        for k, (ids, probs) in enumerate(want):
            assert draft.tokens[k].tolist() == ids.tolist(), f"depth {k}"
            assert torch.allclose(draft.probs[k], probs, atol=1e-5), f"depth {k}"
        assert proposal.parents == (-1, -1, 0, 0, 2, 2)

    eng.forward(torch.tensor(p))
    drafter.begin(p)
    check(p, greedy[0])
    eng.forward_tree(torch.tensor([greedy[0], greedy[1], 11, greedy[2], greedy[3]]),
                     torch.tensor([-1, 0, 0, 1, 3]))
    eng.commit_tree([0, 1, 3, 4])
    eng.settle()
    drafter.accepted(greedy[:4])
    check([*p, *greedy[:4]], greedy[4])
    eng.forward(torch.tensor([greedy[4]]))
    drafter.accepted([greedy[4]])
    check([*p, *greedy[:5]], greedy[5])


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_speculative_decoding_with_mtp_equals_plain(flashnext_ckpts, params):
    spec_engine, plain_engine = load_engine(flashnext_ckpts.mtp.path), load_engine(flashnext_ckpts.mtp.path)
    target = TargetInfo.of(spec_engine.caps, tokenizer=None, vocab_size=320, engine=spec_engine)
    spec = Speculation([build_drafter("mtp", target)], StairCut(flat_prices(), max_tree=8), 8)
    rounds = drafted = 0
    for seed in range(3):
        req = DecodeRequest(prompt(10 + 4 * seed, seed=seed).tolist(), 16, params)
        want = [t for c in Decode(plain_engine, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(spec_engine, req, IdDetok(), speculation=spec)
        assert [t for c in dec.run() for t in c.tokens] == want, f"prompt {seed}"
        for name, sec in spec_engine.state.sections.items():
            assert torch.equal(sec, plain_engine.state.sections[name]), name
        rounds, drafted = rounds + dec.stats.rounds, drafted + dec.stats.drafted
    assert drafted >= rounds, f"{drafted} nodes drafted in {rounds} rounds: the head proposed nothing"
