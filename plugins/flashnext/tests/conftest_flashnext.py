"""Tiny Flash-Next (``qwen4_exp``) checkpoints written by transformers 5.24.0, for the flashnext tests.

``flashnext_ckpts`` (session scope) builds, once per test session:

- ``text``:    ``Qwen4ExpForCausalLM`` (model_type ``qwen4_exp_text``), untied head;
- ``vl``:      ``Qwen4ExpForConditionalGeneration`` (``qwen4_exp``) with a tiny vision tower, the same
               text weights;
- ``sigmoid``: ``Qwen4ExpForCausalLM`` whose Gated DeltaNet norm gates with a sigmoid
               (``output_gate_type``), another seed;
- ``mtp``:     the ``text`` checkpoint with an MTP head in the ``mtp.*`` layout
               (``tests/mtp_reference.py``; its reference forward is ``head``).

The shape exercises every part: 6 experts, top-2, 3 residual streams, PLE on two Gated
DeltaNet layers (two hashing indices, tables split into 5 uneven shards), two QSA layers
whose budget (8 tokens in blocks of 4) is far below the test contexts (so the selection
matters), eos id 317 inside the prompts (the n-gram segments). Every float parameter and
persistent buffer is re-randomised from a fixed seed before ``save_pretrained`` (norms, conv
taps, the PLE tables, the router; the integer hashing buffers stay as the config derives
them).

Import the fixture into a test module: ``from conftest_flashnext import flashnext_ckpts``.
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

from conftest_qwen38 import TinyCheckpoint, rerandomise, save_tiny, wrap_text
from mtp_reference import add_head, reference_head

ROOT = Path(__file__).resolve().parents[3]
PLUGIN_SRC = ROOT / "plugins" / "flashnext"
if str(PLUGIN_SRC) not in sys.path:  # the plugin's source tree, whether or not it is pip-installed
    sys.path.insert(0, str(PLUGIN_SRC))

EOS = 317
TEXT = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=5,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                 "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
    hc_count=3, hc_lowrank=16,
    ple_layer_ids=[2, 4], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=5, seed=1234,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    eos_token_id=EOS,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
SEED = 4321


@dataclass
class TinyCheckpoints:
    text: TinyCheckpoint
    vl: TinyCheckpoint
    sigmoid: TinyCheckpoint
    mtp: TinyCheckpoint
    head: Any            # the MTP head's reference (tests/mtp_reference.RefMTP) written into ``mtp``


def build_text(path: Path, seed: int = SEED, **overrides: Any) -> TinyCheckpoint:
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**TEXT, **overrides})).float().eval()
    rerandomise(model, seed)
    model.generation_config.eos_token_id = None        # generate the full count (eos is in the vocabulary)
    return save_tiny(path, model, model.config.vocab_size)


def build_vl(path: Path, text_model: Any, seed: int = SEED) -> TinyCheckpoint:
    """The vision-language wrapper around the same text weights (its vision tower random too)."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=dict(TEXT), vision_config=VISION))
    return wrap_text(path, model, text_model, seed)


@pytest.fixture(scope="session")
def flashnext_ckpts(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    root = tmp_path_factory.mktemp("flashnext")
    text = build_text(root / "text")
    vl = build_vl(root / "vl", text.model)
    sigmoid = build_text(root / "sigmoid", seed=SEED + 7, output_gate_type="sigmoid")
    shutil.copytree(text.path, root / "mtp")
    head = reference_head(text.model, SEED + 11)
    add_head(root / "mtp", head.checkpoint_tensors())
    mtp = TinyCheckpoint(root / "mtp", text.model, text.raw_config)
    return TinyCheckpoints(text, vl, sigmoid, mtp, head)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's tensors are far below ATen's grain: one thread changes no arithmetic, and keeps the
    many small calls fast on a busy 2-core runner. A module uses it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def open_dir(path: Path):
    """(config, audited checkpoint) of a checkpoint directory."""
    from tandem_flashnext.config import read_config
    from tandem_flashnext.weights import open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, open_checkpoint(path, cfg)


def load_engine(path: Path, *, dtype: str = "fp32", max_context: int = 256, prefill_chunk: int = 512,
                gdn_chunk: int = 64, max_tree: int = 64, last_streams: bool = False):
    """Config -> audit -> weights -> the core's engine over the runner, the way ``serve`` builds it (with the
    checkpoint's MTP head when it ships one)."""
    from tandem_flashnext.mtp import load_mtp
    from tandem_flashnext.serving import build_engine
    from tandem_flashnext.weights import load_weights

    cfg, ckpt = open_dir(path)
    weights = load_weights(ckpt, cfg, dtype)
    return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, gdn_chunk, last_streams,
                        mtp=load_mtp(ckpt, cfg, dtype))


def prompt(n: int, vocab: int = 320, seed: int = 5) -> torch.Tensor:
    """``n`` random ids with an eos every ~17 tokens (the n-gram hashing's segment ends)."""
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ids[7::17] = EOS
    return ids


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's scale."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def per_position(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each position's largest difference relative to the reference's scale: ``[T]``."""
    return (got.float() - ref.float()).abs().amax(-1) / ref.float().abs().max()
