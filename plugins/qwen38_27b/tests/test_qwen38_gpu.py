"""The qwen3_5 engine on a CUDA device: the core's engine over the CUDA graph runner (``tandem_qwen38.cuda_runner``).

On a tiny re-randomised checkpoint written by transformers (``conftest_qwen38.build_text``), loaded in bf16 on
the GPU, what is proved:

- the CUDA engine's logits (chunked prefill, decode steps, a verified chain) and hidden rows track the
  CPU fp32 engine's within bf16 tolerance;
- its verified rows equal its decode rows bit for bit, chains and shuffled trees of every width 1..128
  (``tandem_core.spec.selfcheck.run_selfcheck``), and the state after the commits equals plain decode's;
- greedy ``SpecDecode`` (an oracle drafter that drafts the plain continuation with errors and a distractor
  branch) equals plain greedy token for token, through stops and max_tokens inside accepted runs, and leaves
  the engine's state equal to plain decode's;
- ``trim_pending``, ``rollback_to`` within the pending tokens, ``settle``, ``discard_pending``,
  ``resume_at`` and ``state.restore`` land on plain decode's state bit for bit; a tree near the end of the
  context is refused by its depth, not its width;
- the kernels registered for ``"cuda"`` (``tandem_core.ops.cuda_backend``) keep their reference's contract;
- a second engine over the same weights reuses the fused weight matrices (no second copy);
- the runner conformance suite (``tandem_core.testing.conformance``) passes on the CUDA runner unchanged.

The CUDA tests skip without a CUDA device and Triton (the CPU references stay the source of truth); the first
test runs anywhere: importing the CUDA path imports no Triton.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest_qwen38 import build_text, load_engine, prompt
from tandem_core.testing.trees import Oracle, flat_prices

from tandem_core import ops
from tandem_core.engine import ResumableEngine, TreeEngine
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.selfcheck import run_selfcheck
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.state import ModelState
from tandem_core.testing.conformance import RunnerCase, RunnerContract

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 320
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton (the CPU references are the "
                                                 "source of truth; tests/test_qwen38_*.py cover them)")
ROW_TOL = 0.1      # relative L2 error of one logits row, bf16 GPU engine against the fp32 CPU engine
MEAN_TOL = 0.05    # the mean over rows (the bf16 CPU reference itself sits at 0.015 .. 0.05 on this model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def test_importing_the_cuda_path_imports_no_triton():
    paths = [str(ROOT), str(ROOT / "plugins" / "qwen38_27b")]
    code = (f"import sys; sys.path[:0] = {paths!r}; "
            "import tandem_qwen38.model, tandem_qwen38.cuda_graphs, tandem_qwen38.cuda_runner, "
            "tandem_core.ops.cuda_backend; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_text(tmp_path_factory.mktemp("gpu_qwen38") / "text")


def cuda_engine(path: Path, **kw):
    from tandem_qwen38.config import read_config
    from tandem_qwen38.serving import build_engine
    from tandem_qwen38.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    weights = load_weights(open_checkpoint(path, cfg), cfg, "bf16", "cuda")
    return build_engine(cfg, weights, kw.pop("max_context"), kw.pop("prefill_chunk"), **kw)


@pytest.fixture(scope="module")
def eng(ckpt):
    if not CUDA:
        pytest.skip("needs a CUDA device and Triton")
    return cuda_engine(ckpt.path, max_context=256, prefill_chunk=16, max_tree=128)


@pytest.fixture(scope="module")
def ref(ckpt):
    return load_engine(ckpt.path, dtype="fp32", max_context=256)


def same_state(got: ModelState, want: ModelState) -> list[str]:
    """Names of the tensors that differ (sections whole, views up to length), or the length."""
    if got.length != want.length:
        return [f"length {got.length} != {want.length}"]
    bad = [f"section {k}" for k, t in want.sections.items() if not torch.equal(got.sections[k], t)]
    bad += [f"view {k}" for k, v in want.views.items()
            if not torch.equal(got.views[k].head(want.length), v.head(want.length))]
    return bad


class Recorded:
    """A prompt, then greedy decode one token at a time: rows[j] after feeding tokens[j], states[j] after
    it."""

    def __init__(self, engine, ids, n):
        engine.reset()
        logits = engine.forward(ids)
        self.start = engine.state.clone()
        self.tokens, self.rows, self.states = [], [], []
        tok = int(engine.picks(logits)[-1])
        for _ in range(n):
            self.tokens.append(tok)
            row = engine.forward([tok])
            self.rows.append(row[0].clone())
            self.states.append(engine.state.clone())
            tok = int(engine.picks(row)[-1])


# -- the engine on the CUDA path ----------------------------------------------------------------------------
@needs_cuda
def test_caps_and_the_graph_path(eng):
    assert isinstance(eng, TreeEngine) and isinstance(eng, ResumableEngine)
    caps = eng.caps
    assert (caps.device.split(":")[0], caps.dtype, caps.max_tree, caps.trace) == ("cuda", "bf16", 128, False)
    m = eng.manifest()
    assert m.settings["path"] == "cuda_graphs" and m.settings["widths"][-1] == 128
    assert any(f.endswith("cuda_graphs.py") for f in m.files)
    parts = {p.name: p for p in eng.memory_parts()}
    assert parts["cuda.workspace"].nbytes > 0 and parts["kv"].device.startswith("cuda")
    with pytest.raises(RuntimeError, match="caps.trace"):
        eng.trace_forward([1])
    with pytest.raises(ValueError, match="max_tree"):
        eng.forward_tree(list(range(129)), list(range(-1, 128)))


@needs_cuda
def test_logits_track_the_cpu_fp32_engine(eng, ref):
    ids = prompt(37, VOCAB, seed=11)                     # three prefill chunks of 16, the last of 5
    eng.reset()
    ref.reset()
    a = ref.forward(ids, all_logits=True)
    b = eng.forward(ids, all_logits=True)
    assert b.dtype == torch.float32 and b.shape == a.shape
    errs = [rel(b[i], a[i]) for i in range(len(ids))]
    assert max(errs) < ROW_TOL and sum(errs) / len(errs) < MEAN_TOL, errs
    assert rel(eng.hidden_post_norm(), ref.hidden_post_norm()) < ROW_TOL
    tok = int(a[-1].argmax())
    snap_ref, snap_eng, first = ref.state.clone(), eng.state.clone(), tok
    dec = []
    for _ in range(12):                                  # decode steps (the decode graph)
        a, b = ref.forward([tok]), eng.forward([tok])
        assert b.shape == (1, VOCAB)
        dec.append(rel(b[0], a[0]))
        tok = int(a[0].argmax())
    assert max(dec) < ROW_TOL and sum(dec) / len(dec) < MEAN_TOL, dec
    # a verified chain of the fp32 engine's own continuation, against its verify
    ref.state.restore(snap_ref)
    eng.state.restore(snap_eng)
    chain = [first]
    for _ in range(7):
        chain.append(int(ref.forward([chain[-1]])[0].argmax()))
    ref.state.restore(snap_ref)
    parents = list(range(-1, 7))
    va = ref.forward_tree(chain, parents).logits
    vb = eng.forward_tree(chain, parents).logits
    ver = [rel(vb[i], va[i]) for i in range(8)]
    assert max(ver) < ROW_TOL, ver
    assert rel(eng.hidden_post_norm(), ref.hidden_post_norm()) < ROW_TOL
    eng.discard_pending()
    ref.discard_pending()


@needs_cuda
def test_the_self_check_passes_at_every_width(eng):
    result = run_selfcheck(eng, tokens=24)
    assert result.ok, result.first_mismatch
    assert result.widths == tuple(range(1, 129))
    assert result.rows_checked > 24 * 2
    assert eng.kv.length == 0


@needs_cuda
def test_verified_rows_equal_decode_rows_and_commits_equal_decode_state(eng):
    rec = Recorded(eng, prompt(21, VOCAB, seed=3), 12)
    eng.state.restore(rec.start)
    # a chain of 12 (a padded width 16 graph): every row bit for bit
    out = eng.forward_block(rec.tokens)
    for j in range(12):
        assert torch.equal(out.logits[j], rec.rows[j]), f"chain row {j}"
    eng.commit_tree(list(range(12)))
    assert same_state(eng.state, rec.states[-1]) == []
    # a tree of 100 nodes (two row tiles): the path interleaved with distractors, committed in two rounds
    eng.state.restore(rec.start)
    tokens, parents, where = [], [], []
    prev = -1
    for j in range(10):
        tokens.append(rec.tokens[j])
        parents.append(prev)
        where.append(len(tokens) - 1)
        prev = len(tokens) - 1
        for k in range(8):
            tokens.append((rec.tokens[j] + 1 + k) % VOCAB)
            parents.append(prev if k % 2 else parents[prev])
    tokens += [7] * (100 - len(tokens))
    parents += [-1] * (100 - len(parents))
    out = eng.forward_tree(tokens, parents)
    for j in range(10):
        assert torch.equal(out.logits[where[j]], rec.rows[j]), f"tree row {j}"
    eng.commit_tree(where[:4])
    assert same_state(eng.state, rec.states[3]) == []
    assert torch.equal(eng.forward([rec.tokens[4]])[0], rec.rows[4])
    assert same_state(eng.state, rec.states[4]) == []


@needs_cuda
def test_pending_tokens_trim_rollback_settle_and_resume(eng):
    rec = Recorded(eng, prompt(19, VOCAB, seed=4), 10)
    n0 = rec.start.length
    # trim_pending after one commit
    eng.state.restore(rec.start)
    eng.forward_block(rec.tokens[:6])
    eng.commit_tree(list(range(6)))
    eng.trim_pending(2)
    assert same_state(eng.state, rec.states[3]) == []
    assert torch.equal(eng.forward([rec.tokens[4]])[0], rec.rows[4])
    # two commits pending, rolled back twice, then more commits on top of the replayed rows
    eng.state.restore(rec.start)
    eng.forward_block(rec.tokens[:3])
    eng.commit_tree([0, 1, 2])
    eng.forward_tree(rec.tokens[3:6], [-1, 0, 1])
    eng.commit_tree([0, 1, 2])
    eng.rollback_to(n0 + 5)
    assert same_state(eng.state, rec.states[4]) == []
    eng.rollback_to(n0 + 1)
    assert same_state(eng.state, rec.states[0]) == []
    eng.forward_block(rec.tokens[1:4])
    eng.commit_tree([0, 1, 2])
    eng.rollback_to(n0 + 3)
    assert same_state(eng.state, rec.states[2]) == []
    with pytest.raises(ValueError, match="pending"):
        eng.rollback_to(n0 - 1)
    eng.settle()
    with pytest.raises(ValueError, match="pending"):
        eng.rollback_to(n0 + 2)
    with pytest.raises(ValueError, match="pending"):
        eng.trim_pending(1)
    # discard_pending and a state restore drop the verified tree
    eng.forward_block(rec.tokens[3:5])
    eng.discard_pending()
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    eng.forward_block(rec.tokens[3:5])
    eng.state.restore(rec.states[5])
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    assert torch.equal(eng.forward([rec.tokens[6]])[0], rec.rows[6])
    # resume_at with an anchor's sections over K/V rows already in the buffers
    eng.state.restore(rec.states[9])
    anchor = rec.states[4]
    eng.resume_at(anchor.length, {k: v.clone() for k, v in anchor.sections.items()})
    assert same_state(eng.state, anchor) == []
    assert torch.equal(eng.forward([rec.tokens[5]])[0], rec.rows[5])


@needs_cuda
def test_a_tree_near_the_end_of_the_context_is_refused_by_its_depth(eng):
    from tandem_core.engine import ContextFull

    eng.reset()
    eng.forward(prompt(254, VOCAB, seed=8))
    with pytest.raises(ContextFull):
        eng.forward_block([1, 2, 3])
    tokens = [5] + [(9 + i) % VOCAB for i in range(63)]
    out = eng.forward_tree(tokens, [-1] + [0] * 63)        # 64 nodes, depth 1: rows past max_context: slack
    assert bool(torch.isfinite(out.logits).all())
    eng.commit_tree([0, 1])
    assert eng.kv.length == 256
    with pytest.raises(ContextFull):
        eng.forward([1])
    eng.reset()


# -- speculative decoding --------------------------------------------------------------------------------
class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def run(decode_cls, engine, ids, max_tokens, stop_ids=(), **kw):
    req = DecodeRequest(list(ids), max_tokens, SamplingParams(temperature=0.0), frozenset(stop_ids))
    dec = decode_cls(engine, req, IdDetok(), **kw)
    return [t for chunk in dec.run() for t in chunk.tokens], dec


@needs_cuda
def test_greedy_speculative_decoding_equals_plain_greedy(eng):
    accepted = rounds = 0
    cases = [(prompt(9, VOCAB, seed=s), 40, None) for s in range(3)]
    cases += [(prompt(12, VOCAB, seed=20), 13, None), (prompt(12, VOCAB, seed=21), 40, 17)]
    for i, (ids, max_tokens, stop_at) in enumerate(cases):
        full, _ = run(Decode, eng, ids, 40)
        stops = () if stop_at is None else (full[stop_at],)
        want, _ = run(Decode, eng, ids, max_tokens, stops)          # plain greedy: the reference
        assert want == full[:len(want)]
        plain_state = eng.state.clone()
        spec = Speculation([Oracle(full + [0] * 16, seed=i, vocab=VOCAB)], StairCut(flat_prices(), max_tree=32), 32)
        got, dec = run(SpecDecode, eng, ids, max_tokens, stops, speculation=spec)
        assert got == want, f"case {i}"
        assert same_state(eng.state, plain_state) == [], f"case {i}: the engine holds what plain decode holds"
        accepted += dec.stats.accepted
        rounds += dec.stats.rounds
    assert accepted > rounds, "the oracle's drafts should be accepted several tokens a round"


# -- the registered kernels -------------------------------------------------------------------------------
@needs_cuda
def test_registered_cuda_kernels_keep_their_references_contract(eng):
    from tandem_core.linear import DenseLinear
    from tandem_core.ops import cuda_backend

    for name, fn in cuda_backend.OPS.items():
        assert ops.get(name, "cuda:0") is fn
        assert ops.get(name, "cpu") is ops.reference(name)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    # gdn_chunk: [T, Hk, Dk] / [T, Hv, Dv], against the fp32 reference; nothing mutated
    T, Hk, Hv, Dk, Dv = 150, 2, 4, 32, 48
    q = torch.nn.functional.normalize(randn(T, Hk, Dk), dim=-1)
    k = torch.nn.functional.normalize(randn(T, Hk, Dk), dim=-1)
    v, g_, beta = randn(T, Hv, Dv), -torch.rand(T, Hv, device="cuda") * 0.3, torch.rand(T, Hv, device="cuda")
    S0 = randn(Hv, Dk, Dv) * 0.1
    keep = S0.clone()
    o, S = ops.get("gdn_chunk", "cuda")(q, k, v, g_, beta, S0, scale=Dk ** -0.5, chunk=32)
    o_r, S_r = ops.reference("gdn_chunk")(q, k, v, g_, beta, S0, scale=Dk ** -0.5, chunk=32)
    assert torch.equal(S0, keep) and o.dtype == S.dtype == torch.float32
    assert rel(o, o_r) < 5e-3 and rel(S, S_r) < 5e-3
    # rms_norm_1p: bf16 rows (any leading shape), fp32 falls back to the reference exactly
    x, w = randn(3, 5, 96, dtype=torch.bfloat16), randn(96) * 0.2
    y = ops.get("rms_norm_1p", "cuda")(x, w, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert rel(y, ops.reference("rms_norm_1p")(x, w, 1e-6)) < 1e-2
    xf = randn(4, 96)
    assert torch.equal(ops.get("rms_norm_1p", "cuda")(xf, w, 1e-6), ops.reference("rms_norm_1p")(xf, w, 1e-6))
    # linear_rows: each row as if alone, for M past one launch (128 rows); close to the dense product
    lin = DenseLinear(randn(200, 1024, dtype=torch.bfloat16))
    x = randn(200, 1024, dtype=torch.bfloat16)
    fn = ops.get("linear_rows", "cuda")
    full = fn(lin, x)
    assert full.dtype == torch.bfloat16 and full.shape == (200, 200)
    assert rel(full, x.double() @ lin.weight.double().T) < 1e-2
    for M in (1, 7, 64, 65, 128, 200):
        part = fn(lin, x[:M])
        assert torch.equal(part, full[:M]), f"M={M}"
    one = fn(lin, x[150:151])
    assert torch.equal(one[0], full[150])


@needs_cuda
def test_a_second_engine_reuses_the_fused_weights(eng):
    from tandem_qwen38.serving import build_engine

    w = eng.runner.w
    ptrs = [lin.weight.data_ptr() for lin in w.linears()]
    twin = build_engine(eng.runner.cfg, w, 64, 16, max_tree=8)
    assert [lin.weight.data_ptr() for lin in w.linears()] == ptrs, "the weights were fused a second time"
    assert twin.caps.max_tree == 8
    ids = prompt(10, VOCAB, seed=2)
    eng.reset()
    a = eng.forward(ids)
    b = twin.forward(ids)
    assert torch.equal(a, b)
    tok = int(a[0].argmax())
    assert torch.equal(eng.forward([tok]), twin.forward([tok]))


# -- the runner conformance suite, on the CUDA runner -------------------------------------------------------
@needs_cuda
class TestQwen38CudaRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, ckpt):
        from tandem_qwen38.serving import build_engine

        base = cuda_engine(ckpt.path, max_context=32, prefill_chunk=16, max_tree=8).runner

        def build(max_context: int = 256, max_tree: int = 64):
            return build_engine(base.cfg, base.w, max_context, 16, max_tree=max_tree)

        widest = build(max_context=32).caps.max_tree
        return RunnerCase(build=build, vocab=VOCAB, max_tree=widest,
                          prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())

    def test_the_cuda_runner_runs_the_graph_path(self, eng):
        assert type(eng.runner).__name__ == "Qwen38CudaRunner" and eng.manifest().settings["path"] == "cuda_graphs"
