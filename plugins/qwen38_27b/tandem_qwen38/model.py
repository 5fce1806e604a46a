"""Qwen38Engine: the dense Gated DeltaNet / gated attention hybrid, one sequence (batch 1).

A layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is a Gated
DeltaNet (``linear_attention``) or gated attention (``full_attention``), as the
config's ``layer_types`` say. The engine owns every buffer its sequence needs,
allocated once for ``max_context`` tokens:

    gdn.S     [L_gdn, Hv, Dk, Dv]        fp32   recurrent state of each Gated DeltaNet layer
    gdn.conv  [L_gdn, conv_dim, K-1]     act    the last K-1 conv inputs of each Gated DeltaNet layer
    K, V      [L_attn, Hkv, max_ctx, D]  act    keys (after q/k norm and rope) and values, token axis 2

``L_gdn``/``L_attn`` index the layers of each kind in order (``cfg.slot(layer)``).
``state`` is a live ``ModelState`` over exactly these tensors: a ``restore`` into
it lands in the buffers and sets ``kv.length``.

Hot verbs: ``forward(tokens, all_logits=False)``, ``picks``, ``hidden_post_norm``,
``kv.length``, ``state``, ``reset``. Cold verbs: ``caps``, ``cache_state``,
``manifest``, ``memory_parts``.

Every op comes from ``tandem_core.ops`` for the engine's device (a kernel where
one is registered, else the plain-torch reference). Each layer reads what one
forward appends from a ``Step`` (where its rows start, how many); the attention
mask and the Gated DeltaNet's form (chunked for several rows, recurrent for one)
follow from it.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tandem_core import ops
from tandem_core.engine import Capabilities, Manifest, MemoryPart
from tandem_core.ops import attention as _attention_mod
from tandem_core.ops import rope as _rope
from tandem_core.state import ModelState, View

from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.weights import AttentionWeights, GDNWeights, MLPWeights, Qwen38Weights

__all__ = ["Qwen38Engine", "ContextFull", "Step", "LiveState", "KVLength", "ENGINE_OPS"]

# the ops this engine calls, resolved once per engine for its device
ENGINE_OPS = ("rms_norm_1p", "gated_rms_norm", "l2_norm", "causal_conv", "gdn_chunk", "gdn_recurrent", "rope",
              "attention", "sigmoid", "silu", "softplus")


class ContextFull(ValueError):
    """A forward would hold more tokens than the engine's buffers (``max_context``)."""


class KVLength:
    """``kv.length``: the tokens the sequence holds (committed)."""

    def __init__(self) -> None:
        self.length = 0

    def __repr__(self) -> str:
        return f"KVLength({self.length})"


class LiveState(ModelState):
    """The engine's live state: its sections and views *are* the engine's buffers, and ``length`` is
    the engine's ``kv.length`` (a restore sets it)."""

    def __init__(self, kv: KVLength, sections: dict[str, torch.Tensor], views: dict[str, View]) -> None:
        self._kv = kv
        super().__init__(sections, views, kv.length)

    @property  # type: ignore[override]
    def length(self) -> int:
        return self._kv.length

    @length.setter
    def length(self, n: int) -> None:
        self._kv.length = int(n)


@dataclass(frozen=True)
class Step:
    """What one forward appends: ``count`` rows at positions ``start .. start + count - 1``."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=device)                # [T]

    def mask(self, device: torch.device) -> torch.Tensor:
        return _attention_mod.causal_mask(self.start, self.count, device)        # [T, start + T]

    @property
    def recurrent(self) -> bool:
        """One row: the Gated DeltaNet runs its recurrent (decode) form; several rows its chunked form."""
        return self.count == 1


class Qwen38Engine:
    """One sequence of a Qwen3.5-architecture model over shared ``Qwen38Weights``.

    ``max_context``: tokens the buffers hold. ``prefill_chunk``: rows a forward runs
    through all layers at a time. ``gdn_chunk``: tokens per chunk of the chunked
    gated delta rule.
    """

    def __init__(self, cfg: Qwen38Config, weights: Qwen38Weights, *, max_context: int,
                 prefill_chunk: int = 512, gdn_chunk: int = 64) -> None:
        if max_context <= 0 or prefill_chunk <= 0 or gdn_chunk <= 0:
            raise ValueError(f"max_context ({max_context}), prefill_chunk ({prefill_chunk}) and gdn_chunk "
                             f"({gdn_chunk}) must be positive")
        self.cfg = cfg
        self.w = weights
        self.device = weights.device
        self.act_dtype = weights.act_dtype
        self.prefill_chunk = int(prefill_chunk)
        self.gdn_chunk = int(gdn_chunk)
        self.max_context = int(max_context)
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in ENGINE_OPS}

        n_gdn, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
        dev, act = self.device, self.act_dtype
        self._S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=dev)
        self._conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=act, device=dev)
        kv_shape = (n_attn, cfg.num_key_value_heads, self.max_context, cfg.head_dim)
        self._K = torch.zeros(kv_shape, dtype=act, device=dev)
        self._V = torch.zeros(kv_shape, dtype=act, device=dev)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)

        self.kv = KVLength()
        self._state = LiveState(self.kv, {"gdn.S": self._S, "gdn.conv": self._conv},
                                {"K": View(self._K, 2), "V": View(self._V, 2)})
        self._hidden: list[torch.Tensor] = []
        self._hidden_cat: torch.Tensor | None = None
        self.caps = Capabilities(tree=False, resume=False, recurrent=True, max_context=self.max_context,
                                 max_tree=0, hidden_layers=(), device=str(dev), dtype=weights.dtype)

    # -- hot verbs ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64); return fp32 logits ``[T, V]`` (``all_logits``) or ``[1, V]`` (last).

        Runs ``prefill_chunk`` rows at a time through every layer; the result equals one
        full forward within fp32 rounding. The returned tensor is new.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(self.device)
        T = int(ids.numel())
        if T == 0:
            raise ValueError("forward: no tokens")
        if self.kv.length + T > self.max_context:
            raise ContextFull(f"forward: {self.kv.length} tokens held + {T} new exceed max_context "
                              f"{self.max_context}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"forward: token id {lo if lo < 0 else hi} is outside the vocabulary "
                             f"(size {self.cfg.vocab_size})")
        self._hidden, self._hidden_cat = [], None
        logits = []
        for s in range(0, T, self.prefill_chunk):
            h = self._rows(ids[s:s + self.prefill_chunk])              # h: [t, H] after the final norm
            self._hidden.append(h)
            if all_logits:
                logits.append(self.w.head.matmul(h))
        if not all_logits:
            logits.append(self.w.head.matmul(self._hidden[-1][-1:]))
        return torch.cat(logits).float()

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks: ``[R, V] -> [R]``."""
        return logits.argmax(dim=-1)

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's hidden states after the final norm, ``[T, H]`` (valid until the next one)."""
        if self._hidden_cat is None:
            if not self._hidden:
                raise RuntimeError("hidden_post_norm: no forward has run since the last reset")
            self._hidden_cat = self._hidden[0] if len(self._hidden) == 1 else torch.cat(self._hidden)
        return self._hidden_cat

    @property
    def state(self) -> ModelState:
        """The live state over the engine's own buffers (sections gdn.S, gdn.conv; views K, V)."""
        return self._state

    def reset(self) -> None:
        """Forget the sequence: length 0, recurrent and conv state zero."""
        self._S.zero_()
        self._conv.zero_()
        self.kv.length = 0
        self._hidden, self._hidden_cat = [], None

    # -- one forward's rows through every layer ---------------------------------------------------
    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> hidden after the final norm [T, H]; appends T tokens to the sequence
        cfg, w = self.cfg, self.w
        step = Step(self.kv.length, int(ids.numel()))
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)    # [T, R] each
        norm = self._ops["rms_norm_1p"]
        x = w.embed[ids]                                                        # x: [T, H]
        for i, layer in enumerate(w.layers):
            h = norm(x, layer.input_norm, cfg.rms_norm_eps)
            if isinstance(layer.mixer, GDNWeights):
                h = self._gated_deltanet(h, layer.mixer, cfg.slot(i), step)
            else:
                h = self._attention(h, layer.mixer, cfg.slot(i), step, cos, sin)
            x = x + h
            x = x + self._mlp(norm(x, layer.post_norm, cfg.rms_norm_eps), layer.mlp)
        self.kv.length = step.end
        return norm(x, w.norm, cfg.rms_norm_eps)

    def _gated_deltanet(self, x: torch.Tensor, w: GDNWeights, slot: int, step: Step) -> torch.Tensor:
        # x: [T, H] -> [T, H]; advances gdn.S[slot] and gdn.conv[slot] by T tokens
        cfg, op = self.cfg, self._ops
        T, hk, hv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = w.in_qkv.matmul(x)                                                # qkv: [T, conv_dim]
        z = w.in_z.matmul(x).view(T, hv, dv)                                    # z: [T, Hv, Dv]
        b = w.in_b.matmul(x)                                                    # b: [T, Hv]
        a = w.in_a.matmul(x)                                                    # a: [T, Hv]

        qkv, tail = op["causal_conv"](qkv, self._conv[slot], w.conv)            # silu(conv); tail [C, K-1]
        self._conv[slot].copy_(tail)
        q, k, v = torch.split(qkv, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
        q = op["l2_norm"](q.reshape(T, hk, dk))                                 # q: [T, Hk, Dk] fp32
        k = op["l2_norm"](k.reshape(T, hk, dk))                                 # k: [T, Hk, Dk] fp32
        v = v.reshape(T, hv, dv)                                                # v: [T, Hv, Dv]
        beta = op["sigmoid"](b)                                                 # beta: [T, Hv] fp32
        g = -w.A_log.exp() * op["softplus"](a.float() + w.dt_bias)              # g: [T, Hv] fp32 log-decay

        if step.recurrent:
            o, S = op["gdn_recurrent"](q, k, v, g, beta, self._S[slot], scale=dk ** -0.5)
        else:
            o, S = op["gdn_chunk"](q, k, v, g, beta, self._S[slot], scale=dk ** -0.5, chunk=self.gdn_chunk)
        self._S[slot].copy_(S)                                                  # o: [T, Hv, Dv] fp32
        o = op["gated_rms_norm"](o, z, w.norm, cfg.rms_norm_eps)                # o: [T, Hv, Dv]
        return w.out.matmul(o.reshape(T, hv * dv).to(self.act_dtype))

    def _attention(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]; writes K/V rows step.start .. step.end - 1 of slot
        cfg, op = self.cfg, self._ops
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = w.q.matmul(x).view(T, hq, 2 * D)                                   # qg: [T, Hq, 2D]
        q, gate = qg[..., :D], qg[..., D:].reshape(T, hq * D)                   # [T, Hq, D], [T, Hq*D]
        k = w.k.matmul(x).view(T, hkv, D)                                       # k: [T, Hkv, D]
        v = w.v.matmul(x).view(T, hkv, D)                                       # v: [T, Hkv, D]
        q = op["rope"](op["rms_norm_1p"](q, w.q_norm, cfg.rms_norm_eps), cos, sin)
        k = op["rope"](op["rms_norm_1p"](k, w.k_norm, cfg.rms_norm_eps), cos, sin)

        self._K[slot, :, step.start:step.end] = k.transpose(0, 1)
        self._V[slot, :, step.start:step.end] = v.transpose(0, 1)
        o = op["attention"](q, self._K[slot, :, :step.end], self._V[slot, :, :step.end],
                            step.mask(self.device), D ** -0.5)                   # o: [T, Hq, D]
        o = o.reshape(T, hq * D) * op["sigmoid"](gate).to(self.act_dtype)
        return w.o.matmul(o)

    def _mlp(self, x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
        # x: [T, H] -> [T, H]: down(silu(gate(x)) * up(x))
        return w.down.matmul(self._ops["silu"](w.gate.matmul(x)).to(self.act_dtype) * w.up.matmul(x))

    # -- cold verbs ------------------------------------------------------------------------------
    def cache_state(self) -> ModelState:
        """The live state (``length == kv.length``); tiers clone it to keep it."""
        return self._state

    def manifest(self) -> Manifest:
        """What computes this engine's rows: the plugin's and the ops' source files, the arithmetic
        settings, the dtype and the weights' identity."""
        files = {Path(__file__).resolve()}
        files |= {Path(__file__).with_name(n).resolve() for n in ("config.py", "weights.py")}
        files |= {Path(inspect.getsourcefile(fn) or "").resolve() for fn in self._ops.values()}
        files.add(Path(inspect.getsourcefile(_rope) or "").resolve())
        files |= {Path(inspect.getsourcefile(type(lin)) or "").resolve() for lin in self.w.linears()}
        settings = {"dtype": self.w.dtype, "prefill_chunk": self.prefill_chunk, "gdn_chunk": self.gdn_chunk,
                    "device": self.device.type}
        extra = {"arch": "qwen3_5", "weights": self.w.identity, "config": asdict(self.cfg),
                 "ops": {n: f"{fn.__module__}:{fn.__qualname__}" for n, fn in sorted(self._ops.items())}}
        return Manifest(tuple(sorted(str(f) for f in files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        return [
            MemoryPart("weights", self.w.nbytes, dev),
            MemoryPart("gdn.S", nbytes(self._S), dev),
            MemoryPart("gdn.conv", nbytes(self._conv), dev),
            MemoryPart("kv", nbytes(self._K) + nbytes(self._V), dev),
        ]

    def __repr__(self) -> str:
        return (f"Qwen38Engine({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, "
                f"{self.kv.length}/{self.max_context} tokens)")
