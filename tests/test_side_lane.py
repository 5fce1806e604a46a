"""The side lane's engine half: a running generation parks its sequence at a safe point, another generation
runs to its end on the same engine, the sequence comes back byte for byte.

On both real engines (the tiny Llama GGUF and the tiny Qwen3.8 GDN hybrid, recurrent state included), plain
and speculative: short generations run at safe points between prefill chunks and between decode steps; the
interrupted generation's tokens and final state (every section, every view row) equal the uninterrupted
run's bit for bit, and each short generation equals the same request run alone on a fresh engine.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from test_llama_tiny import _hf_model, bpe, write_gguf  # noqa: F401  (bpe: fixture)

from conftest_qwen38 import load_engine, qwen38_ckpts  # noqa: F401  (fixture)
from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.server.sidelane import SHORT_OUTPUT_TOKENS, SHORT_PROMPT_TOKENS, Parked
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.state import StateMismatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))
from tandem_core.testing.trees import Oracle, assert_same_state, flat_prices  # noqa: E402

CHUNK = 16          # prefill chunk of the engines here: a 70-token prompt is five chunks, four safe points


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


@pytest.fixture(scope="module", autouse=True)
def _plugins_and_one_thread(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def llama_engines(tmp_path_factory, bpe):  # noqa: F811
    from tandem_llama.serving import serve

    from tandem_core.serving import ServeArgs, ServeContext

    path = write_gguf(tmp_path_factory.mktemp("side_llama") / "tiny.gguf", _hf_model(False, seed=5), bpe, {})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_LLAMA_PREFILL_CHUNK", str(CHUNK))
        served = serve(ServeArgs(model_id="tiny", path=path, max_context=256, options={}), ServeContext())
    return [served.engine, served.spawn(), served.spawn()], served.tokenizer.vocab_size, served.tokenizer


@pytest.fixture(scope="module")
def qwen38_engines(qwen38_ckpts):  # noqa: F811
    from tandem_core.tokenizer import HFTokenizer

    path = qwen38_ckpts.text.path
    return ([load_engine(path, prefill_chunk=CHUNK) for _ in range(3)],
            qwen38_ckpts.text.raw_config["vocab_size"], HFTokenizer.from_dir(path))


@pytest.fixture(scope="module")
def qwen38_cuda_engines(qwen38_ckpts):  # noqa: F811
    """The CUDA graph path (bf16; skipped without a CUDA device and Triton)."""
    from test_qwen38_gpu import CUDA, cuda_engine

    from tandem_core.tokenizer import HFTokenizer

    if not CUDA:
        pytest.skip("needs a CUDA device and Triton (the CPU engines above are the same checks)")
    path = qwen38_ckpts.text.path
    return ([cuda_engine(path, max_context=256, prefill_chunk=CHUNK, max_tree=16) for _ in range(3)],
            qwen38_ckpts.text.raw_config["vocab_size"], HFTokenizer.from_dir(path))


@pytest.fixture(params=["llama", "qwen38", "qwen38_cuda"])
def engines(request):
    return request.getfixturevalue(f"{request.param}_engines")


def ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 8) for _ in range(n)]


def greedy(engine, prompt, n, *, safe_point=None, spec=None, hooks=None) -> list[int]:
    req = DecodeRequest(prompt, n, SamplingParams(temperature=0.0))
    if spec is not None:
        dec = SpecDecode(engine, req, IdDetok(), speculation=spec, safe_point=safe_point, **(hooks or {}))
    else:
        dec = Decode(engine, req, IdDetok(), safe_point=safe_point, **(hooks or {}))
    out = [t for c in dec.run() for t in c.tokens]
    if spec is not None:
        dec.finish_stats()
    return out


def speculation(engine, vocab, truth):
    """The lookup drafter and an oracle of the true continuation: deep accepted paths, trimmed ones too."""
    target = TargetInfo.of(engine.caps, tokenizer=None, vocab_size=vocab)
    return Speculation([build_drafter("lookup", target), Oracle(truth + [0] * 16, seed=3, vocab=vocab)],
                       StairCut(flat_prices(), max_tree=8), 8)


def server_caches(engine, tok, directory):
    """The server's cache wiring over ``engine`` (the stack's prefill in chunks of CHUNK, the memory gate)."""
    from tandem_core.server.caches import CacheOptions, build_caches
    from tandem_core.serving import Served

    caches = build_caches(Served("side", engine, tok, chat_template=""), [engine],
                          CacheOptions(directory=directory, chunk=CHUNK))
    assert caches is not None
    return caches


@pytest.mark.parametrize("mode", ["plain", "spec", "cached"])
def test_a_parked_generation_continues_bit_for_bit(engines, mode, tmp_path):
    (ref, main, alone), vocab, tok = engines
    opened = []
    hooks = {}
    if mode == "cached":   # the generations go through the cache stack; the side ones never do
        opened = [server_caches(ref, tok, tmp_path / "ref"), server_caches(main, tok, tmp_path / "main")]
        hooks = {e: c.engine(0).decode_hooks() for e, c in zip((ref, main), opened)}
    unit = ids(5, vocab, 1)
    prompt = (unit * 20)[:70]          # repetitive: the lookup drafter has something to propose
    sides = [ids(n, vocab, 10 + n) for n in (9, 23, 40)]
    plain = greedy(ref, prompt, 30)
    spec = (lambda e: speculation(e, vocab, plain)) if mode == "spec" else (lambda e: None)

    ref_spec = spec(ref)
    want = greedy(ref, prompt, 30, spec=ref_spec, hooks=hooks.get(ref))
    want_state = ref.state.clone()
    assert want == plain
    if ref_spec is not None:
        assert ref_spec.totals.accepted >= 30 // 2, ref_spec.totals
    want_sides = [greedy(alone, s, 12) for s in sides]

    calls, got_sides, lengths = [0], [], []

    def safe_point() -> None:
        calls[0] += 1
        if calls[0] in (2, 5, 9) and len(got_sides) < len(sides):   # 2: mid-prefill, 5, 9: between decode steps
            side = sides[len(got_sides)]
            lengths.append(main.kv.length)
            parked = Parked(main, len(side) + 12)
            got_sides.append(greedy(main, side, 12))
            parked.restore(main)

    got = greedy(main, prompt, 30, safe_point=safe_point, spec=spec(main), hooks=hooks.get(main))
    assert lengths[0] == 2 * CHUNK, lengths   # the second safe point sits between prefill chunks 2 and 3
    assert lengths[1] >= len(prompt) and len(got_sides) == 3
    assert got == want
    assert_same_state(main.state, want_state, "after the parked generation ended")
    assert got_sides == want_sides
    if opened:   # the resident prefix followed the parked generation, not the side ones
        ref_stack, main_stack = (c.engine(0).stack for c in opened)
        assert main_stack.resident.tokens == ref_stack.resident.tokens == tuple(prompt + got[:-1])
        assert main_stack.resident.length == main.kv.length == len(prompt) + 29
        for c in opened:
            c.close()


def test_parking_copies_only_the_rows_the_other_use_can_write(engines):
    (eng, _, _), vocab, _ = engines
    greedy(eng, ids(60, vocab, 3), 4)
    state = eng.state
    parked = Parked(eng, 20)
    assert parked.length == state.length == 63
    assert parked.snap.length == 20
    assert parked.nbytes == Parked.bytes_for(eng, 20) == state.section_bytes() + 20 * state.view_bytes_per_token()
    assert Parked(eng, 1000).snap.length == 63           # never more than the sequence
    # a restore to fewer tokens than the snapshot holds, or past a view's capacity, is refused, naming it
    with pytest.raises(StateMismatch, match="restore to 10 tokens of a snapshot holding 20"):
        state.restore(parked.snap, 10)
    with pytest.raises(StateMismatch, match="sequence of 100000 tokens exceeds capacity"):
        state.restore(parked.snap, 100000)


def test_the_short_request_limits_are_the_seeds():
    assert (SHORT_PROMPT_TOKENS, SHORT_OUTPUT_TOKENS) == (2048, 64)


# -- the lane's bookkeeping (a toy engine; no request ever hangs) -----------------------------------------------
def lane_job(prompt_len: int, max_tokens: int = 8):
    from types import SimpleNamespace

    return SimpleNamespace(rid="r", decode=DecodeRequest(list(range(3, 3 + prompt_len)), max_tokens))


def toy_lane(gate=None):
    from toy_tree_runner import toy_tree_engine

    from tandem_core.server.sidelane import SideLane

    eng = toy_tree_engine()
    greedy(eng, list(range(3, 40)), 5)
    lane = SideLane(served=None, limit=4, gate=gate)
    lane.open = True
    return eng, lane


def offer(lane, job):
    from tandem_core.server.sidelane import SideJob

    got = []
    side = SideJob(job, lambda d: None, got.append)
    assert lane.offer(side)
    return side, got


def test_a_side_request_that_cannot_be_parked_for_fails_alone(monkeypatch):
    from tandem_core.server import sidelane

    eng, lane = toy_lane()
    before = eng.state.clone()
    cancelled, c_out = offer(lane, lane_job(5))
    cancelled.cancel.set()
    _, out = offer(lane, lane_job(5))

    def no_memory(self, engine, rows):
        raise MemoryError("out of memory (test)")

    monkeypatch.setattr(sidelane.Parked, "__init__", no_memory)
    lane.serve(eng)
    assert [o.finish for o in c_out] == ["cancelled"]
    assert [o.finish for o in out] == ["error"] and "MemoryError: out of memory (test)" in out[0].error
    assert_same_state(eng.state, before, "after a failed park")
    assert len(lane) == 0 and lane.total == 2


def test_the_memory_gate_refuses_a_side_request_with_its_parked_bytes():
    from tandem_core.cache.gate import MemoryGate

    seen = []

    class Gate(MemoryGate):
        def check(self, prompt_len, start=0, parked=0):
            seen.append((prompt_len, start, parked))
            return super().check(prompt_len, start, parked)

    eng, lane = toy_lane(Gate(lambda n: 100 * n, 8, peak_bytes=10_000, base_bytes=0))
    before = eng.state.clone()
    _, out = offer(lane, lane_job(90, 8))           # 9,000 + 720 + parked: the section and the 41 rows held
    lane.serve(eng)
    parked = Parked.bytes_for(eng, 98)
    assert seen == [(90, 0, parked)] and parked == eng.state.section_bytes() + 41 * 8 == 392
    assert out[0].finish == "error" and out[0].status == 507 and "parked state" in out[0].error
    assert_same_state(eng.state, before, "after a refused side request")
    assert len(lane) == 0 and lane.total == 1
