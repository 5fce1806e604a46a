"""``LfmCudaRunner`` on the CPU: the static-buffer step (decode and verify of a width as one function of fixed
buffers) in the torch form of every kernel (``graphs=False``). It passes the runner conformance suite on the tiny
re-randomised ``lfm2_moe`` checkpoints (expert bias, top-k renormalised and not, one and two dense layers) and the
dense ``lfm2`` one; its tables (widths, tree paths, conv windows) and ``unsupported``'s reasons are checked on their
own, and serving keeps the reference runner where the CUDA runner cannot run. The kernels' own path runs on the
device (``test_lfm25_gpu.py``)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest_lfm25 import VOCAB, lfm25_ckpts, load_weights_of, prompt  # noqa: F401  (fixture)

from tandem_core.engine import SequenceEngine
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree, random_tree


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def static_case(path, dtype: str = "fp32") -> RunnerCase:
    from tandem_lfm25.cuda_runner import LfmCudaRunner

    cfg, weights = load_weights_of(path, dtype)

    def build(max_context: int = 256, max_tree: int = 64):
        return SequenceEngine(LfmCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                            prefill_chunk=512, graphs=False), name=cfg.model_type)

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


def test_step_plans_cut_k_of_the_few_tile_weights():
    """The step's plans at the 24B-A2B shapes: ``plan_for``'s tiles, K step, warps, stages and layout, K cut until
    the grid would pass three programs a multiprocessor (or one K step a part)."""
    import dataclasses
    import math

    from tandem_lfm25.cuda_runner import SMS, step_plan

    from tandem_core.ops import triton_matmul as tm

    want = {(64, 2048): 16, (32, 2048): 16, (2048, 2048): 8, (6144, 2048): 4, (3072, 2048): 8, (2048, 7168): 8,
            (7168, 2048): 2, (65536, 2048): 1, (6, 64): 1, (1234, 200): 2}
    for (N, K), split in want.items():
        p, base = step_plan(N, K), tm.plan_for(N, K)
        assert p.split == split, (N, K, p)
        assert dataclasses.replace(p, split=base.split) == base
        assert math.ceil(N / p.BN) * split <= max(3 * SMS, math.ceil(N / p.BN)) and split <= math.ceil(K / p.BK)


class TestLfmCudaRunnerMoe(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return static_case(lfm25_ckpts.moe.path)

    def test_the_step_runs_static_on_the_cpu(self, eng):
        r = eng.runner
        assert not r.use_graphs and eng.caps.graph_widths == ()
        assert eng.manifest().settings["path"] == "static" and eng.manifest().settings["kernels"] == "torch"
        assert {"weights", "conv", "kv", "step buffers"} <= {p.name for p in eng.memory_parts()}


class TestLfmCudaRunnerMoeUntied(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return static_case(lfm25_ckpts.moe_untied.path)


class TestLfmCudaRunnerDense(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, lfm25_ckpts):
        return static_case(lfm25_ckpts.dense.path)


def test_the_static_step_equals_the_reference_runner_in_fp32(lfm25_ckpts):
    from tandem_lfm25.serving import build_engine

    cfg, weights = load_weights_of(lfm25_ckpts.moe.path)
    ref = build_engine(cfg, weights, 128, 512)
    eng = static_case(lfm25_ckpts.moe.path).build(max_context=128)
    ids = prompt(21, seed=3)
    assert torch.equal(ref.forward(ids[:13]), eng.forward(ids[:13]))      # the same prefill
    for t in ids[13:].tolist():                                          # decode: the same ops on one row
        a, b = ref.forward(torch.tensor([t])), eng.forward(torch.tensor([t]))
        assert torch.allclose(a, b, atol=1e-5 * float(a.abs().max()), rtol=0)


def test_tree_rows_equal_decode_rows_in_bf16(lfm25_ckpts):
    case = static_case(lfm25_ckpts.moe.path, "bf16")
    eng, twin = case.build(max_context=128), case.build(max_context=128)
    twin.forward(prompt(17, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(11), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])


def test_widths_tables_and_buffers(lfm25_ckpts):
    from tandem_lfm25.cuda_runner import LfmCudaRunner, conv_windows, runner_widths, slots_of, tree_tables

    assert runner_widths(1) == (1,) and runner_widths(20) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="max_tree"):
        runner_widths(129)
    depth, anc = tree_tables([-1, 0, 0, 2, -1])
    assert depth == [0, 1, 1, 2, 0] and anc == [[0], [0, 1], [0, 2], [0, 2, 3], [4]]
    assert slots_of(3, anc[3]) == [0, 1, 2, 3, 5, 6]
    # K-1 = 2 inputs before each node: tail columns 0, 1, then nodes (2 + node), oldest first
    assert conv_windows(anc, 2) == [[0, 1], [1, 2], [1, 2], [2, 4], [0, 1]]
    assert conv_windows([[0, 1, 2, 3]], 3) == [[3, 4, 5]]              # nodes 0, 1, 2 before node 3
    with pytest.raises(ValueError, match="node 1's parent"):
        tree_tables([-1, 1])
    cfg, w = load_weights_of(lfm25_ckpts.moe.path)
    r = LfmCudaRunner(cfg, w, max_context=100, max_tree=20, graphs=False)
    assert r.spec.max_context == 100 and r.spec.max_tree == 24 and r.spec.graph_widths == ()
    assert r._K.shape[2] == 124                                    # the widest verify's scratch past the context


def test_unsupported_names_why(lfm25_ckpts):
    from tandem_lfm25.cuda_runner import unsupported
    from tandem_lfm25.model import Lfm2Runner
    from tandem_lfm25.serving import make_runner, runner_choice

    cfg, w = load_weights_of(lfm25_ckpts.moe.path)
    assert unsupported(cfg, w) == "weights on cpu, not a CUDA device"
    assert runner_choice(cfg, w, cuda_runner=False) == "the LFM25_CUDA_RUNNER setting is off"
    assert type(make_runner(cfg, w, max_context=32, prefill_chunk=16)) is Lfm2Runner


def test_unsupported_on_a_cuda_device_names_the_dtype_and_the_norms(lfm25_ckpts, monkeypatch):
    """The checks past the device, with the weights' device faked as CUDA (nothing runs on it)."""
    import dataclasses
    import importlib.util

    from tandem_lfm25.cuda_runner import unsupported

    cfg, w = load_weights_of(lfm25_ckpts.moe.path)
    fake = dataclasses.replace(w, device=torch.device("cuda", 0))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find(name, *a))
    assert unsupported(cfg, fake) == "Triton is not installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find(name, *a))
    assert unsupported(cfg, fake) == "weights in fp32, the CUDA kernels read bf16"
    cfg16, w16 = load_weights_of(lfm25_ckpts.moe.path, "bf16")
    fake16 = dataclasses.replace(w16, device=torch.device("cuda", 0))
    assert unsupported(cfg16, fake16) is None                      # bf16 norms near one survive 1 + (w - 1)
    odd = dataclasses.replace(fake16, norm=torch.full_like(w16.norm, 1e-9))
    assert "norm weight" in unsupported(cfg16, odd)
    wide = dataclasses.replace(cfg16, head_dim=48)
    assert unsupported(wide, fake16) == "head_dim 48 is not a power of two in 16..256"
