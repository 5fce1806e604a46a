"""``FlashNextCudaRunner`` on the CPU: the static-buffer step (decode and verify of a width as one function of fixed
buffers: the PLE rows gathered on the host into the step's buffer, the QSA selection on the device's tensors, the
committed blocks' keys in the view ``BK``) in the torch form of every kernel (``graphs=False``). It passes the runner
conformance suite on the tiny re-randomised ``qwen4_exp`` checkpoint (PLE on two layers, two QSA layers whose budget
is below the contexts), its logits track the reference runner, a random bf16 tree is its decode rows, the block
selection equals the reference's, and ``unsupported`` and serving's choice name their reasons. The kernels' own
path runs on the device (``test_flashnext_gpu.py``)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest_flashnext import flashnext_ckpts, load_engine, one_thread, prompt  # noqa: F401  (fixtures)

from tandem_core.engine import SequenceEngine
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree, random_tree

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320


def weights_of(path, dtype: str = "fp32"):
    base = load_engine(path, dtype=dtype, max_context=8).runner
    return base.cfg, base.w


def static_case(path, dtype: str = "fp32") -> RunnerCase:
    from tandem_flashnext.cuda_runner import FlashNextCudaRunner

    cfg, weights = weights_of(path, dtype)

    def build(max_context: int = 256, max_tree: int = 64):
        return SequenceEngine(FlashNextCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                                  prefill_chunk=512, graphs=False), name="qwen4_exp")

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


class TestFlashNextCudaRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, flashnext_ckpts):
        return static_case(flashnext_ckpts.text.path)

    def test_the_step_runs_static_on_the_cpu(self, eng):
        r = eng.runner
        assert not r.use_graphs and eng.caps.graph_widths == ()
        settings = eng.manifest().settings
        assert settings["path"] == "static" and settings["kernels"] == "torch"
        parts = {p.name: p for p in eng.memory_parts()}
        assert parts["ple.tables"].device == "cpu (memory-mapped)" and parts["ple.rows"].device == "cpu"
        assert {"weights", "kv", "indexer.keys", "indexer.block_keys", "step buffers"} <= set(parts)
        assert set(eng.state.views) == {"K", "V", "IK", "BK"}
