"""Lfm2Runner: the LFM2 family's arithmetic in plain torch, one sequence (batch 1).

A layer is ``x + mixer(operator_norm(x))`` then ``x + ffn(ffn_norm(x))``. The mixer
is the gated short convolution (``conv``) or grouped-query attention
(``full_attention``) as the config's ``layer_types`` say; the feed-forward is the
dense MLP for the first ``num_dense_layers`` layers and, in ``lfm2_moe``, the
mixture of experts after them (``tandem_lfm25.moe``). After the last layer comes
``embedding_norm``, then the head (the embedding when tied).

The gated short conv (transformers' ``Lfm2ShortConv``)::

    B, C, x = split(in_proj(h), 3)      # [T, H] each
    y = out_proj(C * conv(B * x))       # conv: depthwise causal over time, conv_L_cache taps, no bias,
                                        # no activation; its state is the last K-1 inputs B * x

Attention: q, k, v projections, RMSNorm on each head of q and k (``q_layernorm``,
``k_layernorm``), rotary on the whole head, softmax attention over the cache,
``out_proj``.

The core's ``SequenceEngine`` runs the sequence over this runner (``serving.build_engine``): it
owns the length, the pending tokens and the verified tree; the runner only computes, over the
buffers it allocates once for ``max_context`` tokens (``buffers()``):

    conv   [L_conv, H, K-1]             act   section: the last K-1 conv inputs B*x of each conv layer
    K, V   [L_attn, Hkv, max_ctx, D]    act   views, token axis 2 (K after k_layernorm and rope)

``L_conv``/``L_attn`` index the layers of each kind in order (``cfg.slot(layer)``).

Three forms of one layer code, by what a call does:

- ``prefill`` (a ``Step`` of several rows): rows batched through every op; not row
  invariant, and need not be: plain and speculative decoding start from the same
  prefill.
- ``decode`` (a ``Step`` of one row): every matmul through the row-invariant ``linear_rows``
  op, the conv and attention through their one-row calls.
- ``verify`` (a ``TreeStep`` on ``start`` committed tokens, nothing committed): every
  matmul through ``linear_rows``, the conv and attention through their tree ops
  (each node's conv window from its parent's path, attention over its
  ancestors), the experts grouped over the union of the nodes' selections, each
  expert once; norms and element-wise ops batched (row invariant, see
  ``tandem_core.ops.rows``). Row ``i`` equals, bit for bit, the decode row after
  committing the path root..i. The runner keeps what ``commit`` needs: every
  node's conv inputs and its K/V rows.

``commit`` appends a path: its K/V rows from the verify and each conv tail as the
path's decode steps would leave it (the path's last K-1 conv inputs after the
tail, ``conv_tail``, bit for bit the decode step's). It returns those conv inputs
(``Kept``, a few KiB a token) so ``replay`` can advance the tails again from the
settle point when pending tokens are taken back.

Every op comes from ``tandem_core.ops`` for the runner's device (a kernel where
one is registered, else the plain-torch reference).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core import ops
from tandem_core.engine import (
    Capture, LogitRows, Manifest, MemoryPart, Rows, RunnerSpec, Step, TreeStep, op_paths, source_files, tensor_bytes,
)
from tandem_core.ops import attention as _attention_mod
from tandem_core.ops import rope as _rope
from tandem_core.ops.conv import conv_tail
from tandem_core.state import View

from tandem_lfm25 import moe as _moe
from tandem_lfm25.config import Lfm2Config
from tandem_lfm25.weights import AttentionWeights, ConvWeights, Lfm2Weights, MLPWeights, MoEWeights

__all__ = ["Lfm2Runner", "Kept", "RUNNER_OPS"]

# the ops this runner calls, resolved once per runner for its device
RUNNER_OPS = ("rms_norm", "causal_conv", "causal_conv_tree", "rope", "attention", "attention_tree", "sigmoid",
              "silu", "linear_rows")


class Kept(NamedTuple):
    """What re-advancing the sections over committed tokens needs: per conv slot, their conv inputs."""

    conv_in: tuple[torch.Tensor, ...]    # conv_in[slot]: [P, H] act, one row a token, in order

    @property
    def count(self) -> int:
        return int(self.conv_in[0].shape[0]) if self.conv_in else 0

    def head(self, n: int) -> "Kept":
        return Kept(tuple(t[:n] for t in self.conv_in))

    @staticmethod
    def cat(parts: Sequence["Kept"]) -> "Kept":
        return Kept(tuple(torch.cat(ts) for ts in zip(*(p.conv_in for p in parts))))


@dataclass
class _Verified:
    """The last verify's rows that a commit of one of its paths needs."""

    tree: TreeStep
    conv_in: dict[int, torch.Tensor]                            # by conv slot: [N, H]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]            # by attention slot: k, v [N, Hkv, D]


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class Lfm2Runner:
    """The reference runner: one sequence of an LFM2-family model over shared ``Lfm2Weights``.

    ``max_context``: tokens the buffers hold. ``max_tree``: the most nodes one ``verify`` takes.
    ``prefill_chunk``: rows a ``prefill`` call takes at most (the engine chunks long prompts by it).
    """

    def __init__(self, cfg: Lfm2Config, weights: Lfm2Weights, *, max_context: int, max_tree: int = 64,
                 prefill_chunk: int = 512) -> None:
        if max_context <= 0 or prefill_chunk <= 0 or max_tree <= 0:
            raise ValueError(f"max_context ({max_context}), prefill_chunk ({prefill_chunk}) and max_tree "
                             f"({max_tree}) must be positive")
        self.cfg = cfg
        self.w = weights
        self.device = weights.device
        self.act_dtype = weights.act_dtype
        self.spec = RunnerSpec(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, max_context=int(max_context),
            max_tree=int(max_tree), prefill_chunk=int(prefill_chunk), device=str(self.device),
            dtype=weights.dtype, trace=True, hidden_layers=tuple(range(cfg.num_hidden_layers)))
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in RUNNER_OPS}

        dev, act = self.device, self.act_dtype
        n_conv, n_attn = len(cfg.conv_layers), len(cfg.attention_layers)
        self._conv = torch.zeros(n_conv, cfg.hidden_size, cfg.conv_state_width, dtype=act, device=dev)
        kv_shape = (n_attn, cfg.num_key_value_heads, self.spec.max_context, cfg.head_dim)
        self._K = torch.zeros(kv_shape, dtype=act, device=dev)
        self._V = torch.zeros(kv_shape, dtype=act, device=dev)
        self._sections = {"conv": self._conv} if n_conv else {}
        self._views = {"K": View(self._K, 2), "V": View(self._V, 2)}
        self._inv_freq = _rope.inv_freq(cfg.head_dim, cfg.rope_theta, dev)
        self._verified: _Verified | None = None
        self._taps: tuple[int, ...] = ()

    # -- the runner verbs ---------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """Section ``conv`` (the conv tails, copied whole; none without conv layers); views ``K``, ``V``."""
        return self._sections, self._views

    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        """Append ``ids`` at ``step.start``: K/V rows written, conv tails advanced. Batched arithmetic;
        ``logits="last"``: the last row's, through ``linear_rows`` as decode computes a row's."""
        self._verified = None
        h, taps = self._layers(ids.to(self.device), step, None, capture)          # h: [T, H]
        out = None
        if logits == "all":
            out = self.w.head.matmul(h).float()
        elif logits == "last":
            out = self._ops["linear_rows"](self.w.head, h[-1:]).float()
        return Rows(h, out, taps)

    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        """Append one token at ``step.start``: the row-invariant decode step. Logits ``[1, V]`` fp32."""
        self._verified = None
        h, taps = self._layers(ids.to(self.device), step, None, capture)          # h: [1, H]
        return Rows(h, self._ops["linear_rows"](self.w.head, h).float(), taps)

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        """Verify ``ids`` as ``tree`` on top of ``tree.start`` committed tokens; nothing is committed (K/V
        positions past ``tree.start`` are scratch). Keeps the nodes' conv inputs and K/V rows for ``commit``."""
        self._verified = None
        verified = _Verified(tree, {}, {})
        h, taps = self._layers(ids.to(self.device), tree, verified, capture)      # h: [N, H]
        self._verified = verified
        return Rows(h, self._ops["linear_rows"](self.w.head, h).float(), taps)

    def commit(self, tree: TreeStep, path: Sequence[int]) -> Kept | None:
        """Append the nodes ``path`` (root to leaf) of the last verified ``tree`` at ``tree.start``: their K/V
        rows, and each conv tail as the path's decode steps would leave it. Returns the path's conv inputs
        (what ``replay`` needs), None for a model without conv layers."""
        verified = self._verified
        if verified is None or verified.tree is not tree:
            raise RuntimeError("Lfm2Runner.commit: the tree is not the one this runner verified last")
        idx = torch.tensor(list(path), dtype=torch.long, device=self.device)
        start, P = tree.start, len(path)
        for slot, (k, v) in verified.kv.items():
            self._K[slot, :, start:start + P] = k.index_select(0, idx).transpose(0, 1)
            self._V[slot, :, start:start + P] = v.index_select(0, idx).transpose(0, 1)
        self._verified = None
        if not self.cfg.conv_layers:
            return None
        rows = Kept(tuple(verified.conv_in[s].index_select(0, idx) for s in range(len(self.cfg.conv_layers))))
        self._advance(rows)
        return rows

    def replay(self, kept: Sequence[Kept | None], n: int) -> Kept | None:
        """The sections are back at the settle point: advance the conv tails over the first ``n`` tokens of
        ``kept`` (the commits since, in order) and return the record of those ``n``."""
        if not self.cfg.conv_layers:
            return None
        parts = [k for k in kept if k is not None]
        total = sum(k.count for k in parts)
        if not 0 < n <= total:
            raise ValueError(f"replay({n}): the kept records hold {total} tokens")
        rows = Kept.cat(parts).head(n)
        self._advance(rows)
        return rows

    def tap(self, layers: tuple[int, ...]) -> None:
        self._taps = tuple(layers)

    def reset(self) -> None:
        """The conv tails zeroed (K/V rows past the sequence's length are never read) and no verify kept."""
        self._conv.zero_()
        self._verified = None

    def _advance(self, rows: Kept) -> None:
        for slot, x in enumerate(rows.conv_in):
            self._conv[slot].copy_(conv_tail(self._conv[slot], x))

    # -- one call's rows through every layer -----------------------------------------------------------
    def _mm(self, step: Step | TreeStep) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """How this step multiplies by a weight: row-invariant for a decode step and a verify."""
        return self._ops["linear_rows"] if isinstance(step, TreeStep) or step.count == 1 else _batched

    def _layers(self, ids: torch.Tensor, step: Step | TreeStep, kept: _Verified | None,
                capture: Capture | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # ids: [T] -> hidden after the final norm [T, H], and the taps
        cfg, w = self.cfg, self.w
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)     # [T, D] each
        norm = self._ops["rms_norm"]
        taps: dict[int, torch.Tensor] = {}
        x = w.embed[ids]                                                          # x: [T, H]
        for i, layer in enumerate(w.layers):
            h = norm(x, layer.operator_norm, cfg.norm_eps)
            if isinstance(layer.mixer, ConvWeights):
                h = self._short_conv(h, layer.mixer, cfg.slot(i), step, kept)
            else:
                h = self._attention(h, layer.mixer, cfg.slot(i), step, kept, cos, sin)
            x = x + h
            if capture is not None:
                capture.append((f"layer {i} {layer.kind} mixer", x.clone()))
            h = norm(x, layer.ffn_norm, cfg.norm_eps)
            if isinstance(layer.ffn, MoEWeights):
                x, point = x + self._moe(h, layer.ffn, step), "moe"
            else:
                x, point = x + self._mlp(h, layer.ffn, step), "mlp"
            if capture is not None:
                capture.append((f"layer {i} {point}", x.clone()))
            if i in self._taps:
                taps[i] = x
        out = norm(x, w.norm, cfg.norm_eps)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out, taps

    def _short_conv(self, x: torch.Tensor, w: ConvWeights, slot: int, step: Step | TreeStep,
                    kept: _Verified | None) -> torch.Tensor:
        # x: [T, H] -> [T, H]; prefill/decode advance conv[slot] by T inputs, a verify keeps its nodes' inputs
        mm, op, H = self._mm(step), self._ops, self.cfg.hidden_size
        bcx = mm(w.in_proj, x)                                                    # bcx: [T, 3H]
        b, c, xx = bcx[:, :H], bcx[:, H:2 * H], bcx[:, 2 * H:]
        bx = b * xx                                                               # bx: [T, H] the conv inputs
        if isinstance(step, TreeStep):                                            # each node over its path
            assert kept is not None
            y = op["causal_conv_tree"](bx, self._conv[slot], w.conv, step.parents, activation=None)
            kept.conv_in[slot] = bx
        else:
            y, tail = op["causal_conv"](bx, self._conv[slot], w.conv, activation=None)   # y: [T, H]
            self._conv[slot].copy_(tail)
        return mm(w.out_proj, c * y)

    def _attention(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step | TreeStep,
                   kept: _Verified | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]; prefill/decode write K/V rows step.start .. step.end - 1 of slot
        cfg, op, mm = self.cfg, self._ops, self._mm(step)
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = mm(w.q, x).view(T, hq, D)                                             # q: [T, Hq, D]
        k = mm(w.k, x).view(T, hkv, D)                                            # k: [T, Hkv, D]
        v = mm(w.v, x).view(T, hkv, D)                                            # v: [T, Hkv, D]
        q = op["rope"](op["rms_norm"](q, w.q_norm, cfg.norm_eps), cos, sin)
        k = op["rope"](op["rms_norm"](k, w.k_norm, cfg.norm_eps), cos, sin)
        scale = D ** -0.5
        if isinstance(step, TreeStep):
            assert kept is not None
            o = op["attention_tree"](q, k, v, self._K[slot], self._V[slot], step.start, step.parents,
                                     scale)                                       # o: [T, Hq, D]
            kept.kv[slot] = (k, v)
        else:
            end = step.end
            self._K[slot, :, step.start:end] = k.transpose(0, 1)
            self._V[slot, :, step.start:end] = v.transpose(0, 1)
            mask = _attention_mod.causal_mask(step.start, T, self.device)         # [T, end]
            o = op["attention"](q, self._K[slot, :, :end], self._V[slot, :, :end], mask, scale)
        return mm(w.o, o.reshape(T, hq * D))

    def _mlp(self, x: torch.Tensor, w: MLPWeights, step: Step | TreeStep) -> torch.Tensor:
        # x: [T, H] -> [T, H]: w2(silu(w1 x) * w3 x)
        mm = self._mm(step)
        return mm(w.w2, self._ops["silu"](mm(w.w1, x)).to(self.act_dtype) * mm(w.w3, x))

    def _moe(self, x: torch.Tensor, w: MoEWeights, step: Step | TreeStep) -> torch.Tensor:
        # x: [T, H] -> [T, H]: the selected experts only, each once, over the rows that chose it
        cfg, mm = self.cfg, self._mm(step)
        routes = _moe.route(mm(w.router, x), w.expert_bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                            cfg.routed_scaling_factor, self._ops["sigmoid"])
        return _moe.experts_grouped(x, routes, w.gate_up, w.down, mm, self._ops["silu"])

    # -- what computes the rows, and what the runner holds ---------------------------------------------
    def manifest(self) -> Manifest:
        """The plugin's and the ops' source files that compute rows, the arithmetic settings, the dtype and
        the weights' identity."""
        here = Path(__file__).resolve()
        files = {here} | {here.with_name(n) for n in ("config.py", "weights.py", "moe.py")}
        files = {str(f) for f in files} | source_files(*self._ops.values(), _rope, _attention_mod,
                                                       *{type(lin) for lin in self.w.linears()})
        settings = {"dtype": self.w.dtype, "device": self.device.type}
        extra = {"arch": self.cfg.model_type, "weights": self.w.identity, "config": asdict(self.cfg),
                 "ops": op_paths(self._ops)}
        return Manifest(tuple(sorted(files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        return [
            MemoryPart("weights", self.w.nbytes, dev),
            MemoryPart("conv", tensor_bytes(self._conv), dev),
            MemoryPart("kv", tensor_bytes(self._K, self._V), dev),
        ]

    def __repr__(self) -> str:
        return (f"Lfm2Runner({self.cfg.model_type}, {self.cfg.num_hidden_layers} layers, {self.w.dtype}, "
                f"{self.device})")
