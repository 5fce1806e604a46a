"""The MTP head's reference forward, written from the published design, on transformers' own modules.

transformers drops ``mtp.*`` (``_keys_to_ignore_on_load_unexpected``), so there is no reference to load.
vLLM's Qwen3-Next / Qwen3.5 MTP modules are the published design: the next token's embedding and the last
hidden state, each RMS-normed (zero-centred), concatenated ``[embedding; hidden]``, projected by ``fc``
([H, 2H]), one pre-norm decoder layer (``input_layernorm``, attention, residual, ``post_attention_layernorm``,
MLP, residual), the final ``norm``, and the target's ``lm_head``. The layer here is assembled from
transformers' own qwen4_exp modules (``Qwen4ExpTextAttention`` with its QSA indexer,
``Qwen4ExpTextSparseMoeBlock``, ``Qwen4ExpTextRMSNorm``, the rotary embedding), run as one causal
sequence with SDPA: nothing of the plugin's arithmetic is used.

``RefMTP.state_dict_for_checkpoint()`` is the head in the checkpoint's ``mtp.*`` layout (experts one module
each, as ``save_pretrained`` writes the target's); ``add_head(path, head)`` writes it into a checkpoint.
"""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest_qwen38 import rerandomise


class RefLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextAttention, Qwen4ExpTextRMSNorm,
                                                                       Qwen4ExpTextSparseMoeBlock)

        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.self_attn = Qwen4ExpTextAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.mlp = Qwen4ExpTextSparseMoeBlock(config)

    def forward(self, x, position_embeddings, mask):
        a, _ = self.self_attn(self.input_layernorm(x), position_embeddings, attention_mask=mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class RefMTP(nn.Module):
    """The head; ``forward(next_tokens [T], hidden [T, H])`` over positions ``0 .. T-1`` -> (hidden, logits)."""

    def __init__(self, target, layers: int = 1) -> None:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextRMSNorm,
                                                                       Qwen4ExpTextRotaryEmbedding)

        super().__init__()
        config = copy.deepcopy(target.config)
        config._attn_implementation = "sdpa"                  # the indexer's boolean mask, as in the target
        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(RefLayer(config, config.num_hidden_layers + j) for j in range(layers))
        self.norm = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.rotary = Qwen4ExpTextRotaryEmbedding(config)
        self._shared = (target.model.embed_tokens, target.lm_head)   # a tuple: not this module's parameters

    @torch.no_grad()
    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, layer: int = 0):
        T = next_tokens.numel()
        embed, head = self._shared
        e = self.pre_fc_norm_embedding(embed(next_tokens.reshape(1, T)))
        h = self.pre_fc_norm_hidden(hidden.reshape(1, T, -1))
        x = self.fc(torch.cat([e, h], dim=-1))
        positions = torch.arange(T).view(1, 1, T).expand(3, 1, T)
        cos_sin = self.rotary(x, positions)
        mask = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
        out = self.norm(self.layers[layer](x, cos_sin, mask))
        return out[0], head(out)[0]

    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            if ".mlp.experts." in name:                         # one module an expert, as save_pretrained writes
                base, kind = name.rsplit(".", 1)
                for e in range(t.shape[0]):
                    if kind == "gate_up_proj":
                        gate, up = t[e].chunk(2, dim=0)
                        out[f"mtp.{base}.{e}.gate_proj.weight"] = gate.contiguous()
                        out[f"mtp.{base}.{e}.up_proj.weight"] = up.contiguous()
                    else:
                        out[f"mtp.{base}.{e}.down_proj.weight"] = t[e].contiguous()
                continue
            out["mtp." + name] = t.contiguous()
        return out


def reference_head(target, seed: int, layers: int = 1) -> RefMTP:
    torch.manual_seed(seed)
    head = RefMTP(target, layers).float().eval()
    rerandomise(head, seed)
    return head


def add_head(path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the head's ``mtp.*`` tensors into the checkpoint at ``path`` (one ``model.safetensors``)."""
    file = path / "model.safetensors"
    data = load_file(str(file))
    data.update(tensors)
    save_file(data, str(file), metadata={"format": "pt"})
