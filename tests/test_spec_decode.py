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
