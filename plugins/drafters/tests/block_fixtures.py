"""Helpers for the block drafter's tests: a tiny Llama checkpoint (a Hugging Face folder written with
``save_pretrained``, served by the llama plugin) and random block drafters in the published DFlash layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tandem_drafters.block import BlockConfig, BlockModel, save_checkpoint
from test_llama_tiny import TEMPLATE, _hf_model

from tandem_core.serving import ServeArgs, ServeContext

TINY_LAYERS = 2
TINY_HIDDEN = 64
TINY_VOCAB = 320


def write_tiny_llama(folder: Path, bpe, seed: int = 3) -> Path:
    """A 2-layer Llama (hidden 64, vocabulary 320) with the bpe fixture's tokenizer and a chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    _hf_model(False, seed=seed).save_pretrained(folder)
    bpe[3].save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": TEMPLATE}))
    return folder


def serve_tiny(folder: Path, max_context: int = 512, model_id: str = "tiny"):
    from tandem_llama.serving import serve

    return serve(ServeArgs(model_id=model_id, path=folder, max_context=max_context, options={}), ServeContext())


def tiny_block_config(**kw) -> BlockConfig:
    base = {"hidden_size": TINY_HIDDEN, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "vocab_size": TINY_VOCAB, "target_layer_ids": (0, 1),
            "mask_token_id": TINY_VOCAB - 1, "block_size": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "num_target_layers": TINY_LAYERS}
    base.update(kw)
    return BlockConfig(**base)


def random_block(folder: Path, seed: int = 0, **kw) -> Path:
    """A block drafter of random weights (norm weights near one, projections scaled to keep rows finite)."""
    cfg = tiny_block_config(**kw)
    g = torch.Generator().manual_seed(seed)
    model = BlockModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return save_checkpoint(model, folder)
