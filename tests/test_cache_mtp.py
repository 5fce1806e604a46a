"""The MTP head's rows through every cache tier: after a restore, the head drafts as after a cold prefill.

The engine keeps the head's rows in its state (``mtp.hidden`` a section, ``mtp.K`` / ``mtp.V`` (/ ``mtp.IK``)
views), so the resident prefix (an end anchor and a grid anchor), the snapshot store, the disk tier and the
session spill save and restore them with the target's. For the tiny Qwen3.8 and Flash-Next checkpoints with
an ``mtp.*`` head, in fp32 on the CPU: a prompt resumed from each tier, then the MTP drafter's drafts for a
pending token, equal (same top-two tokens, probabilities within 1e-5) the drafts after a cold prefill of the
whole prompt on a fresh engine, and the head's state equals the cold engine's within the target's own
chunking bound (1e-5 relative: ``tests/test_cache_models.py`` says why). The cold drafts are themselves the
reference head's (``tests/mtp_reference_qwen38.py``) on transformers' target rows.
"""

from __future__ import annotations

import pytest
import torch

from conftest_flashnext import flashnext_ckpts  # noqa: F401  (fixture)
from conftest_flashnext import load_engine as load_flashnext
from conftest_qwen38 import load_engine as load_qwen38
from conftest_qwen38 import qwen38_ckpts, write_tokenizer  # noqa: F401  (fixture)

from tandem_core.cache import CacheStack, DiskTier, ResidentPrefix, SnapshotStore
from tandem_core.drafter import TargetInfo, build_drafter

EVERY, CHUNK, BOUND, VOCAB = 64, 48, 1e-5, 320


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 8, (n,), generator=g).tolist()


@pytest.fixture(params=["qwen", "flashnext"])
def load(request, qwen38_ckpts, flashnext_ckpts):  # noqa: F811
    if request.param == "qwen":
        return lambda: load_qwen38(qwen38_ckpts.mtp.path, max_context=640)
    return lambda: load_flashnext(flashnext_ckpts.mtp.path, max_context=640)


def drafts(engine, context: list[int]):
    """The MTP drafter's top-two tokens and probabilities a depth for ``context`` (the engine holds all but the
    last token)."""
    d = build_drafter("mtp", TargetInfo.of(engine.caps, tokenizer=None, vocab_size=VOCAB, engine=engine),
                      depth=3, branch_below=1.0)
    assert len(d.propose(context, 16)) == 6
    return d.read()


def head_state(engine) -> dict[str, torch.Tensor]:
    n = engine.kv.length
    st = engine.state
    out = {k: v.clone() for k, v in st.sections.items() if k.startswith("mtp.")}
    out.update({k: v.head(n - 1).clone() for k, v in st.views.items() if k.startswith("mtp.")})
    return out


def check_equals_cold(engine, load, prompt: list[int], where: str) -> None:
    pending = 7
    cold = load()
    with torch.inference_mode():
        cold.forward(torch.tensor(prompt))
    assert engine.kv.length == cold.kv.length == len(prompt)
    got, want = head_state(engine), head_state(cold)
    assert set(got) == set(want) and "mtp.hidden" in got and "mtp.K" in got
    for k in want:
        err = float((got[k] - want[k]).abs().max() / want[k].abs().max())
        assert err <= BOUND, f"{where}: the head's {k} differs from a cold prefill's by {err:.2e}"
    a, b = drafts(engine, [*prompt, pending]), drafts(cold, [*prompt, pending])
    assert torch.equal(a.tokens, b.tokens), f"{where}: drafts {a.tokens.tolist()} vs cold {b.tokens.tolist()}"
    assert torch.allclose(a.probs, b.probs, atol=1e-5), where


def generate(stack: CacheStack, engine, logits: torch.Tensor, n: int) -> list[int]:
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


def test_the_cold_drafts_are_the_reference_heads(qwen38_ckpts):  # noqa: F811
    from mtp_reference_qwen38 import target_hidden

    model, ref = qwen38_ckpts.text.model, qwen38_ckpts.head
    eng = load_qwen38(qwen38_ckpts.mtp.path, max_context=640, prefill_chunk=CHUNK)
    p = ids(130, 5)
    with torch.inference_mode():
        eng.forward(torch.tensor(p))
    got = drafts(eng, [*p, 7])
    toks, rows = torch.tensor([*p[1:], 7]), target_hidden(model, torch.tensor(p))
    for k in range(3):
        carry, logits = ref(toks, rows)
        top = torch.softmax(logits[-1], dim=-1).topk(2)
        assert got.tokens[k].tolist() == top.indices.tolist(), f"depth {k}"
        assert torch.allclose(got.probs[k], top.values, atol=1e-5), f"depth {k}"
        toks, rows = torch.cat([toks, top.indices[:1]]), torch.cat([rows, carry[-1:]])


def test_the_heads_rows_are_part_of_the_state(load):
    eng = load()
    assert {"mtp.hidden"} <= set(eng.state.sections) and {"mtp.K", "mtp.V"} <= set(eng.state.views)
    snap_names = set(eng.state.clone().tensors())
    assert {"section.mtp.hidden", "view.mtp.K", "view.mtp.V"} <= snap_names


def test_resident_end_anchor_and_grid_anchor_give_the_cold_drafts(load):
    engine = load()
    stack = CacheStack(ResidentPrefix(EVERY), chunk=CHUNK)
    p1 = ids(200, 1)
    answer = generate(stack, engine, prefill(stack, engine, p1).logits, 6)
    p2 = p1 + answer + ids(30, 2)
    out = prefill(stack, engine, p2)
    assert out.start.describe() == f"resident anchor at 205 of {len(p2)}"
    check_equals_cold(engine, load, p2, "resident end anchor")
    p3 = p2[:150] + ids(40, 4)
    out = prefill(stack, engine, p3)
    assert out.start.start == 128
    check_equals_cold(engine, load, p3, "resident grid anchor")


def test_store_restore_gives_the_cold_drafts(load):
    engine = load()
    store = SnapshotStore(1 << 30)
    stack = CacheStack(ResidentPrefix(EVERY), [store], chunk=CHUNK, keep_displaced=16)
    a = ids(180, 11)
    answer = generate(stack, engine, prefill(stack, engine, a).logits, 6)
    prefill(stack, engine, ids(150, 12))             # another session displaces the first into the store
    a2 = a + answer + ids(30, 13)
    out = prefill(stack, engine, a2)
    assert out.start.describe() == f"store 185 of {len(a2)}"
    check_equals_cold(engine, load, a2, "store")


def test_disk_restore_gives_the_cold_drafts(load, tmp_path):
    engine = load()
    stack = CacheStack(ResidentPrefix(EVERY), chunk=CHUNK)
    a = ids(170, 21)
    answer = generate(stack, engine, prefill(stack, engine, a).logits, 6)
    fp = engine.manifest().fingerprint()
    assert DiskTier(tmp_path, fp, 1 << 30).offer(stack.snapshot(engine))
    fresh = load()
    stack2 = CacheStack(ResidentPrefix(EVERY), [DiskTier(tmp_path, fp, 1 << 30)], chunk=CHUNK)
    a2 = a + answer + ids(25, 22)
    out = prefill(stack2, fresh, a2)
    assert out.start.describe() == f"disk 175 of {len(a2)}"
    check_equals_cold(fresh, load, a2, "disk")


def test_spill_after_a_restart_gives_the_cold_drafts(load, tmp_path, qwen38_ckpts):  # noqa: F811
    from tandem_core.server.caches import CacheOptions, build_caches
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(qwen38_ckpts.mtp.path)

    def server_caches(engine):
        caches = build_caches(Served("cache-mtp", engine, tok, chat_template=""), [engine],
                              CacheOptions(directory=tmp_path, chunk=CHUNK))
        assert caches is not None
        return caches

    engine = load()
    caches = server_caches(engine)
    a = ids(190, 31)
    with torch.inference_mode():
        logits = caches.engine(0).start(engine, a)
    answer = generate(caches.engine(0).stack, engine, logits, 7)
    assert caches.save_sessions() is not None
    caches.close()
    fresh = load()
    caches2 = server_caches(fresh)
    assert caches2.restore() == 1 and fresh.kv.length == 196
    a2 = a + answer + ids(35, 32)
    with torch.inference_mode():
        caches2.engine(0).start(fresh, a2)
    assert (caches2.engine(0).last.tier, caches2.engine(0).last.start) == ("resident", 196)
    check_equals_cold(fresh, load, a2, "spill")
    caches2.close()
