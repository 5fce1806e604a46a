"""The block drafter on the real default model, SmolLM2-135M-Instruct (the pulled Q4_1 GGUF): with a block drafter of
its shape (random weights: what is tested is that whatever it drafts, the output is the model's own), speculative
decoding with ``block`` and ``lookup,block`` equals plain decoding token for token, greedy and seeded sampling."""

from __future__ import annotations

import pytest
from block_fixtures import random_block
from test_llama_default_model import smollm2_path  # noqa: F401  (session fixture: the pulled GGUF)

from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.serving import ServeArgs, ServeContext
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation

PROMPTS = ["Repeat after me: the quick brown fox jumps over the lazy dog.", "What is the capital of France?"]


@pytest.fixture(scope="module", autouse=True)
def _plugins(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def served(smollm2_path):  # noqa: F811
    from tandem_llama.serving import serve

    return serve(ServeArgs(model_id="smollm2-135m", path=smollm2_path, max_context=512), ServeContext())


class NullDetok:
    def push(self, t: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("names", [("block",), ("lookup", "block")], ids=["block", "lookup,block"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=21)],
                         ids=["greedy", "seeded"])
def test_block_speculation_on_the_default_model_equals_plain(served, tmp_path, names, params):
    from test_drafter_block import flat_cut

    from tandem_core.server.template import render_chat

    target = TargetInfo.of_engine(served.engine, tokenizer=served.tokenizer.fingerprint(),
                                  vocab_size=served.tokenizer.vocab_size, name="smollm2-135m")
    block = random_block(tmp_path / "b", hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                         intermediate_size=256, vocab_size=49152, mask_token_id=49151, target_layer_ids=(3, 20),
                         num_target_layers=30)
    drafters = [build_drafter(n, target, **({"path": str(block)} if n == "block" else {})) for n in names]
    spec = Speculation(drafters, flat_cut(8), 8)
    plain_engine = served.spawn()
    drafted = 0
    for text in PROMPTS:
        ids = served.tokenizer.encode(render_chat(served, [{"role": "user", "content": text}]))
        req = DecodeRequest(ids, 16, params, frozenset(served.stop_ids))
        want = [t for c in Decode(plain_engine, req, NullDetok()).run() for t in c.tokens]
        dec = SpecDecode(served.engine, req, NullDetok(), speculation=spec)
        assert [t for c in dec.run() for t in c.tokens] == want, text
        drafted += dec.stats.drafted
    assert drafted > 0
