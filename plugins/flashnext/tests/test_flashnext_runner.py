"""The qwen4_exp runner under the core's sequence engine, on the tiny re-randomised checkpoints (fp32 unless
named).

The runner passes the runner conformance suite (``tandem_core.testing.conformance``: chains and trees of every
width bit for bit against plain decode, commits, rejected branches, pending tokens and rollbacks, resume at an
anchor, traces, taps, oracle speculation, the self-check; ``test_flashnext_mtp.py`` follows the MTP head's
``mtp.h_last`` section through a verify, a commit and a replay). Below it, what is the family's own: a random
tree in bf16 is its decode rows too; the checkpoint
served through the one loader (its plugin registered as an installed one is); speculative decoding with the
real lookup drafter equals plain decoding (greedy and seeded); the self-check naming the layer of a batched
``linear_rows``.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_flashnext import flashnext_ckpts, load_engine, one_thread, prompt  # noqa: F401  (fixtures)

from tandem_core.serving import ServeArgs, ServeContext
from tandem_core.testing.conformance import (RunnerCase, RunnerContract,
                                             check_a_batched_linear_fails_at_width_two)
from tandem_core.testing.trees import assert_same_state, flat_prices, path_to, plain_rows_of_tree, random_tree

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320


def flashnext_case(path, dtype: str = "fp32", last_streams: bool = False) -> RunnerCase:
    def build(max_context: int = 256, max_tree: int = 64):
        from tandem_flashnext.serving import build_engine

        base = load_engine(path, dtype=dtype, max_context=8).runner
        return build_engine(base.cfg, base.w, max_context, 512, max_tree=max_tree, last_streams=last_streams)

    return RunnerCase(build=build, vocab=VOCAB, prompt=lambda n, seed: prompt(n, VOCAB, seed=seed).tolist())


class TestFlashNextRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, flashnext_ckpts):
        return flashnext_case(flashnext_ckpts.text.path)

    def test_the_runner_holds_every_state_kind(self, eng):
        assert set(eng.state.sections) == {"gdn.S", "gdn.conv", "ple.conv", "ngram.ctx"}
        assert set(eng.state.views) == {"K", "V", "IK"}
        parts = {p.name: p for p in eng.memory_parts()}
        assert parts["ple.tables"].device == "cpu (memory-mapped)"
        assert parts["ple.tables"].nbytes == (240 + 312) * 8 * 4          # the two tables' rows of 8, fp32
        assert {"weights", "gdn.S", "gdn.conv", "ple.conv", "ngram.ctx", "kv", "indexer.keys"} <= set(parts)


def test_tree_rows_equal_decode_rows_in_bf16(flashnext_ckpts):
    case = flashnext_case(flashnext_ckpts.text.path, "bf16")
    eng, twin = case.build(max_context=128), case.build(max_context=128)
    twin.forward(prompt(17, VOCAB, seed=4))
    base = twin.state.clone()
    tokens, parents = random_tree(random.Random(11), 24, VOCAB)
    want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
    eng.state.restore(base)
    out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
    assert all(torch.equal(out.logits[i], want[i]) for i in range(24))
    leaf = max(range(24), key=lambda i: len(path_to(parents, i)))
    eng.commit_tree(path_to(parents, leaf))
    assert_same_state(eng.state, states[leaf])


@pytest.fixture(scope="module")
def served(flashnext_ckpts):
    """The vision-language checkpoint through the one loader, the plugin registered as an installed one is."""
    from tandem_flashnext import plugin as flashnext_plugin

    from tandem_core.loader import load_served

    registered(flashnext_plugin, "flashnext")
    path = flashnext_ckpts.vl.path
    return load_served(str(path), args=ServeArgs("tiny-flashnext", path, max_context=256), ctx=ServeContext())


def test_the_loader_serves_the_checkpoint(served, flashnext_ckpts):
    info = served.info
    assert info["architecture"] == "Qwen4ExpForConditionalGeneration" and info["plugin"] == "tandem-flashnext"
    assert info["layers"] == {"gated_deltanet": 3, "indexed_attention": 2, "ple": 2}
    assert info["skipped"] == {"model.visual.": 21} and info["mtp_head"] == {"layers": 0, "served": False, "parameters": 0}
    assert served.tool_format == "qwen_xml" and served.reasoning and served.think_in_prompt
    ids = prompt(30)
    with torch.no_grad():
        ref = flashnext_ckpts.vl.model(ids[None]).logits[0, -1]
    got = served.engine.forward(ids)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
    assert torch.equal(served.spawn().forward(ids)[0], got)       # another engine over the same weights


def registered(module, name: str) -> None:
    """``module`` registered as the plugin ``name`` (as its installed distribution would be), once."""
    from tandem_core.plugins import load_plugins, plugin_manager, register_plugin

    load_plugins()
    if not plugin_manager().is_registered(module) and plugin_manager().get_plugin(name) is None:
        register_plugin(module, name)


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


PROMPTS = [prompt(8 + 3 * i, seed=100 + i).tolist() for i in range(6)] + [
    [5, 6, 7] * 8, [9] * 20, [11, 12] * 11 + [11], [40, 41, 42, 43, 44] * 5, [3] * 3 + [300] * 10,
    [7, 7, 8] * 9]


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_speculative_decoding_with_the_lookup_drafter_equals_plain(flashnext_ckpts, kw):
    from tandem_drafters import plugin as drafters_plugin

    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.spec.cut import StairCut
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams
    from tandem_core.spec.speculate import SpecDecode, Speculation

    registered(drafters_plugin, "drafters")
    eng, twin = load_engine(flashnext_ckpts.text.path), load_engine(flashnext_ckpts.text.path)
    params = SamplingParams(**kw)
    target = TargetInfo.of(eng.caps, tokenizer=None, vocab_size=VOCAB)
    spec = Speculation([build_drafter("lookup", target)], StairCut(flat_prices(), max_tree=16), 16)
    rounds = tokens = 0
    for k, p in enumerate(PROMPTS):
        req = DecodeRequest(p, 24, params)
        want = [t for c in Decode(twin, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(eng, req, IdDetok(), speculation=spec)
        got = [t for c in dec.run() for t in c.tokens]
        assert got == want, f"prompt {k}"
        assert_same_state(eng.state, twin.state, f"prompt {k}: the engine holds what the plain loop's holds")
        rounds += dec.stats.rounds
        tokens += dec.stats.tokens
    if params.greedy:
        assert tokens > rounds, f"{tokens} tokens in {rounds} rounds: no draft was ever accepted"


def test_the_self_check_names_the_layer_of_a_batched_linear(flashnext_ckpts):
    case = flashnext_case(flashnext_ckpts.text.path)
    runner = case.build(max_context=8).runner
    check_a_batched_linear_fails_at_width_two(
        lambda: case.build(max_context=128, max_tree=4),
        lambda x: runner.w.layers[0].attn_hc.down.matmul(x), runner.cfg.hc_dim,
        "layer 0 linear_attention mixer")
