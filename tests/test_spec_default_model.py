"""Lossless speculation on the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF, pulled once into
``.tandem-test-cache/`` by tests/test_llama_default_model.py's session fixture).

- In the engine: ``SpecDecode`` with the real lookup drafter (and StairCut on a synthetic price curve
  cheaper than the CPU's, so the cut drafts) equals the plain loop token for token on 20 chat prompts, repetitive ones
  included (where the lookup drafter gets long acceptances); seeded sampling equals its plain twin.
- Through the server: ``tandem serve --weights <gguf> --spec lookup`` answers what ``--spec off``
  answers, greedy, with ``/health`` showing the load-time self-check passed.

Every decode here runs on one torch thread: the plain and speculative twins run side by side in two
Python threads (and the two servers side by side), which halves the wall time on a 2-core runner and
keeps a busy machine from stalling a multi-threaded op.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from test_llama_default_model import smollm2_path  # noqa: F401  (session fixture: the pulled GGUF)

from tandem_core.serving import ServeArgs, ServeContext

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
for extra in (PLUGINS, ROOT / "plugins" / "drafters"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
from replay_server import Server

MAX_TOKENS = 24
MAX_TREE = 8

# the model copies these from the prompt, so the lookup drafter gets long acceptances
COPYING = [
    "Repeat after me: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    'Copy this JSON exactly: {"name": "Alice", "age": 30, "city": "Paris", "tags": ["a", "b", "c"]}',
    ("Complete this Python code:\n\ndef f0(x):\n    return x + 0\n\ndef f1(x):\n    return x + 1\n\n"
    "def f2(x):\n    return x + 2\n"),
]
# repetitive asks the model answers in its own words (some repetition, shorter acceptances)
REPETITIVE = [
    ("Here is a file:\n\nimport os\nimport sys\n\ndef main():\n    print(os.getcwd())\n    print(sys.argv)\n\n"
    "Print the file again, unchanged."),
    "Count from 1 to 30, separated by commas.",
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Write the word hello ten times, one per line.",
    "Say the alphabet from A to Z separated by spaces.",
    "List the days of the week.",
]
PLAIN = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Name three primary colours, briefly.",
    "Give me a tip for learning to cook.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a pet cat.",
    "Write one sentence about autumn.",
    "What does HTTP stand for?",
]


@pytest.fixture(scope="module", autouse=True)
def _plugins_and_one_thread(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def served(smollm2_path):
    from tandem_llama.serving import serve

    return serve(ServeArgs(model_id="smollm2-135m", path=smollm2_path, max_context=1024), ServeContext())


class NullDetok:
    def push(self, t: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def speculation(served, slope: float = 0.3):
    """The real lookup drafter and StairCut on a synthetic price curve: a verified row costs ``slope`` of a
    decode step, cheaper than on this CPU (about 0.5), so the cut drafts whatever is fairly likely."""
    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.spec.cut import PriceTable, StairCut
    from tandem_core.spec.speculate import Speculation

    w = MAX_TREE + 1
    table = PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "smollm2-135m",
                                  "profile": "fp32", "device": "cpu", "contexts": [0, 4096], "widths": [1, w],
                                  "ms": [[1.0, 1.0 + slope * (w - 1)]] * 2})
    target = TargetInfo.of(served.engine.caps, tokenizer=served.tokenizer.fingerprint(),
                           vocab_size=served.tokenizer.vocab_size, name="smollm2-135m")
    return Speculation([build_drafter("lookup", target)], StairCut(table, max_tree=MAX_TREE), MAX_TREE)


def chat_ids(served, text: str) -> list[int]:
    from tandem_core.server.template import render_chat

    return served.tokenizer.encode(render_chat(served, [{"role": "user", "content": text}]))


def side_by_side(plain_fn, spec_fn):
    """Run the plain and the speculative twin at once (one torch thread each); return both results."""
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(plain_fn)
        spec = pool.submit(spec_fn)
        return plain.result(), spec.result()


def decode_all(served, engine, prompts, params, spec=None):
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.speculate import SpecDecode

    out, stats = [], []
    for text in prompts:
        req = DecodeRequest(chat_ids(served, text), MAX_TOKENS, params, frozenset(served.stop_ids))
        dec = Decode(engine, req, NullDetok()) if spec is None else SpecDecode(engine, req, NullDetok(),
                                                                                speculation=spec)
        out.append([t for c in dec.run() for t in c.tokens])
        stats.append(None if spec is None else dec.stats)
    return out, stats


def test_speculative_greedy_equals_plain_greedy_on_20_prompts(served):
    from tandem_core.spec.sampler import SamplingParams

    prompts = COPYING + REPETITIVE + PLAIN
    assert len(prompts) == 20
    params = SamplingParams(temperature=0.0)
    eng, twin = served.engine, served.spawn()
    spec = speculation(served)
    (want, _), (got, stats) = side_by_side(lambda: decode_all(served, twin, prompts, params),
                                           lambda: decode_all(served, eng, prompts, params, spec))
    for k, (g, w) in enumerate(zip(got, want)):
        first = next((i for i in range(min(len(g), len(w))) if g[i] != w[i]), None)
        assert g == w, f"prompt {k}: first difference at token {first}"
    assert eng.kv.length == twin.kv.length
    copying = stats[:len(COPYING)]
    tokens, rounds = sum(s.tokens for s in copying), sum(s.rounds for s in copying)
    assert tokens / rounds > 3.0, f"{tokens} tokens in {rounds} rounds on the copying prompts"
    assert all(s.tokens_per_round > 2.0 for s in copying), [round(s.tokens_per_round, 2) for s in copying]
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    assert drafted > accepted > 0, "drafts were both accepted and rejected"


def test_seeded_sampling_equals_its_plain_twin(served):
    from tandem_core.spec.sampler import SamplingParams

    prompts = [COPYING[0], COPYING[2], PLAIN[1]]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    eng, twin = served.engine, served.spawn()
    spec = speculation(served)
    (want, _), (got, stats) = side_by_side(lambda: decode_all(served, twin, prompts, params),
                                           lambda: decode_all(served, eng, prompts, params, spec))
    assert got == want
    assert sum(s.accepted for s in stats) > 0, "the sampled run accepted drafts"
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=12)
    assert decode_all(served, twin, prompts[2:3], other)[0] != want[2:3], "the seed matters (the check can fail)"


# -- through the server -----------------------------------------------------------------------------
SERVER_PROMPTS = [COPYING[1], PLAIN[10]]


@pytest.fixture(scope="module")
def servers(smollm2_path, tmp_path_factory):
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin,tandem_drafters.plugin", "TANDEM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), str(ROOT / "plugins" / "llama"),
                                          str(ROOT / "plugins" / "drafters")])}
    common = ("--no-cache", "--max-context", "1024")
    spec = Server(smollm2_path, tmp_path_factory.mktemp("sms"), "--spec", "lookup", "--max-tree", "8", *common,
                  env=env)
    plain = Server(smollm2_path, tmp_path_factory.mktemp("smp"), "--spec", "off", *common, env=env)
    try:
        spec.wait_ready(120)
        plain.wait_ready(120)
        yield spec, plain
    finally:
        spec.stop()
        plain.stop()


def ask(server, prompts):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
    return [client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
            for p in prompts]


@pytest.mark.server
def test_the_speculative_server_answers_what_the_plain_server_answers(servers):
    spec, plain = servers
    with ThreadPoolExecutor(1) as pool:
        plain_answers = pool.submit(ask, plain, SERVER_PROMPTS)   # while the self-check runs on the other
        deadline = time.monotonic() + 120
        while (h := httpx.get(spec.url + "/health").json()["speculation"])["reason"] == "self-check running":
            assert time.monotonic() < deadline, "the self-check did not finish"
            time.sleep(0.2)
        assert h["enabled"] and h["drafters"] == ["lookup"], h
        assert h["selfcheck"]["ok"] and h["selfcheck"]["widths"] == 9 and h["selfcheck"]["rows"] > 0, h
        spec_answers = ask(spec, SERVER_PROMPTS)
        want = plain_answers.result()
    assert all(a and a.strip() for a in want)
    assert spec_answers == want
    assert httpx.get(plain.url + "/health").json()["speculation"]["enabled"] is False
    h = httpx.get(spec.url + "/health").json()["speculation"]
    assert h["rounds"] > 0 and h["tokens_per_round"] >= 1.0, h
