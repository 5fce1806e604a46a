"""Qwen3.8's MTP head and the shared MTP drafter over it, against the reference forward
(``tests/mtp_reference_qwen38.py``: vLLM's published Qwen3.5 MTP design on transformers' own modules, since
transformers drops ``mtp.*``), on a tiny random head in the ``mtp.*`` layout written as its own shard: the
head's rows in both forms, the drafter's drafts after a prefill, a committed tree path and a plain step, a
malformed head refused by name, and speculative decoding with ``mtp`` (alone, and merged with ``lookup``)
equal to plain decoding, in the engine and through a real server."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_qwen38 import load_engine, prompt, qwen38_ckpts  # noqa: F401  (fixture)
from mtp_reference_qwen38 import target_hidden

from tandem_core.checkpoint.audit import AuditError
from tandem_core.drafter import DrafterMismatch, TargetInfo, build_drafter
from tandem_core.engine import supports_mtp
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.testing.trees import flat_prices
from tandem_qwen38.config import read_config
from tandem_qwen38.weights import open_checkpoint

VOCAB = 320


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def open_dir(path):
    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, open_checkpoint(path, cfg)


def reference_drafts(head, next_tokens: torch.Tensor, hidden: torch.Tensor, depth: int):
    """The reference over the whole sequence, fed its own top token and output row one depth at a time:
    ``[(top-2 ids, top-2 probs)]`` a depth."""
    toks, rows, out = next_tokens.clone(), hidden.clone(), []
    for _ in range(depth):
        carry, logits = head(toks, rows)
        top = torch.softmax(logits[-1], dim=-1).topk(2)
        out.append((top.indices, top.values))
        toks, rows = torch.cat([toks, top.indices[:1]]), torch.cat([rows, carry[-1:]])
    return out


def assert_drafts(draft, ref) -> None:
    assert draft.tokens.shape == draft.probs.shape == (len(ref), 2)
    for k, (ids, probs) in enumerate(ref):
        assert draft.tokens[k].tolist() == ids.tolist(), f"depth {k}"
        assert torch.allclose(draft.probs[k], probs, atol=1e-5), f"depth {k}"


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def test_the_checkpoint_reads_its_head_instead_of_skipping_it(qwen38_ckpts):
    _, ckpt = open_dir(qwen38_ckpts.mtp.path)
    assert ckpt.mtp_layers == 1 and ckpt.skipped == {}
    assert "mtp.fc.weight" in ckpt.expected and ckpt.reader.info("mtp.fc.weight").file.name == \
        "model-mtp.safetensors"
    _, bare = open_dir(qwen38_ckpts.text.path)
    assert bare.mtp_layers == 0
    eng, plain = load_engine(qwen38_ckpts.mtp.path), load_engine(qwen38_ckpts.text.path)
    assert supports_mtp(eng) and eng.caps.mtp == 1 and not supports_mtp(plain)
    ids = prompt(24, VOCAB)
    assert torch.equal(eng.forward(ids, all_logits=True), plain.forward(ids, all_logits=True))
    names = {p.name for p in eng.memory_parts()}
    assert {"mtp.weights", "mtp.kv"} <= names


def test_the_heads_rows_equal_the_reference_in_both_forms(qwen38_ckpts):
    eng = load_engine(qwen38_ckpts.mtp.path)
    head = eng.mtp_head()
    ids = prompt(33, VOCAB, seed=13)
    hidden = target_hidden(qwen38_ckpts.text.model, ids[:32])
    ref_carry, ref_logits = qwen38_ckpts.head(ids[1:], hidden)
    scale = ref_logits.abs().max()
    got = head.run(ids[1:21], hidden[:20], 0)                     # prefill form
    rows = [head.run(ids[t + 1:t + 2], hidden[t:t + 1], t) for t in range(20, 32)]   # decode form
    logits = torch.cat([got.logits, *(r.logits for r in rows)])
    carry = torch.cat([got.carry, *(r.carry for r in rows)])
    assert float((logits - ref_logits).abs().max() / scale) < 1e-4
    assert float((carry - ref_carry).abs().max() / ref_carry.abs().max()) < 1e-4


def test_the_drafters_drafts_equal_the_reference_through_a_round(qwen38_ckpts):
    """After the prefill, after a committed tree path of four tokens, and after a plain decode step: each
    draft
    equals the reference run over the whole sequence, whose rows are transformers' target's."""
    model, head = qwen38_ckpts.text.model, qwen38_ckpts.head
    eng = load_engine(qwen38_ckpts.mtp.path)
    drafter = build_drafter("mtp", TargetInfo.of(eng.caps, tokenizer=None, vocab_size=VOCAB, engine=eng),
                            depth=3, branch_below=1.0)
    p = prompt(20, VOCAB, seed=3).tolist()
    greedy = model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, 20:].tolist()

    def check(seq: list[int], pending: int) -> None:
        proposal = drafter.propose([*seq, pending], 16)
        hidden = target_hidden(model, torch.tensor(seq))
        ref = reference_drafts(head, torch.tensor([*seq[1:], pending]), hidden, 3)
        assert_drafts(drafter.read(), ref)
        # the tree: each depth's top token on the chain, its second a sibling (branch_below=1: everywhere)
        assert proposal.source == "mtp" and proposal.parents == (-1, -1, 0, 0, 2, 2)
        assert proposal.tokens[::2] == tuple(int(i[0]) for i, _ in ref)

    eng.forward(torch.tensor(p))
    drafter.begin(p)
    check(p, greedy[0])
    # a round whose tree holds the target's own next tokens: the engine commits pending + 3, the bonus follows
    tokens = torch.tensor([greedy[0], greedy[1], 7, greedy[2], greedy[3]])
    eng.forward_tree(tokens, torch.tensor([-1, 0, 0, 1, 3]))
    eng.commit_tree([0, 1, 3, 4])
    eng.settle()
    drafter.accepted([greedy[0], greedy[1], greedy[2], greedy[3]])
    seq = [*p, *greedy[:4]]
    check(seq, greedy[4])
    # a plain step (nothing drafted this round): the pending token forwarded alone
    eng.forward(torch.tensor([greedy[4]]))
    drafter.accepted([greedy[4]])
    check([*seq, greedy[4]], greedy[5])
    # a new sequence sharing a prefix keeps the head's rows for it; the prefill of the rest gives the others
    q = [*p[:12], 5, 6, 7]
    eng.reset()
    eng.forward(torch.tensor(q))
    drafter.begin(q)
    check(q, 9)


def test_a_prompt_prefilled_in_chunks_with_safe_points_between_gives_the_head_every_row(qwen38_ckpts):
    """The server runs a long prompt in prefill chunks with a safe point between them (the side lane may
    serve there); the engine keeps the head's rows of every chunk until the drafter takes them."""
    from tandem_core.spec.loop import prefill

    model, head = qwen38_ckpts.text.model, qwen38_ckpts.head
    eng = load_engine(qwen38_ckpts.mtp.path, prefill_chunk=8)
    drafter = build_drafter("mtp", TargetInfo.of(eng.caps, tokenizer=None, vocab_size=VOCAB, engine=eng))
    p = prompt(30, VOCAB, seed=21).tolist()
    stops = []
    prefill(eng, p, between=lambda: stops.append(eng.kv.length))
    assert stops == [8, 16, 24]                   # four forwards: three of 8 tokens, then the last 6
    drafter.begin(p)
    drafter.propose([*p, 4], 8)
    hidden = target_hidden(model, torch.tensor(p))
    assert_drafts(drafter.read(), reference_drafts(head, torch.tensor([*p[1:], 4]), hidden, 3))


def test_the_engine_keeps_the_heads_rows_through_a_commit_a_trim_and_a_restore(qwen38_ckpts):
    """``mtp.hidden`` is the target's row at the last position after a forward, a commit, a trim of pending
    tokens and a state restore (the side lane's); the drafts after each equal the reference's on the
    sequence."""
    from tandem_core.engine import restore_state

    model, ref = qwen38_ckpts.text.model, qwen38_ckpts.head
    eng = load_engine(qwen38_ckpts.mtp.path)
    drafter = build_drafter("mtp", TargetInfo.of(eng.caps, tokenizer=None, vocab_size=VOCAB, engine=eng),
                            depth=2, branch_below=1.0)
    hidden = eng.state.sections["mtp.hidden"]
    ids = prompt(12, VOCAB, seed=8)
    eng.forward(ids)
    assert torch.equal(hidden, eng.hidden_post_norm()[-1:])
    eng.forward_tree(torch.tensor([3, 4, 5, 6]), torch.tensor([-1, 0, 0, 2]))
    verified = eng.hidden_post_norm().clone()
    eng.commit_tree([0, 2, 3])
    assert torch.equal(hidden, verified[3:4])
    eng.trim_pending(1)
    assert torch.equal(hidden, verified[2:3])
    seq = [*ids.tolist(), 3, 5]

    def check() -> None:
        drafter.propose([*seq, 9], 16)
        want = reference_drafts(ref, torch.tensor([*seq[1:], 9]), target_hidden(model, torch.tensor(seq)), 2)
        assert_drafts(drafter.read(), want)

    check()
    snap = eng.state.clone()
    eng.forward(torch.tensor([1, 2, 3]))                        # rows the restore takes back
    restore_state(eng, snap)
    assert eng.kv.length == 14 and torch.equal(hidden, verified[2:3])
    check()
    eng.reset()
    assert not hidden.any()


def test_an_engine_refuses_a_head_that_does_not_fit_its_target(qwen38_ckpts):
    from tandem_core.engine import SequenceEngine

    eng = load_engine(qwen38_ckpts.mtp.path)
    head = eng.mtp_head()

    class Misfit:
        layers, reads, max_context, graphed = 1, None, head.max_context, False
        run, views, memory_parts, sections = head.run, head.views, head.memory_parts, head.sections
        append, launch = head.append, head.launch

        def __init__(self, width: int, reads: int | None = None, max_context: int | None = None) -> None:
            self.width, self.reads = width, reads
            if max_context is not None:
                self.max_context = max_context

    with pytest.raises(ValueError, match=r"reads rows of 32 features, the target's hidden states have 64"):
        SequenceEngine(eng.runner, name="qwen3_5", head=Misfit(32))
    with pytest.raises(ValueError, match=r"reads layer 9, which cannot be tapped"):
        SequenceEngine(eng.runner, name="qwen3_5", head=Misfit(64, reads=9))
    with pytest.raises(ValueError, match=r"holds 16 positions, the engine 256"):
        SequenceEngine(eng.runner, name="qwen3_5", head=Misfit(64, max_context=16))


def test_the_proposal_branches_where_the_top_token_is_unsure(qwen38_ckpts):
    from tandem_drafters.mtp import Draft, MTPDrafter

    drafter = MTPDrafter(engine=load_engine(qwen38_ckpts.mtp.path), depth=3)      # branch_below 0.75
    draft = Draft(torch.tensor([[10, 11], [20, 21], [30, 31]]),
                  torch.tensor([[0.9, 0.05], [0.5, 0.3], [0.95, 0.01]]))
    p = drafter.tree(draft, 16)
    assert p.tokens == (10, 20, 21, 30) and p.parents == (-1, 0, 0, 1)
    assert p.probs == pytest.approx((0.9, 0.5, 0.3, 0.95))
    cut = drafter.tree(draft, 3)                                   # max_nodes: a prefix, parents first
    assert cut.tokens == (10, 20, 21) and cut.parents == (-1, 0, 0)


def test_a_target_without_a_head_is_refused_by_name(qwen38_ckpts):
    eng = load_engine(qwen38_ckpts.text.path)
    target = TargetInfo.of(eng.caps, tokenizer=None, vocab_size=VOCAB, engine=eng, name="tiny")
    named = r"drafter 'mtp' cannot draft for target 'tiny': it needs an MTP head"
    with pytest.raises(DrafterMismatch, match=named):
        build_drafter("mtp", target)


@pytest.fixture
def mtp_copy(qwen38_ckpts, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(qwen38_ckpts.mtp.path, path)
    return path


def edit(path, key, value) -> None:
    file = path / "model-mtp.safetensors"
    data = load_file(str(file))
    if value is None:
        data.pop(key)
    else:
        data[key] = value
    save_file(data, str(file), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != file.name or k in data}
    index["weight_map"].update({k: file.name for k in data})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("key, value, named", [
    ("mtp.fc.weight", torch.zeros(64, 64),
     r"tensor 'mtp\.fc\.weight' has shape \[64, 64\], the config needs \[64, 128\]"),
    ("mtp.pre_fc_norm_hidden.weight", torch.zeros(32),
     r"tensor 'mtp\.pre_fc_norm_hidden\.weight' has shape \[32\], the config needs \[64\]"),
    ("mtp.layers.0.self_attn.q_proj.weight", torch.zeros(128, 64),
     r"tensor 'mtp\.layers\.0\.self_attn\.q_proj\.weight' has shape \[128, 64\], "
     r"the config needs \[256, 64\]"),
    ("mtp.layers.0.mlp.down_proj.weight", None, r"missing tensor 'mtp\.layers\.0\.mlp\.down_proj\.weight'"),
    ("mtp.embed_tokens.weight", torch.zeros(320, 64),
     r"tensor 'mtp\.embed_tokens\.weight' is not one the qwen3_5 engine reads"),
    ("mtp.layers.1.input_layernorm.weight", torch.zeros(64),
     r"missing tensor 'mtp\.layers\.1\.post_attention_layernorm\.weight'"),
])
def test_a_malformed_head_is_refused_by_name(mtp_copy, key, value, named):
    edit(mtp_copy, key, value)
    with pytest.raises(AuditError, match=named):
        open_dir(mtp_copy)


def test_a_head_the_config_counts_otherwise_is_refused(mtp_copy):
    raw = json.loads((mtp_copy / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 2
    with pytest.raises(AuditError, match=r"the MTP head has 1 decoder layers .* mtp_num_hidden_layers is 2"):
        open_checkpoint(mtp_copy, read_config(raw))


@pytest.mark.parametrize("names, params", [
    (("mtp",), SamplingParams(temperature=0.0)),
    (("mtp",), SamplingParams(temperature=0.8, seed=7)),
    (("lookup", "mtp"), SamplingParams(temperature=0.0)),
], ids=["greedy", "seeded", "merged-with-lookup"])
def test_speculative_decoding_with_mtp_equals_plain(qwen38_ckpts, names, params):
    spec_engine, plain_engine = load_engine(qwen38_ckpts.mtp.path), load_engine(qwen38_ckpts.mtp.path)
    target = TargetInfo.of(spec_engine.caps, tokenizer=None, vocab_size=VOCAB, engine=spec_engine)
    spec = Speculation([build_drafter(n, target) for n in names], StairCut(flat_prices(), max_tree=8), 8)
    rounds = drafted = 0
    for seed in range(4):
        req = DecodeRequest(prompt(10 + 3 * seed, VOCAB - 8, seed=seed).tolist(), 20, params)
        want = [t for c in Decode(plain_engine, req, IdDetok()).run() for t in c.tokens]
        dec = SpecDecode(spec_engine, req, IdDetok(), speculation=spec)
        assert [t for c in dec.run() for t in c.tokens] == want, f"prompt {seed}"
        for name, sec in spec_engine.state.sections.items():
            assert torch.equal(sec, plain_engine.state.sections[name]), name
        rounds, drafted = rounds + dec.stats.rounds, drafted + dec.stats.drafted
    assert drafted >= rounds, f"{drafted} nodes drafted in {rounds} rounds: the head proposed nothing"


@pytest.fixture(scope="module")
def servers(qwen38_ckpts, tmp_path_factory):
    import os
    import sys
    import time
    from pathlib import Path

    import httpx

    root = Path(__file__).resolve().parents[3]
    helpers = root / "tests" / "plugins"
    if str(helpers) not in sys.path:
        sys.path.insert(0, str(helpers))
    from replay_server import Server

    env = {"TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin,tandem_drafters.plugin",
           "PYTHONPATH": os.pathsep.join([str(helpers), str(root), str(root / "plugins" / "qwen38_27b"),
                                          str(root / "plugins" / "drafters")])}
    path = qwen38_ckpts.mtp.path
    spec = Server(path, tmp_path_factory.mktemp("ms"), "--spec", "mtp", "--max-tree", "8", "--no-cache",
                  "--max-context", "256", env=env)
    plain = Server(path, tmp_path_factory.mktemp("mp"), "--spec", "off", "--no-cache", "--max-context", "256",
                   env=env)
    try:
        spec.wait_ready(120)
        plain.wait_ready(120)
        deadline = time.monotonic() + 120
        while httpx.get(spec.url + "/health").json()["speculation"]["reason"] == "self-check running":
            assert time.monotonic() < deadline, "the self-check did not finish"
            time.sleep(0.2)
        yield spec, plain
    finally:
        spec.stop()
        plain.stop()


@pytest.mark.server
def test_the_server_with_spec_mtp_answers_as_the_plain_server(servers):
    """``--spec mtp`` through a real server and the official client, greedy and seeded, against
    ``--spec off``."""
    import httpx
    from openai import OpenAI

    spec, plain = servers
    h = httpx.get(spec.url + "/health").json()["speculation"]
    assert h["enabled"] and h["drafters"] == ["mtp"] and h["selfcheck"]["ok"], h
    texts = [" ".join(f"w{t}" for t in prompt(6 + 2 * i, 300, seed=40 + i).tolist()) for i in range(4)]

    def ask(server, **kw):
        client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
        return [client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": t}],
                                               max_tokens=20, **kw).choices[0].message.content for t in texts]

    assert ask(spec, temperature=0) == ask(plain, temperature=0)
    assert ask(spec, temperature=0.8, seed=5) == ask(plain, temperature=0.8, seed=5)
    after = httpx.get(spec.url + "/health").json()["speculation"]
    assert after["rounds"] > 0 and after["tokens_per_round"] >= 1.0
