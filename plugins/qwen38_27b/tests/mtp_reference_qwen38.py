"""Qwen3.8's MTP head: its reference forward, from the published design on transformers' own modules.

transformers drops ``mtp.*``, so there is no reference to load. The published design is vLLM's Qwen3.5 MTP
(``Qwen3_5MultiTokenPredictor``, the Qwen3-Next recipe): the next token's embedding and the target's hidden
state (after its final norm: what the target model returns), each RMS-normed (``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``), concatenated in that order and projected by ``fc`` [H, 2H]; one decoder layer of the
full-attention kind; ``norm``; the target's ``lm_head``. Every part here is transformers' own:
``Qwen3_5DecoderLayer`` (built on a config with one more, full-attention, layer), ``Qwen3_5RMSNorm``, the
rotary embedding; run as one causal sequence under SDPA. Nothing of the plugin's arithmetic is used.

``RefMTP.checkpoint_tensors()`` is the head in the checkpoint's ``mtp.*`` layout; ``add_mtp_shard(path,
tensors)`` writes it beside ``save_pretrained``'s output as a shard of its own with an index naming both
files (as a published checkpoint ships it), and ``target_hidden(model, ids)`` are the target's rows.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from conftest_qwen38 import rerandomise


class RefMTP(nn.Module):
    """``forward(next_tokens [T], hidden [T, H])`` over positions ``0 .. T-1`` -> (carry, logits)."""

    def __init__(self, target, layers: int = 1) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                                  Qwen3_5TextRotaryEmbedding)

        super().__init__()
        config = copy.deepcopy(target.config)
        config._attn_implementation = "sdpa"
        L = config.num_hidden_layers
        config.layer_types = list(config.layer_types) + ["full_attention"] * layers
        config.num_hidden_layers = L + layers
        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, L + j) for j in range(layers))
        self.norm = Qwen3_5RMSNorm(H, eps=eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)
        self._shared = (target.model.embed_tokens, target.lm_head)   # a tuple: not this module's parameters

    @torch.no_grad()
    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, layer: int = 0):
        embed, head = self._shared
        T = next_tokens.numel()
        e = self.pre_fc_norm_embedding(embed(next_tokens.reshape(1, T)))                   # [1, T, H]
        h = self.pre_fc_norm_hidden(hidden.reshape(1, T, -1))                              # [1, T, H]
        x = self.fc(torch.cat([e, h], dim=-1))                                             # [1, T, H]
        positions = torch.arange(T).view(1, 1, T).expand(3, 1, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
        x = self.layers[layer](x, self.rotary(x, positions), attention_mask=mask)
        out = self.norm(x)
        return out[0], head(out)[0]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"mtp." + name: t.contiguous() for name, t in self.state_dict().items()}


def reference_head(target, seed: int, layers: int = 1) -> RefMTP:
    torch.manual_seed(seed)
    head = RefMTP(target, layers).float().eval()
    rerandomise(head, seed)
    return head


def target_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's hidden states after its final norm (what the head reads): ``[T, H]``."""
    with torch.no_grad():
        return model.model(ids[None]).last_hidden_state[0]


def add_mtp_shard(path: Path, tensors: dict[str, torch.Tensor], shard: str = "model-mtp.safetensors") -> None:
    """Write ``tensors`` as a shard of their own beside the checkpoint's and an index naming every tensor's
    file
    (the one ``save_pretrained`` wrote, or the index it wrote, extended)."""
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index["weight_map"].update({k: shard for k in tensors})
    index_file.write_text(json.dumps(index, indent=2))
