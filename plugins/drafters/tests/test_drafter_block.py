"""The block drafter on a tiny Llama (2 layers, hidden 64): the published DFlash layout read and its proposals equal
to a plain-torch forward written here from the same tensors; a drafter for another target refused by name;
speculative decoding with ``block`` and ``lookup,block`` equal to plain decoding token for token (greedy and seeded
sampling); the rows the loop hands the drafter are the sequence's own."""

from __future__ import annotations

import json
import math

import pytest
import torch
from block_fixtures import TINY_HIDDEN, TINY_VOCAB, random_block, serve_tiny, write_tiny_llama
from safetensors.torch import save_file
from tandem_drafters.block import BlockDrafter, BlockDrafterError, block_tree, load_checkpoint, read_config
from test_llama_tiny import bpe  # noqa: F401  (fixture)

from tandem_core.drafter import Drafter, DrafterMismatch, ReadsHidden, TargetInfo, build_drafter
from tandem_core.spec.cut import PriceTable, StairCut
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation
from tandem_core.spec.tree import TokenTree


@pytest.fixture(scope="module", autouse=True)
def _plugins(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    return write_tiny_llama(tmp_path_factory.mktemp("tinyllama") / "m", bpe)


@pytest.fixture(scope="module")
def served(tiny):
    return serve_tiny(tiny)


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    return random_block(tmp_path_factory.mktemp("block") / "d", seed=1)


def target_of(served) -> TargetInfo:
    return TargetInfo.of_engine(served.engine, tokenizer=served.tokenizer.fingerprint(),
                                vocab_size=served.tokenizer.vocab_size, name="tiny")


class IdDetok:
    def push(self, t: int) -> str:
        return f"<{t}>"

    def flush(self) -> str:
        return ""


def flat_cut(max_tree: int = 16) -> StairCut:
    table = PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "tiny", "profile": "fp32",
                                  "device": "cpu", "contexts": [0, 100000], "widths": [1, 65],
                                  "ms": [[1.0, 1.05], [1.0, 1.05]]})
    return StairCut(table, max_tree=max_tree)


# -- the published layout -----------------------------------------------------------------------------------


def published_folder(folder, seed=7):
    """A tiny drafter written the way the published DFlash checkpoints are (Qwen3 config with dflash_config,
    rope_parameters, the layout's tensor names), without this package's writer."""
    H, nh, nkv, hd, inter, nl = TINY_HIDDEN, 4, 2, 16, 96, 2
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5

    def n(size):
        return 1.0 + 0.1 * torch.randn(size, generator=g)

    t = {"fc.weight": w(H, 2 * H), "hidden_norm.weight": n(H), "norm.weight": n(H)}
    for i in range(nl):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": n(H), p + "post_attention_layernorm.weight": n(H),
              p + "self_attn.q_proj.weight": w(nh * hd, H), p + "self_attn.k_proj.weight": w(nkv * hd, H),
              p + "self_attn.v_proj.weight": w(nkv * hd, H), p + "self_attn.o_proj.weight": w(H, nh * hd),
              p + "self_attn.q_norm.weight": n(hd), p + "self_attn.k_norm.weight": n(hd),
              p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
              p + "mlp.down_proj.weight": w(H, inter)}
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "block_size": 8, "dflash_config": {"mask_token_id": TINY_VOCAB - 2, "target_layer_ids": [0, 1]},
        "dtype": "bfloat16", "head_dim": hd, "hidden_act": "silu", "hidden_size": H, "intermediate_size": inter,
        "layer_types": ["full_attention"] * nl, "max_position_embeddings": 4096, "model_type": "qwen3",
        "num_attention_heads": nh, "num_hidden_layers": nl, "num_key_value_heads": nkv, "num_target_layers": 2,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": TINY_VOCAB}))
    return {k: v.to(torch.bfloat16).float() for k, v in t.items()}


def reference_probs(t, feats, pending, P, embed, head, B=8, mask_id=TINY_VOCAB - 2):
    """The DFlash forward in plain torch, head by head: context rows fc + norm, a block [pending, mask...] at
    positions P.. attending to every context row and the whole block; softmax of the head at positions 1..B-1."""
    eps, nh, nkv, hd = 1e-6, 4, 2, 16

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    def rot(x, pos):
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).double() / hd))
        ang = pos.double()[:, None] * inv[None, :]
        c, s = torch.cos(ang).float(), torch.sin(ang).float()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    C = ctx.shape[0]
    ids = torch.tensor([pending] + [mask_id] * (B - 1))
    x = embed[ids]
    pos_ctx, pos_blk = torch.arange(P - C, P), torch.arange(P, P + B)
    for i in range(2):
        p = f"layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])
        out = []
        for head_i in range(nh):
            kv_i = head_i // (nh // nkv)
            sl = slice(head_i * hd, (head_i + 1) * hd)
            kvs = slice(kv_i * hd, (kv_i + 1) * hd)
            q = rms(h @ t[p + "self_attn.q_proj.weight"][sl].T, t[p + "self_attn.q_norm.weight"])
            k = rms(both @ t[p + "self_attn.k_proj.weight"][kvs].T, t[p + "self_attn.k_norm.weight"])
            v = both @ t[p + "self_attn.v_proj.weight"][kvs].T
            q = rot(q, pos_blk)
            k = rot(k, torch.cat([pos_ctx, pos_blk]))
            a = torch.softmax(q @ k.T / math.sqrt(hd), dim=-1) @ v
            out.append(a)
        x = x + torch.cat(out, dim=-1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        g_, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g_) * u) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["norm.weight"])
    return torch.softmax(x[1:] @ head.T, dim=-1)


def test_a_published_layout_drafter_proposes_what_a_plain_torch_forward_of_its_weights_gives(tmp_path, served,
                                                                                             tiny):
    from transformers import LlamaForCausalLM

    tensors = published_folder(tmp_path / "pub")
    cfg = read_config(tmp_path / "pub")
    assert cfg.target_layer_ids == (0, 1) and cfg.block_size == 8 and cfg.mask_token_id == TINY_VOCAB - 2
    target = target_of(served)
    d = build_drafter("block", target, path=str(tmp_path / "pub"), top_k=3, min_prob=0.0)
    assert isinstance(d, Drafter) and isinstance(d, ReadsHidden)
    assert d.requires().tokenizer is None and d.requires().hidden_layers == (0, 1)
    eng = served.engine
    seq = [5, 17, 40, 41, 42, 99, 7, 13, 200, 3]
    eng.tap((0, 1))
    eng.reset()
    eng.forward(seq)
    rows = {i: eng.hidden_at(i).clone() for i in (0, 1)}
    d.reset()
    d.hidden(0, seq, rows)
    pending = 77
    prop = d.propose([*seq, pending], 64)
    hf = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    embed, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    want = reference_probs(tensors, torch.cat([rows[0], rows[1]], dim=-1), pending, len(seq), embed, head)
    top_p, top_t = want.topk(3, dim=-1)
    # the tree's nodes at depth d are position d's top 3, with their probabilities
    tree = TokenTree.from_proposal(prop)
    for node, dep in enumerate(tree.depth):
        pos = dep - 1
        j = top_t[pos].tolist().index(prop.tokens[node])
        assert prop.probs[node] == pytest.approx(float(top_p[pos, j]), rel=1e-4, abs=1e-6)
    assert len(prop) == 64 and max(tree.depth) >= 2
    # the best path is position by position argmax
    assert prop.tokens[0] == int(top_t[0, 0])
    # a folder with a tensor missing or misshapen is refused naming it
    bad = {k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"}
    save_file(bad, str(tmp_path / "pub" / "model.safetensors"))
    with pytest.raises(BlockDrafterError, match="layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path / "pub")


def test_the_config_reader_names_what_it_cannot_run(tmp_path):
    published_folder(tmp_path / "p")
    c = tmp_path / "p" / "config.json"
    base = json.loads(c.read_text())
    for change, words in [({"architectures": ["DFlash2DraftModel"]}, "architectures"),
                          ({"layer_types": ["sliding_attention"] * 2}, "sliding"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"dflash_config": {"mask_token_id": 5}}, "target_layer_ids"),
                          ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 10**6}}, "mask_token_id")]:
        c.write_text(json.dumps({**base, **change}))
        with pytest.raises(BlockDrafterError, match=words):
            read_config(tmp_path / "p")
    with pytest.raises(BlockDrafterError, match="no such file"):
        read_config(tmp_path / "nowhere")


def test_fetching_a_published_drafter_without_a_network_fails_in_one_clear_line(tmp_path, monkeypatch):
    from tandem_drafters.block import fetch_published

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub     # read at import: a hub imported earlier (by transformers) needs this

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(BlockDrafterError, match="z-lab/Qwen3-8B-DFlash-b16") as e:
        fetch_published("z-lab/Qwen3-8B-DFlash-b16", tmp_path / "x")
    assert "\n" not in str(e.value)


def test_a_drafter_for_another_target_is_refused_by_name(tmp_path, served):
    target = target_of(served)
    cases = [({"target_layer_ids": (0, 5)}, r"hidden layer\(s\) \[5\]"),
             ({"hidden_size": 32, "head_dim": 8}, "hidden_size 32"),
             ]
    for i, (kw, words) in enumerate(cases):
        folder = random_block(tmp_path / f"d{i}", **kw)
        with pytest.raises(DrafterMismatch, match=rf"drafter 'block' cannot draft for target 'tiny'.*{words}"):
            build_drafter("block", target, path=str(folder))
    # trained for another tokenizer
    folder = random_block(tmp_path / "tok")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tandem"] = {"target": "other", "tokenizer_sha256": "ab" * 32, "target_vocab_size": TINY_VOCAB}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatch, match="tokenizer sha256 abab"):
        build_drafter("block", target, path=str(folder))
    # a target that lends no embedding or head
    bare = TargetInfo.of(served.engine.caps, tokenizer=None, vocab_size=TINY_VOCAB, embedding=False, head=False,
                         hidden_size=TINY_HIDDEN, name="tiny")
    with pytest.raises(DrafterMismatch, match="the embedding"):
        build_drafter("block", bare, path=str(folder))
    # nothing set, nothing shipped
    with pytest.raises(DrafterMismatch, match="needs a checkpoint"):
        build_drafter("block", target)


def test_block_tree_is_best_first_and_closed():
    p = block_tree([[1, 2], [3, 4], [5]], [[0.6, 0.3], [0.9, 0.05], [0.5]], 5, "block")
    assert p.tokens == (1, 3, 2, 5, 3) and p.parents == (-1, 0, -1, 1, 2)
    assert block_tree([], [], 5, "block").tokens == ()


# -- lossless speculation ---------------------------------------------------------------------------------

PROMPTS = [[5, 17, 40, 41, 42, 5, 17, 40, 41], [7, 8, 9], list(range(30, 60)), [100, 101] * 6, [250, 3, 250, 3, 250]]


def run(cls, engine, prompt, params, max_tokens=24, **kw):
    dec = cls(engine, DecodeRequest(prompt, max_tokens, params), IdDetok(), **kw)
    return [t for c in dec.run() for t in c.tokens], dec


@pytest.mark.parametrize("names", [("block",), ("lookup", "block")], ids=["block", "lookup,block"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4)],
                         ids=["greedy", "seeded"])
def test_speculative_decoding_with_the_block_drafter_equals_plain(served, block_dir, names, params):
    spec_engine, plain_engine = served.engine, served.spawn()
    target = target_of(served)
    drafters = [build_drafter(n, target, **({"path": str(block_dir)} if n == "block" else {})) for n in names]
    spec = Speculation(drafters, flat_cut(), 16)
    drafted = 0
    for prompt in PROMPTS:
        want, _ = run(Decode, plain_engine, prompt, params)
        got, dec = run(SpecDecode, spec_engine, prompt, params, speculation=spec)
        assert got == want, f"prompt {prompt}"
        assert spec_engine.kv.length == plain_engine.kv.length
        drafted += dec.stats.drafted
        # the drafter holds one row per token the engine holds, the sequence's own tokens
        blk = drafters[-1]
        seq = [*prompt, *got]
        assert blk._pos == list(range(len(blk._pos))) and blk._toks == seq[:len(blk._toks)]
        assert len(blk._pos) == spec_engine.kv.length
    assert drafted > 0


def test_rows_handed_through_verifies_equal_a_prefill_of_the_sequence(served, block_dir):
    target = target_of(served)
    blk = build_drafter("block", target, path=str(block_dir))
    spec = Speculation([build_drafter("lookup", target), blk], flat_cut(), 16)
    prompt = [100, 101] * 8
    got, dec = run(SpecDecode, served.engine, prompt, SamplingParams(temperature=0.0), max_tokens=20,
                   speculation=spec)
    assert dec.stats.accepted > 0            # some rows came from accepted paths of verifies
    seq = [*prompt, *got][: len(blk._pos)]
    ref = build_drafter("block", target, path=str(block_dir))
    eng = served.spawn()
    eng.tap((0, 1))
    eng.forward(seq)
    ref.hidden(0, seq, {i: eng.hidden_at(i) for i in (0, 1)})
    for a, b in zip(blk._k + blk._v, ref._k + ref._v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_new_sequence_keeps_only_the_rows_of_a_shared_prefix(served, block_dir):
    d = BlockDrafter(target_of(served), path=str(block_dir))
    eng = served.spawn()
    eng.tap((0, 1))
    eng.forward([1, 2, 3, 4, 5])
    d.hidden(0, [1, 2, 3, 4, 5], {i: eng.hidden_at(i) for i in (0, 1)})
    d.begin([1, 2, 9])
    d.propose([1, 2, 9, 10], 4)
    assert d._toks == [1, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=99)],
                         ids=["greedy", "seeded"])
def test_block_speculation_on_tiny_qwen38_equals_plain(tmp_path, params):
    """A model with recurrent state (Gated DeltaNet layers): the merged lookup + block tree keeps the engine's
    state equal to the plain loop's, token for token."""
    from conftest_qwen38 import build_text, load_engine

    path = build_text(tmp_path / "q").path
    spec_engine, plain_engine = load_engine(path), load_engine(path)
    target = TargetInfo.of_engine(spec_engine, tokenizer=None, vocab_size=320)
    block = random_block(tmp_path / "b", target_layer_ids=(0, 3))
    spec = Speculation([build_drafter("lookup", target), build_drafter("block", target, path=str(block))],
                       flat_cut(), 16)
    drafted = 0
    for prompt in PROMPTS[:3]:
        want, _ = run(Decode, plain_engine, prompt, params, max_tokens=16)
        got, dec = run(SpecDecode, spec_engine, prompt, params, max_tokens=16, speculation=spec)
        assert got == want, f"prompt {prompt}"
        for name, sec in spec_engine.state.sections.items():
            assert torch.equal(sec, plain_engine.state.sections[name]), name
        drafted += dec.stats.drafted
    assert drafted > 0


def test_a_chunked_prefill_with_safe_points_hands_every_chunk(tiny, block_dir, monkeypatch):
    """The prefill in chunks with a safe point between them (the server's path, where the side lane may run a
    forward of its own there): the drafter gets every chunk's rows, read before the safe point."""
    from tandem_core.spec.loop import prefill

    monkeypatch.setenv("TANDEM_LLAMA_PREFILL_CHUNK", "4")
    served = serve_tiny(tiny)
    assert served.engine.caps.prefill_chunk == 4
    target = target_of(served)
    blk = build_drafter("block", target, path=str(block_dir))
    other = served.spawn()
    calls = []

    def side_lane() -> None:            # a forward on another engine: the spec engine's taps must be read already
        calls.append(1)
        other.reset()
        other.forward([1, 2, 3])

    prompt = list(range(40, 51))
    dec = SpecDecode(served.engine, DecodeRequest(prompt, 6, SamplingParams(temperature=0.0)), IdDetok(),
                     speculation=Speculation([blk], flat_cut(), 8), start=prefill, safe_point=side_lane)
    got = [t for c in dec.run() for t in c.tokens]
    assert calls and blk._toks == [*prompt, *got][: len(blk._toks)] and len(blk._toks) >= len(prompt)
    ref = build_drafter("block", target, path=str(block_dir))
    eng = served.spawn()
    eng.tap((0, 1))
    eng.forward(prompt)
    ref.hidden(0, prompt, {i: eng.hidden_at(i) for i in (0, 1)})
    for a, b in zip(blk._k, ref._k):
        torch.testing.assert_close(a[:, : len(prompt)], b, rtol=1e-4, atol=1e-5)


def test_a_block_drafter_that_keeps_missing_is_paused_and_asked_again(served, block_dir):
    from tandem_core.spec.speculate import DrafterGate

    g = DrafterGate(patience=2)
    seen = []
    for accepted in (False, False, None, None, False, None, None, None, True):
        asked = g.ask()
        seen.append(asked)
        if asked and accepted is not None:
            g.observe(accepted)
    # two misses: paused 1 round; one more miss: paused 2; then asked again, and a hit resets it
    assert seen == [True, True, False, True, True, False, False, True, True] and g.level == 0
    blk = build_drafter("block", target_of(served), path=str(block_dir))
    calls = []
    real = blk.propose
    blk.propose = lambda ctx, n: calls.append(1) or real(ctx, n)
    prompt = [7, 8, 9]
    want, _ = run(Decode, served.spawn(), prompt, SamplingParams(temperature=0.0), max_tokens=40)
    got, dec = run(SpecDecode, served.engine, prompt, SamplingParams(temperature=0.0), max_tokens=40,
                   speculation=Speculation([blk], flat_cut(), 16))
    assert got == want
    assert dec.stats.accepted == 0 and 8 <= len(calls) < dec.stats.rounds
