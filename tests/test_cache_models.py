"""Real engines through every cache tier: a restore, then the rest of the prompt, equals a cold prefill.

For the tiny Qwen3.8 checkpoint (Gated DeltaNet + gated attention, written by
transformers 5.24 with ``save_pretrained``), the tiny Flash-Next (``qwen4_exp``: Gated DeltaNet, QSA
indexed attention, MoE, hyper-connections, PLE with its n-gram context and dilated conv as sections;
likewise), a tiny Llama (attention only, likewise) and a tiny LFM2 mixture of experts (gated short
convolutions + attention, likewise), in fp32 on the CPU, a prompt resumed from

- the resident prefix (the end anchor of the last generation: turn n+1 = turn n's
  prompt + answer + tool result; and a grid anchor for a prompt that diverges),
- the snapshot store (a session another prompt displaced),
- the disk tier (after the tier is closed and opened again),
- the session spill (after a "restart": the server's caches saved, a new engine loaded
  from the checkpoint, the caches built again and the session adopted)

gives the logits of the prompt's last position, and of the next tokens forwarded on
top, of a cold prefill of the whole prompt.

Tolerance. The Llama engine computes each row the same way whatever the chunking up
to matmul blocking: the bound is 1e-6 relative (measured 0 to ~1e-7). The Qwen3.8
engine's chunked gated delta rule sums a chunk's contributions in another order when
the chunks start at another position (a resume at 307 chunks from 307, a cold prefill
from 0): fp32 reassociation only, measured below 2e-6 relative; the bound is 1e-5
relative to the largest logit. The LFM2 engine's rows depend on the chunking only through
matmul blocking too (its conv is summed tap by tap, its experts run per group): 1e-6.
Each cold prefill is itself checked against
transformers (1e-4, the plugins' own bound) so the comparison is against the reference
model, not only against ourselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest_flashnext import flashnext_ckpts  # noqa: F401  (fixture)
from conftest_flashnext import load_engine as load_flashnext
from conftest_lfm25 import lfm25_ckpts  # noqa: F401  (fixture)
from conftest_lfm25 import load_engine as load_lfm25
from conftest_qwen38 import load_engine, qwen38_ckpts, write_tokenizer  # noqa: F401  (fixture)

from tandem_core.cache import CacheStack, DiskTier, ResidentPrefix, SnapshotStore
from tandem_core.cache.base import GEN_END
from tandem_core.serving import ServeArgs, ServeContext

EVERY = 64          # grid anchors every 64 tokens (the server's default is 1,024)
CHUNK = 48          # prefill chunks of the cache stack
REST = 5            # tokens forwarded after the prompt, their logits compared too
QWEN_BOUND = 1e-5
LLAMA_BOUND = 1e-6
LFM25_BOUND = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 8, (n,), generator=g).tolist()


# -- the two models ----------------------------------------------------------------------------------------

class Model:
    """A checkpoint, a way to load a fresh engine from it, and its transformers reference."""

    def __init__(self, name: str, path: Path, vocab: int, bound: float, load, ref) -> None:
        self.name, self.path, self.vocab, self.bound = name, path, vocab, bound
        self.load = load
        self.ref = ref

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.ref(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def qwen(qwen38_ckpts):  # noqa: F811
    ck = qwen38_ckpts.text
    return Model("qwen3.8", ck.path, ck.model.config.vocab_size, QWEN_BOUND,
                 lambda: load_engine(ck.path, max_context=640), ck.model)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem_llama.serving import serve

    path = tmp_path_factory.mktemp("llama-cache")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.8 / p.shape[1] ** 0.5 if "embed" not in name else 1.0))
    model.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)

    def load():
        return serve(ServeArgs(model_id="tiny-llama", path=path, max_context=640), ServeContext()).engine

    return Model("llama", path, cfg.vocab_size, LLAMA_BOUND, load, model)


@pytest.fixture(scope="module")
def lfm25(lfm25_ckpts):  # noqa: F811
    ck = lfm25_ckpts.moe
    return Model("lfm2_moe", ck.path, ck.model.config.vocab_size, LFM25_BOUND,
                 lambda: load_lfm25(ck.path, max_context=640), ck.model)


@pytest.fixture(scope="module")
def flashnext(flashnext_ckpts):  # noqa: F811
    ck = flashnext_ckpts.text
    return Model("flashnext", ck.path, ck.model.config.vocab_size, QWEN_BOUND,
                 lambda: load_flashnext(ck.path, max_context=640), ck.model)


@pytest.fixture(params=["qwen", "flashnext", "llama", "lfm25"])
def model(request) -> Model:
    return request.getfixturevalue(request.param)


# -- helpers -------------------------------------------------------------------------------------------

def cold(engine, prompt: list[int], rest: list[int]) -> torch.Tensor:
    """A cold prefill of ``prompt``, then ``rest``: logits ``[1 + len(rest), V]``."""
    engine.reset()
    with torch.inference_mode():
        first = engine.forward(torch.tensor(prompt))
        after = engine.forward(torch.tensor(rest), all_logits=True)
    return torch.cat([first, after])


def continued(engine, logits: torch.Tensor, rest: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        after = engine.forward(torch.tensor(rest), all_logits=True)
    return torch.cat([logits, after])


def generate(stack: CacheStack, engine, logits: torch.Tensor, n: int) -> list[int]:
    """Greedy, the way the decode loop does it: every pick but the last is forwarded, then the end anchor."""
    out = []
    with torch.inference_mode():
        for i in range(n):
            tok = int(engine.picks(logits)[-1])
            out.append(tok)
            if i < n - 1:
                logits = engine.forward(torch.tensor([tok]))
                stack.commit(engine, [tok])
    stack.end_generation(engine)
    return out


def prefill(stack: CacheStack, engine, prompt: list[int]):
    with torch.inference_mode():
        return stack.prefill(engine, prompt)


def check(model: Model, got: torch.Tensor, want: torch.Tensor, where: str) -> float:
    err = rel(got, want)
    assert err <= model.bound, f"{model.name}, {where}: relative error {err:.2e} > {model.bound:.0e}"
    return err


# -- the tiers -----------------------------------------------------------------------------------------

def test_the_cold_prefill_is_the_reference_models(model):
    """What every tier is compared with: a cold prefill, itself within 1e-4 of transformers."""
    prompt, rest = ids(300, model.vocab, 51), ids(REST, model.vocab, 52)
    got = cold(model.load(), prompt, rest)
    want = model.reference_logits(prompt + rest)[len(prompt) - 1:]
    assert rel(got, want) < 1e-4, f"{model.name}: the cold prefill differs from transformers"


def test_resident_end_anchor_and_grid_anchor_equal_cold(model):
    engine, ref_engine = model.load(), model.load()
    stack = CacheStack(ResidentPrefix(EVERY), chunk=CHUNK)
    p1 = ids(300, model.vocab, 1)
    first = prefill(stack, engine, p1)
    assert first.start.describe() == "cold 0 of 300"
    answer = generate(stack, engine, first.logits, 8)
    assert stack.resident.length == 307
    if engine.state.sections:
        assert stack.resident.anchors()[-1].kind == GEN_END
    # turn 2 = turn 1's prompt + answer + tool result: resumes at the end anchor of the generation
    p2 = p1 + answer + ids(40, model.vocab, 2)
    rest = ids(REST, model.vocab, 3)
    out = prefill(stack, engine, p2)
    want = f"resident anchor at 307 of {len(p2)}" if engine.state.sections else f"resident 307 of {len(p2)}"
    assert out.start.describe() == want
    check(model, continued(engine, out.logits, rest), cold(ref_engine, p2, rest), "resident end")
    # a prompt that diverges at 150 resumes at the grid anchor at 128 (a model without sections: at 150)
    p3 = p2[:150] + ids(60, model.vocab, 4)
    out = prefill(stack, engine, p3)
    assert out.start.start == (128 if engine.state.sections else 150)
    check(model, continued(engine, out.logits, rest), cold(ref_engine, p3, rest), "resident grid")


def test_store_restore_equals_cold(model):
    engine, ref_engine = model.load(), model.load()
    store = SnapshotStore(1 << 30)
    stack = CacheStack(ResidentPrefix(EVERY), [store], chunk=CHUNK, keep_displaced=16)
    a = ids(260, model.vocab, 11)
    answer = generate(stack, engine, prefill(stack, engine, a).logits, 6)
    b = ids(200, model.vocab, 12)                   # another session displaces the first into the store
    prefill(stack, engine, b)
    assert store.stats().entries == 1
    a2 = a + answer + ids(30, model.vocab, 13)
    rest = ids(REST, model.vocab, 14)
    out = prefill(stack, engine, a2)
    assert out.start.describe() == f"store 265 of {len(a2)}" and store.stats().hits == 1
    check(model, continued(engine, out.logits, rest), cold(ref_engine, a2, rest), "store")


def test_disk_restore_after_reopening_equals_cold(model, tmp_path):
    engine, ref_engine = model.load(), model.load()
    stack = CacheStack(ResidentPrefix(EVERY), chunk=CHUNK)
    a = ids(280, model.vocab, 21)
    answer = generate(stack, engine, prefill(stack, engine, a).logits, 6)
    fp = engine.manifest().fingerprint()
    assert DiskTier(tmp_path, fp, 1 << 30).offer(stack.snapshot(engine))
    reopened = DiskTier(tmp_path, fp, 1 << 30)      # a new process would open it so
    assert reopened.stats().entries == 1
    fresh = model.load()
    stack2 = CacheStack(ResidentPrefix(EVERY), [reopened], chunk=CHUNK)
    a2 = a + answer + ids(25, model.vocab, 22)
    rest = ids(REST, model.vocab, 23)
    out = prefill(stack2, fresh, a2)
    assert out.start.describe() == f"disk 285 of {len(a2)}" and reopened.stats().hits == 1
    check(model, continued(fresh, out.logits, rest), cold(ref_engine, a2, rest), "disk")
    # a prompt diverging inside the stored sequence resumes at one of its anchors (or at the divergence)
    a3 = a[:200] + ids(30, model.vocab, 24)
    out = prefill(CacheStack(ResidentPrefix(EVERY), [reopened], chunk=CHUNK), model.load(), a3)
    assert out.start.tier == "disk" and out.start.start == (192 if engine.state.sections else 200)


def test_spill_after_a_restart_equals_cold(model, tmp_path):
    """Through the server's own wiring (``server.caches``): save the sessions, load a new engine, adopt."""
    from tandem_core.serving import Served
    from tandem_core.server.caches import CacheOptions, build_caches
    from tandem_core.tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(model.path)

    def server_caches(engine):
        served = Served("cache-models", engine, tok, chat_template="")
        caches = build_caches(served, [engine], CacheOptions(directory=tmp_path, chunk=CHUNK))
        assert caches is not None
        return caches

    engine, ref_engine = model.load(), model.load()
    caches = server_caches(engine)
    ec = caches.engine(0)
    a = ids(290, model.vocab, 31)
    with torch.inference_mode():
        logits = ec.start(engine, a)
    answer = generate(ec.stack, engine, logits, 7)
    assert caches.save_sessions() is not None
    caches.close()

    fresh = model.load()                            # the restarted server's engine
    caches2 = server_caches(fresh)
    assert caches2.restore() == 1 and fresh.state.length == 296 and fresh.kv.length == 296
    a2 = a + answer + ids(35, model.vocab, 32)
    rest = ids(REST, model.vocab, 33)
    with torch.inference_mode():
        logits = caches2.engine(0).start(fresh, a2)
    start = caches2.engine(0).last
    assert start is not None and (start.tier, start.start) == ("resident", 296)
    check(model, continued(fresh, logits, rest), cold(ref_engine, a2, rest), "spill")
    caches2.close()


def test_live_state_contract(model):
    """What the server checks before it caches an engine: a restore into ``state`` moves ``kv.length``."""
    from tandem_core.server.caches import state_is_live

    engine = model.load()
    with torch.inference_mode():
        engine.forward(torch.tensor(ids(20, model.vocab, 41)))
    assert state_is_live(engine) and engine.kv.length == 0 and engine.state.length == 0
