"""The Llama runner under the core's sequence engine, on tiny re-randomised Llama checkpoints (GGUF and Hugging
Face directories written by test_llama_tiny.py's helpers; its tests check the decode step against transformers).

The runner passes the runner conformance suite (``tandem_core.testing.conformance``): chains and trees of every
width bit for bit against plain decode, commits, rejected branches, pending tokens and rollbacks to any length
(attention only), resume at a common prefix, traces, taps, oracle speculation, the self-check. Below it, what is
Llama's own: other weight holdings and sources verify bit for bit, the output head in row blocks, speculative
decoding with the real lookup drafter equals plain decoding (greedy and seeded), and the self-check failing
naming the layer on a deliberately perturbed runner.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from test_llama_tiny import _hf_model, bpe, write_gguf  # noqa: F401  (bpe: fixture)

from tandem_core.engine import SequenceEngine, TreeStep
from tandem_core.serving import ServeArgs, ServeContext
from tandem_core.spec.selfcheck import run_selfcheck
from tandem_core.testing.conformance import RunnerCase, RunnerContract, check_a_batched_linear_fails_at_width_two
from tandem_core.testing.trees import Recorded, assert_same_state, flat_prices, path_to, plain_rows_of_tree, random_tree

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "plugins" / "drafters") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins" / "drafters"))

VOCAB = 320
WIDTH = 16  # the self-check's widths


@pytest.fixture(scope="module", autouse=True)
def _plugins_and_one_thread(llama_plugins_one_thread):
    yield


def serve_tiny(path: Path, max_context: int = 256, **options):
    from tandem_llama.serving import serve

    return serve(ServeArgs(model_id="tiny", path=path, max_context=max_context, options=options), ServeContext())


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, bpe):
    qtypes = {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_1",
              "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
    return write_gguf(tmp_path_factory.mktemp("llama_tree") / "tiny.gguf", _hf_model(False, seed=3), bpe, qtypes)


@pytest.fixture(scope="module")
def served(gguf_path):
    return serve_tiny(gguf_path)


@pytest.fixture(scope="module")
def eng(served):
    return served.engine


@pytest.fixture(scope="module")
def twin(served):
    """A second engine over the same weights: the plain-decode reference."""
    return served.spawn()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def rec(twin):
    return Recorded(twin, prompt(20, seed=21), 68)


def llama_case(served) -> RunnerCase:
    from tandem_llama.model import build_engine

    r = served.engine.runner

    def build(max_context: int = 256, max_tree: int = 64, **kw):
        return build_engine(r.cfg, r.w, max_context=max_context, max_tree=max_tree, **kw)

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, seed))


class TestLlamaRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, served):
        return llama_case(served)

    def test_serve_gives_max_tree_and_an_attention_only_state(self, gguf_path, eng):
        assert not eng.state.sections and set(eng.state.views) == {"K", "V"}
        assert {"linear_rows", "silu"} <= set(eng.manifest().extra["ops"])
        small = serve_tiny(gguf_path, max_context=64, max_tree=8)
        assert small.engine.caps.max_tree == 8 and small.spawn().caps.max_tree == 8


def _other_sources(tmp_path, bpe, monkeypatch, kind):
    if kind == "gguf-lean":
        monkeypatch.setenv("TANDEM_LLAMA_DENSE", "0")             # dequantised per matmul from Q4_1 rows
        return serve_tiny(write_gguf(tmp_path / "lean.gguf", _hf_model(True, seed=4), bpe, "Q4_1"), 128)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    _hf_model(False, seed=5, rope_scaling=scaling).save_pretrained(tmp_path)
    bpe[3].save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    return serve_tiny(tmp_path, 128)


@pytest.mark.parametrize("kind", ["gguf-lean", "hf-llama3-rope"])
def test_other_weight_holdings_and_sources_verify_bit_for_bit(tmp_path, bpe, monkeypatch, kind):
    served = _other_sources(tmp_path, bpe, monkeypatch, kind)
    eng, twin = served.engine, served.spawn()
    twin.forward(prompt(37, seed=4))                              # past the llama3 band edges of 16
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(11), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])


def test_a_head_in_row_blocks_verifies_bit_for_bit_and_equals_the_whole_head(served, eng, twin, rec):
    """The output head in row blocks (the real model's 49152-row head is; the tiny one fits one block):
    decode and verify make the same blocked calls, and the logits are the whole head's within rounding."""
    from tandem_llama.model import head_blocks

    lm_head = served.engine.runner.w.lm_head
    blocks = head_blocks(lm_head, 48 * 64 * 4)                       # 48 rows of 64 fp32 a block
    assert [(s, e) for s, e, _ in blocks] == [(s, min(320, s + 48)) for s in range(0, 320, 48)]
    assert all(torch.equal(b.dense(), lm_head.dense()[s:e]) for s, e, b in blocks)
    assert len(head_blocks(lm_head)) == 1
    case = llama_case(served)
    blocked, blocked_twin = (case.build(max_context=256, head_block_bytes=48 * 64 * 4) for _ in range(2))
    base = rec.state_at(4)
    tokens, parents = random_tree(random.Random(9), 20, VOCAB)
    want, _, _ = plain_rows_of_tree(blocked_twin, base, tokens, parents)
    blocked.state.restore(base)
    out = blocked.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(20))
    ref = torch.stack([twin_row(twin, base, tokens, parents, i) for i in range(20)])
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)
    assert blocked.manifest().settings["head_block_rows"] == 48
    assert blocked.manifest().fingerprint() != eng.manifest().fingerprint()


def twin_row(twin, base, tokens, parents, i):
    """Node ``i``'s row by plain decode of its path on the one-block engine."""
    twin.state.restore(base)
    for j in path_to(parents, i):
        row = twin.forward([tokens[j]])[0]
    return row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestLlamaCudaRunner(RunnerContract):
    """The same (eager) runner on a CUDA device: the weights dense in bf16 there (``weights.on_device``). The CUDA
    graph runner the serving picks there has its own class (test_llama_cuda_runner.py, ``TestLlamaCudaGraphRunner``);
    this one stays the eager reference on the device."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, gguf_path):
        from tandem_llama.model import build_engine
        from tandem_llama.weights import on_device

        r = serve_tiny(gguf_path).engine.runner
        w = on_device(r.w, "cuda:0", torch.bfloat16)

        def build(max_context: int = 256, max_tree: int = 64, **kw):
            return build_engine(r.cfg, w, max_context=max_context, max_tree=max_tree, device="cuda:0", **kw)

        return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, seed))

    def test_it_runs_on_the_device_in_bf16(self, eng):
        assert eng.caps.device == "cuda:0" and eng.caps.dtype == "bf16"
        assert eng.state.views["K"].tensor.is_cuda


# -- speculation: the real loop with the lookup drafter, and an oracle -----------------------------------
class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


PROMPTS = [prompt(8 + 3 * i, seed=100 + i) for i in range(14)] + [
    [5, 6, 7] * 8, [9] * 20, [11, 12] * 11 + [11], [40, 41, 42, 43, 44] * 5, [3] * 3 + [300] * 10, [7, 7, 8] * 9,
]


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1234},
                                {"temperature": 1.0, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.3}],
                         ids=["greedy", "seeded", "seeded-penalties"])
def test_speculative_decoding_with_the_lookup_drafter_equals_plain(served, eng, twin, kw):
    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.spec.cut import StairCut
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams
    from tandem_core.spec.speculate import SpecDecode, Speculation

    params = SamplingParams(**kw)
    target = TargetInfo.of(eng.caps, tokenizer=served.tokenizer.fingerprint(), vocab_size=VOCAB)
    spec = Speculation([build_drafter("lookup", target)], StairCut(flat_prices(), max_tree=32), 32)
    rounds = tokens = 0
    assert len(PROMPTS) == 20
    for k, p in enumerate(PROMPTS):
        stops = frozenset() if k % 3 else frozenset({(k * 37) % VOCAB})
        req = DecodeRequest(p, 40 - k % 4, params, stops)
        want = [t for c in Decode(twin, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(eng, req, IdDetok(), speculation=spec)
        got = [t for c in dec.run() for t in c.tokens]
        assert got == want, f"prompt {k}"
        assert_same_state(eng.state, twin.state, f"prompt {k}: the engine holds what the plain loop's holds")
        rounds += dec.stats.rounds
        tokens += dec.stats.tokens
    if params.greedy:
        assert tokens / rounds > 1.5, f"{tokens} tokens in {rounds} rounds: the drafter should be accepted"


# -- the load-time self-check ---------------------------------------------------------------------------
def nudge(t: torch.Tensor) -> torch.Tensor:
    """Every element one ulp up."""
    return torch.nextafter(t, torch.full_like(t, math.inf))


def build(served, runner=None, cls=SequenceEngine):
    """An engine of ``cls`` over a runner of ``runner`` (a test subclass of the plugin's) on the tiny weights."""
    base = served.engine.runner
    return cls((runner or type(base))(base.cfg, base.w, max_context=128, max_tree=WIDTH))


@pytest.mark.parametrize("layer,part", [(1, "attention"), (0, "mlp")])
def test_a_one_ulp_difference_in_one_layers_verify_fails_naming_that_layer(served, layer, part):
    class OneUlpOff(type(served.engine.runner)):
        """Verifies of 3 or more nodes are off by one ulp in one layer's attention or MLP output."""

        def _attention(self, h, lw, li, step, cos, sin):
            out = super()._attention(h, lw, li, step, cos, sin)
            hit = part == "attention" and li == layer and isinstance(step, TreeStep) and step.count >= 3
            return nudge(out) if hit else out

        def _mlp(self, h, lw, step):
            out = super()._mlp(h, lw, step)
            hit = part == "mlp" and lw is self.w.layers[layer] and isinstance(step, TreeStep) and step.count >= 3
            return nudge(out) if hit else out

    res = run_selfcheck(build(served, runner=OneUlpOff))
    assert not res.ok
    m = res.mismatch
    assert m is not None and m.form == "chain" and m.width == 3 and m.node == 0
    assert m.layer == f"layer {layer} {part}"
    assert "width 3" in res.first_mismatch and f"layer {layer} {part}" in res.first_mismatch
    assert res.rows_checked == 1 + 2 + 1                   # widths 1 and 2 passed; the first row of width 3


def test_a_batched_linear_kernel_fails_the_check_at_width_two(served):
    lin = served.engine.runner.w.layers[0].qkv
    check_a_batched_linear_fails_at_width_two(lambda: build(served), lin.matmul, lin.shape[1], "layer 0 attention")


def test_an_inexact_commit_is_named_as_the_state_before_the_row(served):
    class LossyCommit(SequenceEngine):
        def commit_tree(self, path):
            start = self.kv.length
            super().commit_tree(path)
            if self.kv.length > start:
                K = self.state.views["K"].tensor
                K[0, :, start] = nudge(K[0, :, start])

    res = run_selfcheck(build(served, cls=LossyCommit))
    assert not res.ok and res.mismatch is not None
    assert res.mismatch.form == "chain" and res.mismatch.width == 2 and res.mismatch.layer is None
    assert "the state earlier commits left differs" in res.first_mismatch


def test_the_trace_names_the_layers_of_the_family(served):
    t = build(served).trace_forward([5, 17, 2, 99, 43])
    assert t.points[0] == "layer 0 attention" and len(t.points) == 2 * 2 + 1
    assert all(r.shape == (5, 64) for r in t.rows)
