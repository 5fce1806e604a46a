"""``FlashNextCudaRunner`` on the CPU: the static-buffer step (decode and verify of a width as one function of fixed
buffers: the PLE rows gathered on the host into the step's buffer, the QSA selection on the device's tensors, the
committed blocks' keys in the view ``BK``) in the torch form of every kernel (``graphs=False``). It passes the runner
conformance suite on the tiny re-randomised ``qwen4_exp`` checkpoint (PLE on two layers, two QSA layers whose budget
is below the contexts) with the CUDA path's own block selection, its logits track the reference runner (the
reference's selection, node by node), a random bf16 tree is its decode rows in both selections, the block selection
and the attended slots equal the reference's, the vectorised prefill the reference prefill, and ``unsupported`` and
serving's choice name their reasons. The kernels' own
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


def static_case(path, dtype: str = "fp32", device_select: bool | None = None) -> RunnerCase:
    from tandem_flashnext.cuda_runner import FlashNextCudaRunner

    cfg, weights = weights_of(path, dtype)

    def build(max_context: int = 256, max_tree: int = 64):
        return SequenceEngine(FlashNextCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                                  prefill_chunk=512, graphs=False, device_select=device_select),
                              name="qwen4_exp")

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


class TestFlashNextCudaRunner(RunnerContract):
    """The suite on the CUDA path's own selection (``device_select``: the top-k keys, the slots by path)."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, flashnext_ckpts):
        return static_case(flashnext_ckpts.text.path, device_select=True)

    def test_the_step_runs_static_on_the_cpu(self, eng):
        r = eng.runner
        assert not r.use_graphs and eng.caps.graph_widths == ()
        settings = eng.manifest().settings
        assert settings["path"] == "static" and settings["kernels"] == "torch"
        parts = {p.name: p for p in eng.memory_parts()}
        assert parts["ple.tables"].device == "cpu (memory-mapped)" and parts["ple.rows"].device == "cpu"
        assert {"weights", "kv", "indexer.keys", "indexer.block_keys", "step buffers"} <= set(parts)
        assert set(eng.state.views) == {"K", "V", "IK", "BK"}


def test_the_static_step_tracks_the_reference_runner_in_fp32(flashnext_ckpts):
    from tandem_flashnext.serving import build_engine

    cfg, weights = weights_of(flashnext_ckpts.text.path)
    ref = build_engine(cfg, weights, 128, 512)
    eng = static_case(flashnext_ckpts.text.path).build(max_context=128)
    ids = prompt(40, seed=3)
    assert torch.equal(ref.forward(ids[:13]), eng.forward(ids[:13]))      # the same prefill
    for t in ids[13:].tolist():            # decode past several blocks: the selection matters (budget 8 of 13+)
        a, b = ref.forward(torch.tensor([t])), eng.forward(torch.tensor([t]))
        assert torch.allclose(a, b, atol=1e-5 * float(a.abs().max()), rtol=0)
    for name in ("gdn.S", "gdn.conv", "ple.conv", "ngram.ctx"):
        assert torch.allclose(ref.state.sections[name].float(), eng.state.sections[name].float(), atol=1e-5)


def test_tree_rows_equal_decode_rows_in_bf16(flashnext_ckpts):
    case = static_case(flashnext_ckpts.text.path, "bf16")
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


def test_block_selection_equals_the_references():
    """``select_blocks`` (the device form: committed and frontier scores, a key carrying the block) picks the blocks
    ``qsa.selection`` does, ties going to the lower block."""
    from types import SimpleNamespace

    from tandem_flashnext.cuda_runner import select_blocks
    from tandem_flashnext.qsa import selection

    cfg = SimpleNamespace(indexer_compress_ratio=4, block_topk=3)
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        nb = 1 + trial % 9
        nbc = max(0, nb - trial % 4)                                                  # 0 .. 3 frontier blocks
        scores = torch.relu(torch.randn(nb, generator=g)).round(decimals=1)          # ties (zeros, equal tenths)
        NB, F = 12, 3
        committed = torch.full((1, NB), -1.0)
        committed[0, :nbc] = scores[:nbc]
        frontier = torch.full((1, F), -1.0)
        frontier[0, :nb - nbc] = scores[nbc:]
        blocks, valid = select_blocks(committed, frontier, torch.tensor([nbc]), cfg.block_topk)
        got = sorted(int(b) for b, v in zip(blocks[0], valid[0]) if v)
        assert got == sorted(sorted(range(nb), key=lambda b: (-float(scores[b]), b))[:min(3, nb)]), trial
        if len(set(scores.tolist())) == nb:                                           # untied: the reference's tokens
            p = nb * 4 + 1
            want = torch.zeros(p + 1, dtype=torch.bool)
            selection(scores, p, cfg, want)
            mine = torch.zeros(p + 1, dtype=torch.bool)
            for b in got:
                mine[b * 4:b * 4 + 4] = True
            mine[nb * 4:] = True
            assert torch.equal(mine, want), trial


def test_tables_widths_and_buffers(flashnext_ckpts):
    from tandem_flashnext.cuda_runner import (FlashNextCudaRunner, conv_windows, ple_windows, runner_widths,
                                              tree_tables)
    from tandem_flashnext.ple import dilated_conv_tree

    assert runner_widths(1) == (1,) and runner_widths(20) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="max_tree"):
        runner_widths(129)
    parents = [-1, 0, 0, 2, 3, -1]
    depth, anc = tree_tables(parents)
    assert depth == [0, 1, 1, 2, 3, 0] and anc[4] == [0, 2, 3, 4]
    assert conv_windows(anc, 3)[4] == [3 + 0, 3 + 2, 3 + 3]
    # the PLE taps index [tail | nodes] as the reference's tree conv does: the same outputs
    C, K, d = 5, 4, 3
    tail = torch.randn(C, (K - 1) * d, generator=torch.Generator().manual_seed(1))
    x = torch.randn(len(parents), C, generator=torch.Generator().manual_seed(2))
    wc = torch.randn(C, K, generator=torch.Generator().manual_seed(3))
    ops = {"silu": torch.nn.functional.silu}
    want = dilated_conv_tree(ops, x, tail, wc, d, parents)
    src = torch.cat([tail.t(), x])
    taps = torch.tensor(ple_windows(anc, (K - 1) * d, K, d))
    y = src[taps[:, 0]] * wc[:, 0]
    for k in range(1, K):
        y = y + src[taps[:, k]] * wc[:, k]
    assert torch.equal(torch.nn.functional.silu(y), want)
    with pytest.raises(ValueError, match="node 1's parent"):
        tree_tables([-1, 1])
    cfg, w = weights_of(flashnext_ckpts.text.path)
    r = FlashNextCudaRunner(cfg, w, max_context=100, max_tree=20, graphs=False)
    assert r.spec.max_context == 100 and r.spec.max_tree == 24 and r.spec.graph_widths == ()
    assert r._K.shape[2] == 124 and r._BK.shape[1] == 124       # the widest verify's scratch past the context


def test_unsupported_names_why_and_serving_chooses(flashnext_ckpts, monkeypatch):
    import dataclasses
    import importlib.util

    from tandem_flashnext.cuda_runner import unsupported
    from tandem_flashnext.model import FlashNextRunner
    from tandem_flashnext.serving import make_runner, runner_choice

    cfg, w = weights_of(flashnext_ckpts.text.path)
    assert unsupported(cfg, w) == "weights on cpu, not a CUDA device"
    assert runner_choice(cfg, w, cuda_runner=False) == "the FLASHNEXT_CUDA_RUNNER setting is off"
    assert type(make_runner(cfg, w, max_context=32, prefill_chunk=16)) is FlashNextRunner
    # the checks past the device, with the weights' device faked as CUDA (nothing runs on it)
    fake = dataclasses.replace(w, device=torch.device("cuda", 0))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find(name, *a))
    assert unsupported(cfg, fake) == "Triton is not installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find(name, *a))
    assert unsupported(cfg, fake) == "weights in fp32, the CUDA kernels read bf16"
    cfg16, w16 = weights_of(flashnext_ckpts.text.path, "bf16")
    fake16 = dataclasses.replace(w16, device=torch.device("cuda", 0))
    assert unsupported(cfg16, fake16) is None
    # the setting's default: on (its GPU tests passed on the H200, session 9); off, the reference runner
    assert runner_choice(cfg16, fake16) is None
    monkeypatch.setenv("TANDEM_FLASHNEXT_CUDA_RUNNER", "0")
    assert runner_choice(cfg16, fake16) == "the FLASHNEXT_CUDA_RUNNER setting is off"
    monkeypatch.delenv("TANDEM_FLASHNEXT_CUDA_RUNNER")
    assert "sigmoid output gate" in unsupported(dataclasses.replace(cfg16, output_gate="sigmoid"), fake16)
    assert "below 16" in unsupported(dataclasses.replace(cfg16, indexer_head_dim=8), fake16)
    assert "1024" in unsupported(dataclasses.replace(cfg16, num_experts=2048), fake16)


@pytest.mark.parametrize("budget", [1024, None], ids=["every-block", "checkpoint-budget"])
def test_the_vectorised_prefill_equals_the_reference_prefill(flashnext_ckpts, budget):
    """The CUDA path's prefill of the indexed attention (every row's selection at once, one masked attention), here
    in fp32 on the CPU: the reference's rows; with the checkpoint's budget a row may differ only where its block
    scores tie (``topk`` returns either of equal scores)."""
    import dataclasses

    from tandem_flashnext.cuda_runner import FlashNextCudaRunner
    from tandem_flashnext.serving import build_engine

    cfg, weights = weights_of(flashnext_ckpts.text.path)
    if budget is not None:
        cfg = dataclasses.replace(cfg, indexer_budget=budget)
    ref = build_engine(cfg, weights, 128, 512)
    eng = SequenceEngine(FlashNextCudaRunner(cfg, weights, max_context=128, prefill_chunk=24, graphs=False,
                                             vector_prefill=True), name="qwen4_exp")
    ids = prompt(60, seed=9)
    a, b = ref.forward(ids, all_logits=True), eng.forward(ids, all_logits=True)
    err = (a - b).abs().amax(-1) / a.abs().max()
    if budget is not None:
        assert float(err.max()) < 1e-4
    else:
        assert float((err < 1e-4).float().mean()) >= 0.8, err


def test_the_attended_slots_of_a_tree():
    """``triton_qsa.slots_ref`` (the device form's slots, its kernel's reference): selected blocks then the tail,
    a committed position its own slot, a later one the row's path node at that depth."""
    from tandem_flashnext.triton_qsa import slots_ref

    L, r, NB = 10, 4, 2                           # committed blocks 0, 1 (positions 0..7); 8, 9 committed
    anc = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 2, 0]], dtype=torch.int32)   # node 1 on 0; node 2 a sibling
    pos = torch.tensor([10, 11, 11])
    head = torch.tensor([L, 3], dtype=torch.int32)
    # node 0 picks block 1; node 1 block 0 and its frontier block 2 (8, 9, then its path: 10, 11); node 2 (node
    # 1's sibling, also at 11) its own frontier block 2: 8, 9, node 0, itself
    topv = torch.tensor([[5, -1], [7, 6], [6, -1]])
    topi = torch.tensor([[1, 0], [0, NB + 0], [NB + 0, 0]])
    got = slots_ref(topv, topi, head, pos, anc, NB, r).tolist()
    assert got[0] == [4, 5, 6, 7, -1, -1, -1, -1] + [8, 9, 10, -1]           # tail 8..10: 10 is node 0 (L + 0)
    assert got[1] == [0, 1, 2, 3, 8, 9, 10, 11] + [-1, -1, -1, -1]           # block 2 complete: no tail
    assert got[2] == [8, 9, 10, 12] + [-1] * 8                               # 11 is node 2 itself (L + 2)


def test_the_device_selection_keeps_tree_rows_equal_to_decode_rows(flashnext_ckpts):
    """The CUDA path's selection (``top_keys``: ties to the lower block; ``slots_ref``: the slots by path) in the
    torch form, bf16: a random tree's rows are its decode rows bit for bit and its commit the decode state; with a
    budget selecting every block its logits track the reference runner's."""
    import dataclasses

    from tandem_flashnext.cuda_runner import FlashNextCudaRunner
    from tandem_flashnext.serving import build_engine

    cfg, weights = weights_of(flashnext_ckpts.text.path, "bf16")

    def build(c=cfg):
        return SequenceEngine(FlashNextCudaRunner(c, weights, max_context=128, graphs=False, device_select=True),
                              name="qwen4_exp")

    eng, twin = build(), build()
    twin.forward(prompt(29, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(5), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])
    cfg32, w32 = weights_of(flashnext_ckpts.text.path)
    every = dataclasses.replace(cfg32, indexer_budget=1024)
    ref = build_engine(every, w32, 128, 512)
    mine = SequenceEngine(FlashNextCudaRunner(every, w32, max_context=128, graphs=False, device_select=True),
                          name="qwen4_exp")
    ids = prompt(30, seed=6)
    ref.forward(ids[:21]), mine.forward(ids[:21])
    for t in ids[21:].tolist():
        a, b = ref.forward(torch.tensor([t])), mine.forward(torch.tensor([t]))
        assert torch.allclose(a, b, atol=1e-5 * float(a.abs().max()), rtol=0)
