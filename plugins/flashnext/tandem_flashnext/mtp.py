"""Flash-Next's MTP head: the published multi-token-prediction design on the family's attention layer.

For a position ``i`` whose hidden state ``h_i`` (the target's, after its final mixer) and next
token ``x_{i+1}`` are known, the head predicts ``x_{i+2}``:

    u  = fc([pre_fc_norm_embedding(embed(x_{i+1})) ; pre_fc_norm_hidden(h_i)])          [H]   (fc: [H, 2H])
    u  = u + attention(input_layernorm(u))          QSA indexed attention over the head's own rows 0..i
    u  = u + moe(post_attention_layernorm(u))       the family's sparse MoE and shared expert
    o  = norm(u);   logits = lm_head(o)             the target's embedding and head, shared

(vLLM's Qwen3-Next / Qwen3.5 MTP modules; transformers drops ``mtp.*``, so the reference is
written from that design, ``tests/mtp_reference.py``). Drafting deeper feeds the head its own
output: depth ``k`` reads ``(d_k, o_k)`` at position ``i + k``. The layout and its assumptions
are in ``tandem_flashnext.layout``.

The head keeps its own K, V and indexer keys for ``max_context`` positions (views, like the
target's). ``forward`` appends rows at ``start ..`` in the prefill form (several rows, batched)
or the decode form (one row, ``linear_rows``); ``draft`` chains ``depth`` decode steps and
returns the top two tokens and probabilities of each depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import torch

from tandem_core import ops
from tandem_core.ops import rope as _rope

from tandem_flashnext.blocks import moe
from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.layout import expected_mtp_tensors
from tandem_flashnext.qsa import indexed_attention
from tandem_flashnext.steps import Step, batched
from tandem_flashnext.weights import (AttentionWeights, Builder, Checkpoint, FlashNextWeights, MoEWeights,
                                      normalise_dtype)

__all__ = ["MTPLayerWeights", "MTPWeights", "load_mtp", "build_mtp", "MTPHead", "MTPRows", "Draft", "MTP_OPS"]

MTP_OPS = ("rms_norm_1p", "rope", "attention", "sigmoid", "silu", "softmax", "linear_rows")


@dataclass(frozen=True)
class MTPLayerWeights:
    input_norm: torch.Tensor          # [H] fp32 (zero-centred)
    attn: AttentionWeights
    post_norm: torch.Tensor           # [H] fp32 (zero-centred)
    moe: MoEWeights


@dataclass(frozen=True)
class MTPWeights:
    """The head's own weights; the embedding and the head it reads are the target's."""

    fc: Any                           # Linear [H, 2H]
    norm_embed: torch.Tensor          # [H] fp32 (zero-centred)
    norm_hidden: torch.Tensor         # [H] fp32 (zero-centred)
    layers: tuple[MTPLayerWeights, ...]
    norm: torch.Tensor                # [H] fp32 (zero-centred)

    def linears(self) -> Iterable[Any]:
        yield self.fc
        for layer in self.layers:
            a, m = layer.attn, layer.moe
            yield from (a.q, a.k, a.v, a.o, a.index_qk, m.router, m.shared_gate, m.shared.gate, m.shared.up,
                        m.shared.down)
            for ex in m.experts:
                yield from (ex.gate, ex.up, ex.down)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield from (self.norm_embed, self.norm_hidden, self.norm)
        for layer in self.layers:
            a = layer.attn
            yield from (layer.input_norm, layer.post_norm, a.q_norm, a.k_norm, a.index_q_norm, a.index_k_norm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors()) + sum(x.nbytes for x in self.linears())


def build_mtp(get: Callable[[str], torch.Tensor], cfg: FlashNextConfig, layers: int, dtype: str = "fp32",
              device: str | torch.device = "cpu") -> MTPWeights:
    """The head from its tensors by key (``mtp.fc.weight``, ``mtp.layers.0.self_attn.q_proj.weight``, ...)."""
    b = Builder(get, cfg, normalise_dtype(dtype), device, len(expected_mtp_tensors(cfg, layers)))
    out = []
    for j in range(layers):
        p = f"mtp.layers.{j}."
        out.append(MTPLayerWeights(b.vec(p + "input_layernorm.weight"), b.attention(p + "self_attn."),
                                   b.vec(p + "post_attention_layernorm.weight"), b.moe(p + "mlp.")))
    return MTPWeights(b.linear("mtp.fc.weight"), b.vec("mtp.pre_fc_norm_embedding.weight"),
                      b.vec("mtp.pre_fc_norm_hidden.weight"), tuple(out), b.vec("mtp.norm.weight"))


def load_mtp(ckpt: Checkpoint, cfg: FlashNextConfig, dtype: str = "fp32",
             device: str | torch.device = "cpu") -> MTPWeights | None:
    """The audited checkpoint's MTP head (``open_checkpoint`` checked every ``mtp.*`` tensor), or None."""
    if not ckpt.mtp_layers:
        return None
    return build_mtp(ckpt.reader.get, cfg, ckpt.mtp_layers, dtype, device)


class MTPRows(NamedTuple):
    hidden: torch.Tensor              # [T, H] after the head's norm (what a deeper step reads)
    logits: torch.Tensor              # fp32 [T, V]


class Draft(NamedTuple):
    tokens: torch.Tensor              # [depth, 2] the top two tokens of each depth (the chain follows column 0)
    probs: torch.Tensor               # [depth, 2] fp32 their probabilities


class MTPHead:
    """The MTP head over the target's ``FlashNextWeights`` (embedding and head) and its own ``MTPWeights``,
    with its own K/V/IK rows for ``max_context`` positions. One sequence."""

    def __init__(self, cfg: FlashNextConfig, target: FlashNextWeights, weights: MTPWeights, *,
                 max_context: int) -> None:
        self.cfg, self.target, self.w = cfg, target, weights
        self.device, self.act_dtype = target.device, target.act_dtype
        self.max_context = int(max_context)
        self._op: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in MTP_OPS}
        L = len(weights.layers)
        shape = (L, cfg.num_key_value_heads, self.max_context, cfg.head_dim)
        self._K = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self._V = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self._IK = torch.zeros(L, self.max_context, cfg.indexer_head_dim, dtype=self.act_dtype, device=self.device)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, self.device)

    @property
    def depth_layers(self) -> int:
        return len(self.w.layers)

    def views(self) -> dict[str, tuple[torch.Tensor, int]]:
        """The head's own rows (tensor, token axis): ``mtp.K``, ``mtp.V`` (axis 2), ``mtp.IK`` (axis 1)."""
        return {"mtp.K": (self._K, 2), "mtp.V": (self._V, 2), "mtp.IK": (self._IK, 1)}

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, *, layer: int = 0) -> MTPRows:
        """Rows at positions ``start .. start + T - 1``: ``tokens [T]`` the next tokens, ``hidden [T, H]`` the
        hidden states at those positions. Writes the head's rows there; one row is the decode form."""
        cfg, op, w = self.cfg, self._op, self.w
        T = int(tokens.numel())
        if start + T > self.max_context:
            raise ValueError(f"MTP head: positions up to {start + T - 1} exceed max_context {self.max_context}")
        step = Step(int(start), T)
        mm = op["linear_rows"] if step.rowwise else batched
        eps = cfg.rms_norm_eps
        e = op["rms_norm_1p"](self.target.embed[tokens.reshape(-1)], w.norm_embed, eps)          # e: [T, H]
        h = op["rms_norm_1p"](hidden.to(self.act_dtype), w.norm_hidden, eps)                   # h: [T, H]
        x = mm(w.fc, torch.cat([e, h], dim=-1))                                               # x: [T, H]
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)
        lw = w.layers[layer]
        a, _ = indexed_attention(op, mm, op["rms_norm_1p"](x, lw.input_norm, eps), lw.attn, cfg, step,
                                 self._K[layer], self._V[layer], self._IK[layer], cos, sin, self._inv_freq)
        x = x + a
        x = x + moe(op, mm, op["rms_norm_1p"](x, lw.post_norm, eps), lw.moe, cfg.num_experts_per_tok)
        out = op["rms_norm_1p"](x, w.norm, eps)
        return MTPRows(out, mm(self.target.head, out).float())

    @torch.no_grad()
    def draft(self, token: int, hidden: torch.Tensor, position: int, depth: int) -> Draft:
        """``depth`` chained decode steps from position ``position`` (hidden ``[H]`` there, ``token`` the next
        one): depth ``k`` reads the previous depth's top token and output. Writes the head's rows at
        ``position .. position + depth - 1`` (speculative: a later ``forward`` over those positions
        rewrites them)."""
        tokens, probs = [], []
        tok, h = torch.tensor([int(token)], device=self.device), hidden.reshape(1, -1)
        for k in range(depth):
            rows = self.forward(tok, h, position + k, layer=k % self.depth_layers)
            p = self._op["softmax"](rows.logits)[0]
            top = p.topk(2)
            tokens.append(top.indices)
            probs.append(top.values)
            tok, h = top.indices[:1], rows.hidden
        return Draft(torch.stack(tokens), torch.stack(probs))
