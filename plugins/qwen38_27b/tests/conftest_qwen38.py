"""Tiny Qwen3.5-architecture checkpoints written by transformers 5.24.0, for the qwen38 plugin's tests.

``qwen38_ckpts`` (session scope) builds, once per test session:

- ``text``:   ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``), untied head;
- ``vl``:     ``Qwen3_5ForConditionalGeneration`` (``qwen3_5``) with a tiny vision tower,
              the same text weights;
- ``tied``:   ``Qwen3_5ForCausalLM`` with ``tie_word_embeddings=True``;
- ``mtp``:    the ``text`` checkpoint with an MTP head in the published ``mtp.*`` layout, written as a
              shard of its own with an index (``tests/mtp_reference_qwen38.py``; its reference forward is
              ``head``).

Every float parameter is re-randomised from a fixed seed before ``save_pretrained``
(norm weights, A_log, dt_bias, conv taps, everything), so no initialisation
constant hides a wrong formula. Each checkpoint directory also gets a tiny
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

Import the fixture into a test module: ``from conftest_qwen38 import qwen38_ckpts``.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
PLUGIN_SRC = ROOT / "plugins" / "qwen38_27b"
if str(PLUGIN_SRC) not in sys.path:  # the plugin's source tree, whether or not it is pip-installed
    sys.path.insert(0, str(PLUGIN_SRC))

TEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
SEED = 1234

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every float parameter and persistent buffer drawn again from ``seed`` (deterministic order)."""
    gen = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict(keep_vars=False))
    with torch.no_grad():
        named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
        for name, p in sorted(named, key=lambda kv: kv[0]):
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                value = r * 0.5 - 1.0                       # decay rates exp(A_log) around 0.4
            elif name.endswith("dt_bias"):
                value = r * 0.5
            elif p.dim() >= 2:
                fan_in = p.shape[-1] if p.dim() == 2 else p[0].numel()
                value = r / fan_in ** 0.5
            else:                                           # norm weights (zero-centred or plain), biases
                value = r * 0.2
            p.copy_(value.to(p.dtype))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level ``tokenizer.json`` of ``vocab_size`` ids (Qwen's special tokens), a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    n_words = vocab_size - len(SPECIALS)
    vocab = {f"w{i}": i for i in range(n_words - 1)}
    vocab["[UNK]"] = n_words - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


@dataclass
class TinyCheckpoint:
    path: Path
    model: Any           # the transformers model, fp32, eval mode
    raw_config: dict


@dataclass
class TinyCheckpoints:
    text: TinyCheckpoint
    vl: TinyCheckpoint
    tied: TinyCheckpoint
    mtp: TinyCheckpoint
    head: Any            # the MTP head's reference (tests/mtp_reference_qwen38.RefMTP) written into ``mtp``


def build_text(path: Path, seed: int = SEED, **overrides: Any) -> TinyCheckpoint:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TEXT, **overrides})).float().eval()
    rerandomise(model, seed)
    return save_tiny(path, model, model.config.vocab_size)


def save_tiny(path: Path, model: Any, vocab_size: int) -> TinyCheckpoint:
    """``save_pretrained`` with a tiny tokenizer beside it."""
    model.save_pretrained(path)
    write_tokenizer(path, vocab_size)
    return TinyCheckpoint(path, model, json.loads((path / "config.json").read_text()))


def wrap_text(path: Path, model: Any, text_model: Any, seed: int) -> TinyCheckpoint:
    """A vision-language wrapper ``model`` (freshly built) around ``text_model``'s weights, its vision tower
    re-randomised from ``seed + 1``, saved."""
    model = model.float().eval()
    rerandomise(model, seed + 1)
    with torch.no_grad():
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        model.lm_head.weight.copy_(text_model.lm_head.weight)
    return save_tiny(path, model, model.config.text_config.vocab_size)


def build_vl(path: Path, text_model: Any, seed: int = SEED) -> TinyCheckpoint:
    """The vision-language wrapper around the same text weights (its vision tower random too)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(TEXT), vision_config=VISION))
    return wrap_text(path, model, text_model, seed)


@pytest.fixture(scope="session")
def qwen38_ckpts(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    root = tmp_path_factory.mktemp("qwen38")
    text = build_text(root / "text")
    vl = build_vl(root / "vl", text.model)
    tied = build_text(root / "tied", seed=SEED + 7, tie_word_embeddings=True)
    from mtp_reference_qwen38 import add_mtp_shard, reference_head

    shutil.copytree(text.path, root / "mtp")
    head = reference_head(text.model, SEED + 11)
    add_mtp_shard(root / "mtp", head.checkpoint_tensors())
    mtp = TinyCheckpoint(root / "mtp", text.model, text.raw_config)
    return TinyCheckpoints(text, vl, tied, mtp, head)


def load_engine(path: Path, *, dtype: str = "fp32", max_context: int = 256, prefill_chunk: int = 512,
                max_tree: int = 64):
    """Config -> audit -> weights -> engine, the way ``serve`` does it (no tokenizer); with the checkpoint's
    MTP head when it ships one."""
    from tandem_qwen38.config import read_config
    from tandem_qwen38.mtp import load_mtp
    from tandem_qwen38.serving import build_engine
    from tandem_qwen38.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    ckpt = open_checkpoint(path, cfg)
    weights = load_weights(ckpt, cfg, dtype)
    return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=load_mtp(ckpt, cfg, dtype))


def prompt(n: int, vocab: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
