"""The Llama engine's tree verbs on tiny re-randomised Llama checkpoints (GGUF and Hugging Face directories
written by tests/test_llama_tiny.py's helpers; its tests check the decode step against transformers).

What is proved, bit for bit (``torch.equal``) against plain decode (``forward`` of one token at a time):

- every verified row of chains of every width 1..max_tree and of random trees (distractors included, each
  node against plain decode of its own path) equals the decode step's row, and its hidden row too;
- ``commit_tree`` leaves the state plain decode leaves (views up to length); rejected branches leave no
  trace; ``rollback_to`` (any length: the model is attention only), ``trim_pending``, ``discard_pending``,
  ``settle``, ``resume_at`` and a state restore do what the contract says;
- speculative decoding (``SpecDecode`` with the real lookup drafter, and an oracle drafter) equals plain
  decoding token for token, greedy and seeded sampling, through stops and max_tokens inside accepted runs;
- the load-time self-check passes, and fails naming the layer on a deliberately perturbed engine.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from test_llama_tiny import _hf_model, bpe, write_gguf  # noqa: F401  (bpe: fixture)

from tree_checks import (Recorded, flat_prices, assert_same_state, check_a_batched_linear_fails_at_width_two,  # noqa: E402
                         check_chains, check_forward_settles, check_oracle_speculation, check_random_tree,
                         check_rejected_branches, check_second_tree, check_trace_verbs, check_trim_pending, path_to,
                         plain_rows_of_tree, random_tree)
from tandem_core.engine import ResumableEngine, TreeEngine
from tandem_core.serving import ServeArgs, ServeContext
from tandem_core.spec.selfcheck import LayerTrace, run_selfcheck
from tandem_core.state import StateMismatch

ROOT = Path(__file__).resolve().parents[1]
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


# -- the engine contract ------------------------------------------------------------------------------
def test_the_engine_offers_the_tree_resume_and_trace_verbs(gguf_path, eng):
    assert isinstance(eng, TreeEngine) and isinstance(eng, ResumableEngine) and isinstance(eng, LayerTrace)
    caps = eng.caps
    assert caps.tree and caps.resume and caps.trace and not caps.recurrent and caps.max_tree == 64
    assert not eng.state.sections                               # attention only: every state is K and V views
    assert {"linear_rows", "silu"} <= set(eng.manifest().extra["ops"])
    small = serve_tiny(gguf_path, max_context=64, max_tree=8)
    assert small.engine.caps.max_tree == 8 and small.spawn().caps.max_tree == 8


def test_chains_of_every_width_equal_the_decode_rows_and_commit_its_state(eng, rec):
    check_chains(eng, rec, VOCAB)


@pytest.mark.parametrize("size,seed", [(1, 0), (2, 1), (5, 2), (13, 3), (33, 4), (64, 5)])
def test_random_trees_equal_plain_decode_of_every_nodes_path(eng, twin, rec, size, seed):
    check_random_tree(eng, twin, rec, size, seed, VOCAB)


def test_rejected_branches_leave_no_trace(eng, rec):
    check_rejected_branches(eng, rec, VOCAB)


def test_a_second_tree_replaces_the_first_and_discard_drops_it(eng, rec):
    check_second_tree(eng, rec)


def test_verify_and_commit_refuse_what_they_cannot_do(served, eng, rec):
    eng.state.restore(rec.state_at(0))
    with pytest.raises(ValueError, match="exceed max_tree 64"):
        eng.forward_block(list(range(65)))
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        eng.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="3 tokens but 2 parents"):
        eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="token id 320"):
        eng.forward_block([1, 320])
    with pytest.raises(ValueError, match="token id -1"):
        eng.forward([-1])
    with pytest.raises(ValueError, match="no tokens"):
        eng.forward_block([])
    eng.forward_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, -1]))
    with pytest.raises(ValueError, match=r"path\[0\] = 7 is not a node"):
        eng.commit_tree([7])
    with pytest.raises(ValueError, match=r"path\[1\] = node 2 has parent -1, not 0"):
        eng.commit_tree([0, 2])
    assert_same_state(eng.state, rec.state_at(0), "refused commits change nothing")
    small = type(eng)(eng.cfg, eng.w, max_context=24, max_tree=8)
    small.forward(list(range(20)))
    with pytest.raises(ValueError, match="exceed the engine's context of 24"):
        small.forward_block([1, 2, 3, 4, 5])
    assert small.kv.length == 20
    small.forward_tree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, -1, -1, 0]))   # depth 2 fits
    small.commit_tree([0, 4])
    assert small.kv.length == 22


def test_trim_pending_rollback_and_settle(eng, rec):
    base = check_trim_pending(eng, rec)
    with pytest.raises(ValueError, match="holds"):
        eng.rollback_to(base + 13)
    with pytest.raises(ValueError, match="holds"):
        eng.rollback_to(-1)
    eng.settle()
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    eng.trim_pending(0)
    # attention only: a rollback may go past the settled tokens, to any length, and decoding on is plain
    eng.rollback_to(base + 2)
    assert_same_state(eng.state, rec.state_at(2), "after rolling back past the settle point")
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    for j in range(2, 6):
        assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
    eng.forward_block(rec.tokens[6:9])
    eng.commit_tree(range(3))                                    # 3 pending from position base + 6
    eng.rollback_to(base + 4)                                    # before them: none are left
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    eng.forward_block(rec.tokens[4:7])
    eng.commit_tree(range(3))
    eng.trim_pending(3)
    assert_same_state(eng.state, rec.state_at(4), "pending counted from the rollback")
    eng.rollback_to(0)
    assert eng.kv.length == 0


def test_forward_settles_and_a_state_restore_forgets_pending_and_tree(eng, rec):
    check_forward_settles(eng, rec)


def test_resume_at_a_common_prefix_then_verify_equals_the_plain_run(eng, rec):
    eng.state.restore(rec.state_at(0))
    eng.forward_block(rec.tokens[:12])
    eng.commit_tree(range(12))                                  # the views hold 12 tokens' rows
    eng.forward_block(rec.tokens[12:14])
    eng.resume_at(rec.state_at(6).length)                       # a cache's common prefix: no sections
    assert eng.kv.length == rec.state_at(6).length
    with pytest.raises(RuntimeError, match="no verified tree"):
        eng.commit_tree([0])
    with pytest.raises(ValueError, match="0 tokens are pending"):
        eng.trim_pending(1)
    for j in range(6, 10):
        assert torch.equal(eng.forward([rec.tokens[j]])[0], rec.rows[j]), f"decode row {j}"
    out = eng.forward_block(rec.tokens[10:14])
    assert all(torch.equal(out.logits[i], rec.rows[10 + i]) for i in range(4))
    eng.commit_tree(range(4))
    assert_same_state(eng.state, rec.state_at(14), "after resuming and verifying on")
    eng.resume_at(eng.kv.length, {})
    with pytest.raises(StateMismatch, match="cannot resume"):
        eng.resume_at(eng.kv.length + 1)
    with pytest.raises(StateMismatch, match="anchor sections"):
        eng.resume_at(4, {"gdn.S": torch.zeros(1)})


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

    lm_head = served.engine.w.lm_head
    blocks = head_blocks(lm_head, 48 * 64 * 4)                       # 48 rows of 64 fp32 a block
    assert [(s, e) for s, e, _ in blocks] == [(s, min(320, s + 48)) for s in range(0, 320, 48)]
    assert all(torch.equal(b.dense(), lm_head.dense()[s:e]) for s, e, b in blocks)
    assert len(head_blocks(lm_head)) == 1
    cls = type(eng)
    blocked, blocked_twin = (cls(eng.cfg, eng.w, max_context=256, head_block_bytes=48 * 64 * 4) for _ in range(2))
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


def test_greedy_speculation_with_an_oracle_drafter_equals_plain_greedy(eng, twin):
    check_oracle_speculation(eng, twin, PROMPTS, VOCAB)


# -- the load-time self-check ---------------------------------------------------------------------------
def nudge(t: torch.Tensor) -> torch.Tensor:
    """Every element one ulp up."""
    return torch.nextafter(t, torch.full_like(t, math.inf))


def build(served, cls=None):
    base = served.engine
    return (cls or type(base))(base.cfg, base.w, max_context=128, max_tree=WIDTH)


def test_the_self_check_passes_on_the_engine(served):
    eng = build(served)
    res = run_selfcheck(eng)
    assert res.ok, res.first_mismatch
    assert res.widths == tuple(range(1, WIDTH + 1))
    assert res.rows_checked >= WIDTH * (WIDTH + 1) // 2 + WIDTH
    assert eng.kv.length == 0, "the self-check leaves the engine reset"


@pytest.mark.parametrize("layer,part", [(1, "attention"), (0, "mlp")])
def test_a_one_ulp_difference_in_one_layers_verify_fails_naming_that_layer(served, layer, part):
    from tandem_llama.model import TreeStep

    class OneUlpOff(type(served.engine)):
        """Verifies of 3 or more nodes are off by one ulp in one layer's attention or MLP output."""

        def _attention(self, h, lw, li, step, tree, cos, sin):
            out = super()._attention(h, lw, li, step, tree, cos, sin)
            hit = part == "attention" and li == layer and isinstance(step, TreeStep) and step.count >= 3
            return nudge(out) if hit else out

        def _mlp(self, h, lw, step):
            out = super()._mlp(h, lw, step)
            hit = part == "mlp" and lw is self.w.layers[layer] and isinstance(step, TreeStep) and step.count >= 3
            return nudge(out) if hit else out

    res = run_selfcheck(build(served, OneUlpOff))
    assert not res.ok
    m = res.mismatch
    assert m is not None and m.form == "chain" and m.width == 3 and m.node == 0
    assert m.layer == f"layer {layer} {part}"
    assert "width 3" in res.first_mismatch and f"layer {layer} {part}" in res.first_mismatch
    assert res.rows_checked == 1 + 2 + 1                   # widths 1 and 2 passed; the first row of width 3


def test_a_batched_linear_kernel_fails_the_check_at_width_two(served):
    lin = served.engine.w.layers[0].qkv
    check_a_batched_linear_fails_at_width_two(lambda: build(served), lin.matmul, lin.shape[1], "layer 0 attention")


def test_an_inexact_commit_is_named_as_the_state_before_the_row(served):
    class LossyCommit(type(served.engine)):
        def commit_tree(self, path):
            start = self.kv.length
            super().commit_tree(path)
            if self.kv.length > start:
                self.k_cache[0, :, start] = nudge(self.k_cache[0, :, start])

    res = run_selfcheck(build(served, LossyCommit))
    assert not res.ok and res.mismatch is not None
    assert res.mismatch.form == "chain" and res.mismatch.width == 2 and res.mismatch.layer is None
    assert "the state earlier commits left differs" in res.first_mismatch


def test_the_trace_verbs_have_their_verbs_arithmetic(served):
    check_trace_verbs(build(served), build(served), "layer 0 attention", 2 * 2 + 1, 64)
