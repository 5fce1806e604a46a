"""The LFM2 runner against transformers 5.24.0 (fp32) on tiny re-randomised ``lfm2_moe`` and ``lfm2`` checkpoints.

Measured worst logits difference, relative to the logits' scale: 3.1e-7 (moe), 2.8e-7 (moe_untied), 2.9e-7 (dense)
over 70 positions, prefill and prefill + decode alike.
"""

from __future__ import annotations

import pytest
import torch

from conftest_lfm25 import VOCAB, lfm25_ckpts, load_engine, prompt  # noqa: F401  (fixture)

PROMPT = 70          # not a multiple of any chunk size used below


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models' tensors are far below ATen's grain: one thread changes no arithmetic and keeps the many
    small calls fast on a busy 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
KINDS = ["moe", "moe_untied", "dense"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's scale."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def reference_logits(lfm25_ckpts):
    ids = prompt(PROMPT)
    with torch.no_grad():
        return ids, {k: getattr(lfm25_ckpts, k).model(ids[None]).logits[0] for k in KINDS}


def test_the_checkpoints_exercise_what_they_should(lfm25_ckpts):
    moe = lfm25_ckpts.moe.model
    cfg = moe.config
    assert cfg.num_dense_layers >= 1 and cfg.num_experts_per_tok > 1 and cfg.num_experts > cfg.num_experts_per_tok
    bias = moe.model.layers[cfg.num_dense_layers].feed_forward.expert_bias
    assert float(bias.abs().min()) > 0                              # re-randomised, not the zeros it starts at
    assert set(cfg.layer_types) == {"conv", "full_attention"}


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_at_every_position(lfm25_ckpts, reference_logits, kind):
    ids, ref = reference_logits
    eng = load_engine(getattr(lfm25_ckpts, kind).path)
    got = eng.forward(ids, all_logits=True)
    assert got.shape == ref[kind].shape == (PROMPT, VOCAB)
    per_position = (got - ref[kind]).abs().amax(-1) / ref[kind].abs().max()
    assert float(per_position.max()) < 1e-4, f"worst position {int(per_position.argmax())}"
    assert eng.kv.length == PROMPT


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_hidden_after_the_final_norm_equals_transformers(lfm25_ckpts, reference_logits, kind):
    ids, _ = reference_logits
    ck = getattr(lfm25_ckpts, kind)
    with torch.no_grad():
        ref = ck.model.model(ids[None]).last_hidden_state[0]
    eng = load_engine(ck.path, prefill_chunk=16)
    eng.forward(ids)
    assert eng.hidden_post_norm().shape == ref.shape
    assert rel_err(eng.hidden_post_norm(), ref) < 1e-4


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("chunk", [7, 16, 33])
def test_chunked_prefill_equals_one_full_forward(lfm25_ckpts, reference_logits, kind, chunk):
    ids, ref = reference_logits
    path = getattr(lfm25_ckpts, kind).path
    full = load_engine(path, prefill_chunk=4096).forward(ids, all_logits=True)
    got = load_engine(path, prefill_chunk=chunk).forward(ids, all_logits=True)
    assert rel_err(got, full) < 1e-5
    assert rel_err(got, ref[kind]) < 1e-4
    last = load_engine(path, prefill_chunk=chunk).forward(ids)
    assert last.shape == (1, VOCAB) and rel_err(last, full[-1:]) < 1e-5


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_prefill_then_decode_equals_one_full_forward(lfm25_ckpts, reference_logits, kind):
    ids, ref = reference_logits
    path = getattr(lfm25_ckpts, kind).path
    eng = load_engine(path, prefill_chunk=16)
    rows = [eng.forward(ids[:60], all_logits=True)]
    for t in ids[60:]:
        rows.append(eng.forward([int(t)]))
    got = torch.cat(rows)
    assert eng.kv.length == PROMPT
    assert rel_err(got, ref[kind]) < 1e-4
    assert rel_err(got, load_engine(path, prefill_chunk=4096).forward(ids, all_logits=True)) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_32_tokens_equal_transformers_generate(lfm25_ckpts, kind):
    ck = getattr(lfm25_ckpts, kind)
    ids = prompt(23, seed=11)
    with torch.no_grad():
        ref = ck.model.generate(ids[None], max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 23:]
    eos = ck.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    eng = load_engine(ck.path)
    logits = eng.forward(ids)
    out = []
    for _ in range(32):
        logits = logits.clone()
        logits[:, eos] = float("-inf")                       # min_new_tokens: generate never picks an end token
        tok = int(eng.picks(logits)[-1])
        out.append(tok)
        logits = eng.forward([tok])
    assert out == ref.tolist()


def _reference_state(cache, layer_types, length):
    """transformers' cache as the runner's sections and views (copied: the cache mutates in place)."""
    conv = [i for i, t in enumerate(layer_types) if t == "conv"]
    attn = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    return {
        # conv_states: [B, H, conv_L_cache], the last L_cache conv inputs B*x; the oldest is read by no later
        # row (the next step convolves the last L_cache - 1 with its own input), so the runner keeps L_cache - 1
        "conv": torch.stack([cache.layers[i].conv_states[0][0][:, 1:] for i in conv]).clone(),
        # keys/values: [B, Hkv, T, D] (keys after k_layernorm and rope)
        "K": torch.stack([cache.layers[i].keys[0][:, :length] for i in attn]).clone(),
        "V": torch.stack([cache.layers[i].values[0][:, :length] for i in attn]).clone(),
    }


def _assert_state_equal(state, ref, length, when):
    assert state.length == length
    assert rel_err(state.sections["conv"], ref["conv"]) < 1e-5, when
    assert rel_err(state.views["K"].head(length), ref["K"]) < 1e-5, when
    assert rel_err(state.views["V"].head(length), ref["V"]) < 1e-5, when


@pytest.mark.parametrize("kind,chunk", [("moe", 16), ("moe_untied", 33), ("dense", 7)])
def test_state_after_prefill_and_decode_equals_transformers_cache(lfm25_ckpts, reference_logits, kind, chunk):
    ids, _ = reference_logits
    ck = getattr(lfm25_ckpts, kind)
    types = ck.model.config.layer_types
    with torch.no_grad():
        out = ck.model(ids[None], use_cache=True)
        after_prefill = _reference_state(out.cache, types, PROMPT)
        nxt = int(out.logits[0, -1].argmax())
        ck.model(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)     # a decode step (the update kernel)
        after_decode = _reference_state(out.cache, types, PROMPT + 1)
    eng = load_engine(ck.path, prefill_chunk=chunk)
    eng.forward(ids)
    st = eng.state
    n_conv, n_attn = types.count("conv"), types.count("full_attention")
    assert set(st.sections) == {"conv"} and set(st.views) == {"K", "V"}
    assert st.sections["conv"].shape == (n_conv, 64, 2) and st.sections["conv"].dtype == torch.float32
    heads = ck.model.config.num_key_value_heads
    assert st.views["K"].tensor.shape == (n_attn, heads, 256, 16) and st.views["K"].axis == 2
    _assert_state_equal(st, after_prefill, PROMPT, "prefill")
    eng.forward([nxt])
    _assert_state_equal(eng.state, after_decode, PROMPT + 1, "decode")


def test_short_prompt_conv_tail_is_zero_padded_like_transformers(lfm25_ckpts):
    ids = prompt(2, seed=3)                                   # fewer tokens than the conv's taps
    ck = lfm25_ckpts.moe
    with torch.no_grad():
        cache = ck.model(ids[None], use_cache=True).cache
    eng = load_engine(ck.path)
    eng.forward(ids)
    conv = eng.state.sections["conv"]
    assert rel_err(conv[0], cache.layers[0].conv_states[0][0][:, 1:]) < 1e-6
    eng.reset()
    eng.forward(ids[:1])                                      # one token: the oldest tail column stays zero
    assert torch.all(eng.state.sections["conv"][0][:, 0] == 0)
    assert not torch.all(eng.state.sections["conv"][0][:, 1] == 0)


def test_bf16_weights_track_fp32(lfm25_ckpts, reference_logits):
    ids, ref = reference_logits
    got = load_engine(lfm25_ckpts.moe.path, dtype="bf16").forward(ids, all_logits=True)
    assert got.dtype == torch.float32
    assert rel_err(got, ref["moe"]) < 0.05
