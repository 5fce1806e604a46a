"""The speculative loop (SpecDecode) equals the plain loop token for token, greedy and seeded sampling,
through stops and max_tokens in the middle of accepted runs, on a toy tree engine with the real lookup
drafter and StairCut."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.spec.cut import PriceTable, StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))
from toy_tree_runner import toy_tree_engine  # noqa: E402


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def flat_prices() -> PriceTable:
    return prices(1.05)


def prices(at_65: float) -> PriceTable:
    return PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "toy", "profile": "fp32",
                                 "device": "cpu", "contexts": [0, 100000], "widths": [1, 65],
                                 "ms": [[1.0, at_65], [1.0, at_65]]})


def run(decode_cls, engine, prompt, params, max_tokens=40, stop_ids=(), **kw):
    req = DecodeRequest(prompt, max_tokens, params, frozenset(stop_ids))
    dec = decode_cls(engine, req, IdDetok(), **kw)
    toks = [t for chunk in dec.run() for t in chunk.tokens]
    return toks, dec


def speculation(engine):
    target = TargetInfo.of(engine.caps, tokenizer=None, vocab_size=engine.runner.vocab)
    return Speculation([build_drafter("lookup", target)], StairCut(flat_prices(), max_tree=32), 32)


PROMPTS = [[1, 2, 3], [5, 5, 5, 5, 5], [7, 1, 7, 1, 7, 1, 7], list(range(20)), [3, 9, 27, 33, 3, 9, 27, 33, 3, 9],
           [11] * 12, [0, 1, 0, 2, 0, 3], [40, 41, 42, 43, 40, 41, 42], [8, 16, 24, 32], [2, 4, 2, 4, 2, 4, 2, 4],
           [13], [47, 46, 45, 44, 43, 42], [6, 6, 7, 7, 6, 6, 7, 7], [30, 20, 10], [9, 19, 29, 39, 9, 19],
           [12, 14, 16, 12, 14, 16, 12], [1, 1, 2, 3, 5, 8, 13, 21], [44, 0, 44, 0], [25, 26], [17, 34, 17, 34, 17]]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1234),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=7, frequency_penalty=0.3)],
                         ids=["greedy", "sampled", "sampled-penalties"])
def test_speculative_equals_plain(params):
    spec_engine, plain_engine = toy_tree_engine(), toy_tree_engine()
    spec = speculation(spec_engine)
    rounds = tokens = 0
    for prompt in PROMPTS:
        want, plain = run(Decode, plain_engine, prompt, params)
        got, dec = run(SpecDecode, spec_engine, prompt, params, speculation=spec)
        assert got == want, f"prompt {prompt}"
        # the engine holds what the plain loop's engine holds: prompt + answer but the last token
        assert spec_engine.kv.length == plain_engine.kv.length
        assert torch.equal(spec_engine.state.sections["s"], plain_engine.state.sections["s"])
        rounds += dec.stats.rounds
        tokens += dec.stats.tokens
    if params.greedy:
        assert tokens / rounds > 2.0, "the lookup drafter should get long acceptances on cycles"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 17])
def test_max_tokens_inside_an_accepted_run(max_tokens):
    params = SamplingParams(temperature=0.0)
    e1, e2 = toy_tree_engine(), toy_tree_engine()
    spec = speculation(e1)
    for prompt in PROMPTS[:6]:
        want, _ = run(Decode, e2, prompt, params, max_tokens=max_tokens)
        got, dec = run(SpecDecode, e1, prompt, params, max_tokens=max_tokens, speculation=spec)
        assert got == want and len(got) == max_tokens
        assert e1.kv.length == e2.kv.length


def test_stop_id_inside_an_accepted_run():
    params = SamplingParams(temperature=0.0)
    e1, e2 = toy_tree_engine(), toy_tree_engine()
    full, _ = run(Decode, e2, [5, 5, 5], params, max_tokens=30)
    stop = full[7]  # a token the greedy answer reaches mid-way
    want, _ = run(Decode, e2, [5, 5, 5], params, max_tokens=30, stop_ids={stop})
    spec = speculation(e1)
    for _ in range(3):  # later runs: the drafter has seen it all before, so the stop lands inside a run
        got, dec = run(SpecDecode, e1, [5, 5, 5], params, max_tokens=30, stop_ids={stop}, speculation=spec)
        assert got == want and got[-1] == stop
        assert e1.kv.length == e2.kv.length


def test_steep_prices_mean_plain_rounds():
    steep = prices(200.0)
    want, _ = run(Decode, toy_tree_engine(), PROMPTS[1], SamplingParams(temperature=0.0))
    for every in (0, 16):
        e1 = toy_tree_engine()
        trees = []
        real_forward_tree = e1.forward_tree
        e1.forward_tree = lambda t, p: trees.append(len(t)) or real_forward_tree(t, p)
        target = TargetInfo.of(e1.caps, tokenizer=None, vocab_size=e1.runner.vocab)
        spec = Speculation([build_drafter("lookup", target)], StairCut(steep, max_tree=32, explore_every=every), 32)
        got, dec = run(SpecDecode, e1, PROMPTS[1], SamplingParams(temperature=0.0), speculation=spec)
        assert got == want
        # plain rounds, but for one node verified after every 16 rounds in a row that kept nothing
        assert dec.stats.drafted == spec.cut.explored <= dec.stats.rounds // 17, (every, dec.stats)
        assert (spec.cut.explored > 0) == (every > 0)
        # a round with nothing to verify is a decode step (engine.forward), not a one-node verify
        assert trees == [2] * spec.cut.explored and e1.runner.forward_calls >= dec.stats.rounds - len(trees)


# -- the cost rule of the costly drafters' gate --------------------------------------------------------------

def test_the_gate_pauses_a_drafter_that_costs_more_than_it_saves_and_backs_off():
    from tandem_core.spec.speculate import DrafterGate

    g = DrafterGate(warm=3)
    asked = []
    for _ in range(40):
        if g.ask():
            asked.append(True)
            g.paid(10.0)
            g.value(2.0)                 # it saves 2 ms a round and costs 10
        else:
            asked.append(False)
    # warm rounds, then pauses of 1, 2, 4, 8, 16, 32 rounds, one losing round between them
    assert [i for i, a in enumerate(asked) if a] == [0, 1, 2, 4, 7, 12, 21, 38]
    assert g.cost_pauses == 6
    # a new request caps the pause an earlier one left at 4 rounds; the cost rule's level stays
    g.new_request()
    assert g.cost_skip <= 4 and g.cost_level == 6
    # once its proposals pay, the cost rule's level resets and it is asked every round
    asked = []
    for _ in range(200):
        asked.append(g.ask())
        if asked[-1]:
            g.paid(1.0)
            g.value(5.0)
    assert g.cost_level == 0 and all(asked[-100:])


def test_a_paying_drafter_is_never_paused_by_the_cost_rule():
    from tandem_core.spec.speculate import DrafterGate

    g = DrafterGate(warm=2)
    for _ in range(50):
        assert g.ask()
        g.paid(3.0)
        g.value(3.5)
    assert g.cost_pauses == 0 and g.skipped == 0


def test_needed_tokens_counts_the_path_from_the_first_node_only_this_drafter_proposed():
    from tandem_core.drafter import Proposal
    from tandem_core.spec.speculate import needed_tokens
    from tandem_core.spec.tree import TokenTree

    a = Proposal.chain([1, 2, 3], [0.9, 0.9, 0.9], "a")
    b = Proposal.chain([1, 2, 7, 8], [0.9, 0.9, 0.9, 0.9], "b")
    tree = TokenTree.merge([a, b])
    # nodes: 0:1 (a,b) 1:2 (a,b) 2:3 (a) 3:7 (b) 4:8 (b)
    assert needed_tokens(tree, [0, 1, 3, 4], "b", ["a", "b"]) == 2      # 7, 8 needed b
    assert needed_tokens(tree, [0, 1, 3, 4], "a", ["a", "b"]) == 0      # b alone had that path
    assert needed_tokens(tree, [0, 1, 2], "a", ["a", "b"]) == 1
    assert needed_tokens(tree, [0, 1, 2], "a", ["a"]) == 3              # alone: every token needed it
    assert needed_tokens(tree, [], "a", ["a", "b"]) == 0


class CostlyLookup:
    """The lookup drafter under another name, ``costly`` and slowed by ``delay_s`` a proposal (a block drafter's
    forward, as far as the loop can tell)."""

    costly = True

    def __init__(self, inner, delay_s: float, name: str = "slow") -> None:
        self.inner, self.delay_s, self.name = inner, delay_s, name
        self.proposals = 0

    def requires(self):
        return self.inner.requires()

    def begin(self, prompt_ids):
        self.inner.begin(prompt_ids)

    def propose(self, context_ids, max_nodes):
        import dataclasses
        import time

        self.proposals += 1
        time.sleep(self.delay_s)
        return dataclasses.replace(self.inner.propose(context_ids, max_nodes), source=self.name)

    def accepted(self, tokens):
        self.inner.accepted(tokens)


@pytest.mark.parametrize("delay_s, paused", [(0.080, True), (0.0, False)], ids=["costs-more", "pays"])
def test_the_loop_stops_asking_a_costly_drafter_that_does_not_pay(delay_s, paused):
    spec_engine, plain_engine = toy_tree_engine(), toy_tree_engine()
    target = TargetInfo.of(spec_engine.caps, tokenizer=None, vocab_size=spec_engine.runner.vocab)
    slow = CostlyLookup(build_drafter("lookup", target), delay_s)
    # a verify costs 1 ms a round whatever its width: an accepted token saves 1 ms, the slow proposal costs 80
    # (more than the up to 32 tokens a round it can save)
    spec = Speculation([slow], StairCut(flat_prices(), max_tree=32), 32)
    params = SamplingParams(temperature=0.0)
    prompt = [7, 1, 7, 1, 7, 1, 7]
    want, _ = run(Decode, plain_engine, prompt, params, max_tokens=400)
    got, dec = run(SpecDecode, spec_engine, prompt, params, max_tokens=400, speculation=spec)
    assert got == want                    # pausing a drafter never changes the answer
    gate = dec._gates["slow"]
    assert spec.gates["slow"] is gate and dec.stats.paused == gate.skipped   # the engine's gate; its first request
    if paused:
        # paused for 1, 2, 4, ... rounds: most rounds end up plain ones
        assert gate.cost_pauses >= 5 and gate.skipped > 2 * slow.proposals, (gate, slow.proposals)
    else:
        # at most the first rounds' short pauses, 1 + 2 + 4 (a 7-token prompt gives the lookup nothing to copy
        # yet); once it pays it is asked every round
        assert gate.cost_level == 0 and gate.skipped <= 7 and slow.proposals == dec.stats.rounds - gate.skipped, \
            (gate, slow.proposals, dec.stats)
    # the next request on the engine starts from what the gate learnt: a drafter that does not pay sits out from
    # its first rounds on
    before = slow.proposals
    got, dec2 = run(SpecDecode, spec_engine, [3, 9, 27, 33, 3, 9, 27, 33], params, max_tokens=120, speculation=spec)
    want, _ = run(Decode, plain_engine, [3, 9, 27, 33, 3, 9, 27, 33], params, max_tokens=120)
    assert got == want
    if paused:
        assert slow.proposals - before < dec2.stats.rounds / 3, (slow.proposals - before, dec2.stats)
