"""Flash-Next on a CUDA device (skipped without one and Triton): ``FlashNextCudaRunner``'s kernels and graphs.

- the plugin's kernels (``triton_qsa``: the grouped zero-centred norm, the head scores, the gathered attention)
  against their torch references, and a gathered row equal whatever rows share its call;
- ``FlashNextCudaRunner`` with CUDA graphs passes the runner conformance suite (chains and trees of every width bit
  for bit against its decode rows, commits, pending tokens, the self-check, oracle speculation) on the tiny
  re-randomised ``qwen4_exp`` checkpoint in bf16 (PLE on two layers, two QSA layers whose budget is below the
  contexts);
- a random 48-node tree is its decode rows bit for bit and its commit the decode state;
- its logits track the fp32 CPU reference runner: tightly with a budget that selects every block (the selection is
  a discontinuous top-k: a bf16 score within rounding of the cut may pick another block than fp32 does), and on
  average with the checkpoint's own budget;
- greedy speculative decoding equals plain greedy through the graphs, and the self-check passes at every width;
- the PLE tables stay on the host (memory parts), the rows a step needs gathered into pinned memory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random

import pytest
import torch
from conftest_flashnext import flashnext_ckpts, load_engine, prompt  # noqa: F401  (fixture)

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

VOCAB = 320
ROW_TOL = 0.1      # relative L2 error of one logits row, the bf16 GPU engine against the fp32 CPU engine
MEAN_TOL = 0.05    # the mean over rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def cuda_weights(path):
    from tandem_flashnext.config import read_config
    from tandem_flashnext.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, load_weights(open_checkpoint(path, cfg), cfg, "bf16", "cuda")


def cuda_case(path, graphs: bool = True, cfg_change: dict | None = None) -> RunnerCase:
    from tandem_flashnext.cuda_runner import FlashNextCudaRunner

    cfg, weights = cuda_weights(path)
    if cfg_change:
        cfg = dataclasses.replace(cfg, **cfg_change)

    def build(max_context: int = 256, max_tree: int = 16):
        return SequenceEngine(FlashNextCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                                  prefill_chunk=16, graphs=graphs), name="qwen4_exp")

    # the suite at widths up to 16 (six graphs an engine, many engines); the wider graphs are the random tree's
    # and the self-check's below
    return RunnerCase(build=build, vocab=VOCAB, max_tree=16,
                      prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


# -- the kernels ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R,G,D", [(5, 3, 40), (64, 4, 2560), (1, 24, 256)], ids=["odd", "streams", "heads"])
def test_group_norm_equals_its_reference(R, G, D):
    from tandem_flashnext import triton_qsa as tq

    g = torch.Generator(device="cuda").manual_seed(R + G)
    x = torch.randn(R, G * D, device="cuda", generator=g).bfloat16()
    w = 0.1 * torch.randn(G * D, device="cuda", generator=g)
    got, want = tq.group_norm1p(x, w, 1e-6, G), tq.group_norm1p_ref(x, w, 1e-6, G)
    assert rel(got, want) < 1e-2
    assert torch.equal(tq.group_norm1p(x[2:3].clone() if R > 2 else x, w, 1e-6, G)[0], got[2 if R > 2 else 0])


@pytest.mark.parametrize("R,H,D,B,shared", [(4, 3, 32, 70, True), (64, 4, 128, 1030, True), (16, 2, 16, 3, False),
                                            (40, 1, 2560, 1, False)], ids=["small", "published", "frontier", "ple"])
def test_head_scores_equal_their_reference(R, H, D, B, shared):
    from tandem_flashnext import triton_qsa as tq

    g = torch.Generator(device="cuda").manual_seed(R + B)
    q = torch.randn(R, H, D, device="cuda", generator=g).bfloat16()
    r = 4
    keys = (torch.randn(B * r, D, device="cuda", generator=g).bfloat16()[r - 1::r] if shared
            else torch.randn(R, B, D, device="cuda", generator=g).bfloat16())
    nv = torch.randint(0, B + 1, (R,), device="cuda", generator=g).int()
    for relu in (True, False):
        got, want = tq.head_scores(q, keys, nv, math.sqrt(D), relu), tq.head_scores_ref(q, keys, nv, math.sqrt(D), relu)
        width = want.shape[1]
        dead = torch.arange(width, device="cuda")[None, :] >= nv[:, None]
        assert bool((got[dead] == -1).all()) and bool((want[dead] == -1).all())    # -1 past nvalid
        if bool((~dead).any()):
            scale = max(1.0, float(want[~dead].abs().max()))
            assert float((got - want)[~dead].abs().max()) <= 1e-3 * scale


@pytest.mark.parametrize("R,hq,hkv,D,M", [(5, 6, 2, 32, 43), (64, 24, 2, 256, 2051), (1, 4, 2, 32, 11)],
                         ids=["small", "published", "decode"])
def test_gathered_attention_equals_its_reference_row_by_row(R, hq, hkv, D, M):
    from tandem_flashnext import triton_qsa as tq

    g = torch.Generator(device="cuda").manual_seed(R + M)
    S = 4096
    q = torch.randn(R, hq * D, device="cuda", generator=g).bfloat16()
    K = torch.randn(hkv, S, D, device="cuda", generator=g).bfloat16()
    V = torch.randn(hkv, S, D, device="cuda", generator=g).bfloat16()
    slots = torch.randint(0, S, (R, M), device="cuda", generator=g).int()
    slots[0, M // 3:] = -1
    if R > 2:
        slots[2] = -1
    parts = tq.AttnParts(max(R, 8), hq, hkv, D, torch.device("cuda"))
    got = tq.gathered_attention(q, K, V, slots, D ** -0.5, hkv, parts)
    want = tq.gathered_attention_ref(q, K, V, slots, D ** -0.5, hkv)
    assert rel(got, want) < 2e-2
    if R > 2:
        assert bool((got[2] == 0).all())                             # no slots: zeros
    one = tq.gathered_attention(q[-1:].clone(), K, V, slots[-1:].clone(), D ** -0.5, hkv, parts)
    assert torch.equal(one[0], got[-1])                              # a row's bits do not depend on its call


@pytest.mark.parametrize("R,n,H,S", [(5, 3, 40, 4), (64, 4, 2560, 1), (1, 4, 320, 4)], ids=["small", "streams", "low-rank"])
def test_the_hyper_connection_pieces_equal_their_references(R, n, H, S):
    from tandem_flashnext import triton_qsa as tq

    g = torch.Generator(device="cuda").manual_seed(R + H)
    parts = torch.randn(S, R, H, device="cuda", generator=g)
    for kind, scale, mul in (("silu", 1 / n, 1.0), ("sigmoid", 1 / n, 2.0)):
        assert rel(tq.act(parts, scale, mul, kind), tq.act_ref(parts, scale, mul, kind)) < 1e-2
        assert rel(tq.act(parts[0].bfloat16(), scale, mul, kind), tq.act_ref(parts[0].bfloat16(), scale, mul, kind)) < 1e-2
    up = torch.randn(R, n * H, device="cuda", generator=g).bfloat16()
    normed = torch.randn(R, n * H, device="cuda", generator=g).bfloat16()
    mixed = tq.hyper_combine(up, normed, n)
    assert rel(mixed, tq.hyper_combine_ref(up, normed, n)) < 1e-2
    assert torch.equal(tq.hyper_combine(up[-1:].clone(), normed[-1:].clone(), n)[0], mixed[-1])
    x = torch.randn(R, n * H, device="cuda", generator=g).bfloat16()
    d = torch.randn(R, H, device="cuda", generator=g).bfloat16()
    w = torch.rand(R, n, device="cuda", generator=g).bfloat16()
    assert rel(tq.inject_add(x.clone(), d, w), tq.inject_add_ref(x, d, w)) < 1e-2
    dp = torch.randn(S, R, H, device="cuda", generator=g)                        # a split matmul's partials
    assert rel(tq.inject_add(x.clone(), dp, w), tq.inject_add_ref(x, dp, w)) < 1e-2


@pytest.mark.parametrize("W,L,k", [(24, 37, 6), (1, 4096, 512), (64, 4000, 512)], ids=["tree", "decode", "wide"])
def test_the_attended_slots_equal_their_reference(W, L, k):
    from tandem_flashnext import triton_qsa as tq
    from tandem_flashnext.cuda_runner import tree_tables

    rng = random.Random(W + L)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, W)]
    depth, anc_l = tree_tables(parents)
    anc = torch.zeros(W, W, dtype=torch.int32)
    for i, a in enumerate(anc_l):
        anc[i, :len(a)] = torch.tensor(a, dtype=torch.int32)
    r, NB = 4, (L + 64) // 4
    g = torch.Generator().manual_seed(W)
    topv = torch.randint(-3, 100, (W, k), generator=g)
    topi = torch.randint(0, NB + (W + 3) // 4, (W, k), generator=g)
    args = [t.cuda() for t in (topv, topi, torch.tensor([L, W], dtype=torch.int32),
                               torch.tensor([L + d for d in depth]), anc)]
    assert torch.equal(tq.slots(*args, NB, r), tq.slots_ref(*args, NB, r))


# -- the runner ------------------------------------------------------------------------------------------------
class TestFlashNextCudaGraphRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, flashnext_ckpts):
        return cuda_case(flashnext_ckpts.text.path)

    def test_the_runner_captured_its_widths(self, eng):
        r = eng.runner
        assert r.use_graphs and eng.caps.graph_widths == r.widths and r.widths[-1] >= eng.caps.max_tree
        assert set(r.graphs) == {"decode", *r.widths}
        settings = eng.manifest().settings
        assert settings["path"] == "static_graphs" and settings["kernels"] == "triton"
        parts = {p.name: p for p in eng.memory_parts()}
        assert parts["ple.tables"].device == "cpu (memory-mapped)" and parts["ple.rows"].device == "cpu (pinned)"
        assert parts["weights"].device.startswith("cuda") and parts["step buffers"].device.startswith("cuda")


@pytest.fixture(scope="module")
def eng(flashnext_ckpts):
    return cuda_case(flashnext_ckpts.text.path).build(max_context=256, max_tree=64)


def _track(eng, ref, n_prompt: int, n_decode: int) -> tuple[list[float], list[float]]:
    ids = prompt(n_prompt, VOCAB, seed=11)
    eng.reset()
    ref.reset()
    a = ref.forward(ids, all_logits=True)
    b = eng.forward(ids, all_logits=True)
    assert b.dtype == torch.float32 and b.shape == a.shape
    pre = [rel(b[i], a[i]) for i in range(len(ids))]
    tok, dec = int(a[-1].argmax()), []
    for _ in range(n_decode):                             # decode steps (the decode graph)
        a, b = ref.forward([tok]), eng.forward([tok])
        dec.append(rel(b[0], a[0]))
        tok = int(a[0].argmax())
    return pre, dec


def test_logits_track_the_cpu_fp32_runner_with_every_block_selected(flashnext_ckpts):
    from tandem_flashnext.serving import build_engine

    every = {"indexer_budget": 1024}
    eng = cuda_case(flashnext_ckpts.text.path, cfg_change=every).build(max_context=256, max_tree=16)
    base = load_engine(flashnext_ckpts.text.path, dtype="fp32", max_context=8).runner
    ref = build_engine(dataclasses.replace(base.cfg, **every), base.w, 256, 512)
    pre, dec = _track(eng, ref, 37, 12)                   # prefill in chunks of 16, then the decode graph
    assert max(pre) < ROW_TOL and sum(pre) / len(pre) < MEAN_TOL, pre
    assert max(dec) < ROW_TOL and sum(dec) / len(dec) < MEAN_TOL, dec


def test_logits_track_the_cpu_fp32_runner_with_the_checkpoints_budget(eng, flashnext_ckpts):
    ref = load_engine(flashnext_ckpts.text.path, dtype="fp32", max_context=256)
    pre, dec = _track(eng, ref, 45, 16)
    errs = sorted(pre + dec)
    # the top-k selection is discontinuous: most rows as close as with every block, a few may pick another block
    assert sum(errs) / len(errs) < 2 * MEAN_TOL and errs[int(0.8 * len(errs))] < ROW_TOL, errs
    eng.reset()


def test_a_random_tree_is_its_decode_rows_and_its_commit_the_decode_state(eng, flashnext_ckpts):
    from tandem_core.testing.trees import assert_same_state

    twin = cuda_case(flashnext_ckpts.text.path).build(max_context=256, max_tree=64)
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


def test_serving_picks_the_cuda_runner_on_the_device(flashnext_ckpts):
    from tandem_flashnext.cuda_runner import FlashNextCudaRunner
    from tandem_flashnext.model import FlashNextRunner
    from tandem_flashnext.serving import make_runner, runner_choice

    cfg, w = cuda_weights(flashnext_ckpts.text.path)
    assert runner_choice(cfg, w, cuda_runner=True) is None
    assert type(make_runner(cfg, w, max_context=64, prefill_chunk=16, max_tree=4, cuda_runner=True)) \
        is FlashNextCudaRunner
    assert type(make_runner(cfg, w, max_context=64, prefill_chunk=16, cuda_runner=False)) is FlashNextRunner
