"""Flash-Next's MTP head: vLLM's published qwen4_exp multi-token predictor, in plain torch.

For a position ``i`` whose streams ``s_i`` (the target's ``[n*H]`` before its final mixer) and
next token ``x_{i+1}`` are known, the head predicts ``x_{i+2}``:

    e   = fc_embedding(pre_fc_norm_embedding(embed(x_{i+1})))                     [H]
    u   = fc_hidden(pre_fc_norm_hidden(s_i) per stream) + e   (each stream)      [n, H]
    u   = a qwen4_exp decoder layer on the streams u: the attention hyper-connection around
          QSA indexed attention over the head's own rows 0..i, the MLP hyper-connection
          around the sparse MoE (no PLE)                                          [n*H]
    o   = hyper_connection_mixer(u);  logits = lm_head(o)     (embedding and head: the target's)

(vLLM ``vllm/models/qwen4_exp/*/mtp.py``; transformers drops ``mtp.*``, so the reference is
written from that design on transformers' own qwen4_exp modules, ``tests/mtp_reference.py``.)
A deeper draft step reads the head's own streams ``u`` of the step before at position ``i + k``.
The tensors and what is refused are in ``tandem_flashnext.layout``.

The head keeps its own K, V and indexer keys for ``max_context`` positions (views ``mtp.K``,
``mtp.V``, ``mtp.IK``, like the target's) and the target's streams at the sequence's last position
(section ``mtp.hidden``): the engine's state holds them, so every cache tier saves and restores them.
``append`` / ``launch`` are the ``DraftHead`` verbs the engine and the drafter drive. ``forward`` appends rows at ``start ..`` in the prefill form (several rows, batched)
or the decode form (one row, ``linear_rows``); ``draft`` chains ``depth`` decode steps and
returns the top two tokens and probabilities of each depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, NamedTuple

import torch

from tandem_core import ops
from tandem_core.engine import HeadRows, MemoryPart, Step, head_append, tensor_bytes
from tandem_core.ops import rope as _rope

from tandem_flashnext.blocks import decoder_block, hyper_mix
from tandem_flashnext.config import INDEXED, FlashNextConfig
from tandem_flashnext.layout import expected_mtp_tensors
from tandem_flashnext.qsa import indexed_attention
from tandem_flashnext.steps import batched, rowwise
from tandem_flashnext.weights import (AttentionWeights, Builder, Checkpoint, FlashNextWeights, HyperWeights,
                                      LayerWeights, normalise_dtype)

__all__ = ["MTPWeights", "load_mtp", "build_mtp", "MTPHead", "MTPRows", "Draft", "MTP_OPS"]

MTP_OPS = ("rms_norm_1p", "rope", "attention", "sigmoid", "silu", "softmax", "linear_rows")


@dataclass(frozen=True)
class MTPWeights:
    """The head's own weights; the embedding and the head it reads are the target's."""

    norm_embed: torch.Tensor          # [H] fp32 (zero-centred)
    norm_hidden: torch.Tensor         # [n*H] fp32 (zero-centred, one RMS over every stream)
    fc_embed: Any                     # Linear [H, H]
    fc_hidden: Any                    # Linear [H, H], shared by the streams
    layers: tuple[LayerWeights, ...]  # qwen4_exp decoder layers: QSA attention, MoE, no PLE
    final_hc: HyperWeights            # the final mixer of the streams

    def linears(self) -> Iterable[Any]:
        yield from (self.fc_embed, self.fc_hidden, self.final_hc.down, self.final_hc.up)
        for layer in self.layers:
            a, m = layer.mixer, layer.moe
            assert isinstance(a, AttentionWeights)
            for hc in (layer.attn_hc, layer.mlp_hc):
                yield from (hc.down, hc.up)
                if hc.inject is not None:
                    yield hc.inject
            yield from (a.q, a.k, a.v, a.o, a.index_qk, m.router, m.shared_gate, m.shared.gate, m.shared.up,
                        m.shared.down)
            for ex in m.experts:
                yield from (ex.gate, ex.up, ex.down)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield from (self.norm_embed, self.norm_hidden, self.final_hc.norm)
        for layer in self.layers:
            a = layer.mixer
            assert isinstance(a, AttentionWeights)
            yield from (layer.attn_hc.norm, layer.mlp_hc.norm, a.q_norm, a.k_norm, a.index_q_norm,
                        a.index_k_norm)

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in self.tensors())
        return held + sum(x.nbytes for x in self.linears())


def build_mtp(get: Callable[[str], torch.Tensor], cfg: FlashNextConfig, layers: int, dtype: str = "fp32",
              device: str | torch.device = "cpu") -> MTPWeights:
    """The head from its tensors by key (``mtp.fc_embedding.weight``,
    ``mtp.layers.0.self_attn.q_proj.weight``, ...)."""
    b = Builder(get, cfg, normalise_dtype(dtype), device, len(expected_mtp_tensors(cfg, layers)))
    out = []
    for j in range(layers):
        p = f"mtp.layers.{j}."
        out.append(LayerWeights(INDEXED, b.hyper(p + "attn_hyper_connection.", True),
                                b.attention(p + "self_attn."), b.hyper(p + "mlp_hyper_connection.", True),
                                b.moe(p + "mlp."), None))
    return MTPWeights(b.vec("mtp.pre_fc_norm_embedding.weight"), b.vec("mtp.pre_fc_norm_hidden.weight"),
                      b.linear("mtp.fc_embedding.weight"), b.linear("mtp.fc_hidden.weight"), tuple(out),
                      b.hyper("mtp.hyper_connection_mixer.", False))


def load_mtp(ckpt: Checkpoint, cfg: FlashNextConfig, dtype: str = "fp32",
             device: str | torch.device = "cpu") -> MTPWeights | None:
    """The audited checkpoint's MTP head (``open_checkpoint`` checked every ``mtp.*`` tensor), or None."""
    if not ckpt.mtp_layers:
        return None
    return build_mtp(ckpt.reader.get, cfg, ckpt.mtp_layers, dtype, device)


class MTPRows(NamedTuple):
    hidden: torch.Tensor              # [T, H] after the head's final mixer (the logits' input)
    streams: torch.Tensor             # [T, n*H] before it (what a deeper step reads)
    logits: torch.Tensor              # fp32 [T, V]


class Draft(NamedTuple):
    # [depth, 2] the top two tokens of each depth (the chain follows column 0)
    tokens: torch.Tensor
    probs: torch.Tensor               # [depth, 2] fp32 their probabilities


class MTPHead:
    """The MTP head over the target's ``FlashNextWeights`` (embedding and head) and its own ``MTPWeights``,
    with its own K/V/IK rows for ``max_context`` positions. One sequence. A ``DraftHead``
    (``tandem_core.engine.base``): ``run`` reads the last layer's tapped streams (``reads``), ``[n*H]``
    a row."""

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
        self._IK = torch.zeros(L, self.max_context, cfg.indexer_head_dim, dtype=self.act_dtype,
                               device=self.device)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, self.device)
        self.layers = L
        self.reads: int | None = cfg.num_hidden_layers - 1      # the streams after the last decoder layer
        self.width = cfg.hc_dim
        self._hidden = torch.zeros(1, cfg.hc_dim, dtype=self.act_dtype, device=self.device)

    graphed = False

    def sections(self) -> dict[str, torch.Tensor]:
        """``mtp.hidden [1, n*H]``: the target's streams at the sequence's last position."""
        return {"mtp.hidden": self._hidden}

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, rows: torch.Tensor, start: int, *, decode_form: bool = False) -> None:
        """``DraftHead.append``: the head's rows ``start - 1 ..`` of appended tokens, in the prefill form."""
        head_append(self, tokens.reshape(-1).to(self.device), rows, int(start), decode_form=decode_form)

    def launch(self, token: int, position: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``DraftHead.launch``: ``draft`` from ``mtp.hidden``."""
        d = self.draft(token, self._hidden, position, depth)
        return d.tokens, d.probs

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, *, layer: int = 0,
            logits: bool = True) -> HeadRows:
        """``forward`` as a ``DraftHead``: the carry is the streams before the head's final mixer; ``logits``
        False skips the final mixer and the output head."""
        rows = self.forward(tokens, hidden, start, layer=layer, logits=logits)
        return HeadRows(rows.streams, rows.logits if logits else None)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        return [MemoryPart("mtp.weights", self.w.nbytes, dev),
                MemoryPart("mtp.kv", tensor_bytes(self._K, self._V, self._IK, self._hidden), dev)]

    def views(self) -> dict[str, tuple[torch.Tensor, int]]:
        """The head's own rows (tensor, token axis): ``mtp.K``, ``mtp.V`` (axis 2), ``mtp.IK`` (axis 1)."""
        return {"mtp.K": (self._K, 2), "mtp.V": (self._V, 2), "mtp.IK": (self._IK, 1)}

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, streams: torch.Tensor, start: int, *, layer: int = 0,
                logits: bool = True) -> MTPRows:
        """Rows at positions ``start .. start + T - 1``: ``tokens [T]`` the next tokens, ``streams [T, n*H]``
        the streams at those positions. Writes the head's rows there; one row is the decode form."""
        cfg, op, w = self.cfg, self._op, self.w
        T, n, eps = int(tokens.numel()), cfg.hc_count, cfg.rms_norm_eps
        if start + T > self.max_context:
            raise ValueError(f"MTP head: positions up to {start + T - 1} exceed max_context "
                             f"{self.max_context}")
        step = Step(int(start), T)
        mm = op["linear_rows"] if rowwise(step) else batched
        # [T, H]
        e = mm(w.fc_embed, op["rms_norm_1p"](self.target.embed[tokens.reshape(-1)], w.norm_embed, eps))
        # [T, n*H]
        h = op["rms_norm_1p"](streams.to(self.act_dtype), w.norm_hidden, eps)
        # one row a stream, shared
        h = mm(w.fc_hidden, h.reshape(T * n, -1)).view(T, n, -1)
        x = (h + e[:, None, :]).reshape(T, -1)                                       # x: [T, n*H]
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)
        lw = w.layers[layer]
        mix = partial(self._attend, lw.mixer, layer, step, mm, cos, sin)
        x = decoder_block(op, mm, x, lw, cfg, mix)
        if not logits:                          # the head's rows only (its KV rows are written)
            return MTPRows(x, x, torch.empty(0))
        out, _ = hyper_mix(op, mm, x, w.final_hc, cfg)
        return MTPRows(out, x, mm(self.target.head, out).float())

    def _attend(self, attn: AttentionWeights, layer: int, step: Step, mm: Any, cos: torch.Tensor,
                sin: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out, _ = indexed_attention(self._op, mm, h, attn, self.cfg, step, self._K[layer], self._V[layer],
                                   self._IK[layer], cos, sin, self._inv_freq)
        return out

    @torch.no_grad()
    def draft(self, token: int, streams: torch.Tensor, position: int, depth: int) -> Draft:
        """``depth`` chained decode steps from ``position`` (its streams ``[n*H]``, ``token`` the next one):
        depth ``k`` reads the previous depth's top token and streams at ``position + k``. Writes the head's
        rows at ``position .. position + depth - 1`` (speculative: a later ``forward`` rewrites them)."""
        tokens, probs = [], []
        tok, s = torch.tensor([int(token)], device=self.device), streams.reshape(1, -1)
        for k in range(depth):
            rows = self.forward(tok, s, position + k, layer=k % len(self.w.layers))
            top = self._op["softmax"](rows.logits)[0].topk(2)
            tokens.append(top.indices)
            probs.append(top.values)
            tok, s = top.indices[:1], rows.streams
        return Draft(torch.stack(tokens), torch.stack(probs))
