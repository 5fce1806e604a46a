"""Qwen3.8's MTP head on a CUDA device as CUDA graphs (``tandem_qwen38.mtp_cuda.CudaMTPHead``), against the
plain-torch head (``tandem_qwen38.mtp.MTPHead``) on the same bf16 weights and the same target rows.

On the tiny checkpoint with an ``mtp.*`` head (``conftest_qwen38``), loaded in bf16 on the GPU beside the CUDA graph
runner, what is proved:

- the engine offers the graphed head (``caps.mtp_graphs``) and its rows are the state's (``mtp.hidden``, ``mtp.K``);
- after a prefill, after a committed tree path (one append graph) and after a plain decode step (the width-1
  graph), the head's K/V rows and ``mtp.hidden`` track the plain head's (fed the same target rows) within bf16
  tolerance, and a launch of every depth 1..4 gives the plain head's top-two probabilities within bf16 tolerance
  and its top tokens wherever the plain head's margin allows;
- one launch's logits (depth 1) track the plain head's within bf16 tolerance;
- the rows a committed path appends (one graph of its width) equal, bit for bit, those that decode steps
  append one at a time (the kernels are row-invariant), and a launch after a state restore repeats the launch
  before it bit for bit;
- greedy speculative decoding with ``mtp`` equals plain greedy, and the head drafts.

Skips without a CUDA device and Triton.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest_qwen38 import prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.engine import restore_state
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.testing.trees import flat_prices

CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton (tests/test_qwen38_mtp.py covers "
                                                 "the plain-torch head)")
VOCAB = 320
PROB_TOL = 2e-2     # top-two probabilities, graphed head against the plain head, both bf16
ROW_TOL = 3e-2      # relative L2 error of K/V rows and logits, both bf16 (different matmul blocking)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cuda_engine(path, max_context: int = 256, prefill_chunk: int = 16, max_tree: int = 64):
    from tandem_qwen38.config import read_config
    from tandem_qwen38.mtp import load_mtp
    from tandem_qwen38.serving import build_engine
    from tandem_qwen38.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    ckpt = open_checkpoint(path, cfg)
    weights = load_weights(ckpt, cfg, "bf16", "cuda")
    mtp = load_mtp(ckpt, cfg, "bf16", "cuda")
    return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=mtp)


@pytest.fixture(scope="module")
def eng(qwen38_ckpts):  # noqa: F811
    return cuda_engine(qwen38_ckpts.mtp.path)


def plain_twin(eng):
    """The plain-torch head over the graphed head's own weights (the same bf16 tensors), with rows of its own."""
    from tandem_qwen38.mtp import MTPHead

    g = eng.mtp_head()
    return MTPHead(g.cfg, g.target, g.w, max_context=g.max_context)


def compare(head, twin, n: int, token: int, where: str) -> None:
    """The head's state for ``n`` tokens and its launches of depth 1..4 against the twin's."""
    for name in ("mtp.K", "mtp.V"):
        a, b = head.views()[name][0][:, :, :n - 1], twin.views()[name][0][:, :, :n - 1]
        assert rel(a, b) < ROW_TOL, f"{where}: {name} rows differ from the plain head's ({rel(a, b):.3g})"
    assert rel(head.sections()["mtp.hidden"], twin.sections()["mtp.hidden"]) < 1e-6, where
    for depth in range(1, 5):
        t1, p1 = (x.clone() for x in head.launch(token, n - 1, depth))
        t2, p2 = twin.launch(token, n - 1, depth)
        assert (p1 - p2).abs().max() < PROB_TOL, f"{where}, depth {depth}: {p1.tolist()} vs {p2.tolist()}"
        for k in range(depth):
            if float(p2[k, 0] - p2[k, 1]) > 2 * PROB_TOL and torch.equal(t1[:k], t2[:k]):
                assert int(t1[k, 0]) == int(t2[k, 0]), f"{where}, depth {depth}: top token at {k}"


def test_the_engine_offers_the_graphed_head(eng):
    from tandem_qwen38.mtp_cuda import CudaMTPHead

    head = eng.mtp_head()
    assert isinstance(head, CudaMTPHead) and eng.caps.mtp_graphs and eng.caps.mtp == 1
    assert {"mtp.hidden"} <= set(eng.state.sections) and {"mtp.K", "mtp.V"} <= set(eng.state.views)
    assert {p.name for p in eng.memory_parts()} >= {"mtp.weights", "mtp.kv", "mtp.cuda.workspace"}


def test_the_graphed_head_tracks_the_plain_head_through_a_round(eng, qwen38_ckpts):  # noqa: F811
    head, twin = eng.mtp_head(), plain_twin(eng)
    eng.reset()
    p = prompt(40, VOCAB, seed=3)
    with torch.inference_mode():
        logits = eng.forward(p)
        twin.append(p, eng.hidden_post_norm(), 0)
        compare(head, twin, 40, int(logits.argmax()), "prefill")
        # one launch's logits: the graph's against the plain head's decode form
        head.launch(5, 39, 1)
        want = twin.run(torch.tensor([5], device="cuda"), twin.sections()["mtp.hidden"], 39).logits
        assert rel(head.logits.float(), want) < ROW_TOL
        # a committed path of three (one append graph of width 4), then a plain step (the width-1 graph)
        eng.forward_tree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 2]))
        rows = eng.hidden_post_norm().clone()
        eng.commit_tree([0, 2, 3])
        eng.settle()
        twin.append(torch.tensor([7, 9, 10]), rows[[0, 2, 3]], 40, decode_form=True)
        compare(head, twin, 43, 11, "commit")
        eng.forward(torch.tensor([11]))
        twin.append(torch.tensor([11]), eng.hidden_post_norm(), 43, decode_form=True)
        compare(head, twin, 44, 12, "decode")


def test_a_commits_rows_equal_decode_steps_rows_bit_for_bit_and_a_restore_repeats_a_launch(qwen38_ckpts):  # noqa: F811
    a, b = cuda_engine(qwen38_ckpts.mtp.path), cuda_engine(qwen38_ckpts.mtp.path)
    p = prompt(30, VOCAB, seed=9)
    path = [4, 5, 6, 7]
    with torch.inference_mode():
        a.forward(p)
        b.forward(p)
        a.forward_tree(torch.tensor(path), torch.tensor([-1, 0, 1, 2]))
        a.commit_tree([0, 1, 2, 3])
        a.settle()
        for t in path:
            b.forward(torch.tensor([t]))
        for name in ("mtp.K", "mtp.V"):
            assert torch.equal(a.state.views[name].head(33), b.state.views[name].head(33)), name
        assert torch.equal(a.state.sections["mtp.hidden"], b.state.sections["mtp.hidden"])
        first = [x.clone() for x in a.mtp_head().launch(8, 33, 3)]
        snap = a.state.clone()
        a.forward(torch.tensor([1, 2, 3, 4, 5]))
        restore_state(a, snap)
        again = a.mtp_head().launch(8, 33, 3)
        assert all(torch.equal(x, y) for x, y in zip(first, again))


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def test_greedy_speculative_decoding_with_the_graphed_head_equals_plain(qwen38_ckpts):  # noqa: F811
    spec_engine, plain_engine = cuda_engine(qwen38_ckpts.mtp.path), cuda_engine(qwen38_ckpts.mtp.path)
    target = TargetInfo.of(spec_engine.caps, tokenizer=None, vocab_size=VOCAB, engine=spec_engine)
    spec = Speculation([build_drafter("mtp", target)], StairCut(flat_prices(), max_tree=8), 8)
    rounds = drafted = 0
    for seed in range(3):
        req = DecodeRequest(prompt(12 + 5 * seed, VOCAB, seed=seed).tolist(), 24, SamplingParams(temperature=0.0))
        want = [t for c in Decode(plain_engine, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(spec_engine, req, IdDetok(), speculation=spec)
        assert [t for c in dec.run() for t in c.tokens] == want, f"prompt {seed}"
        rounds, drafted = rounds + dec.stats.rounds, drafted + dec.stats.drafted
    assert drafted >= rounds, f"{drafted} nodes drafted in {rounds} rounds: the head proposed nothing"
