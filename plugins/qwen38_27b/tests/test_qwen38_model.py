"""The qwen3_5 engine against transformers 5.24.0 (fp32) on tiny re-randomised checkpoints, both wrappers."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest_qwen38 import load_engine, prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.engine import Capabilities, Engine, Manifest, TreeEngine
from tandem_core.state import StateMismatch

PROMPT = 70          # not a multiple of any chunk size used below
WRAPPERS = ["text", "vl"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's scale."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def reference_logits(qwen38_ckpts):
    ids = prompt(PROMPT, qwen38_ckpts.text.model.config.vocab_size)
    out = {}
    with torch.no_grad():
        for name in WRAPPERS:
            out[name] = getattr(qwen38_ckpts, name).model(ids[None]).logits[0]
    return ids, out


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_logits_equal_transformers_at_every_position(qwen38_ckpts, reference_logits, wrapper):
    ids, ref = reference_logits
    eng = load_engine(getattr(qwen38_ckpts, wrapper).path)
    got = eng.forward(ids, all_logits=True)
    assert got.shape == ref[wrapper].shape == (PROMPT, 320)
    per_position = (got - ref[wrapper]).abs().amax(-1) / ref[wrapper].abs().max()
    assert float(per_position.max()) < 1e-4, f"worst position {int(per_position.argmax())}"
    assert eng.kv.length == PROMPT


def test_hidden_post_norm_equals_transformers(qwen38_ckpts, reference_logits):
    ids, _ = reference_logits
    with torch.no_grad():
        ref = qwen38_ckpts.text.model.model(ids[None]).last_hidden_state[0]
    eng = load_engine(qwen38_ckpts.text.path, prefill_chunk=16)
    eng.forward(ids)
    assert eng.hidden_post_norm().shape == ref.shape
    assert rel_err(eng.hidden_post_norm(), ref) < 1e-4


@pytest.mark.parametrize("chunk", [7, 16, 33])
def test_chunked_prefill_equals_one_full_forward(qwen38_ckpts, reference_logits, chunk):
    ids, ref = reference_logits
    full = load_engine(qwen38_ckpts.text.path, prefill_chunk=4096).forward(ids, all_logits=True)
    eng = load_engine(qwen38_ckpts.text.path, prefill_chunk=chunk)
    got = eng.forward(ids, all_logits=True)
    assert rel_err(got, full) < 1e-5
    assert rel_err(got, ref["text"]) < 1e-4
    last = load_engine(qwen38_ckpts.text.path, prefill_chunk=chunk).forward(ids)
    assert last.shape == (1, 320) and rel_err(last, full[-1:]) < 1e-5


def test_prefill_then_decode_equals_one_full_forward(qwen38_ckpts, reference_logits):
    ids, ref = reference_logits
    eng = load_engine(qwen38_ckpts.text.path, prefill_chunk=16)
    rows = [eng.forward(ids[:60], all_logits=True)]
    for t in ids[60:]:
        rows.append(eng.forward([int(t)]))
    got = torch.cat(rows)
    assert eng.kv.length == PROMPT
    assert rel_err(got, ref["text"]) < 1e-4
    full = load_engine(qwen38_ckpts.text.path, prefill_chunk=4096).forward(ids, all_logits=True)
    assert rel_err(got, full) < 1e-5


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_greedy_32_tokens_equal_transformers_generate(qwen38_ckpts, wrapper):
    ck = getattr(qwen38_ckpts, wrapper)
    ids = prompt(23, 320, seed=11)
    with torch.no_grad():
        ref = ck.model.generate(ids[None], max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 23:]
    eng = load_engine(ck.path)
    logits = eng.forward(ids)
    out = []
    for _ in range(32):
        tok = int(eng.picks(logits)[-1])
        out.append(tok)
        logits = eng.forward([tok])
    assert out == ref.tolist()


def _reference_state(cache, layer_types, length):
    """transformers' cache as the engine's sections and views (copied: the cache mutates in place)."""
    linear = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    return {
        # recurrent_states: [B, Hv, Dk, Dv]; conv_states: [B, conv_dim, K], the last K conv inputs
        "gdn.S": torch.stack([cache.layers[i].recurrent_states[0][0] for i in linear]).clone(),
        "gdn.conv": torch.stack([cache.layers[i].conv_states[0][0][:, 1:] for i in linear]).clone(),
        # keys/values: [B, Hkv, T, D] (keys after q/k norm and rope)
        "K": torch.stack([cache.layers[i].keys[0][:, :length] for i in full]).clone(),
        "V": torch.stack([cache.layers[i].values[0][:, :length] for i in full]).clone(),
    }


def _assert_state_equal(state, ref, length, when):
    assert state.length == length
    assert rel_err(state.sections["gdn.S"], ref["gdn.S"]) < 1e-5, when
    assert rel_err(state.sections["gdn.conv"], ref["gdn.conv"]) < 1e-6, when
    assert rel_err(state.views["K"].head(length), ref["K"]) < 1e-5, when
    assert rel_err(state.views["V"].head(length), ref["V"]) < 1e-5, when


@pytest.mark.parametrize("wrapper,chunk", [("text", 16), ("vl", 33)])
def test_state_after_prefill_and_decode_equals_transformers_cache(qwen38_ckpts, reference_logits, wrapper,
                                                                   chunk):
    ids, _ = reference_logits
    ck = getattr(qwen38_ckpts, wrapper)
    types = getattr(ck.model.config, "text_config", ck.model.config).layer_types
    with torch.no_grad():
        out = ck.model(ids[None], use_cache=True)
        after_prefill = _reference_state(out.cache, types, PROMPT)
        nxt = int(out.logits[0, -1].argmax())
        ck.model(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)      # a decode step (recurrent form)
        after_decode = _reference_state(out.cache, types, PROMPT + 1)
    eng = load_engine(ck.path, prefill_chunk=chunk)
    eng.forward(ids)
    st = eng.state
    assert set(st.sections) == {"gdn.S", "gdn.conv"} and set(st.views) == {"K", "V"}
    assert st.sections["gdn.S"].shape == (3, 4, 16, 24) and st.sections["gdn.S"].dtype == torch.float32
    assert st.sections["gdn.conv"].shape == (3, 2 * 2 * 16 + 4 * 24, 3)
    assert st.views["K"].tensor.shape == (1, 2, 256, 32) and st.views["K"].axis == 2
    _assert_state_equal(st, after_prefill, PROMPT, "prefill")
    eng.forward([nxt])
    _assert_state_equal(eng.state, after_decode, PROMPT + 1, "decode")


def test_short_prompt_conv_tail_is_zero_padded_like_transformers(qwen38_ckpts):
    ids = prompt(2, 320, seed=3)                                   # fewer tokens than the conv's K-1
    with torch.no_grad():
        cache = qwen38_ckpts.text.model(ids[None], use_cache=True).cache
    eng = load_engine(qwen38_ckpts.text.path)
    eng.forward(ids)
    ref = cache.layers[0].conv_states[0][0][:, 1:]
    assert rel_err(eng.state.sections["gdn.conv"][0], ref) < 1e-6
    assert torch.all(eng.state.sections["gdn.conv"][0][:, 0] == 0)


def test_engine_protocol_caps_and_cold_verbs(qwen38_ckpts):
    eng = load_engine(qwen38_ckpts.text.path, max_context=128)
    assert isinstance(eng, Engine)
    assert isinstance(eng, TreeEngine)            # the tree verbs: test_qwen38_runner.py
    assert isinstance(eng.caps, Capabilities)
    assert eng.state.sections and eng.caps.tree and eng.caps.resume
    assert eng.caps.max_context == 128 and eng.caps.dtype == "fp32"
    parts = {p.name: p for p in eng.memory_parts()}
    assert set(parts) == {"weights", "gdn.S", "gdn.conv", "kv", "pending.sections"}
    assert parts["kv"].nbytes == 2 * 1 * 2 * 128 * 32 * 4
    assert parts["gdn.S"].nbytes == 3 * 4 * 16 * 24 * 4
    assert parts["pending.sections"].nbytes == parts["gdn.S"].nbytes + parts["gdn.conv"].nbytes
    man = eng.manifest()
    assert isinstance(man, Manifest)
    names = {f.rsplit("/", 1)[-1] for f in man.files}
    assert {"model.py", "weights.py", "config.py", "gdn.py", "conv.py", "attention.py", "norm.py", "act.py",
            "rope.py", "linear.py"} <= names
    assert man.settings["dtype"] == "fp32" and man.settings["prefill_chunk"] == 512
    assert man.extra["weights"] and man.fingerprint() == eng.manifest().fingerprint()
    other = load_engine(qwen38_ckpts.text.path, max_context=128, prefill_chunk=7)
    assert other.manifest().fingerprint() != man.fingerprint()


def test_state_restore_lands_in_the_buffers_and_sets_length(qwen38_ckpts, reference_logits):
    ids, _ = reference_logits
    eng = load_engine(qwen38_ckpts.text.path, prefill_chunk=16)
    eng.forward(ids[:40])
    snap = eng.state.clone()
    assert snap.length == 40 and snap.views["K"].tensor.shape[2] == 40
    a = eng.forward(ids[40:50], all_logits=True)
    assert eng.kv.length == 50
    eng.state.restore(snap)
    assert eng.kv.length == 40
    b = eng.forward(ids[40:50], all_logits=True)
    assert torch.equal(a, b)
    # into a second engine over the same weights
    twin = load_engine(qwen38_ckpts.text.path, prefill_chunk=16)
    twin.state.restore(snap)
    assert twin.kv.length == 40 and torch.equal(twin.forward(ids[40:50], all_logits=True), a)
    # resume: back to 40 tokens in place from an anchor's sections (the views already hold the prefix)
    eng.forward(ids[50:60])
    eng.state.resume(40, snap.sections)
    assert eng.kv.length == 40 and torch.equal(eng.forward(ids[40:50], all_logits=True), a)
    small = load_engine(qwen38_ckpts.text.path, max_context=32)
    with pytest.raises(StateMismatch, match="exceeds capacity"):
        small.state.restore(snap)


def test_reset_and_limits(qwen38_ckpts, reference_logits):
    ids, ref = reference_logits
    eng = load_engine(qwen38_ckpts.text.path, max_context=80)
    eng.forward(ids[:30])
    eng.reset()
    assert eng.kv.length == 0 and not eng.state.sections["gdn.S"].any()
    assert rel_err(eng.forward(ids, all_logits=True), ref["text"]) < 1e-4
    with pytest.raises(ValueError, match="exceed the engine's context of 80"):
        eng.forward(ids[:11])
    eng.reset()
    with pytest.raises(ValueError, match="token id 320"):
        eng.forward([1, 320])
    with pytest.raises(ValueError, match="no tokens"):
        eng.forward([])


def test_bf16_weights_track_fp32_as_closely_as_transformers_in_bf16(qwen38_ckpts, reference_logits):
    ids, ref = reference_logits
    with torch.no_grad():
        ref_bf16 = copy.deepcopy(qwen38_ckpts.text.model).to(torch.bfloat16)(ids[None]).logits[0].float()
    eng = load_engine(qwen38_ckpts.text.path, dtype="bf16")
    assert eng.caps.dtype == "bf16" and eng.state.views["K"].tensor.dtype == torch.bfloat16
    assert eng.state.sections["gdn.S"].dtype == torch.float32
    got = eng.forward(ids, all_logits=True)
    assert got.dtype == torch.float32

    def mean_rel(a: torch.Tensor) -> float:
        return float((a - ref["text"]).abs().mean() / ref["text"].abs().mean())

    assert mean_rel(got) < 0.05
    assert mean_rel(got) <= 1.5 * mean_rel(ref_bf16)
