"""FlashNextModel: the arithmetic of one Flash-Next sequence (batch 1), in the runner's shape.

A layer on ``n`` residual streams ``x: [T, n*H]`` (the embedding repeated ``n`` times
to start):

    x = x + ple(x, tokens)                          (PLE layers only)
    h, w = attn_hyper_connection(x);  x = x + w * mixer(h)      (Gated DeltaNet or QSA attention)
    h, w = mlp_hyper_connection(x);   x = x + w * moe(h)
    ...
    hidden = hyper_connection_mixer(x)              (in place of a final norm), logits = lm_head(hidden)

The model owns every buffer its sequence needs, allocated once for ``max_context`` tokens:

    sections  gdn.S       [L_gdn, Hv, Dk, Dv]          fp32   each Gated DeltaNet layer's recurrent state
              gdn.conv    [L_gdn, conv_dim, K-1]       act    its last K-1 conv inputs
              ple.conv    [L_ple, n*H, (Kp-1)*d]       act    each PLE module's last dilated-conv inputs
              ngram.ctx   [ngram_size - 1]             int64  the last tokens (eos before the first one)
              mtp.h_last  [n*H]                        act    the last token's streams before the final mixer
                                                              (what the MTP head reads; ``last_streams=True``)
    views     K, V        [L_attn, Hkv, max_ctx, D]    act    keys (after k_norm and rope) and values, axis 2
              IK          [L_attn, max_ctx, Di]        act    the indexer's raw keys, axis 1

Verbs (the runner's, ``docs/architecture.md``): ``buffers()``, ``prefill(ids, start)``
(several tokens, batched), ``decode(ids, start)`` (one token: the row-invariant form),
``verify(ids, tree)`` (a token tree, nothing committed; row ``i`` equals the decode row
after committing path root..i bit for bit), ``commit(tree, path)`` (the path's K/V/IK
rows from the verify, every section advanced along the path as decode would: the
Gated DeltaNet state by the recurrent form over the kept rule rows, the conv tails,
the n-gram context), ``replay(kept, n)`` (redo the first ``n`` tokens of kept commits on
sections put back to an earlier point), ``reset()``.

``taps``: layers whose output streams ``[T, n*H]`` a call returns in ``Rows.taps`` (the MTP head
reads the last layer's: the streams before the final mixer).

Every op comes from ``tandem_core.ops.get`` for the device; the PLE tables stay on the
host and a step gathers its rows there (``tandem_flashnext.ngram.RowTable``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core import ops
from tandem_core.ops import rope as _rope
from tandem_core.ops.conv import conv_tail

from tandem_flashnext.blocks import RuleRows, decoder_block, gated_deltanet, hyper_mix
from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.ngram import context_after
from tandem_flashnext.ple import ple
from tandem_flashnext.qsa import AttentionRows, indexed_attention
from tandem_flashnext.steps import Capture, Rows, Step, TreeStep, batched
from tandem_flashnext.weights import AttentionWeights, FlashNextWeights, GDNWeights

__all__ = ["FlashNextModel", "PathRows", "MODEL_OPS"]

# the ops this model calls, resolved once per model for its device
MODEL_OPS = ("rms_norm", "rms_norm_1p", "gated_rms_norm", "l2_norm", "causal_conv", "gdn_chunk",
             "gdn_recurrent", "rope", "attention", "sigmoid", "silu", "softplus", "softmax", "linear_rows",
             "causal_conv_tree", "gdn_tree")


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


class FlashNextModel:
    """One Flash-Next sequence over shared ``FlashNextWeights``.

    ``max_context``: tokens the buffers hold (a verify's scratch rows included). ``gdn_chunk``: tokens per
    chunk of the chunked gated delta rule in a prefill. ``taps``: layers whose output streams every call
    returns. ``last_streams``: keep the last token's final streams as the section ``mtp.h_last``.
    """

    def __init__(self, cfg: FlashNextConfig, weights: FlashNextWeights, *, max_context: int,
                 gdn_chunk: int = 64, taps: Sequence[int] = (), last_streams: bool = False) -> None:
        if max_context <= 0 or gdn_chunk <= 0:
            raise ValueError(f"max_context ({max_context}) and gdn_chunk ({gdn_chunk}) must be positive")
        self.cfg, self.w = cfg, weights
        self.device, self.act_dtype = weights.device, weights.act_dtype
        self.max_context, self.gdn_chunk = int(max_context), int(gdn_chunk)
        bad = [t for t in taps if not 0 <= t < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"taps: layer {bad[0]} is not one of the model's {cfg.num_hidden_layers} layers")
        self.taps = tuple(sorted(set(int(t) for t in taps)))
        self._op: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in MODEL_OPS}
        dev, act = self.device, self.act_dtype
        n_gdn, n_attn, n_ple = len(cfg.linear_layers), len(cfg.attention_layers), len(cfg.ple_layer_ids)
        self._S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=dev)
        self._conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=act, device=dev)
        self._ple_conv = torch.zeros(n_ple, cfg.hc_dim, cfg.ple_conv_tail, dtype=act, device=dev)
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        self._eos = eos
        self._ctx = torch.full((cfg.ngram_size - 1,), eos, dtype=torch.long, device=dev)
        kv_shape = (n_attn, cfg.num_key_value_heads, self.max_context, cfg.head_dim)
        self._K = torch.zeros(kv_shape, dtype=act, device=dev)
        self._V = torch.zeros(kv_shape, dtype=act, device=dev)
        self._IK = torch.zeros(n_attn, self.max_context, cfg.indexer_head_dim, dtype=act, device=dev)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)
        self._h_last = torch.zeros(cfg.hc_dim, dtype=act, device=dev) if last_streams else None
        self._verified: _Verified | None = None

    # -- the state ------------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, int]]]:
        """The live state's tensors: sections (copied whole) and views (tensor, token axis). The model's
        own buffers: a restore into them is what the next call reads."""
        sections = {"gdn.S": self._S, "gdn.conv": self._conv}
        if self.cfg.ple_layer_ids:
            sections.update({"ple.conv": self._ple_conv, "ngram.ctx": self._ctx})
        if self._h_last is not None:
            sections["mtp.h_last"] = self._h_last
        views = {"K": (self._K, 2), "V": (self._V, 2), "IK": (self._IK, 1)}
        if not self.cfg.attention_layers:
            views = {}
        return sections, views

    def reset(self) -> None:
        """The sequence's start: recurrent state and conv tails zero, the n-gram context all eos."""
        self._S.zero_()
        self._conv.zero_()
        self._ple_conv.zero_()
        self._ctx.fill_(self._eos)
        if self._h_last is not None:
            self._h_last.zero_()
        self._verified = None

    # -- the verbs ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: int, *, logits: str = "all",
                capture: Capture | None = None) -> Rows:
        """Append ``ids`` ([T] int64) at positions ``start ..``: views' rows written, sections advanced;
        batched arithmetic. ``logits``: "all" ([T, V]), "last" ([1, V]) or "none"."""
        step = Step(int(start), int(ids.numel()))
        self._check_room(step.end)
        h, taps = self._layers(ids, step, None, capture)
        self._ctx.copy_(context_after(self._ctx, ids))
        if logits == "all":
            out: torch.Tensor | None = batched(self.w.head, h).float()
        elif logits == "last":
            out = self._op["linear_rows"](self.w.head, h[-1:]).float()
        elif logits == "none":
            out = None
        else:
            raise ValueError(f"prefill: logits={logits!r} is not 'all', 'last' or 'none'")
        return Rows(h, out, taps)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, start: int, *, capture: Capture | None = None) -> Rows:
        """Append ONE token at ``start``: the row-invariant decode form."""
        if ids.numel() != 1:
            raise ValueError(f"decode: one token, got {ids.numel()}")
        step = Step(int(start), 1)
        self._check_room(step.end)
        h, taps = self._layers(ids.reshape(1), step, None, capture)
        self._ctx.copy_(context_after(self._ctx, ids.reshape(1)))
        return Rows(h, self._op["linear_rows"](self.w.head, h).float(), taps)

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        """Verify ``ids`` ([N]) as ``tree`` on top of ``tree.start`` committed tokens; nothing committed
        changes (the views' rows past ``tree.start`` are scratch). Row ``i`` equals the decode row after
        committing path root..i, bit for bit."""
        if ids.numel() != tree.count:
            raise ValueError(f"verify: {ids.numel()} tokens for a tree of {tree.count} nodes")
        self._check_room(tree.start + max(tree.depth) + 1)
        self._verified = None
        record = _Verified(tree, PathRows({}, {}, ids.reshape(-1).clone()))
        h, taps = self._layers(ids.reshape(-1), tree, record, capture)
        self._verified = record
        return Rows(h, self._op["linear_rows"](self.w.head, h).float(), taps)

    @torch.no_grad()
    def commit(self, tree: TreeStep, path: torch.Tensor | Sequence[int]) -> PathRows | None:
        """Append the last verify's nodes ``path`` (root to leaf) at ``tree.start``: K/V/IK rows from the
        verify, sections advanced along the path exactly as decode would. Returns what ``replay`` needs to
        redo it (None for an empty path)."""
        rec = self._verified
        if rec is None or rec.tree != tree:
            raise RuntimeError("commit: the tree is not the last one verified")
        idx = torch.as_tensor(list(path) if not isinstance(path, torch.Tensor) else path, dtype=torch.long)
        self._verified = None
        if idx.numel() == 0:
            return None
        at = idx.to(self.device)
        rows = rec.rows.take(at)
        self._advance(rows)
        s, P = tree.start, int(at.numel())
        for slot, kv in rec.attention.items():
            k, v, ik = kv.take(at)
            self._K[slot, :, s:s + P] = k.transpose(0, 1)
            self._V[slot, :, s:s + P] = v.transpose(0, 1)
            self._IK[slot, s:s + P] = ik
        return rows

    @torch.no_grad()
    def replay(self, kept: Sequence[PathRows], n: int) -> PathRows | None:
        """The sections are back at an earlier point: advance them along the first ``n`` tokens of ``kept``
        (commits in order) and return the record of those ``n``."""
        if n == 0 or not kept:
            return None
        rows = PathRows.cat(list(kept)).head(n)
        self._advance(rows)
        return rows

    def _advance(self, rows: PathRows) -> None:
        # the sections after appending rows' tokens: each token the decode step's own update
        step, scale = self._op["gdn_recurrent"], self.cfg.linear_key_head_dim ** -0.5
        for slot, r in rows.rule.items():
            _, S = step(r.q, r.k, r.v, r.g, r.beta, self._S[slot], scale=scale)
            self._S[slot].copy_(S)
            self._conv[slot].copy_(conv_tail(self._conv[slot], r.conv_in))
        for slot, x in rows.ple_in.items():
            self._ple_conv[slot].copy_(conv_tail(self._ple_conv[slot], x))
        self._ctx.copy_(context_after(self._ctx, rows.ids))
        if self._h_last is not None and rows.streams is not None and rows.count:
            self._h_last.copy_(rows.streams[-1])

    def _check_room(self, end: int) -> None:
        if end > self.max_context:
            raise ValueError(f"positions up to {end - 1} exceed the buffers' max_context {self.max_context}")

    # -- one call's rows through every layer --------------------------------------------------------
    def _layers(self, ids: torch.Tensor, step: Step | TreeStep, rec: _Verified | None,
                capture: Capture | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # ids: [T] -> (hidden after the final mixer [T, H], taps);
        # a Step advances the state, a TreeStep fills rec
        cfg, w, op = self.cfg, self.w, self._op
        mm = op["linear_rows"] if step.rowwise else batched
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)          # [T, R] each
        x = w.embed[ids].repeat(1, cfg.hc_count)                                       # x: [T, n*H]
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(w.layers):
            slot = cfg.slot(i)
            if layer.ple is not None:
                m = cfg.ple_slot(i)
                assert m is not None
                add, conv_in = ple(op, mm, x, ids, layer.ple, cfg, step, self._ple_conv[m], self._ctx)
                x = x + add
                if rec is not None:
                    rec.rows.ple_in[m] = conv_in
            mix = partial(self._mixer, layer.mixer, slot, step, rec, mm, cos, sin)
            x = decoder_block(op, mm, x, layer, cfg, mix, capture, f"layer {i}")
            if i in self.taps:
                taps[i] = x
        if self._h_last is not None:
            if rec is not None:
                rec.rows = rec.rows._replace(streams=x)
            else:
                self._h_last.copy_(x[-1])
        out, _ = hyper_mix(op, mm, x, w.final_hc, cfg)
        if capture is not None:
            capture.append(("final mixer", out.clone()))
        return out, taps

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
