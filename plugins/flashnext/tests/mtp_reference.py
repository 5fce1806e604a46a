"""Flash-Next's MTP head: its reference forward, from the published design on transformers' own modules.

transformers drops ``mtp.*`` (``_keys_to_ignore_on_load_unexpected``), so there is no reference to load. The
published design is vLLM's qwen4_exp MTP (``Qwen4ExpMultiTokenPredictor``; the Qwen3-Next / Qwen3.5 MTP
recipe adapted to hyper-connections): the next token's embedding, RMS-normed and projected by
``fc_embedding``; the target's streams before its final mixer, RMS-normed over all ``n*H`` features and
projected stream by stream by the shared ``fc_hidden``; their sum on every stream; one qwen4_exp decoder
layer of the attention kind (hyper-connections, QSA indexed attention, the sparse MoE, no PLE); the final
hyper-connection mixer; the target's ``lm_head``. Here every part is transformers' own:
``Qwen4ExpTextDecoderLayer`` (built on a config with one more, indexed, layer), ``Qwen4ExpTextGatedResidual``,
``Qwen4ExpTextRMSNorm``, the rotary embedding; run as one causal sequence under SDPA as the target runs.
Nothing of the plugin's arithmetic is used.

``RefMTP.checkpoint_tensors()`` is the head in the checkpoint's ``mtp.*`` layout (experts one module each, as
``save_pretrained`` writes the target's); ``add_head(path, tensors)`` writes it into a checkpoint, and
``target_streams(model, ids)`` are the target's streams before its final mixer (transformers does not return
them: a hook on the last decoder layer reads them).
"""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest_qwen38 import rerandomise


class RefMTP(nn.Module):
    """``forward(next_tokens [T], streams [T, n*H])`` over positions ``0 .. T-1`` -> (hidden, streams,
    logits)."""

    def __init__(self, target, layers: int = 1) -> None:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer,
                                                                       Qwen4ExpTextGatedResidual,
                                                                       Qwen4ExpTextRMSNorm,
                                                                       Qwen4ExpTextRotaryEmbedding)

        super().__init__()
        config = copy.deepcopy(target.config)
        config._attn_implementation = "sdpa"
        L = config.num_hidden_layers
        config.layer_types = list(config.layer_types) + ["indexed_attention"] * layers
        config.num_hidden_layers = L + layers                  # the head's layers follow the target's, no PLE
        H, eps, self.n = config.hidden_size, config.rms_norm_eps, config.hc_count
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(self.n * H, eps=eps)     # one RMS over the streams
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = nn.ModuleList(Qwen4ExpTextDecoderLayer(config, L + j) for j in range(layers))
        self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(config, use_combine=False)
        self.rotary = Qwen4ExpTextRotaryEmbedding(config)
        self._shared = (target.model.embed_tokens, target.lm_head)   # a tuple: not this module's parameters

    @torch.no_grad()
    def forward(self, next_tokens: torch.Tensor, streams: torch.Tensor, layer: int = 0):
        embed, head = self._shared
        T = next_tokens.numel()
        e = self.fc_embedding(self.pre_fc_norm_embedding(embed(next_tokens.reshape(1, T))))     # [1, T, H]
        h = self.pre_fc_norm_hidden(streams.reshape(1, T, -1)).unflatten(-1, (self.n, -1))     # [1, T, n, H]
        x = (self.fc_hidden(h) + e.unsqueeze(-2)).flatten(-2)                                 # [1, T, n*H]
        positions = torch.arange(T).view(1, 1, T).expand(3, 1, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
        x = self.layers[layer](x, self.rotary(x, positions), attention_mask=mask)
        out = self.hyper_connection_mixer(x)
        return out[0], x[0], head(out)[0]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            # one module an expert, as save_pretrained writes
            if ".mlp.experts." in name:
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


def target_streams(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's streams after its last decoder layer (before the final mixer): ``[T, n*H]``."""
    got = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: got.append(out))
    try:
        with torch.no_grad():
            model.model(ids[None])
    finally:
        hook.remove()
    return got[0][0]


def add_head(path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the head's ``mtp.*`` tensors into the checkpoint at ``path`` (one ``model.safetensors``)."""
    file = path / "model.safetensors"
    data = load_file(str(file))
    data.update(tensors)
    save_file(data, str(file), metadata={"format": "pt"})
