"""LFM2 on a CUDA device (skipped without one and Triton): ``LfmCudaRunner``'s kernels and graphs.

- the gated short conv over a tree (``triton_conv.gated_conv``) and the ungated ``qk_post`` against their torch
  references; the grouped experts are ``tests/test_gpu_moe.py``'s;
- the kernels that add a matmul's fp32 partials themselves (the add-norm, the gated conv, ``qk_post``; the step
  plans cut K of the few-tile projections) give the bits they give on the partials reduced;
- at the 24B-A2B widths (three layers, every step plan cutting K), verify rows equal decode rows bit for bit, the
  self-check passes at every width and the logits track the fp32 reference runner;
- ``LfmCudaRunner`` with CUDA graphs passes the runner conformance suite (chains and trees of every width bit for
  bit against its decode rows, commits, pending tokens, the self-check, oracle speculation) on the tiny
  re-randomised ``lfm2_moe`` checkpoint in bf16;
- its logits track the fp32 CPU reference runner (prefill in chunks, decode, a verified chain);
- greedy speculative decoding equals plain greedy through the graphs, and the self-check passes at every width;
- ``tandem serve --device cuda`` on the tiny ``lfm2_moe`` checkpoint picks the CUDA runner (``/health`` shows its
  graph widths), passes its self-check on the device and answers a chat through the ``openai`` client.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time

import pytest
import torch
from conftest_lfm25 import PLUGIN_SRC, ROOT, VOCAB, lfm25_ckpts, load_engine, prompt  # noqa: F401  (fixture)

from tandem_core.engine import SequenceEngine
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.selfcheck import run_selfcheck
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from tandem_core.testing.trees import Oracle, flat_prices, path_to, plain_rows_of_tree, random_tree

CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton (the CPU tests cover the rest)")

ROW_TOL = 0.1      # relative L2 error of one logits row, the bf16 GPU engine against the fp32 CPU engine
MEAN_TOL = 0.05    # the mean over rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def cuda_weights(path):
    from tandem_lfm25.config import read_config
    from tandem_lfm25.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, load_weights(open_checkpoint(path, cfg), cfg, "bf16", "cuda")


def cuda_case(path, graphs: bool = True) -> RunnerCase:
    from tandem_lfm25.cuda_runner import LfmCudaRunner

    cfg, weights = cuda_weights(path)

    def build(max_context: int = 256, max_tree: int = 16):
        return SequenceEngine(LfmCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                            prefill_chunk=16, graphs=graphs), name=cfg.model_type)

    # the suite at widths up to 16 (five graphs an engine, many engines); the wider graphs are the random tree's
    # and the self-check's below
    return RunnerCase(build=build, vocab=VOCAB, max_tree=16,
                      prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


# -- the kernels ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,K,N", [(2048, 3, 24), (200, 4, 7), (64, 2, 1)])
def test_gated_conv_equals_its_reference(H, K, N):
    from tandem_lfm25.cuda_runner import conv_windows, tree_tables
    from tandem_lfm25.triton_conv import gated_conv

    from tandem_core.ops.conv import causal_conv, causal_conv_tree

    g = torch.Generator(device="cuda").manual_seed(H + N)
    parents = random_tree(random.Random(N), N, 10)[1] if N > 1 else [-1]
    bcx = torch.randn(N, 3 * H, device="cuda", generator=g).bfloat16()
    tail = torch.randn(H, K - 1, device="cuda", generator=g).bfloat16()
    w = torch.randn(H, K, device="cuda", generator=g)
    bx = bcx[:, :H] * bcx[:, 2 * H:]
    want = bcx[:, H:2 * H] * causal_conv_tree(bx, tail, w, parents, activation=None)
    win = torch.tensor(conv_windows(tree_tables(parents)[1], K - 1), dtype=torch.int32, device="cuda")
    n = torch.tensor([N], dtype=torch.int32, device="cuda")
    keep = torch.zeros(N, H, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(N, H, dtype=torch.bfloat16, device="cuda")
    t0 = tail.clone()
    gated_conv(bcx, t0, w, win, n, keep, out, advance=None)
    assert torch.equal(keep, bx) and torch.equal(t0, tail)
    # the taps may be contracted into FMAs on the GPU: within one bf16 rounding of the reference
    assert rel(out, want) < 1e-2 and float((out != want).float().mean()) < 0.05
    # a decode step: one node over the tail, moving it on (advance 1); a one-node verify leaves it (advance 0)
    one = torch.zeros(1, H, dtype=torch.bfloat16, device="cuda")
    win1 = torch.arange(K - 1, dtype=torch.int32, device="cuda")[None]
    t1 = tail.clone()
    gated_conv(bcx[:1], t1, w, win1, n[:1] * 0 + 1, keep[:1], one, advance=torch.ones(1, dtype=torch.int32,
                                                                                        device="cuda"))
    y, new_tail = causal_conv(bx[:1], tail, w, activation=None)
    assert torch.equal(t1, new_tail) and rel(one, bcx[:1, H:2 * H] * y) < 1e-2
    t2 = tail.clone()
    gated_conv(bcx[:1], t2, w, win1, n[:1] * 0 + 1, keep[:1], one.clone(),
               advance=torch.zeros(1, dtype=torch.int32, device="cuda"))
    assert torch.equal(t2, tail)


def test_ungated_qk_post_equals_norm_and_rope():
    from tandem_core.ops import norm, rope
    from tandem_core.ops import triton_fused as tf

    hq, hkv, D, rows, L, S = 8, 2, 64, 5, 11, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    raw = torch.randn(rows, (hq + 2 * hkv) * D, device="cuda", generator=g).bfloat16()
    qn, kn = 1.0 + 0.3 * torch.randn(D, device="cuda", generator=g), 1.0 + 0.3 * torch.randn(D, device="cuda",
                                                                                             generator=g)
    freqs = rope.inv_freq(D, 10000.0, "cuda")
    pos = torch.arange(L, L + rows, device="cuda")
    meta = torch.tensor([L, rows], dtype=torch.int32, device="cuda")
    q = torch.empty(rows, hq * D, dtype=torch.bfloat16, device="cuda")
    K = torch.zeros(hkv, S, D, dtype=torch.bfloat16, device="cuda")
    V = torch.zeros_like(K)
    tf.qk_post(raw, qn - 1.0, kn - 1.0, freqs, pos.int(), meta, q, K, V, hq, hkv, D, D, 1e-5, rows, gated=False)
    cos, sin = rope.cos_sin(pos, freqs)
    want_q = rope.apply_rope(norm.rms_norm(raw[:, :hq * D].view(rows, hq, D), qn, 1e-5), cos, sin)
    want_k = rope.apply_rope(norm.rms_norm(raw[:, hq * D:(hq + hkv) * D].view(rows, hkv, D), kn, 1e-5), cos, sin)
    assert rel(q.view(rows, hq, D), want_q) < 1e-2
    assert rel(K[:, L:L + rows].transpose(0, 1), want_k) < 1e-2
    assert torch.equal(V[:, L:L + rows].transpose(0, 1), raw[:, (hq + hkv) * D:].view(rows, hkv, D))


# -- the consumers of a matmul's fp32 partials (the step plans cut K; the next kernel adds the parts) -----------
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_the_partials_consumers_equal_them_reduced(rows):
    """At the 24B-A2B shapes, each kernel on a skinny matmul's partials (cut by ``step_plan``) gives the bits it gives
    on ``bf16(reduce_parts(parts))``: the add-norm after ``out_proj``, the gated conv after ``in_proj``, ``qk_post``
    after ``q | k | v``."""
    from tandem_lfm25.cuda_runner import conv_windows, step_plan, tree_tables
    from tandem_lfm25.triton_conv import gated_conv

    from tandem_core.ops import rope
    from tandem_core.ops import triton_fused as tf
    from tandem_core.ops import triton_matmul as tm

    H, K, hq, hkv, D = 2048, 3, 32, 8, 64
    g = torch.Generator(device="cuda").manual_seed(rows)

    def parts_of(N: int, Kin: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, Kin, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, Kin, device="cuda", generator=g) * Kin ** -0.5).bfloat16()
        parts = tm.skinny_matmul(x, w, step_plan(N, Kin))
        assert parts.dim() == 3 and parts.shape[0] > 1
        return parts, tm.reduce_parts(parts).bfloat16()

    parts, d = parts_of(H, H)                                               # out_proj: 8 parts
    x0 = torch.randn(rows, H, device="cuda", generator=g).bfloat16()
    w = torch.randn(H, device="cuda", generator=g) * 0.1
    got, want = [], []
    for src, res in ((parts, got), (d, want)):
        x = x0.clone()
        out = torch.empty_like(x)
        tf.add_rms_norm_1p(x, src, w, 1e-5, out)
        res += [x, out]
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    parts, bcx = parts_of(3 * H, H)                                         # in_proj: 4 parts
    parents = random_tree(random.Random(rows), rows, 10)[1] if rows > 1 else [-1]
    win = torch.tensor(conv_windows(tree_tables(parents)[1], K - 1), dtype=torch.int32, device="cuda")
    n = torch.tensor([rows], dtype=torch.int32, device="cuda")
    tail = torch.randn(H, K - 1, device="cuda", generator=g).bfloat16()
    cw = torch.randn(H, K, device="cuda", generator=g)
    adv = torch.ones(1, dtype=torch.int32, device="cuda") if rows == 1 else None
    got, want = [], []
    for src, res in ((parts, got), (bcx, want)):
        t = tail.clone()
        keep = torch.zeros(rows, H, dtype=torch.bfloat16, device="cuda")
        out = torch.zeros(rows, H, dtype=torch.bfloat16, device="cuda")
        gated_conv(src, t, cw, win, n, keep, out, advance=adv)
        res += [t, keep, out]
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    parts, raw = parts_of((hq + 2 * hkv) * D, H)                            # q | k | v: 8 parts
    L, S = 11, 96
    freqs = rope.inv_freq(D, 1e6, "cuda")
    pos = torch.arange(L, L + rows, dtype=torch.int32, device="cuda")
    meta = torch.tensor([L, rows], dtype=torch.int32, device="cuda")
    qn, kn = 0.3 * torch.randn(D, device="cuda", generator=g), 0.3 * torch.randn(D, device="cuda", generator=g)
    got, want = [], []
    for src, res in ((parts, got), (raw, want)):
        q = torch.empty(rows, hq * D, dtype=torch.bfloat16, device="cuda")
        Kc = torch.zeros(hkv, S, D, dtype=torch.bfloat16, device="cuda")
        Vc = torch.zeros_like(Kc)
        tf.qk_post(src, qn, kn, freqs, pos, meta, q, Kc, Vc, hq, hkv, D, D, 1e-5, rows, gated=False)
        res += [q, Kc, Vc]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- the runner at a real width: every step plan cuts K --------------------------------------------------------
WIDE_VOCAB = 512


def wide_weights():
    """Three layers at the 24B-A2B widths (hidden 2048; a dense MLP of 7168, then 64 experts top-4 of 1536; conv,
    attention with 32/8 heads of 64, conv), random bf16, and the same tensors in fp32 for the reference runner."""
    from tandem_lfm25.config import read_config
    from tandem_lfm25.weights import build_weights, expected_tensors

    raw = dict(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], vocab_size=WIDE_VOCAB,
               hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1536, num_hidden_layers=3,
               layer_types=["conv", "full_attention", "conv"], num_attention_heads=32, num_key_value_heads=8,
               conv_L_cache=3, num_experts=64, num_experts_per_tok=4, num_dense_layers=1, use_expert_bias=True,
               norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=4096, norm_eps=1e-5,
               tie_word_embeddings=True, eos_token_id=7, bos_token_id=1, pad_token_id=0,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg = read_config(raw)
    gen = torch.Generator(device="cuda").manual_seed(5)
    src: dict[str, torch.Tensor] = {}
    for name, e in expected_tensors(cfg).items():
        shape = e.shape
        if len(shape) >= 2:
            src[name] = (torch.randn(shape, device="cuda", generator=gen) * shape[-1] ** -0.5).bfloat16()
        elif name.endswith("expert_bias"):
            src[name] = torch.randn(shape, device="cuda", generator=gen) * 0.02
        else:
            src[name] = torch.ones(shape, device="cuda") + 0.125 * torch.randint(-2, 3, shape, device="cuda",
                                                                                  generator=gen)
    bf = build_weights(lambda n: src[n], cfg, "bf16", "cuda", tied=True)
    f32 = build_weights(lambda n: src[n].float(), cfg, "fp32", "cuda", tied=True)
    return cfg, bf, f32


@pytest.fixture(scope="module")
def wide():
    from tandem_lfm25.cuda_runner import LfmCudaRunner, step_plan

    cfg, bf, f32 = wide_weights()
    runner = LfmCudaRunner(cfg, bf, max_context=512, max_tree=64, prefill_chunk=64)
    # every projection of the step is cut: the router 16 parts, out_proj and q | k | v 8, in_proj 4, w2 8
    lw = bf.layers
    assert [step_plan(*map(int, t.shape)).split for t in (lw[1].ffn.router.weight, lw[0].mixer.out_proj.weight,
                                                           lw[0].mixer.in_proj.weight, runner._qkv[0],
                                                           lw[0].ffn.w2.weight)] == [16, 8, 4, 8, 8]
    return SequenceEngine(runner, name="lfm2_moe"), cfg, f32, bf


def test_wide_verify_rows_are_the_decode_rows_and_the_self_check_passes(wide):
    from tandem_core.testing.trees import assert_same_state

    eng = wide[0]
    eng.reset()
    eng.forward(prompt(40, WIDE_VOCAB, seed=8))
    base = eng.state.clone()
    tokens, parents = random_tree(random.Random(9), 48, WIDE_VOCAB)
    want, _, states = plain_rows_of_tree(eng, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    bad = [i for i in range(48) if not torch.equal(out.logits[i], want[i])]
    assert not bad, f"verify rows {bad} differ from their decode rows"
    leaf = max(range(48), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])
    eng.reset()
    result = run_selfcheck(eng, tokens=24)
    assert result.ok, result.first_mismatch
    assert result.widths[-1] == eng.caps.max_tree


def test_wide_logits_track_the_fp32_reference_runner(wide):
    """The bf16 CUDA runner at the 24B-A2B widths against the fp32 reference runner, measured against bf16's own
    error there: the plain-torch runner over the same bf16 tensors (``Lfm2Runner``, what serving runs with the
    CUDA runner off) against the same fp32 reference. With 64 random experts top-4, a rounding can flip a near-tied
    pick and move a row by ~0.1 in either bf16 engine (the H200 measured 0.103 on the prefill's last row in
    session 9): the bound is ``ROW_TOL`` or twice plain bf16's error, whichever is larger, per row."""
    from tandem_lfm25.model import Lfm2Runner

    eng, cfg, f32, bf = wide
    ref = SequenceEngine(Lfm2Runner(cfg, f32, max_context=512, max_tree=16, prefill_chunk=64), name="ref")
    b16 = SequenceEngine(Lfm2Runner(cfg, bf, max_context=512, max_tree=16, prefill_chunk=64), name="bf16")
    engines = (ref, eng, b16)

    def close(got: torch.Tensor, plain: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float]:
        e, e16 = rel(got, want), rel(plain, want)
        return e < max(ROW_TOL, 2 * e16), e, e16

    ids = prompt(70, WIDE_VOCAB, seed=12)                 # two prefill chunks of 64, the second of 6
    for x in engines:
        x.reset()
    a, b, c = (x.forward(ids) for x in engines)
    ok, e, e16 = close(b[-1], c[-1], a[-1])
    assert ok, f"prefill's last row: {e:.4f} from fp32, plain bf16 {e16:.4f}"
    tok = int(a[-1].argmax())
    snaps, first = [x.state.clone() for x in engines], tok
    dec = []
    for _ in range(8):                                    # decode steps: the width-1 graph
        a, b, c = (x.forward([tok]) for x in engines)
        dec.append(close(b[0], c[0], a[0]))
        tok = int(a[0].argmax())
    assert all(d[0] for d in dec), [(round(d[1], 4), round(d[2], 4)) for d in dec]
    assert sum(d[1] for d in dec) / len(dec) < max(MEAN_TOL, 2 * sum(d[2] for d in dec) / len(dec)), dec
    for x, snap in zip(engines, snaps):
        x.state.restore(snap)
    chain = [first]
    for _ in range(7):
        chain.append(int(ref.forward([chain[-1]])[0].argmax()))
    ref.state.restore(snaps[0])
    va, vb, vc = (x.forward_tree(chain, list(range(-1, 7))).logits for x in engines)
    bad = [(i, *close(vb[i], vc[i], va[i])[1:]) for i in range(8) if not close(vb[i], vc[i], va[i])[0]]
    assert not bad, f"verified rows (node, error, plain bf16's error): {bad}"
    for x in engines:
        x.discard_pending()


# -- the runner ------------------------------------------------------------------------------------------------
class TestLfmCudaGraphRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return cuda_case(lfm25_ckpts.moe.path)

    def test_the_runner_captured_its_widths(self, eng):
        r = eng.runner
        assert r.use_graphs and eng.caps.graph_widths == r.widths and r.widths[-1] >= eng.caps.max_tree
        settings = eng.manifest().settings
        assert settings["path"] == "static_graphs" and settings["kernels"] == "triton"
        assert {"weights", "conv", "kv", "step buffers", "fused qkv (shared)"} <= {p.name for p in eng.memory_parts()}


@pytest.fixture(scope="module")
def eng(lfm25_ckpts):
    return cuda_case(lfm25_ckpts.moe.path).build(max_context=256, max_tree=64)


def test_logits_track_the_cpu_fp32_runner(eng, lfm25_ckpts):
    ref = load_engine(lfm25_ckpts.moe.path, dtype="fp32", max_context=256)
    ids = prompt(37, VOCAB, seed=11)                      # three prefill chunks of 16, the last of 5
    eng.reset()
    a = ref.forward(ids, all_logits=True)
    b = eng.forward(ids, all_logits=True)
    assert b.dtype == torch.float32 and b.shape == a.shape
    errs = [rel(b[i], a[i]) for i in range(len(ids))]
    assert max(errs) < ROW_TOL and sum(errs) / len(errs) < MEAN_TOL, errs
    tok = int(a[-1].argmax())
    snap_ref, snap_eng, first = ref.state.clone(), eng.state.clone(), tok
    dec = []
    for _ in range(12):                                   # decode steps (the width-1 graph)
        a, b = ref.forward([tok]), eng.forward([tok])
        dec.append(rel(b[0], a[0]))
        tok = int(a[0].argmax())
    assert max(dec) < ROW_TOL and sum(dec) / len(dec) < MEAN_TOL, dec
    ref.state.restore(snap_ref)
    eng.state.restore(snap_eng)
    chain = [first]
    for _ in range(7):
        chain.append(int(ref.forward([chain[-1]])[0].argmax()))
    ref.state.restore(snap_ref)
    va = ref.forward_tree(chain, list(range(-1, 7))).logits
    vb = eng.forward_tree(chain, list(range(-1, 7))).logits
    assert max(rel(vb[i], va[i]) for i in range(8)) < ROW_TOL
    eng.discard_pending()


def test_a_random_tree_is_its_decode_rows_and_its_commit_the_decode_state(eng, lfm25_ckpts):
    from tandem_core.testing.trees import assert_same_state

    twin = cuda_case(lfm25_ckpts.moe.path).build(max_context=256, max_tree=64)
    twin.forward(prompt(40, VOCAB, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(7), 48, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.reset()
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    bad = [i for i in range(48) if not torch.equal(out.logits[i], want[i])]
    assert not bad, f"verify rows {bad} differ from their decode rows"
    leaf = max(range(48), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])
    eng.reset()


def test_the_self_check_passes_at_every_width(eng):
    eng.reset()
    result = run_selfcheck(eng, tokens=24)
    assert result.ok, result.first_mismatch
    assert result.widths[-1] == eng.caps.max_tree


class _Detok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def _run(decode_cls, engine, ids, max_tokens, **kw):
    req = DecodeRequest(list(ids), max_tokens, SamplingParams(temperature=0.0), frozenset())
    dec = decode_cls(engine, req, _Detok(), **kw)
    return [t for chunk in dec.run() for t in chunk.tokens], dec


def test_greedy_speculative_decoding_equals_plain_greedy(eng):
    accepted = rounds = 0
    for i in range(3):
        ids = prompt(9 + i, VOCAB, seed=30 + i)
        want, _ = _run(Decode, eng, ids, 40)
        spec = Speculation([Oracle(want + [0] * 16, seed=i, vocab=VOCAB)], StairCut(flat_prices(), max_tree=32), 32)
        got, dec = _run(SpecDecode, eng, ids, 40, speculation=spec)
        assert got == want, f"case {i}"
        accepted += dec.stats.accepted
        rounds += dec.stats.rounds
    assert accepted > rounds, "the oracle's drafts should be accepted several tokens a round"


# -- the server ------------------------------------------------------------------------------------------------
@pytest.mark.server
def test_tandem_serve_on_cuda_answers_a_chat(lfm25_ckpts, tmp_path):
    import httpx
    from openai import OpenAI
    from replay_server import Server

    env = {"TANDEM_EXTRA_PLUGINS": "tandem_lfm25.plugin,tandem_drafters.plugin",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "plugins"), str(ROOT), str(PLUGIN_SRC),
                                          str(ROOT / "plugins" / "drafters"), os.environ.get("PYTHONPATH", "")])}
    srv = Server(lfm25_ckpts.moe.path, tmp_path / "home", "--device", "cuda", "--spec", "lookup", "--max-tree", "16",
                 "--max-context", "2048", env=env)
    try:
        srv.wait_ready(300)
        deadline = time.monotonic() + 300
        while httpx.get(srv.url + "/health").json()["speculation"].get("reason") == "self-check running":
            assert time.monotonic() < deadline, "the self-check did not finish"
            time.sleep(0.2)
        h = httpx.get(srv.url + "/health").json()
        e = h["engine"]
        assert e["device"].startswith("cuda") and e["dtype"] == "bf16"
        assert e["graph_widths"] and e["graph_widths"][0] == 1 and e["graph_widths"][-1] >= 16
        assert h["speculation"]["enabled"], h["speculation"]          # the self-check passed on the device
        c = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        r = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "Hi there."}],
                                      max_tokens=24, temperature=0)
        assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens > 0
        s = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "Hi there."}],
                                      max_tokens=24, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        assert streamed == r.choices[0].message.content              # the same greedy answer, streamed
    finally:
        srv.stop()
        (tmp_path / "server.log").write_text("".join(srv.stderr))
