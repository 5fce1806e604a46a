"""Lossless speculation on the tiny LFM2 mixture of experts with the real lookup drafter, and LFM2 through a real
server and the ``openai`` client.

- In the engine: ``SpecDecode`` against the plain loop, token for token, greedy (20 prompts, every drafted node
  verified) and seeded sampling (8 prompts), and the conv tails and K/V equal after each answer; the lookup
  drafter with a corpus built with the family's tokenizer drafts from it (and a corpus of another tokenizer
  is refused by name).
- Through the server (``tandem serve`` on the tiny checkpoint, the plugin's chat template, the test tokenizer):
  ``--spec lookup`` answers as ``--spec off`` does, the load-time self-check passes, and a chat streams.
"""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest
import torch
from openai import OpenAI

from conftest_lfm25 import PLUGIN_SRC, ROOT, VOCAB, lfm25_ckpts, load_engine  # noqa: F401  (fixture)
from replay_server import Server

from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.testing.trees import flat_prices


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def prompts(n: int) -> list[list[int]]:
    """Half random, half a short unit repeated (where the lookup drafter finds the loop)."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        if i % 2:
            unit = [rng.randrange(14, VOCAB - 8) for _ in range(rng.randrange(2, 6))]
            out.append((unit * 8)[: rng.randrange(12, 30)])
        else:
            out.append([rng.randrange(14, VOCAB - 8) for _ in range(rng.randrange(4, 20))])
    return out


@pytest.mark.parametrize("params, n_prompts", [(SamplingParams(temperature=0.0), 20),
                                               (SamplingParams(temperature=0.8, seed=5), 8)],
                         ids=["greedy", "seeded"])
def test_speculative_equals_plain_in_the_engine(lfm25_ckpts, params, n_prompts):
    path = lfm25_ckpts.moe.path
    spec_engine, plain_engine = load_engine(path), load_engine(path)
    target = TargetInfo.of(spec_engine.caps, tokenizer=None, vocab_size=VOCAB)
    spec = Speculation([build_drafter("lookup", target)], StairCut(flat_prices(), max_tree=16), 16)
    rounds = tokens = 0
    for p in prompts(n_prompts):
        req = DecodeRequest(p, 32, params)
        want = [t for c in Decode(plain_engine, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(spec_engine, req, IdDetok(), speculation=spec)
        assert [t for c in dec.run() for t in c.tokens] == want, f"prompt {p}"
        n = plain_engine.kv.length
        assert spec_engine.kv.length == n
        assert torch.equal(spec_engine.state.sections["conv"], plain_engine.state.sections["conv"])
        for name in ("K", "V"):
            assert torch.equal(spec_engine.state.views[name].head(n), plain_engine.state.views[name].head(n))
        rounds += dec.stats.rounds
        tokens += dec.stats.tokens
    assert tokens > rounds, f"{tokens} tokens in {rounds} rounds: no draft was ever accepted"


def test_the_lookup_drafter_drafts_from_a_corpus_built_with_the_family_tokenizer(lfm25_ckpts, tmp_path):
    from lfm2_tokenizer import lfm2_tokenizer
    from tandem_drafters.corpus import TokenizerMismatch, build_store

    tok = lfm2_tokenizer()
    path = lfm25_ckpts.moe.path
    spec_engine, plain_engine = load_engine(path), load_engine(path)
    # what the model answers greedily after a prompt, as a document the corpus holds
    prompt_ids = tok.encode("def add(x, y):")
    want = [t for c in Decode(plain_engine, DecodeRequest(prompt_ids, 24, SamplingParams(temperature=0.0)),
                              IdDetok()).run() for t in c.tokens]
    store = build_store([prompt_ids + want, tok.encode("Some other text, about the weather.")],
                        tmp_path / "corpus.bin", tok.fingerprint())
    assert store.exists()
    target = TargetInfo.of(spec_engine.caps, tokenizer=tok.fingerprint(), vocab_size=VOCAB)
    spec = Speculation([build_drafter("lookup", target, corpus=store)], StairCut(flat_prices(), max_tree=16), 16)
    dec = SpecDecode(spec_engine, DecodeRequest(prompt_ids, 24, SamplingParams(temperature=0.0)), IdDetok(),
                     speculation=spec)
    assert [t for c in dec.run() for t in c.tokens] == want
    assert dec.stats.tokens >= 2 * dec.stats.rounds, "the corpus continuation was not accepted"
    other = TargetInfo.of(spec_engine.caps, tokenizer="0" * 64, vocab_size=VOCAB)
    with pytest.raises(TokenizerMismatch, match="tokenizer"):
        build_drafter("lookup", other, corpus=store)


@pytest.fixture(scope="module")
def servers(lfm25_ckpts, tmp_path_factory):
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_lfm25.plugin,tandem_drafters.plugin",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "plugins"), str(ROOT), str(PLUGIN_SRC),
                                          str(ROOT / "plugins" / "drafters")])}
    path = lfm25_ckpts.moe.path
    spec = Server(path, tmp_path_factory.mktemp("ls"), "--spec", "lookup", "--max-tree", "8", "--no-cache",
                  "--max-context", "256", env=env)
    plain = Server(path, tmp_path_factory.mktemp("lp"), "--spec", "off", "--no-cache", "--max-context", "256",
                   env=env)
    try:
        spec.wait_ready(180)
        plain.wait_ready(180)
        deadline = time.monotonic() + 180
        while httpx.get(spec.url + "/health").json()["speculation"]["reason"] == "self-check running":
            assert time.monotonic() < deadline, "the self-check did not finish"
            time.sleep(0.2)
        yield spec, plain
    finally:
        spec.stop()
        plain.stop()


@pytest.mark.server
def test_speculative_server_equals_plain_server(servers):
    spec, plain = servers
    health = httpx.get(spec.url + "/health").json()
    assert health["speculation"]["enabled"] and health["speculation"]["selfcheck"]["ok"], health["speculation"]
    assert "chat template" in spec.log_text() and "plugin's" in spec.log_text()
    texts = ["Read src/main.py and tell me what it does.", "def add(x, y):\n    return x + y\n" * 3,
             "Hello! " * 6, "Wie geht's? 日本語も少し。"]

    def ask(server):
        client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
        return [client.chat.completions.create(model="replay-test", messages=[
            {"role": "system", "content": "You are terse."}, {"role": "user", "content": t}],
            max_tokens=24, temperature=0).choices[0].message.content for t in texts]

    answers = ask(spec)
    assert answers == ask(plain)
    assert all(isinstance(a, str) for a in answers)


@pytest.mark.server
def test_a_chat_streams_through_the_openai_client(servers):
    spec, _ = servers
    client = OpenAI(base_url=spec.url + "/v1", api_key="x", timeout=120)
    stream = client.chat.completions.create(
        model="replay-test", messages=[{"role": "user", "content": "Count to five."}], max_tokens=32000,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 0 and usage[-1].prompt_tokens > 10
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1] in ("stop", "length")
    whole = client.chat.completions.create(
        model="replay-test", messages=[{"role": "user", "content": "Count to five."}], max_tokens=32000,
        temperature=0)
    assert whole.choices[0].message.content == text
