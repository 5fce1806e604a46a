"""tandem-llama on tiny random Llama checkpoints, against transformers 5.24 in fp32.

GGUF files are written with the ``gguf`` package's GGUFWriter from a re-randomised
``LlamaForCausalLM`` (Q and K rows permuted the way llama.cpp's converter does,
matrices stored as F32, F16, Q8_0, Q4_1 or a mix, a small byte-level BPE tokenizer
in the metadata); transformers loads the same file (``gguf_file=``, dequantised to
fp32). Hugging Face directories are written with ``save_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem_core.checkpoint.audit import AuditError
from tandem_core.checkpoint.config import ConfigError
from tandem_core.engine import Engine
from tandem_core.plugins import plugin_manager, register_plugin
from tandem_core.serving import ServeArgs, ServeContext

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tandem",
    "numbers 12345 and 67",
    "über naïve café — ünïcödé text",
    "def main():\n    return 42\n",
    "tabs\tand  spaces   here",
] * 4


@pytest.fixture(scope="module", autouse=True)
def _llama_plugin():
    """The plugin as an installed distribution would register it (once, through the entry point or here)."""
    from tandem_llama import plugin

    pm = plugin_manager()
    from tandem_core.plugins import load_plugins

    load_plugins()
    if not pm.is_registered(plugin) and pm.get_plugin("llama") is None:
        register_plugin(plugin, "llama")
    yield


# -- building tiny checkpoints --------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE: ``(tokens, token_types, merges, tokenizers.Tokenizer)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, types, merges, tok


def _hf_model(tie: bool, seed: int = 0, vocab: int = 320, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # re-randomise: larger weights, so logits are far from ties
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.8 / p.shape[1] ** 0.5 if "embed" not in name else 1.0))
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF's half-split Q/K rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(writer, name: str, w: np.ndarray, qtype: str) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if w.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        q = getattr(Q, qtype)
        writer.add_tensor(name, quantize(w.astype(np.float32), q), raw_dtype=q)


def write_gguf(
    path: Path,
    model,
    bpe,
    qtypes: dict[str, str] | str,
    pre: str = "gpt2",
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """``model`` (a LlamaForCausalLM) as a llama GGUF; ``qtypes``: one type, or per GGUF tensor kind."""
    from gguf import GGUFWriter

    cfg = model.config
    tokens, types, merges, _ = bpe
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", cfg.num_hidden_layers)
    w.add_uint32("llama.context_length", cfg.max_position_embeddings)
    w.add_uint32("llama.embedding_length", cfg.hidden_size)
    w.add_uint32("llama.feed_forward_length", cfg.intermediate_size)
    w.add_uint32("llama.attention.head_count", cfg.num_attention_heads)
    w.add_uint32("llama.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32("llama.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32("llama.rope.dimension_count", cfg.hidden_size // cfg.num_attention_heads)
    w.add_uint32("llama.vocab_size", cfg.vocab_size)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }

    def qt(kind: str) -> str:
        return qtypes if isinstance(qtypes, str) else qtypes.get(kind, "F32")

    _store(w, "token_embd.weight", sd["model.embed_tokens.weight"], qt("token_embd"))
    for n in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{n}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            _store(w, f"blk.{n}.{gg}.weight", t, qt(gg))
    _store(w, "output_norm.weight", sd["model.norm.weight"], "F32")
    if not cfg.tie_word_embeddings:
        _store(w, "output.weight", sd["lm_head.weight"], qt("output"))
    if rope_freqs is not None:
        _store(w, "rope_freqs.weight", rope_freqs, "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _serve(path: Path, **opts):
    from tandem_llama.serving import serve

    return serve(ServeArgs(model_id="tiny", path=path, max_context=128), ServeContext())


def _ours_greedy(engine, ids: list[int], n: int) -> list[int]:
    engine.reset()
    logits = engine.forward(ids)
    out = []
    for _ in range(n):
        nxt = int(engine.picks(logits)[0])
        out.append(nxt)
        logits = engine.forward([nxt])
    return out


def _ref_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


PROMPT = [5, 17, 90, 44, 201, 3, 77, 150, 8, 260, 31, 12, 99]

GGUF_CASES = {
    "f32-tied": ("F32", True),
    "f16-untied": ("F16", False),
    "q8_0-tied": ("Q8_0", True),
    "q4_1-tied": ("Q4_1", True),
    "q4_1-q8_0-embed-untied": (
        {
            "token_embd": "Q8_0",
            "output": "Q8_0",
            "attn_q": "Q4_1",
            "attn_k": "Q4_1",
            "attn_v": "Q4_1",
            "attn_output": "Q4_1",
            "ffn_gate": "Q4_1",
            "ffn_up": "Q4_1",
            "ffn_down": "Q4_1",
        },
        False,
    ),
    "mixed-stacks": (
        {
            "attn_q": "Q4_1",
            "attn_k": "Q8_0",
            "attn_v": "F16",
            "ffn_gate": "Q8_0",
            "ffn_up": "Q4_1",
            "token_embd": "F16",
            "attn_output": "F32",
            "ffn_down": "Q8_0",
        },
        True,
    ),
}


@pytest.mark.parametrize(
    "case,dense",
    [(c, True) for c in GGUF_CASES] + [("q4_1-tied", False), ("mixed-stacks", False)],
    ids=[f"{c}-dense" for c in GGUF_CASES] + ["q4_1-tied-lean", "mixed-stacks-lean"],
)
def test_gguf_equals_transformers(tmp_path, bpe, monkeypatch, case, dense):
    from transformers import AutoModelForCausalLM

    qtypes, tie = GGUF_CASES[case]
    path = write_gguf(tmp_path / "tiny.gguf", _hf_model(tie), bpe, qtypes)
    monkeypatch.setenv("TANDEM_LLAMA_DENSE", "1" if dense else "0")
    monkeypatch.setenv("TANDEM_LLAMA_PREFILL_CHUNK", "5")  # the prompt runs in three chunks
    served = _serve(path)
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = served.engine.forward(PROMPT, all_logits=True)
    assert got.shape == want.shape
    assert _rel(got, want) < 1e-4, case
    assert _ours_greedy(served.engine, PROMPT, 32) == _ref_greedy(ref, PROMPT, 32)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_dir_equals_transformers(tmp_path, bpe, rope, tie):
    from transformers import LlamaForCausalLM

    extra = {}
    if rope == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif rope == "llama3":
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    model = _hf_model(tie, seed=1, **extra)
    model.save_pretrained(tmp_path)
    bpe[3].save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": TEMPLATE})
    )
    served = _serve(tmp_path)
    ref = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    long_prompt = PROMPT * 6  # 78 positions: past the llama3 band edges of a 64-token original context
    with torch.no_grad():
        want = ref(torch.tensor([long_prompt])).logits[0]
    got = served.engine.forward(long_prompt, all_logits=True)
    assert _rel(got, want) < 1e-4
    assert _ours_greedy(served.engine, PROMPT, 32) == _ref_greedy(ref, PROMPT, 32)
    assert served.chat_template == TEMPLATE
    assert served.tokenizer.token_to_id("<|im_end|>") in served.stop_ids


def test_gguf_rope_freqs_equals_llama3_scaling(tmp_path, bpe):
    """llama.cpp stores Llama 3 rope scaling as ``rope_freqs.weight`` (frequency divisors); the engine must
    then equal transformers' llama3 rope on the same weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = _hf_model(True, seed=2, rope_scaling=scaling)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    base = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    path = write_gguf(tmp_path / "l3.gguf", model, bpe, "F32", rope_freqs=(base / scaled).numpy())
    served = _serve(path)
    long_prompt = PROMPT * 6
    with torch.no_grad():
        want = model(torch.tensor([long_prompt])).logits[0]
    assert _rel(served.engine.forward(long_prompt, all_logits=True), want) < 1e-4
    # and without the tensor the same file computes something else (the check can fail)
    plain = _serve(write_gguf(tmp_path / "plain.gguf", model, bpe, "F32"))
    assert _rel(plain.engine.forward(long_prompt, all_logits=True), want) > 1e-3


def test_gguf_tokenizer_equals_transformers(tmp_path, bpe):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "tiny.gguf", _hf_model(True), bpe, "F32")
    served = _serve(tmp_path / "tiny.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in [
        "the quick brown fox",
        "hello  world\n\n  indented",
        "ünïcödé café 🦊 ok",
        "<|im_start|>user\nhi<|im_end|>\n",
        "numbers 2024 and 7",
    ]:
        assert served.tokenizer.encode(text) == ref(text, add_special_tokens=False)["input_ids"], text
        ids = served.tokenizer.encode(text)
        assert served.tokenizer.decode(ids) == text
    assert served.chat_template == TEMPLATE
    assert served.stop_ids[0] == 2 and 0 in served.stop_ids  # eos, then <|endoftext|>
    assert served.tool_format == "hermes_json" and served.reasoning is False


def test_engine_contract(tmp_path, bpe):
    from tandem_core.state import StateMismatch

    served = _serve(write_gguf(tmp_path / "tiny.gguf", _hf_model(True), bpe, "Q8_0"))
    eng = served.engine
    assert isinstance(eng, Engine)
    assert eng.caps.tree and eng.caps.max_tree == 64 and eng.caps.max_context == 128 and eng.caps.dtype == "fp32"
    logits = eng.forward(PROMPT)
    assert logits.shape == (1, 320) and eng.kv.length == len(PROMPT)
    assert eng.hidden_post_norm().shape == (len(PROMPT), 64)
    snap = eng.state.clone()
    assert snap.length == len(PROMPT) and not snap.sections and set(snap.views) == {"K", "V"}
    assert snap.views["K"].tensor.shape == (2, 2, len(PROMPT), 16)
    first = _continue(eng, logits, 6)
    # restore into the live state lands in the engine's buffers
    eng.state.restore(snap)
    assert eng.kv.length == len(PROMPT)
    assert _continue(eng, logits, 6) == first
    # a second engine shares the weights and has its own buffers
    other = served.spawn()
    assert other.runner.w is eng.runner.w
    assert other.state.views["K"].tensor.data_ptr() != eng.state.views["K"].tensor.data_ptr()
    assert _continue(other, other.forward(PROMPT), 6) == first
    eng.reset()
    assert eng.kv.length == 0
    with pytest.raises(ValueError, match="exceed the engine's context of 128"):
        eng.forward(list(range(129)))
    bad = snap.clone()
    bad.views["K"] = type(bad.views["K"])(bad.views["K"].tensor[:, :1], 2)
    with pytest.raises(StateMismatch):
        eng.state.restore(bad)
    m1, m2 = eng.manifest(), other.manifest()
    assert m1.fingerprint() == m2.fingerprint()
    parts = {p.name: p.nbytes for p in eng.memory_parts()}
    assert parts["kv"] == 2 * 2 * 2 * 128 * 16 * 4
    assert served.info["weights"]["formats"]["Q8_0"] == 2 * 7 + 1


def _continue(eng, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        nxt = int(eng.picks(logits)[0])
        out.append(nxt)
        logits = eng.forward([nxt])
    return out


def test_through_the_core_loader(tmp_path, bpe):
    from tandem_core.loader import load_served
    from tandem_core.registry import architecture

    path = write_gguf(tmp_path / "tiny.gguf", _hf_model(True), bpe, "Q4_1")
    served = load_served(None, weights=str(path))
    assert served.info["architecture"] == "llama" and served.info["plugin"] == "tandem-llama"
    assert architecture({"architectures": ["LlamaForCausalLM"]}).name == "llama"
    cfg = architecture({"model_type": "llama", "format": "gguf", "gguf_path": str(path)}).read_config(
        {"model_type": "llama", "format": "gguf", "gguf_path": str(path)}
    )
    assert cfg.num_layers == 2 and cfg.num_kv_heads == 2 and cfg.tie_word_embeddings


# -- strictness --------------------------------------------------------------------------------------


def test_hf_config_refuses_unknown_and_fixed_fields():
    from tandem_llama.config import from_hf

    base = json.loads(_hf_model(True).config.to_json_string())
    assert from_hf(base).num_layers == 2
    with pytest.raises(ConfigError, match="'sliding_window'"):
        from_hf({**base, "sliding_window": 128})
    with pytest.raises(ConfigError, match="'hidden_act'"):
        from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="'attention_bias'"):
        from_hf({**base, "attention_bias": True})
    with pytest.raises(ConfigError, match="yarn"):
        from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})


def test_gguf_metadata_and_tensors_are_audited(tmp_path, bpe):
    from gguf import GGUFWriter
    from tandem_llama.config import config_of
    from tandem_llama.gguf_reader import GGUFFile
    from tandem_llama.weights import audit_gguf

    path = write_gguf(tmp_path / "ok.gguf", _hf_model(True), bpe, "F32")
    gf = GGUFFile(path)
    audit_gguf(gf, config_of(gf))
    # an unknown llama.* key is refused, naming it
    from tandem_llama.config import from_gguf

    with pytest.raises(ConfigError, match="'attention.sliding_window'"):
        from_gguf({**gf.arch_metadata(), "attention.sliding_window": 4}, n_vocab=320, tied=True)
    with pytest.raises(ConfigError, match="'expert_count'"):
        from_gguf({**gf.arch_metadata(), "expert_count": 8}, n_vocab=320, tied=True)
    # a missing tensor and an unexpected one are named
    model = _hf_model(True)
    w = GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for k, v in gf.metadata.items():
        if k.startswith("llama."):
            (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    sd = model.state_dict()
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bad = GGUFFile(tmp_path / "bad.gguf")
    with pytest.raises(AuditError, match="'blk.0.attn_q.bias'"):
        audit_gguf(bad, config_of(bad))
    bad.tensors.pop("blk.0.attn_q.bias")
    with pytest.raises(AuditError, match="missing tensor 'output_norm.weight'"):
        audit_gguf(bad, config_of(bad))


def test_unsupported_tokenizer_is_refused(bpe):
    from tandem_llama.gguf_reader import GGUFError, TokenizerSpec, build_tokenizer

    tokens, types, merges, _ = bpe
    spec = TokenizerSpec(
        "gpt2",
        "mystery",
        tuple(tokens),
        tuple(types),
        tuple(merges),
        1,
        2,
        None,
        None,
        None,
        None,
        False,
        False,
    )
    with pytest.raises(GGUFError, match="'mystery'"):
        build_tokenizer(spec)
    with pytest.raises(GGUFError, match="'llama'"):
        build_tokenizer(dataclasses.replace(spec, model="llama"))


# -- the engine's fast ops against the core's references ---------------------------------------------


@pytest.mark.parametrize(
    "start,t", [(0, 1), (7, 1), (0, 9), (5, 4)], ids=["first", "decode", "prefill", "chunk"]
)
def test_fast_ops_equal_core_references(start, t):
    from tandem_llama.config import from_hf
    from tandem_llama.model import attend, rope_rows, rope_tables

    from tandem_core.ops.attention import attention, causal_mask
    from tandem_core.ops.norm import rms_norm
    from tandem_core.ops.rope import apply_rope, cos_sin, inv_freq

    cfg = from_hf(json.loads(_hf_model(True).config.to_json_string()))
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(cfg, 32)
    x = torch.randn(t, hq, d)
    rc, rs = cos_sin(torch.arange(start, start + t), inv_freq(d, cfg.rope_theta))
    torch.testing.assert_close(
        rope_rows(x, cos[start : start + t, None], sin[start : start + t, None]),
        apply_rope(x, rc, rs),
        rtol=1e-6,
        atol=1e-6,
    )
    h = torch.randn(t, cfg.hidden_size)
    w = torch.randn(cfg.hidden_size)
    torch.testing.assert_close(
        torch.nn.functional.rms_norm(h, (cfg.hidden_size,), w, 1e-5),
        rms_norm(h, w, 1e-5),
        rtol=1e-6,
        atol=1e-6,
    )
    g, end = hq // hkv, start + t
    q = torch.randn(t, hq, d)
    k, v = torch.randn(hkv, end, d), torch.randn(hkv, end, d)
    mask = causal_mask(start, t)
    qg = q.reshape(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
    ours = attend(qg, k, v, None if t == 1 else mask.repeat(g, 1), d**-0.5)
    ours = ours.reshape(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d)
    torch.testing.assert_close(ours, attention(q, k, v, mask, d**-0.5), rtol=1e-5, atol=1e-6)
