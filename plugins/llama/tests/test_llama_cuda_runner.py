"""``LlamaCudaRunner``: the static-buffer step (decode and verify of a width as one function of fixed buffers).

On the CPU (``graphs=False``, the torch attention of the same contract) it passes the runner conformance suite on
the tiny GGUF of test_llama_runner.py, and its rows equal the eager ``LlamaRunner``'s within fp32 rounding (the
same matmuls; attention over gathered keys instead of a cache view). The CUDA step's own calls (the Triton
attention with its tree tables and identity gate, the fused residual-add norm handed ``w - 1``, ``silu_mul``, the skinny matmul) run
on the CPU in bf16 against torch implementations of those kernels' documented contracts (``KernelContracts``):
the suite passes on them too, and the rows are the eager bf16 runner's within bf16 rounding. On a CUDA device
(skipped without one) the same suite runs with the graphs captured and the real kernels, and the graph replay
equals the step run without its graph bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_llama_runner import VOCAB, gguf_path, prompt, serve_tiny  # noqa: F401  (gguf_path: fixture)
from test_llama_tiny import bpe  # noqa: F401  (fixture)

from tandem_core.engine import SequenceEngine
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from tandem_core.testing.trees import path_to, random_tree


@pytest.fixture(scope="module", autouse=True)
def _plugins_and_one_thread(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(gguf_path):  # noqa: F811
    r = serve_tiny(gguf_path).engine.runner
    return r.cfg, r.w


def static_case(cfg, w, device: str = "cpu", graphs: bool = False) -> RunnerCase:
    from tandem_llama.cuda_runner import LlamaCudaRunner

    def build(max_context: int = 256, max_tree: int = 64, **kw):
        return SequenceEngine(LlamaCudaRunner(cfg, w, max_context=max_context, max_tree=max_tree, device=device,
                                              graphs=graphs, **kw), name="llama")

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, seed))


class TestLlamaStaticRunnerOnTheCPU(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tiny):
        return static_case(*tiny)


def test_the_static_runner_equals_the_eager_runner_within_rounding(tiny):
    """Prefill, decode steps and a verified tree: the eager runner's logits (its own verify included)."""
    from tandem_llama.cuda_runner import LlamaCudaRunner
    from tandem_llama.model import LlamaRunner

    cfg, w = tiny
    engines = [SequenceEngine(cls(cfg, w, max_context=128, max_tree=16), name="llama")
               for cls in (LlamaRunner, LlamaCudaRunner)]
    p = prompt(23, seed=5)
    rows = [e.forward(p) for e in engines]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-5)
    for t in (7, 99, 3):
        a, b = (e.forward([t]) for e in engines)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    tokens, parents = random_tree(random.Random(3), 13, VOCAB)
    outs = [e.forward_tree(torch.tensor(tokens), torch.tensor(parents)) for e in engines]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    leaf = max(range(13), key=lambda i: len(path_to(parents, i)))
    for e in engines:
        e.commit_tree(path_to(parents, leaf))
    a, b = (e.forward([11]) for e in engines)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert engines[0].kv.length == engines[1].kv.length == 23 + 3 + len(path_to(parents, leaf)) + 1


def test_widths_buffers_and_refusals(tiny):
    from tandem_llama.cuda_runner import LlamaCudaRunner, runner_widths, slots_of, tree_tables

    cfg, w = tiny
    assert runner_widths(1) == (1,) and runner_widths(20) == (1, 2, 4, 8, 16, 24)
    assert runner_widths(128)[-1] == 128
    with pytest.raises(ValueError, match="max_tree"):
        runner_widths(129)
    depth, anc = tree_tables([-1, 0, 0, 2, -1])
    assert depth == [0, 1, 1, 2, 0] and anc == [[0], [0, 1], [0, 2], [0, 2, 3], [4]]
    assert slots_of(3, anc[3]) == [0, 1, 2, 3, 5, 6]
    with pytest.raises(ValueError, match="node 1's parent"):
        tree_tables([-1, 1])
    r = LlamaCudaRunner(cfg, w, max_context=100, max_tree=20, graphs=False)
    assert r.spec.max_context == 100 and r.spec.max_tree == 24 and r.spec.graph_widths == ()
    assert r.k_cache.shape[2] == 124                           # the widest verify's scratch past the context
    assert not r.use_graphs and r.manifest().settings["path"] == "static"
    assert "step buffers" in {p.name for p in r.memory_parts()}


def test_serving_keeps_the_eager_runner_on_the_cpu(gguf_path):  # noqa: F811
    from tandem_llama.model import LlamaRunner
    from tandem_llama.serving import make_runner

    served = serve_tiny(gguf_path, max_context=64)
    assert type(served.engine.runner) is LlamaRunner
    r = served.engine.runner
    assert type(make_runner(r.cfg, r.w, max_context=32, device="cpu")) is LlamaRunner


# -- the CUDA step's kernel calls, on the CPU: torch implementations of the kernels' documented contracts ----------
BF = torch.bfloat16


def add_rms_norm_1p(x, parts, w, eps, out):
    """``triton_fused.add_rms_norm_1p`` with 2-d bf16 parts or None: ``x <- bf16(x + parts)``; ``out =
    bf16(x / rms(x) * (1 + w))``, one row at a time."""
    for r in range(x.shape[0]):
        xf = x[r].float()
        if parts is not None:
            xf = (xf + parts[r].float()).to(BF).float()
            x[r] = xf.to(BF)
        inv = 1.0 / torch.sqrt((xf * xf).sum() / x.shape[1] + eps)
        out[r] = (xf * inv * (1.0 + w)).to(BF)
    return out


def silu_mul(gu, out):
    """``triton_fused.silu_mul``: ``bf16(bf16(silu(gate)) * up)``."""
    inter = out.shape[1]
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    out.copy_(((g / (1.0 + torch.exp(-g))).to(BF).float() * u).to(BF))
    return out


def tree_attention(q, raw, K, V, meta, pos, anc, scratch, out, *, hq, hkv, head_dim, scale, rows):
    """``triton_attention.tree_attention``: node j (< ``meta[1]``) over positions ``0 .. pos[j]``, position t read
    from slot t below ``L = meta[0]`` and from ``L + anc[j, t - L]`` above; times ``sigmoid(gate)``; rows past the
    tree untouched."""
    L, n, G, D = int(meta[0]), int(meta[1]), hq // hkv, head_dim
    assert q.shape[0] >= rows and raw.shape[1] == 2 * hq * D and scratch.rows >= rows and anc.shape == (rows, rows)
    for j in range(n):
        p = int(pos[j])
        at = torch.tensor([t if t < L else L + int(anc[j, t - L]) for t in range(p + 1)])
        k, v = K[:, at].float(), V[:, at].float()                          # [hkv, p + 1, D]
        s = q[j].float().view(hkv, G, D) @ k.transpose(1, 2) * scale
        a = (torch.softmax(s, -1) @ v).reshape(hq, D).to(BF).float()
        gate = torch.sigmoid(raw[j].float().view(hq, 2 * D)[:, D:]).to(BF).float()
        out[j] = (a * gate).to(BF).reshape(-1)
    return out


def skinny_matmul(x, w, plan=None, out=None):
    """``triton_matmul.skinny_matmul`` of a plan that does not cut K: ``[M, N]`` bf16, every row alone."""
    assert out is None and x.stride(1) == 1 and x.shape[0] <= 128
    return torch.cat([(x[r:r + 1].float() @ w.float().T).to(BF) for r in range(x.shape[0])])


class KernelContracts:
    """Monkeypatches the four Triton launchers with the torch contracts above; ``runner_class`` is a bf16
    ``LlamaCudaRunner`` on the CPU that takes the kernels' path."""

    def __init__(self, monkeypatch):
        from tandem_core.ops import triton_attention, triton_fused, triton_matmul

        monkeypatch.setattr(triton_matmul, "skinny_matmul", skinny_matmul)

        monkeypatch.setattr(triton_fused, "add_rms_norm_1p", add_rms_norm_1p)
        monkeypatch.setattr(triton_fused, "silu_mul", silu_mul)
        monkeypatch.setattr(triton_attention, "tree_attention", tree_attention)

    @staticmethod
    def runner_class():
        from tandem_llama.cuda_runner import LlamaCudaRunner

        class OnKernels(LlamaCudaRunner):
            def _kernels(self, cfg, weights):
                return True

        return OnKernels


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    from tandem_llama.weights import on_device

    cfg, w = tiny
    return cfg, on_device(w, "cpu", BF)


class TestLlamaKernelPathOnTheCPU(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tiny_bf16):
        cfg, w = tiny_bf16
        mp = pytest.MonkeyPatch()
        KernelContracts(mp)
        cls_ = KernelContracts.runner_class()

        def build(max_context: int = 256, max_tree: int = 64, **kw):
            return SequenceEngine(cls_(cfg, w, max_context=max_context, max_tree=max_tree, graphs=False, **kw),
                                  name="llama")

        yield RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, seed))
        mp.undo()

    def test_it_takes_the_kernels_path_and_equals_the_eager_bf16_runner(self, case, tiny_bf16):
        from tandem_llama.model import LlamaRunner

        cfg, w = tiny_bf16
        eng = case.build(max_context=128, max_tree=16)
        assert eng.runner._triton and eng.runner.manifest().settings["attention"] == "triton"
        ref = SequenceEngine(LlamaRunner(cfg, w, max_context=128, max_tree=16), name="llama")
        p = prompt(21, seed=8)
        eng.forward(p)
        ref.forward(p)
        for t in (5, 77, 200, 9):
            a, b = ref.forward([t]), eng.forward([t])
            torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
        tokens, parents = random_tree(random.Random(4), 12, VOCAB)
        a = ref.forward_tree(torch.tensor(tokens), torch.tensor(parents)).logits
        b = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents)).logits
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestLlamaCudaGraphRunner(RunnerContract):
    """The CUDA graph runner: bf16 dense weights on the device, decode and every verify width replayed."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tiny):
        from tandem_llama.weights import on_device

        cfg, w = tiny
        return static_case(cfg, on_device(w, "cuda:0", torch.bfloat16), device="cuda:0", graphs=True)

    def test_it_replays_graphs_on_the_device(self, eng):
        assert eng.caps.device == "cuda:0" and eng.caps.dtype == "bf16"
        assert eng.caps.graph_widths[0] == 1 and eng.caps.graph_widths[-1] == 64
        assert eng.runner.use_graphs and eng.manifest().settings["attention"] == "triton"

    def test_a_replay_equals_the_step_run_without_its_graph(self, case, rec):
        eng = case.build(max_context=128, max_tree=16)
        tokens, parents = random_tree(random.Random(5), 11, VOCAB)
        eng.state.restore(rec.state_at(6))
        replayed = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents)).logits.clone()
        traced = eng.trace_tree(tokens, parents)                 # capture: the step run without its graph
        assert torch.equal(traced.logits, replayed)

    def test_serving_chooses_the_graph_runner_on_cuda(self, gguf_path, monkeypatch):  # noqa: F811
        from tandem_llama.cuda_runner import LlamaCudaRunner

        monkeypatch.setenv("TANDEM_LLAMA_CUDA_RUNNER", "1")
        from tandem_llama.serving import serve

        from tandem_core.serving import ServeArgs, ServeContext

        args = ServeArgs(model_id="tiny", path=gguf_path, max_context=128, device="cuda:0", dtype="bf16",
                         options={"max_tree": 16})
        served = serve(args, ServeContext())
        assert isinstance(served.engine.runner, LlamaCudaRunner) and served.engine.caps.graph_widths[-1] == 16
        assert isinstance(served.spawn().runner, LlamaCudaRunner)
