"""``BatchedLlama`` (many sequences a forward, for the drafter trainer): on tiny checkpoints in fp32 on the CPU,
a dozen prompts of different lengths answered in one batch equal the batch-1 engine's greedy answers token for
token (stops included), and its hidden rows equal the engine's taps; on the real default model too."""

from __future__ import annotations

import random

import pytest
import torch
from test_llama_default_model import smollm2_path  # noqa: F401  (session fixture: the pulled GGUF)
from test_llama_tiny import _hf_model, _serve, bpe, write_gguf  # noqa: F401  (bpe: fixture)

from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _plugins(llama_plugins_one_thread):
    yield


class _NoText:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _prompts(n: int = 12, vocab: int = 320) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _engine_answer(served, ids: list[int], n: int, stops: frozenset[int]) -> list[int]:
    dec = Decode(served.engine, DecodeRequest(ids, n, SamplingParams(temperature=0.0), stops), _NoText())
    for _ in dec.run():
        pass
    return list(dec.generated)


@pytest.mark.parametrize("kind", ["hf-untied", "gguf-q4_1-tied"])
def test_batched_answers_and_rows_equal_the_engine(tmp_path, bpe, kind):  # noqa: F811
    if kind == "hf-untied":
        path = tmp_path / "m"
        _hf_model(False, seed=5).save_pretrained(path)
        bpe[3].save(str(path / "tokenizer.json"))
    else:
        path = write_gguf(tmp_path / "tiny.gguf", _hf_model(True, seed=5), bpe, "Q4_1")
    served = _serve(path)
    prompts = _prompts()
    # a stop id the answers meet: the token the first prompt's answer emits 5th (its own answer then stops there)
    free = _engine_answer(served, prompts[0], 12, frozenset())
    stops = frozenset({free[4]})
    want = [_engine_answer(served, p, 12, stops) for p in prompts]
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)
    gen = served.engine.runner.batched()
    assert gen.generate(prompts, 12, sorted(stops)) == want
    # in batches of other sizes (other padding) too, and with the prompts' forward in row chunks
    assert gen.generate(prompts[:5], 12, sorted(stops)) + gen.generate(prompts[5:], 12, sorted(stops)) == want
    chunked = served.engine.runner.batched()
    chunked.chunk_tokens = 60                       # 2 rows a forward of the longest prompts
    assert chunked._rows(max(len(p) for p in prompts)) < len(prompts)
    assert chunked.generate(prompts, 12, sorted(stops)) == want
    # hidden rows: the engine's taps over prompt + answer
    layers = (0, 1)
    seqs = [p + w for p, w in zip(prompts, want)]
    rows = gen.hidden(seqs, layers)
    served.engine.tap(layers)
    for s, r in zip(seqs, rows):
        served.engine.reset()
        with torch.inference_mode():
            served.engine.forward(s)
            ref = torch.cat([served.engine.hidden_at(li) for li in layers], dim=-1)
        assert r.shape == ref.shape
        torch.testing.assert_close(r, ref, rtol=1e-4, atol=1e-4)
    for r, c in zip(rows, chunked.hidden(seqs, layers)):
        torch.testing.assert_close(c, r, rtol=1e-4, atol=1e-4)


def test_bad_requests_are_refused(tmp_path, bpe):  # noqa: F811
    path = tmp_path / "m"
    _hf_model(False).save_pretrained(path)
    bpe[3].save(str(path / "tokenizer.json"))
    gen = _serve(path).engine.runner.batched()
    assert gen.generate([], 4) == []
    with pytest.raises(ValueError, match="every prompt"):
        gen.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="positions"):
        gen.generate([[1] * 250], 10)


def test_batched_answers_equal_the_engine_on_the_default_model(smollm2_path):  # noqa: F811
    """The real default model (SmolLM2-135M-Instruct, Q4_1, fp32 on the CPU): chat prompts of different lengths
    answered in one batch equal the engine's greedy answers token for token."""
    from tandem_llama.serving import serve

    from tandem_core.server.template import render_chat
    from tandem_core.serving import ServeArgs, ServeContext

    served = serve(ServeArgs(model_id="smollm2-135m", path=smollm2_path, max_context=256, options={}),
                   ServeContext())
    texts = ["What is the capital of France?", "Write a haiku about rain.",
             "Explain what a Python list comprehension is, in one sentence.", "Hi"]
    prompts = [served.tokenizer.encode(render_chat(served, [{"role": "user", "content": t}])) for t in texts]
    stops = frozenset(served.stop_ids)
    want = [_engine_answer(served, p, 16, stops) for p in prompts]
    assert served.engine.runner.batched().generate(prompts, 16, sorted(stops)) == want
