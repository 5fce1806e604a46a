"""The qwen4_exp arithmetic against transformers 5.24.0 (fp32) on tiny re-randomised checkpoints.

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
    flashnext_ckpts, load_model, per_position, prompt, rel_err, one_thread)

from tandem_flashnext.model import FlashNextModel

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = 70          # not a multiple of any chunk size used below; 70 >> the 8-token QSA budget
WRAPPERS = ["text", "vl", "sigmoid"]


@pytest.fixture(scope="module")
def reference(flashnext_ckpts):
    ids = prompt(PROMPT)
    with torch.no_grad():
        return ids, {name: getattr(flashnext_ckpts, name).model(ids[None]).logits[0] for name in WRAPPERS}


def decode_from(model: FlashNextModel, ids: torch.Tensor, split: int) -> torch.Tensor:
    rows = [model.prefill(ids[:split], 0).logits]
    rows += [model.decode(ids[t:t + 1], t).logits for t in range(split, ids.numel())]
    return torch.cat(rows)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_logits_equal_transformers_at_every_position(flashnext_ckpts, reference, wrapper):
    ids, ref = reference
    model = load_model(getattr(flashnext_ckpts, wrapper).path)
    got = model.prefill(ids, 0).logits
    assert got.shape == ref[wrapper].shape == (PROMPT, 320)
    err = per_position(got, ref[wrapper])
    assert float(err.max()) < 1e-4, f"worst position {int(err.argmax())}: {float(err.max()):.2e}"


def test_the_qsa_selection_matters(flashnext_ckpts, reference):
    ids, ref = reference
    model = load_model(flashnext_ckpts.text.path)
    every = FlashNextModel(dataclasses.replace(model.cfg, indexer_budget=1024), model.w, max_context=256)
    err = per_position(every.prefill(ids, 0).logits, ref["text"])
    assert float(err[:8].max()) < 1e-4             # within the budget the selection is everything
    assert float(err.max()) > 1e-2                 # past it, attending to every token is another model


def test_hidden_rows_equal_transformers(flashnext_ckpts, reference):
    ids, _ = reference
    with torch.no_grad():
        ref = flashnext_ckpts.text.model.model(ids[None]).last_hidden_state[0]
    got = load_model(flashnext_ckpts.text.path).prefill(ids, 0, logits="none")
    assert got.logits is None and got.hidden.shape == ref.shape
    assert rel_err(got.hidden, ref) < 1e-4


@pytest.mark.parametrize("chunk, gdn_chunk", [(7, 64), (16, 4), (33, 16)])
def test_chunked_prefill_equals_one_full_forward(flashnext_ckpts, reference, chunk, gdn_chunk):
    ids, ref = reference
    full = load_model(flashnext_ckpts.text.path).prefill(ids, 0).logits
    model = load_model(flashnext_ckpts.text.path, gdn_chunk=gdn_chunk)
    got = torch.cat([model.prefill(ids[s:s + chunk], s).logits for s in range(0, PROMPT, chunk)])
    assert rel_err(got, full) < 1e-5 and rel_err(got, ref["text"]) < 1e-4
    last = load_model(flashnext_ckpts.text.path).prefill(ids, 0, logits="last").logits
    assert last.shape == (1, 320) and rel_err(last, full[-1:]) < 1e-5


def test_prefill_then_decode_equals_one_full_forward(flashnext_ckpts, reference):
    ids, ref = reference
    got = decode_from(load_model(flashnext_ckpts.text.path), ids, 37)
    full = load_model(flashnext_ckpts.text.path).prefill(ids, 0).logits
    assert rel_err(got, ref["text"]) < 1e-4 and rel_err(got, full) < 1e-5


@pytest.mark.parametrize("wrapper", ["text", "vl"])
def test_32_greedy_tokens_equal_generate(flashnext_ckpts, wrapper):
    ids = prompt(24, seed=9)
    hf = getattr(flashnext_ckpts, wrapper).model
    with torch.no_grad():
        want = hf.generate(ids[None], max_new_tokens=32, do_sample=False, eos_token_id=None)[0, 24:].tolist()
    model = load_model(getattr(flashnext_ckpts, wrapper).path)
    tok, got = int(model.prefill(ids, 0, logits="last").logits.argmax()), []
    for t in range(24, 24 + 32):
        got.append(tok)
        tok = int(model.decode(torch.tensor([tok]), t).logits.argmax())
    assert got == want


def transformers_cache(hf, ids: torch.Tensor, steps: list[int]):
    """transformers' cache after ``ids`` run as a prefill of ``len(ids) - len(steps)`` then one token each."""
    n = ids.numel() - len(steps)
    with torch.no_grad():
        out = hf(ids[None, :n], use_cache=True)
        cache = out.cache
        for t in range(n, ids.numel()):
            cache = hf(ids[None, t:t + 1], cache=cache, use_cache=True).cache
    return cache


@pytest.mark.parametrize("decoded", [0, 5])
def test_every_state_section_equals_transformers_cache(flashnext_ckpts, decoded):
    ids = prompt(45, seed=3)
    hf, cfg = flashnext_ckpts.text.model, None
    cache = transformers_cache(hf, ids, list(range(decoded)))
    model = load_model(flashnext_ckpts.text.path)
    cfg = model.cfg
    decode_from(model, ids, ids.numel() - decoded)
    sections, views = model.buffers()
    assert set(sections) == {"gdn.S", "gdn.conv", "ple.conv", "ngram.ctx"} and set(views) == {"K", "V", "IK"}
    K1 = cfg.linear_conv_kernel_dim - 1
    n = ids.numel()
    for i in range(cfg.num_hidden_layers):
        layer, slot = cache.layers[i], cfg.slot(i)
        if cfg.is_linear(i):
            assert rel_err(sections["gdn.S"][slot], layer.recurrent_states[0][0]) < 1e-5, f"layer {i} gdn.S"
            assert rel_err(sections["gdn.conv"][slot], layer.conv_states[0][0][:, -K1:]) < 1e-5, f"layer {i}"
            m = cfg.ple_slot(i)
            if m is not None:
                assert rel_err(sections["ple.conv"][m], layer.conv_states[1][0]) < 1e-5, f"layer {i} ple.conv"
                assert torch.equal(sections["ngram.ctx"], layer.conv_states[2][0]), f"layer {i} ngram.ctx"
        else:
            K, V, IK = (views[v][0][slot] for v in ("K", "V", "IK"))
            assert rel_err(K[:, :n], layer.keys[0]) < 1e-5, f"layer {i} K"
            assert rel_err(V[:, :n], layer.values[0]) < 1e-5, f"layer {i} V"
            assert rel_err(IK[:n], layer.indexer_keys[0]) < 1e-5, f"layer {i} IK"


def test_reset_starts_the_sequence_over(flashnext_ckpts, reference):
    ids, ref = reference
    model = load_model(flashnext_ckpts.text.path)
    model.prefill(ids[:30], 0)
    model.reset()
    sections, _ = model.buffers()
    assert all(not t.any() for k, t in sections.items() if k != "ngram.ctx")
    assert sections["ngram.ctx"].tolist() == [model.cfg.eos_token_id] * 2
    assert per_position(model.prefill(ids, 0).logits, ref["text"]).max() < 1e-4
