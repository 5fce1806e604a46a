"""The qwen4_exp runner under the core's engine against transformers 5.24.0 (fp32), tiny random checkpoints.

Every position's logits within 1e-4 of their scale, both wrappers and both gate activations; the hidden rows
after the final mixer; chunked prefill and prefill-then-decode equal one full forward; 32 greedy tokens equal
``generate``; every state section and view equals transformers' cache after a prefill and after decode steps.
The QSA selection is shown to matter: the same weights with a budget covering every token are far off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest_flashnext import (  # noqa: F401  (fixtures)
    EOS, flashnext_ckpts, load_engine, one_thread, per_position, prompt, rel_err)

from tandem_flashnext.ngram import read_context
from tandem_flashnext.serving import build_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = 70          # not a multiple of any chunk size used below; 70 >> the 8-token QSA budget
WRAPPERS = ["text", "vl", "sigmoid"]


@pytest.fixture(scope="module")
def reference(flashnext_ckpts):
    ids = prompt(PROMPT)
    with torch.no_grad():
        return ids, {name: getattr(flashnext_ckpts, name).model(ids[None]).logits[0] for name in WRAPPERS}


def decode_from(eng, ids: torch.Tensor, split: int) -> torch.Tensor:
    rows = [eng.forward(ids[:split], all_logits=True)]
    rows += [eng.forward(ids[t:t + 1]) for t in range(split, ids.numel())]
    return torch.cat(rows)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_logits_equal_transformers_at_every_position(flashnext_ckpts, reference, wrapper):
    ids, ref = reference
    got = load_engine(getattr(flashnext_ckpts, wrapper).path).forward(ids, all_logits=True)
    assert got.shape == ref[wrapper].shape == (PROMPT, 320)
    err = per_position(got, ref[wrapper])
    assert float(err.max()) < 1e-4, f"worst position {int(err.argmax())}: {float(err.max()):.2e}"


def test_the_qsa_selection_matters(flashnext_ckpts, reference):
    ids, ref = reference
    runner = load_engine(flashnext_ckpts.text.path).runner
    every = build_engine(dataclasses.replace(runner.cfg, indexer_budget=1024), runner.w, 256, 512)
    err = per_position(every.forward(ids, all_logits=True), ref["text"])
    assert float(err[:8].max()) < 1e-4             # within the budget the selection is everything
    assert float(err.max()) > 1e-2                 # past it, attending to every token is another model


def test_hidden_rows_equal_transformers(flashnext_ckpts, reference):
    ids, _ = reference
    with torch.no_grad():
        ref = flashnext_ckpts.text.model.model(ids[None]).last_hidden_state[0]
    eng = load_engine(flashnext_ckpts.text.path, prefill_chunk=16)
    eng.forward(ids)
    assert eng.hidden_post_norm().shape == ref.shape
    assert rel_err(eng.hidden_post_norm(), ref) < 1e-4


@pytest.mark.parametrize("chunk, gdn_chunk", [(7, 64), (16, 4), (33, 16)])
def test_chunked_prefill_equals_one_full_forward(flashnext_ckpts, reference, chunk, gdn_chunk):
    ids, ref = reference
    full = load_engine(flashnext_ckpts.text.path, prefill_chunk=4096).forward(ids, all_logits=True)
    eng = load_engine(flashnext_ckpts.text.path, prefill_chunk=chunk, gdn_chunk=gdn_chunk)
    got = eng.forward(ids, all_logits=True)
    assert rel_err(got, full) < 1e-5 and rel_err(got, ref["text"]) < 1e-4
    last = load_engine(flashnext_ckpts.text.path, prefill_chunk=chunk).forward(ids)
    assert last.shape == (1, 320) and rel_err(last, full[-1:]) < 1e-5


def test_prefill_then_decode_equals_one_full_forward(flashnext_ckpts, reference):
    ids, ref = reference
    got = decode_from(load_engine(flashnext_ckpts.text.path, prefill_chunk=16), ids, 37)
    full = load_engine(flashnext_ckpts.text.path, prefill_chunk=4096).forward(ids, all_logits=True)
    assert rel_err(got, ref["text"]) < 1e-4 and rel_err(got, full) < 1e-5


@pytest.mark.parametrize("wrapper", ["text", "vl"])
def test_32_greedy_tokens_equal_generate(flashnext_ckpts, wrapper):
    ids = prompt(24, seed=9)
    hf = getattr(flashnext_ckpts, wrapper).model
    with torch.no_grad():
        want = hf.generate(ids[None], max_new_tokens=32, do_sample=False, eos_token_id=None)[0, 24:].tolist()
    eng = load_engine(getattr(flashnext_ckpts, wrapper).path)
    logits, got = eng.forward(ids), []
    for _ in range(32):
        got.append(int(eng.picks(logits)[-1]))
        logits = eng.forward([got[-1]])
    assert got == want


def transformers_cache(hf, ids: torch.Tensor, decoded: int):
    """transformers' cache after ``ids`` run as a prefill, then ``decoded`` tokens one at a time."""
    n = ids.numel() - decoded
    with torch.no_grad():
        cache = hf(ids[None, :n], use_cache=True).cache
        for t in range(n, ids.numel()):
            cache = hf(ids[None, t:t + 1], cache=cache, use_cache=True).cache
    return cache


@pytest.mark.parametrize("decoded", [0, 5])
def test_every_state_section_equals_transformers_cache(flashnext_ckpts, decoded):
    ids = prompt(45, seed=3)
    cache = transformers_cache(flashnext_ckpts.text.model, ids, decoded)
    eng = load_engine(flashnext_ckpts.text.path, prefill_chunk=16)
    decode_from(eng, ids, ids.numel() - decoded)
    cfg, sections, views = eng.runner.cfg, eng.state.sections, eng.state.views
    assert set(sections) == {"gdn.S", "gdn.conv", "ple.conv", "ngram.ctx"} and set(views) == {"K", "V", "IK"}
    K1, n = cfg.linear_conv_kernel_dim - 1, ids.numel()
    for i in range(cfg.num_hidden_layers):
        layer, slot = cache.layers[i], cfg.slot(i)
        if cfg.is_linear(i):
            assert rel_err(sections["gdn.S"][slot], layer.recurrent_states[0][0]) < 1e-5, f"layer {i} gdn.S"
            assert rel_err(sections["gdn.conv"][slot], layer.conv_states[0][0][:, -K1:]) < 1e-5, f"layer {i}"
            m = cfg.ple_slot(i)
            if m is not None:
                assert rel_err(sections["ple.conv"][m], layer.conv_states[1][0]) < 1e-5, f"layer {i} ple.conv"
                assert torch.equal(read_context(sections["ngram.ctx"], EOS), layer.conv_states[2][0]), i
        else:
            K, V, IK = (views[v].tensor[slot] for v in ("K", "V", "IK"))
            assert rel_err(K[:, :n], layer.keys[0]) < 1e-5, f"layer {i} K"
            assert rel_err(V[:, :n], layer.values[0]) < 1e-5, f"layer {i} V"
            assert rel_err(IK[:n], layer.indexer_keys[0]) < 1e-5, f"layer {i} IK"


def test_a_reset_is_a_fresh_sequence_with_zeroed_sections(flashnext_ckpts, reference):
    ids, ref = reference
    eng = load_engine(flashnext_ckpts.text.path)
    eng.forward(ids[:30])
    assert read_context(eng.state.sections["ngram.ctx"], EOS).tolist() == ids[28:30].tolist()
    eng.reset()
    assert all(not t.any() for t in eng.state.sections.values())
    assert read_context(eng.state.sections["ngram.ctx"], EOS).tolist() == [EOS, EOS]
    assert per_position(eng.forward(ids, all_logits=True), ref["text"]).max() < 1e-4
