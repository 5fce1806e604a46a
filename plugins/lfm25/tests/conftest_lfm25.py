"""Tiny LFM2-family checkpoints written by transformers 5.24.0, for the lfm25 plugin's tests.

``lfm25_ckpts`` (session scope) builds, once per test session:

- ``moe``:    ``Lfm2MoeForCausalLM`` (``lfm2_moe``), tied head: layer types set explicitly (conv and
              attention interleaved), 6 experts, top 3, one dense layer first, a non-zero expert bias
              (re-randomised like every float), renormalised top-k and a routed scaling of 1.5;
- ``moe_untied``: the same family untied, without the expert bias or the renormalisation, two dense
              layers, top 2 of 5;
- ``dense``:  ``Lfm2ForCausalLM`` (``lfm2``), tied, its MLP width derived the reference's way.

Every float parameter and persistent buffer (norms, conv taps, router, expert bias) is drawn again
from a fixed seed before ``save_pretrained``, so no initialisation constant hides a wrong formula. Each
directory also gets the test tokenizer (``lfm2_tokenizer``: LFM2's special tokens at their ids).

Import the fixture into a test module: ``from conftest_lfm25 import lfm25_ckpts``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
PLUGIN_SRC = ROOT / "plugins" / "lfm25"
if str(PLUGIN_SRC) not in sys.path:  # the plugin's source tree, whether or not it is pip-installed
    sys.path.insert(0, str(PLUGIN_SRC))

from lfm2_tokenizer import write_tokenizer  # noqa: E402  (beside this file)

VOCAB = 320
MOE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, num_experts=6, num_experts_per_tok=3,
    num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=1024, norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=7, bos_token_id=1,
    pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
MOE_UNTIED = dict(MOE, tie_word_embeddings=False, use_expert_bias=False, norm_topk_prob=False,
                  routed_scaling_factor=1.0, num_experts=5, num_experts_per_tok=2, num_dense_layers=2,
                  layer_types=["full_attention", "conv", "conv", "full_attention", "conv"])
DENSE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=144, num_hidden_layers=4,
    layer_types=["conv", "conv", "full_attention", "conv"], num_attention_heads=4, num_key_value_heads=1,
    conv_L_cache=3, block_multiple_of=32, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
    max_position_embeddings=1024, norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=7, bos_token_id=1,
    pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
SEED = 4321


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Every float parameter and persistent buffer drawn again from ``seed`` (deterministic order): matrices
    scaled by their fan-in, LFM2's plain RMSNorm weights around one (``1 + 0.3 r``), the expert bias at the
    sigmoid router's scale (``0.3 r``: it changes which experts a token takes), anything else ``0.2 r``."""
    gen = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict(keep_vars=False))
    with torch.no_grad():
        named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
        for name, p in sorted(named, key=lambda kv: kv[0]):
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                value = r / (p.shape[-1] if p.dim() == 2 else p[0].numel()) ** 0.5
            elif "norm" in name:
                value = 1.0 + 0.3 * r
            elif name.endswith("expert_bias"):
                value = 0.3 * r
            else:
                value = 0.2 * r
            p.copy_(value.to(p.dtype))


@dataclass
class TinyCheckpoint:
    path: Path
    model: Any           # the transformers model, fp32, eval mode
    raw_config: dict


@dataclass
class TinyCheckpoints:
    moe: TinyCheckpoint
    moe_untied: TinyCheckpoint
    dense: TinyCheckpoint


def build(path: Path, kind: str, seed: int = SEED, **overrides: Any) -> TinyCheckpoint:
    """A re-randomised tiny checkpoint of ``kind`` ``"moe"`` or ``"dense"`` written by ``save_pretrained``,
    with the test tokenizer (LFM2's special tokens) and no chat template (the plugin's is used)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe":
        model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**{**MOE, **overrides}))
    else:
        model = Lfm2ForCausalLM(Lfm2Config(**{**DENSE, **overrides}))
    model = model.float().eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, VOCAB)
    return TinyCheckpoint(path, model, json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="session")
def lfm25_ckpts(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    root = tmp_path_factory.mktemp("lfm25")
    return TinyCheckpoints(
        moe=build(root / "moe", "moe"),
        moe_untied=build(root / "moe_untied", "moe", seed=SEED + 3, **MOE_UNTIED),
        dense=build(root / "dense", "dense", seed=SEED + 5),
    )


def load_weights_of(path: Path, dtype: str = "fp32"):
    """Config -> audit -> weights, the way ``serve`` does it."""
    from tandem_lfm25.config import read_config
    from tandem_lfm25.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    return cfg, load_weights(open_checkpoint(path, cfg), cfg, dtype)


def load_engine(path: Path, *, dtype: str = "fp32", max_context: int = 256, prefill_chunk: int = 512,
                max_tree: int = 64):
    """Config -> audit -> weights -> the core's engine over the runner, the way ``serve`` does it."""
    from tandem_lfm25.serving import build_engine

    cfg, weights = load_weights_of(path, dtype)
    return build_engine(cfg, weights, max_context, prefill_chunk, max_tree)


def prompt(n: int, vocab: int = VOCAB, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
