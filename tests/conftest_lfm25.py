"""Tiny LFM2-family checkpoints written by transformers 5.24.0, for the lfm25 plugin's tests.

``lfm25_ckpts`` (session scope) builds, once per test session:

- ``moe``:    ``Lfm2MoeForCausalLM`` (``lfm2_moe``), tied head: layer types set explicitly (conv and
              attention interleaved), 6 experts, top 3, one dense layer first, a non-zero expert bias
              (re-randomised like every float), renormalised top-k and a routed scaling of 1.5;
- ``moe_untied``: the same family untied, without the expert bias or the renormalisation, two dense
              layers, top 2 of 5;
- ``dense``:  ``Lfm2ForCausalLM`` (``lfm2``), tied, its MLP width derived the reference's way.

Every float parameter and persistent buffer (norms, conv taps, router, expert bias) is drawn again
from a fixed seed before ``save_pretrained``, so no initialisation constant hides a wrong formula.

Import the fixture into a test module: ``from conftest_lfm25 import lfm25_ckpts``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch

from conftest_qwen38 import TinyCheckpoint, rerandomise

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SRC = ROOT / "plugins" / "lfm25"
if str(PLUGIN_SRC) not in sys.path:  # the plugin's source tree, whether or not it is pip-installed
    sys.path.insert(0, str(PLUGIN_SRC))

VOCAB = 320
MOE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, num_experts=6, num_experts_per_tok=3,
    num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=1024, norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
MOE_UNTIED = dict(MOE, tie_word_embeddings=False, use_expert_bias=False, norm_topk_prob=False,
                  routed_scaling_factor=1.0, num_experts=5, num_experts_per_tok=2, num_dense_layers=2,
                  layer_types=["full_attention", "conv", "conv", "full_attention", "conv"])
DENSE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=144, num_hidden_layers=4,
    layer_types=["conv", "conv", "full_attention", "conv"], num_attention_heads=4, num_key_value_heads=1,
    conv_L_cache=3, block_multiple_of=32, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
    max_position_embeddings=1024, norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
SEED = 4321


@dataclass
class TinyCheckpoints:
    moe: TinyCheckpoint
    moe_untied: TinyCheckpoint
    dense: TinyCheckpoint


def build(path: Path, kind: str, seed: int = SEED, **overrides: Any) -> TinyCheckpoint:
    """A re-randomised tiny checkpoint of ``kind`` ``"moe"`` or ``"dense"`` written by ``save_pretrained``."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe":
        model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**{**MOE, **overrides}))
    else:
        model = Lfm2ForCausalLM(Lfm2Config(**{**DENSE, **overrides}))
    model = model.float().eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    return TinyCheckpoint(path, model, json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="session")
def lfm25_ckpts(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    root = tmp_path_factory.mktemp("lfm25")
    return TinyCheckpoints(
        moe=build(root / "moe", "moe"),
        moe_untied=build(root / "moe_untied", "moe", seed=SEED + 3, **MOE_UNTIED),
        dense=build(root / "dense", "dense", seed=SEED + 5),
    )


def load_runner(path: Path, *, dtype: str = "fp32", max_context: int = 256, max_tree: int = 64):
    """Config -> audit -> weights -> runner, the way ``serve`` does it (no tokenizer)."""
    from tandem_lfm25.config import read_config
    from tandem_lfm25.model import Lfm2Runner
    from tandem_lfm25.weights import load_weights, open_checkpoint

    cfg = read_config(json.loads((path / "config.json").read_text()))
    weights = load_weights(open_checkpoint(path, cfg), cfg, dtype)
    return Lfm2Runner(cfg, weights, max_context=max_context, max_tree=max_tree)


def prompt(n: int, vocab: int = VOCAB, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def prefill(runner: Any, ids: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
    """``ids`` appended ``chunk`` rows a call (the sequence engine's prefill chunking); all logits [T, V]."""
    rows = []
    for s in range(0, int(ids.numel()), chunk):
        piece = ids[s:s + chunk]
        call = runner.decode if piece.numel() == 1 else runner.prefill
        rows.append(call(piece, start + s).logits)
    return torch.cat(rows)


def tree(start: int, parents: Sequence[int]) -> SimpleNamespace:
    """A verified tree as the sequence engine hands it to a runner (start, parents, depth)."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return SimpleNamespace(start=start, parents=tuple(parents), depth=tuple(depth))
