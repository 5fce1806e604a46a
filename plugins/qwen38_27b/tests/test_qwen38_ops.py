"""tandem_core.ops: each plain-torch reference against transformers' qwen3_5 functions, and the dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem_core import ops
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def gdn_inputs(T: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, dk, generator=g)
    k = torch.randn(T, hk, dk, generator=g)
    v = torch.randn(T, hv, dv, generator=g)
    decay = -torch.rand(T, hv, generator=g) * 2.0
    beta = torch.rand(T, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 64), (130, 64), (50, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("op", ["gdn_chunk", "gdn_recurrent"])
def test_gated_delta_rule_equals_transformers(op, T, chunk):
    q, k, v, g, beta, s0 = gdn_inputs(T)
    ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    l2 = ops.get("l2_norm")
    kw = {"chunk": chunk} if op == "gdn_chunk" else {}
    o, s = ops.get(op)(l2(q), l2(k), v, g, beta, s0, scale=16 ** -0.5, **kw)
    assert o.shape == (T, 4, 24) and s.shape == (4, 16, 24)
    assert rel_err(o, ref_o[0]) < 2e-6
    assert rel_err(s, ref_s[0]) < 2e-6


def test_gated_delta_rule_does_not_mutate_its_state():
    q, k, v, g, beta, s0 = gdn_inputs(9)
    before = s0.clone()
    ops.get("gdn_chunk")(q, k, v, g, beta, s0, scale=0.25)
    ops.get("gdn_recurrent")(q, k, v, g, beta, s0, scale=0.25)
    assert torch.equal(s0, before)


def test_chunked_rule_split_anywhere_equals_one_call():
    q, k, v, g, beta, s0 = gdn_inputs(90, seed=3)
    q, k = ops.get("l2_norm")(q), ops.get("l2_norm")(k)
    fn = ops.get("gdn_chunk")
    whole, s_whole = fn(q, k, v, g, beta, s0, scale=0.25)
    a, s_a = fn(q[:41], k[:41], v[:41], g[:41], beta[:41], s0, scale=0.25)
    b, s_b = fn(q[41:], k[41:], v[41:], g[41:], beta[41:], s_a, scale=0.25)
    assert rel_err(torch.cat([a, b]), whole) < 2e-6 and rel_err(s_b, s_whole) < 2e-6


def test_causal_conv_equals_transformers_with_and_without_tail():
    g = torch.Generator().manual_seed(1)
    C, K, T = 12, 4, 29
    x = torch.randn(T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    fn = ops.get("causal_conv")
    y, tail = fn(x, torch.zeros(C, K - 1), w)
    assert rel_err(y, ref) < 1e-6 and torch.equal(tail, x[-(K - 1):].t())
    y1, t1 = fn(x[:10], torch.zeros(C, K - 1), w)
    y2, t2 = fn(x[10:11], t1, w)                      # one token, as a decode step
    y3, t3 = fn(x[11:], t2, w)
    assert rel_err(torch.cat([y1, y2, y3]), ref) < 1e-6 and torch.equal(t3, tail)
    # transformers' decode update on a K-wide state (the oldest column is never read)
    state = torch.cat([torch.zeros(C, 1), t2], dim=1)[None].clone()
    upd = hf.causal_conv1d_update(x[11:12].t()[None], state, w, None, "silu")
    assert rel_err(fn(x[11:12], t2, w)[0], upd[0].t()) < 1e-6


def test_norms_equal_transformers_modules():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 3, 24, generator=g)
    w = torch.randn(24, generator=g) * 0.3
    zc = hf.Qwen3_5RMSNorm(24, eps=1e-6)
    gated = hf.Qwen3_5RMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        zc.weight.copy_(w)
        gated.weight.copy_(w)
        gate = torch.randn(7, 3, 24, generator=g)
        assert rel_err(ops.get("rms_norm_1p")(x, w, 1e-6), zc(x)) < 1e-6
        assert rel_err(ops.get("gated_rms_norm")(x, gate, w, 1e-6), gated(x, gate)) < 1e-6
    assert rel_err(ops.get("l2_norm")(x), hf.l2norm(x)) < 1e-6
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert rel_err(ops.get("rms_norm")(x, w, 1e-6), plain) < 1e-6


def test_text_rope_equals_transformers_mrope():
    """Text positions are equal in every mrope section: transformers' interleaved mrope is plain rope."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                             "mrope_interleaved": True})
    emb = hf.Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.arange(100, 140)
    x = torch.randn(1, 40, 64)
    cos_ref, sin_ref = emb(x, pos.view(1, 1, -1).expand(3, 1, -1))
    from tandem_core.ops import rope

    cos, sin = rope.cos_sin(pos, rope.inv_freq(16, 1e7))
    assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0])
    q = torch.randn(40, 3, 64)
    k = torch.randn(40, 3, 64)
    q_ref, k_ref = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_ref, sin_ref)
    fn = ops.get("rope")
    assert rel_err(fn(q, cos, sin), q_ref[0].transpose(0, 1)) < 1e-6
    assert rel_err(fn(k, cos, sin), k_ref[0].transpose(0, 1)) < 1e-6


def test_attention_equals_sdpa_with_grouped_heads_and_a_cache():
    g = torch.Generator().manual_seed(4)
    start, T, hq, hkv, D = 9, 6, 4, 2, 16
    q = torch.randn(T, hq, D, generator=g)
    k = torch.randn(hkv, start + T, D, generator=g)
    v = torch.randn(hkv, start + T, D, generator=g)
    from tandem_core.ops.attention import causal_mask

    mask = causal_mask(start, T)
    assert mask.shape == (T, start + T) and mask[0, start] and not mask[0, start + 1]
    out = ops.get("attention")(q, k, v, mask, D ** -0.5)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 0),
                                         v.repeat_interleave(2, 0), attn_mask=mask)
    assert rel_err(out, ref.transpose(0, 1)) < 1e-6


def test_activations_equal_torch():
    x = torch.linspace(-60, 60, 20001)
    assert rel_err(ops.get("sigmoid")(x), torch.sigmoid(x)) < 1e-6
    assert rel_err(ops.get("silu")(x), F.silu(x)) < 1e-6
    sp = ops.get("softplus")(x)
    assert float(((sp - F.softplus(x)).abs() / F.softplus(x).clamp_min(1e-30)).max()) < 1e-5
    m = torch.randn(5, 33).masked_fill(torch.rand(5, 33) > 0.7, float("-inf"))
    m[:, 0] = 0.0
    assert rel_err(ops.get("softmax")(m), torch.softmax(m, -1)) < 1e-6


def test_dispatch_prefers_a_registered_kernel_for_its_device_only():
    calls = []

    def fake(*args, **kw):
        calls.append(args)
        return "kernel"

    assert ops.get("rope", "cpu") is ops.reference("rope")
    ops.register("rope", "meta", fake)
    try:
        assert ops.get("rope", torch.device("meta")) is fake
        assert ops.get("rope", "meta:0") is fake
        assert ops.get("rope", "cpu") is ops.reference("rope")
        assert ("rope", "meta") in ops.kernels()
    finally:
        ops.unregister("rope", "meta")
    assert ops.get("rope", "meta") is ops.reference("rope")
    with pytest.raises(KeyError, match="no_such_op"):
        ops.get("no_such_op")
    with pytest.raises(KeyError, match="no_such_op"):
        ops.register("no_such_op", "cuda", fake)
    assert set(ops.names()) >= {"gdn_chunk", "gdn_recurrent", "causal_conv", "rms_norm_1p", "gated_rms_norm",
                                "rope", "attention"}
