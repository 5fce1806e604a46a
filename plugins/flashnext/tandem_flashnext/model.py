"""FlashNextRunner: the arithmetic of one Flash-Next sequence (batch 1), the core's ``Runner``.

The core's ``SequenceEngine`` (``tandem_core.engine``) owns the sequence; this runner only
computes (``serving.build_engine`` puts them together). A layer on ``n`` residual streams
``x: [T, n*H]`` (the embedding repeated ``n`` times to start):

    x = x + ple(x, tokens)                          (PLE layers only)
    h, w = attn_hyper_connection(x);  x = x + w * mixer(h)      (Gated DeltaNet or QSA attention)
    h, w = mlp_hyper_connection(x);   x = x + w * moe(h)
    ...
    hidden = hyper_connection_mixer(x)              (in place of a final norm), logits = lm_head(hidden)

The runner owns every buffer its sequence needs, allocated once for ``max_context`` tokens:

    sections  gdn.S       [L_gdn, Hv, Dk, Dv]          fp32   each Gated DeltaNet layer's recurrent state
              gdn.conv    [L_gdn, conv_dim, K-1]       act    its last K-1 conv inputs
              ple.conv    [L_ple, n*H, (Kp-1)*d]       act    each PLE module's last dilated-conv inputs
              ngram.ctx   [ngram_size - 1]             int64  the last tokens, each id plus one (0: before
                                                              the first; ``ngram.read_context``)
              mtp.h_last  [n*H]                        act    the last token's streams before the final
                                                              mixer (the MTP head reads it; ``last_streams``)
    views     K, V        [L_attn, Hkv, max_ctx, D]    act    keys (after k_norm and rope) and values, axis 2
              IK          [L_attn, max_ctx, Di]        act    the indexer's raw keys, axis 1

Zeroed sections are a fresh sequence (``reset``). The verbs are the runner contract's
(``tandem_core.engine.runner``): ``prefill`` (several tokens, batched), ``decode`` (one token: the
row-invariant form), ``verify`` (a token tree, nothing committed; row ``i`` equals the decode row
after committing path root..i bit for bit: every state kind from the node's own path),
``commit`` (the path's K/V/IK rows from the verify, every section advanced along the path as
decode would: the Gated DeltaNet state by the recurrent form over the kept rule rows, the conv
tails, the n-gram context, the last streams), ``replay`` (redo the first ``n`` tokens of kept
commits on sections put back to the settle point), ``tap``, ``reset``, ``manifest``,
``memory_parts``. ``Rows.hidden`` is ``[T, H]`` after the final mixer; ``Rows.taps`` are a layer's
output streams ``[T, n*H]`` (the MTP head reads the last layer's); the capture points' rows are
each block's output ``[T, H]`` (the mixer's, the MoE's) and the final mixer's.

Every op comes from ``tandem_core.ops.get`` for the device; the PLE tables stay on the
host and a step gathers its rows there (``tandem_flashnext.ngram.RowTable``).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core import ops
from tandem_core.engine import Capture, LogitRows, Manifest, MemoryPart, Rows, RunnerSpec, Step, TreeStep
from tandem_core.ops import rope as _rope
from tandem_core.ops.conv import conv_tail
from tandem_core.state import View

from tandem_flashnext.blocks import RuleRows, decoder_block, gated_deltanet, hyper_mix
from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.ngram import context_after, read_context
from tandem_flashnext.ple import ple
from tandem_flashnext.qsa import AttentionRows, indexed_attention
from tandem_flashnext.steps import batched, rowwise
from tandem_flashnext.weights import AttentionWeights, FlashNextWeights, GDNWeights

__all__ = ["FlashNextRunner", "PathRows", "RUNNER_OPS", "runner_files"]

# the ops this runner calls, resolved once per runner for its device
RUNNER_OPS = ("rms_norm", "rms_norm_1p", "gated_rms_norm", "l2_norm", "causal_conv", "gdn_chunk",
              "gdn_recurrent", "rope", "attention", "sigmoid", "silu", "softplus", "softmax", "linear_rows",
              "causal_conv_tree", "gdn_tree")
_FILES = ("config.py", "layout.py", "weights.py", "ngram.py", "steps.py", "blocks.py", "qsa.py", "ple.py")


def runner_files(weights: FlashNextWeights) -> set[Path]:
    """The plugin's files that compute the rows (this one and the modules it computes with), the rotary
    tables and the weights' ``Linear`` classes."""
    here = Path(__file__).resolve()
    files = {here} | {here.with_name(n) for n in _FILES}
    files.add(Path(inspect.getsourcefile(_rope) or "").resolve())
    files |= {Path(inspect.getsourcefile(type(lin)) or "").resolve() for lin in weights.linears()}
    return files


class PathRows(NamedTuple):
    """What advancing the sections along committed tokens needs, one row a token (``replay``'s record)."""

    rule: dict[int, RuleRows]              # by GDN slot
    ple_in: dict[int, torch.Tensor]        # by PLE slot: the dilated conv's inputs [P, n*H]
    ids: torch.Tensor                      # [P] the tokens (the n-gram context)
    streams: torch.Tensor | None = None    # [P, n*H] the streams before the final mixer (``last_streams``)

    @property
    def count(self) -> int:
        return int(self.ids.numel())

    def take(self, idx: torch.Tensor) -> "PathRows":
        return PathRows({s: r.take(idx) for s, r in self.rule.items()},
                        {s: t.index_select(0, idx) for s, t in self.ple_in.items()},
                        self.ids.index_select(0, idx),
                        None if self.streams is None else self.streams.index_select(0, idx))

    def head(self, n: int) -> "PathRows":
        return PathRows({s: r.head(n) for s, r in self.rule.items()},
                        {s: t[:n] for s, t in self.ple_in.items()}, self.ids[:n],
                        None if self.streams is None else self.streams[:n])

    @staticmethod
    def cat(parts: Sequence["PathRows"]) -> "PathRows":
        first = parts[0]
        streams = None if first.streams is None else torch.cat([p.streams for p in parts])   # type: ignore[misc]
        return PathRows({s: RuleRows.cat([p.rule[s] for p in parts]) for s in first.rule},
                        {s: torch.cat([p.ple_in[s] for p in parts]) for s in first.ple_in},
                        torch.cat([p.ids for p in parts]), streams)


@dataclass
class _Verified:
    """The last verified tree: what ``commit`` takes of it."""

    tree: TreeStep
    rows: PathRows
    attention: dict[int, AttentionRows] = field(default_factory=dict)          # by attention slot


class FlashNextRunner:
    """The reference runner: one Flash-Next sequence over shared ``FlashNextWeights``, on any device.

    ``max_context``: tokens the buffers hold (a verify's scratch rows included). ``prefill_chunk``: rows a
    prefill call takes at most. ``gdn_chunk``: tokens per chunk of the chunked gated delta rule in a
    prefill. ``max_tree``: the widest verify. ``last_streams``: keep the last token's final streams as the
    section ``mtp.h_last`` (a checkpoint with an MTP head).
    """

    def __init__(self, cfg: FlashNextConfig, weights: FlashNextWeights, *, max_context: int,
                 prefill_chunk: int = 512, gdn_chunk: int = 64, max_tree: int = 64,
                 last_streams: bool = False) -> None:
        if min(max_context, prefill_chunk, gdn_chunk, max_tree) <= 0:
            raise ValueError(f"max_context ({max_context}), prefill_chunk ({prefill_chunk}), gdn_chunk "
                             f"({gdn_chunk}) and max_tree ({max_tree}) must be positive")
        self.cfg, self.w = cfg, weights
        self.device, self.act_dtype = weights.device, weights.act_dtype
        self.gdn_chunk = int(gdn_chunk)
        self.spec = RunnerSpec(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, max_context=int(max_context),
            max_tree=int(max_tree), prefill_chunk=int(prefill_chunk), device=str(self.device),
            dtype=weights.dtype, trace=True, hidden_layers=tuple(range(cfg.num_hidden_layers)))
        self._op: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in RUNNER_OPS}
        dev, act, cap = self.device, self.act_dtype, self.spec.max_context
        n_gdn, n_attn, n_ple = len(cfg.linear_layers), len(cfg.attention_layers), len(cfg.ple_layer_ids)
        self._S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=dev)
        self._conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=act, device=dev)
        self._ple_conv = torch.zeros(n_ple, cfg.hc_dim, cfg.ple_conv_tail, dtype=act, device=dev)
        self._ctx = torch.zeros(cfg.ngram_size - 1, dtype=torch.long, device=dev)
        self._eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        kv_shape = (n_attn, cfg.num_key_value_heads, cap, cfg.head_dim)
        self._K = torch.zeros(kv_shape, dtype=act, device=dev)
        self._V = torch.zeros(kv_shape, dtype=act, device=dev)
        self._IK = torch.zeros(n_attn, cap, cfg.indexer_head_dim, dtype=act, device=dev)
        self._h_last = torch.zeros(cfg.hc_dim, dtype=act, device=dev) if last_streams else None
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)
        self._sections: dict[str, torch.Tensor] = {"gdn.S": self._S, "gdn.conv": self._conv}
        if cfg.ple_layer_ids:
            self._sections.update({"ple.conv": self._ple_conv, "ngram.ctx": self._ctx})
        if self._h_last is not None:
            self._sections["mtp.h_last"] = self._h_last
        self._views = {"K": View(self._K, 2), "V": View(self._V, 2), "IK": View(self._IK, 1)}
        self._verified: _Verified | None = None
        self._taps: tuple[int, ...] = ()

    # -- the runner verbs ---------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """Sections ``gdn.S``, ``gdn.conv`` (with PLE: ``ple.conv``, ``ngram.ctx``; with ``last_streams``:
        ``mtp.h_last``); views ``K``, ``V``, ``IK``."""
        return self._sections, self._views

    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids.to(self.device), step, None, capture)            # h: [T, H]
        out = None
        if logits == "all":
            out = batched(self.w.head, h).float()
        elif logits == "last":
            out = self._op["linear_rows"](self.w.head, h[-1:]).float()
        return Rows(h, out, taps)

    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids.to(self.device), step, None, capture)            # h: [1, H]
        return Rows(h, self._op["linear_rows"](self.w.head, h).float(), taps)

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        self._verified = None
        ids = ids.to(self.device)
        record = _Verified(tree, PathRows({}, {}, ids.clone()))
        h, taps = self._layers(ids, tree, record, capture)                          # h: [N, H]
        self._verified = record
        return Rows(h, self._op["linear_rows"](self.w.head, h).float(), taps)

    def commit(self, tree: TreeStep, path: Sequence[int]) -> PathRows:
        """The path's K/V/IK rows from the verify, every section advanced along it as decode would; returns
        the path's rows (``replay``'s record)."""
        rec = self._verified
        if rec is None or rec.tree is not tree:
            raise RuntimeError("FlashNextRunner.commit: the tree is not the one this runner verified last")
        at = torch.tensor(list(path), dtype=torch.long, device=self.device)
        rows = rec.rows.take(at)
        self._advance(rows)
        s, P = tree.start, int(at.numel())
        for slot, kv in rec.attention.items():
            k, v, ik = kv.take(at)
            self._K[slot, :, s:s + P] = k.transpose(0, 1)
            self._V[slot, :, s:s + P] = v.transpose(0, 1)
            self._IK[slot, s:s + P] = ik
        self._verified = None
        return rows

    def replay(self, kept: Sequence[PathRows], n: int) -> PathRows:
        """The sections advanced along the first ``n`` kept tokens (restored to the settle point first)."""
        rows = PathRows.cat(list(kept)).head(n)
        self._advance(rows)
        return rows

    def tap(self, layers: tuple[int, ...]) -> None:
        self._taps = tuple(layers)

    def reset(self) -> None:
        for t in self._sections.values():
            t.zero_()
        self._verified = None

    def _advance(self, rows: PathRows) -> None:
        # the sections after appending rows' tokens: each token the decode step's own update
        step, scale = self._op["gdn_recurrent"], self.cfg.linear_key_head_dim ** -0.5
        for slot, r in rows.rule.items():
            _, S = step(r.q, r.k, r.v, r.g, r.beta, self._S[slot], scale=scale)
            self._S[slot].copy_(S)
            self._conv[slot].copy_(conv_tail(self._conv[slot], r.conv_in))
        for slot, x in rows.ple_in.items():
            self._ple_conv[slot].copy_(conv_tail(self._ple_conv[slot], x))
        self._ctx.copy_(context_after(self._ctx, rows.ids + 1))
        if self._h_last is not None and rows.streams is not None:
            self._h_last.copy_(rows.streams[-1])

    # -- one call's rows through every layer --------------------------------------------------------
    def _layers(self, ids: torch.Tensor, step: Step | TreeStep, rec: _Verified | None,
                capture: Capture | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # ids: [T] -> (hidden after the final mixer [T, H], taps);
        # a Step advances the state, a TreeStep fills rec
        cfg, w, op = self.cfg, self.w, self._op
        mm = op["linear_rows"] if rowwise(step) else batched
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)          # [T, R] each
        ctx = read_context(self._ctx, self._eos)                                       # the tokens before
        x = w.embed[ids].repeat(1, cfg.hc_count)                                       # x: [T, n*H]
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(w.layers):
            slot = cfg.slot(i)
            if layer.ple is not None:
                m = cfg.ple_slot(i)
                assert m is not None
                add, conv_in = ple(op, mm, x, ids, layer.ple, cfg, step, self._ple_conv[m], ctx)
                x = x + add
                if rec is not None:
                    rec.rows.ple_in[m] = conv_in
            mix = partial(self._mixer, layer.mixer, slot, step, rec, mm, cos, sin)
            x = decoder_block(op, mm, x, layer, cfg, mix, capture, f"layer {i}", self._experts(step))
            if i in self._taps:
                taps[i] = x
        if rec is not None:                                                            # a verify: kept
            if self._h_last is not None:
                rec.rows = rec.rows._replace(streams=x)
        else:                                                                          # a step: appended
            self._ctx.copy_(context_after(self._ctx, ids + 1))
            if self._h_last is not None:
                self._h_last.copy_(x[-1])
        out, _ = hyper_mix(op, mm, x, w.final_hc, cfg)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out, taps

    def _experts(self, step: Step | TreeStep) -> Callable[[torch.Tensor, Any], torch.Tensor] | None:
        """The MoE form of a call (None: ``blocks.moe``, each selected expert over its rows)."""
        return None

    def _mixer(self, mixer: GDNWeights | AttentionWeights, slot: int, step: Step | TreeStep,
               rec: _Verified | None, mm: Callable[[Any, torch.Tensor], torch.Tensor], cos: torch.Tensor,
               sin: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # a layer's token mixer, h: [T, H] -> [T, H], over its slot's state; a verify keeps what a commit
        # needs
        if isinstance(mixer, GDNWeights):
            out, rule = gated_deltanet(self._op, mm, h, mixer, self.cfg, step, self._S[slot],
                                       self._conv[slot], self.gdn_chunk)
            if rec is not None and rule is not None:
                rec.rows.rule[slot] = rule
            return out
        out, kv = indexed_attention(self._op, mm, h, mixer, self.cfg, step, self._K[slot], self._V[slot],
                                    self._IK[slot], cos, sin, self._inv_freq)
        if rec is not None and kv is not None:
            rec.attention[slot] = kv
        return out

    # -- what computes the rows ----------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The plugin's and the ops' source files, the arithmetic settings, the dtype and the weights'
        identity."""
        files = runner_files(self.w)
        files |= {Path(inspect.getsourcefile(fn) or "").resolve() for fn in self._op.values()}
        settings = {"dtype": self.w.dtype, "gdn_chunk": self.gdn_chunk, "device": self.device.type}
        extra = {"arch": "qwen4_exp", "weights": self.w.identity, "config": asdict(self.cfg),
                 "ops": {n: f"{fn.__module__}:{fn.__qualname__}" for n, fn in sorted(self._op.items())}}
        return Manifest(tuple(sorted(str(f) for f in files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        """The weights on the device, the PLE tables on the host (memory-mapped from the checkpoint), every
        section and the views."""
        dev = str(self.device)

        def nbytes(*ts: torch.Tensor) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        parts = [MemoryPart("weights", self.w.nbytes, dev),
                 MemoryPart("ple.tables", self.w.table_bytes, "cpu (memory-mapped)")]
        parts += [MemoryPart(name, nbytes(t), dev) for name, t in self._sections.items()]
        parts += [MemoryPart("kv", nbytes(self._K, self._V), dev),
                  MemoryPart("indexer.keys", nbytes(self._IK), dev)]
        return parts

    def __repr__(self) -> str:
        return (f"FlashNextRunner({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, "
                f"{self.spec.max_context} tokens)")
