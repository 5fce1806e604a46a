"""The Qwen3.8 arithmetic: the dense Gated DeltaNet / gated attention hybrid, one sequence (batch 1).

``Qwen38Runner`` is the plain-torch reference runner (any device; every op from ``tandem_core.ops``
for it); ``tandem_qwen38.cuda_runner.Qwen38CudaRunner`` is the CUDA graph runner over the same
buffers' layout. The core's ``SequenceEngine`` runs the sequence over either (``serving.build_engine``
picks by the device); a runner only computes.

A layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is a Gated
DeltaNet (``linear_attention``) or gated attention (``full_attention``), as the
config's ``layer_types`` say. The runner owns every buffer its sequence needs,
allocated once for ``max_context`` tokens (``allocate_state``):

    gdn.S     [L_gdn, Hv, Dk, Dv]        fp32   recurrent state of each Gated DeltaNet layer
    gdn.conv  [L_gdn, conv_dim, K-1]     act    the last K-1 conv inputs of each Gated DeltaNet layer
    K, V      [L_attn, Hkv, max_ctx, D]  act    keys (after q/k norm and rope) and values, token axis 2

``L_gdn``/``L_attn`` index the layers of each kind in order (``cfg.slot(layer)``);
``gdn.S`` and ``gdn.conv`` are the sections, ``K`` and ``V`` the views.

Three forms of one layer code, one for each runner verb:

- prefill (``prefill``, a ``Step`` of several rows): rows batched through every
  op, the Gated DeltaNet in its chunked form. Not row invariant, and need not be:
  plain and speculative decoding start from the same prefill.
- decode (``decode``, a ``Step`` of one row): the recurrent form, every projection
  through the row-invariant ``linear_rows`` op.
- verify (``verify``, a ``TreeStep``): every projection through ``linear_rows``,
  the conv, the gated delta rule and attention through their tree ops, each node
  from its parent's state and over its own ancestors; norms and activations
  batched (row invariant, see ``tandem_core.ops.rows``). Every verified row equals
  the decode step's row at that position bit for bit.

Committing a path recomputes the Gated DeltaNet state along it with the recurrent
form (token by token the decode step's own update), from the nodes' kept rule
inputs (q, k, v, decay, beta: a few KiB a node and layer), instead of keeping
every node's state from the verify (a state a node and layer: 3 MiB each on the
27B, 9 GiB for a 64-node tree); the result is the decode step's state bit for
bit and costs the path's length in recurrent steps a layer. The K/V rows of the
path are copied from the verify, the conv tail is the path's last K-1 inputs. The
commit returns the path's rule rows, from which ``replay`` redoes it (the engine
takes pending tokens back that way).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core import ops
from tandem_core.drafter import TargetParts
from tandem_core.engine import (
    Capture, LogitRows, Manifest, MemoryPart, Rows, RunnerSpec, Step, TreeStep, op_paths, source_files, tensor_bytes,
)
from tandem_core.ops import rope as _rope
from tandem_core.ops.attention import causal_mask
from tandem_core.ops.conv import conv_tail
from tandem_core.state import View

from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.weights import AttentionWeights, GDNWeights, MLPWeights, Qwen38Weights

__all__ = ["Qwen38Runner", "ENGINE_OPS", "allocate_state", "runner_files"]

# the ops this runner calls, resolved once per runner for its device
ENGINE_OPS = ("rms_norm_1p", "gated_rms_norm", "l2_norm", "causal_conv", "gdn_chunk", "gdn_recurrent", "rope",
              "attention", "sigmoid", "silu", "softplus",
              "linear_rows", "causal_conv_tree", "gdn_tree", "attention_tree")


def allocate_state(cfg: Qwen38Config, device: torch.device, act: torch.dtype, capacity: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
    """The sequence's buffers for ``capacity`` token positions: sections ``gdn.S`` (fp32) and ``gdn.conv``,
    views ``K`` and ``V`` (token axis 2), zeroed."""
    n_gdn, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
    S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                    dtype=torch.float32, device=device)
    conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=act, device=device)
    kv_shape = (n_attn, cfg.num_key_value_heads, capacity, cfg.head_dim)
    K = torch.zeros(kv_shape, dtype=act, device=device)
    V = torch.zeros(kv_shape, dtype=act, device=device)
    return {"gdn.S": S, "gdn.conv": conv}, {"K": View(K, 2), "V": View(V, 2)}


def runner_files(weights: Qwen38Weights) -> set[str]:
    """The plugin's files that compute any runner's rows: this file, the config and weights readers, the
    rotary tables and the weights' ``Linear`` classes."""
    here = Path(__file__).resolve()
    return ({str(here)} | {str(here.with_name(n)) for n in ("config.py", "weights.py")}
            | source_files(_rope, *{type(lin) for lin in weights.linears()}))


class _RuleRows(NamedTuple):
    """Per Gated DeltaNet slot, one row a token: what re-running the decode step's state update needs."""

    conv_in: torch.Tensor   # [T, conv_dim] act   the conv inputs (the tail is the last K-1 of them)
    q: torch.Tensor         # [T, Hk, Dk] fp32    after the conv and the L2 norm
    k: torch.Tensor         # [T, Hk, Dk] fp32
    v: torch.Tensor         # [T, Hv, Dv] act
    g: torch.Tensor         # [T, Hv] fp32        log-decay
    beta: torch.Tensor      # [T, Hv] fp32

    def take(self, idx: torch.Tensor) -> "_RuleRows":
        return _RuleRows(*(t.index_select(0, idx) for t in self))

    def head(self, n: int) -> "_RuleRows":
        return _RuleRows(*(t[:n] for t in self))

    @staticmethod
    def cat(parts: Sequence["_RuleRows"]) -> "_RuleRows":
        return _RuleRows(*(torch.cat(ts) for ts in zip(*parts)))


@dataclass
class _Verified:
    """The last verified tree: what ``commit`` needs of it."""

    step: TreeStep
    rule: dict[int, _RuleRows] = field(default_factory=dict)                     # by GDN slot, [N] rows
    # by attention slot: the nodes' keys and values [N, Hkv, D]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class Qwen38Runner:
    """The reference runner: one sequence of a Qwen3.5-architecture model over shared ``Qwen38Weights``.

    ``max_context``: tokens the buffers hold. ``prefill_chunk``: rows a prefill call takes at most.
    ``gdn_chunk``: tokens per chunk of the chunked gated delta rule. ``max_tree``: the most nodes one
    ``verify`` takes.
    """

    def __init__(self, cfg: Qwen38Config, weights: Qwen38Weights, *, max_context: int,
                 prefill_chunk: int = 512, gdn_chunk: int = 64, max_tree: int = 64) -> None:
        if max_context <= 0 or prefill_chunk <= 0 or gdn_chunk <= 0 or max_tree <= 0:
            raise ValueError(f"max_context ({max_context}), prefill_chunk ({prefill_chunk}), gdn_chunk "
                             f"({gdn_chunk}) and max_tree ({max_tree}) must be positive")
        self.cfg = cfg
        self.w = weights
        self.device = weights.device
        self.act_dtype = weights.act_dtype
        self.gdn_chunk = int(gdn_chunk)
        self.spec = RunnerSpec(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, max_context=int(max_context),
            max_tree=int(max_tree), prefill_chunk=int(prefill_chunk),
            device=str(self.device), dtype=weights.dtype,
            trace=True, hidden_layers=tuple(range(cfg.num_hidden_layers)))
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in ENGINE_OPS}
        self._sections, self._views = allocate_state(cfg, self.device, self.act_dtype, self.spec.max_context)
        self._S, self._conv = self._sections["gdn.S"], self._sections["gdn.conv"]
        self._K, self._V = self._views["K"].tensor, self._views["V"].tensor
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, self.device)
        self._tree: _Verified | None = None
        self._taps: tuple[int, ...] = ()

    # -- the runner verbs ---------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """Sections ``gdn.S``, ``gdn.conv``; views ``K``, ``V``."""
        return self._sections, self._views

    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids.to(self.device), step, None, capture)        # h: [T, H]
        out = None
        if logits == "all":
            out = self.w.head.matmul(h).float()
        elif logits == "last":
            out = self._ops["linear_rows"](self.w.head, h[-1:]).float()
        return Rows(h, out, taps)

    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids.to(self.device), step, None, capture)        # h: [1, H]
        return Rows(h, self._ops["linear_rows"](self.w.head, h).float(), taps)

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        self._tree = None
        verified = _Verified(tree)
        h, taps = self._layers(ids.to(self.device), tree, verified, capture)    # h: [N, H]
        self._tree = verified
        return Rows(h, self._ops["linear_rows"](self.w.head, h).float(), taps)

    def commit(self, tree: TreeStep, path: Sequence[int]) -> dict[int, _RuleRows]:
        """The path's K/V rows from the verify, and the Gated DeltaNet state and conv tails advanced along
        it by the recurrent form; returns the path's rule rows by slot (``replay``'s record)."""
        verified = self._tree
        if verified is None or verified.step is not tree:
            raise RuntimeError("Qwen38Runner.commit: the tree is not the one this runner verified last")
        at = torch.tensor(list(path), dtype=torch.long, device=self.device)
        start, P = tree.start, len(path)
        rule = {slot: rows.take(at) for slot, rows in verified.rule.items()}
        self._advance(rule)
        for slot, (k, v) in verified.kv.items():
            self._K[slot, :, start:start + P] = k.index_select(0, at).transpose(0, 1)
            self._V[slot, :, start:start + P] = v.index_select(0, at).transpose(0, 1)
        self._tree = None
        return rule

    def replay(self, kept: Sequence[dict[int, _RuleRows]], n: int) -> dict[int, _RuleRows]:
        """The state advanced along the first ``n`` kept rule rows (the engine put the settle point's back)."""
        rows = {slot: _RuleRows.cat([r[slot] for r in kept]).head(n) for slot in kept[0]}
        self._advance(rows)
        return rows

    def tap(self, layers: tuple[int, ...]) -> None:
        self._taps = tuple(layers)

    def parts(self) -> TargetParts:
        """The embedding and the head, lent to a drafter (the block drafter)."""
        w = self.w
        return TargetParts(embed=lambda ids: w.embed[ids.to(w.device)],
                           head=lambda h: w.head.matmul(h.to(w.act_dtype)).float(),
                           device=str(w.device), dtype=w.act_dtype)

    def reset(self) -> None:
        self._S.zero_()
        self._conv.zero_()
        self._tree = None

    def _mm(self, step: Step | TreeStep) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """How this step multiplies by a weight: row-invariant for a decode step and a verify."""
        return self._ops["linear_rows"] if isinstance(step, TreeStep) or step.count == 1 else _batched

    def _advance(self, rule: dict[int, _RuleRows]) -> None:
        """Append rule rows to the recurrent state: the recurrent form over them, whose every token is the
        decode step's one-token update (``tandem_core.ops.gdn``), and the conv tail they leave."""
        op, scale = self._ops["gdn_recurrent"], self.cfg.linear_key_head_dim ** -0.5
        for slot, r in rule.items():
            _, S = op(r.q, r.k, r.v, r.g, r.beta, self._S[slot], scale=scale)
            self._S[slot].copy_(S)
            self._conv[slot].copy_(conv_tail(self._conv[slot], r.conv_in))

    # -- one call's rows through every layer --------------------------------------------------------
    def _layers(self, ids: torch.Tensor, step: Step | TreeStep, tree: _Verified | None,
                capture: Capture | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # ids: [T] -> hidden after the final norm [T, H]; a Step advances the state, a TreeStep fills ``tree``
        cfg, w = self.cfg, self.w
        taps: dict[int, torch.Tensor] = {}
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)    # [T, R] each
        norm = self._ops["rms_norm_1p"]
        x = w.embed[ids]                                                        # x: [T, H]
        for i, layer in enumerate(w.layers):
            h = norm(x, layer.input_norm, cfg.rms_norm_eps)
            if isinstance(layer.mixer, GDNWeights):
                h = self._gated_deltanet(h, layer.mixer, cfg.slot(i), step, tree)
            else:
                h = self._attention(h, layer.mixer, cfg.slot(i), step, tree, cos, sin)
            x = x + h
            if capture is not None:
                capture.append((f"layer {i} {layer.kind} mixer", x.clone()))
            x = x + self._mlp(norm(x, layer.post_norm, cfg.rms_norm_eps), layer.mlp, step)
            if capture is not None:
                capture.append((f"layer {i} mlp", x.clone()))
            if i in self._taps:
                taps[i] = x
        out = norm(x, w.norm, cfg.rms_norm_eps)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out, taps

    def _gated_deltanet(self, x: torch.Tensor, w: GDNWeights, slot: int, step: Step | TreeStep,
                        tree: _Verified | None) -> torch.Tensor:
        # x: [T, H] -> [T, H]; a Step advances gdn.S[slot] and gdn.conv[slot] by T tokens
        cfg, op, mm = self.cfg, self._ops, self._mm(step)
        T, hk, hv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv_in = mm(w.in_qkv, x)                                                # qkv_in: [T, conv_dim]
        z = mm(w.in_z, x).view(T, hv, dv)                                       # z: [T, Hv, Dv]
        b = mm(w.in_b, x)                                                       # b: [T, Hv]
        a = mm(w.in_a, x)                                                       # a: [T, Hv]

        if isinstance(step, TreeStep):                                          # each node over its path
            qkv = op["causal_conv_tree"](qkv_in, self._conv[slot], w.conv, step.parents)
        else:
            qkv, tail = op["causal_conv"](qkv_in, self._conv[slot], w.conv)     # silu(conv); tail [C, K-1]
            self._conv[slot].copy_(tail)
        q, k, v = torch.split(qkv, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
        q = op["l2_norm"](q.reshape(T, hk, dk))                                 # q: [T, Hk, Dk] fp32
        k = op["l2_norm"](k.reshape(T, hk, dk))                                 # k: [T, Hk, Dk] fp32
        v = v.reshape(T, hv, dv)                                                # v: [T, Hv, Dv]
        beta = op["sigmoid"](b)                                                 # beta: [T, Hv] fp32
        g = -w.A_log.exp() * op["softplus"](a.float() + w.dt_bias)              # g: [T, Hv] fp32 log-decay

        scale = dk ** -0.5
        if isinstance(step, TreeStep):
            assert tree is not None
            o = op["gdn_tree"](q, k, v, g, beta, self._S[slot], step.parents, scale=scale)
            tree.rule[slot] = _RuleRows(qkv_in, q, k, v, g, beta)
        else:
            if step.count == 1:                                                 # decode: the recurrent form
                o, S = op["gdn_recurrent"](q, k, v, g, beta, self._S[slot], scale=scale)
            else:
                o, S = op["gdn_chunk"](q, k, v, g, beta, self._S[slot], scale=scale, chunk=self.gdn_chunk)
            self._S[slot].copy_(S)                                              # o: [T, Hv, Dv] fp32
        o = op["gated_rms_norm"](o, z, w.norm, cfg.rms_norm_eps)                # o: [T, Hv, Dv]
        return mm(w.out, o.reshape(T, hv * dv).to(self.act_dtype))

    def _attention(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step | TreeStep,
                   tree: _Verified | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]; a Step writes K/V rows step.start .. step.end - 1 of slot
        cfg, op, mm = self.cfg, self._ops, self._mm(step)
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = mm(w.q, x).view(T, hq, 2 * D)                                      # qg: [T, Hq, 2D]
        q, gate = qg[..., :D], qg[..., D:].reshape(T, hq * D)                   # [T, Hq, D], [T, Hq*D]
        k = mm(w.k, x).view(T, hkv, D)                                          # k: [T, Hkv, D]
        v = mm(w.v, x).view(T, hkv, D)                                          # v: [T, Hkv, D]
        q = op["rope"](op["rms_norm_1p"](q, w.q_norm, cfg.rms_norm_eps), cos, sin)
        k = op["rope"](op["rms_norm_1p"](k, w.k_norm, cfg.rms_norm_eps), cos, sin)

        if isinstance(step, TreeStep):
            assert tree is not None
            o = op["attention_tree"](q, k, v, self._K[slot], self._V[slot], step.start, step.parents,
                                     D ** -0.5)                                  # o: [T, Hq, D]
            tree.kv[slot] = (k, v)
        else:
            self._K[slot, :, step.start:step.end] = k.transpose(0, 1)
            self._V[slot, :, step.start:step.end] = v.transpose(0, 1)
            o = op["attention"](q, self._K[slot, :, :step.end], self._V[slot, :, :step.end],
                                causal_mask(step.start, step.count, self.device), D ** -0.5)   # o: [T, Hq, D]
        o = o.reshape(T, hq * D) * op["sigmoid"](gate).to(self.act_dtype)
        return mm(w.o, o)

    def _mlp(self, x: torch.Tensor, w: MLPWeights, step: Step | TreeStep) -> torch.Tensor:
        # x: [T, H] -> [T, H]: down(silu(gate(x)) * up(x))
        mm = self._mm(step)
        return mm(w.down, self._ops["silu"](mm(w.gate, x)).to(self.act_dtype) * mm(w.up, x))

    # -- what computes the rows ----------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The plugin's and the ops' source files, the arithmetic settings, the dtype and the weights'
        identity."""
        files = runner_files(self.w) | source_files(*self._ops.values())
        settings = {"dtype": self.w.dtype, "gdn_chunk": self.gdn_chunk, "device": self.device.type}
        extra = {"arch": "qwen3_5", "weights": self.w.identity, "config": asdict(self.cfg),
                 "ops": op_paths(self._ops)}
        return Manifest(tuple(sorted(files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        return [
            MemoryPart("weights", self.w.nbytes, dev),
            MemoryPart("gdn.S", tensor_bytes(self._S), dev),
            MemoryPart("gdn.conv", tensor_bytes(self._conv), dev),
            MemoryPart("kv", tensor_bytes(self._K, self._V), dev),
        ]

    def __repr__(self) -> str:
        return (f"Qwen38Runner({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, "
                f"{self.spec.max_context} tokens)")
