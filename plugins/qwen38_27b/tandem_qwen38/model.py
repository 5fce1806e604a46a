"""Qwen38Engine: the dense Gated DeltaNet / gated attention hybrid, one sequence (batch 1).

A layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is a Gated
DeltaNet (``linear_attention``) or gated attention (``full_attention``), as the
config's ``layer_types`` say. The engine owns every buffer its sequence needs,
allocated once for ``max_context`` tokens:

    gdn.S     [L_gdn, Hv, Dk, Dv]        fp32   recurrent state of each Gated DeltaNet layer
    gdn.conv  [L_gdn, conv_dim, K-1]     act    the last K-1 conv inputs of each Gated DeltaNet layer
    K, V      [L_attn, Hkv, max_ctx, D]  act    keys (after q/k norm and rope) and values, token axis 2

``L_gdn``/``L_attn`` index the layers of each kind in order (``cfg.slot(layer)``).
``state`` is a live ``ModelState`` over exactly these tensors: a ``restore`` or
``resume`` into it lands in the buffers, sets ``kv.length`` and drops the
verified tree and the pending tokens (they described the state it replaced).

Hot verbs: ``forward(tokens, all_logits=False)``, ``forward_tree``, ``forward_block``,
``commit_tree``, ``rollback_to``, ``picks``, ``hidden_post_norm``, ``kv.length``,
``state``, ``reset``. Cold verbs: ``caps``, ``cache_state``, ``resume_at``, ``settle``,
``discard_pending``, ``trim_pending``, ``manifest``, ``memory_parts``. Diagnostics:
``trace_forward``/``trace_tree`` (the self-check's ``LayerTrace``).

Three forms of one layer code, chosen by what a call appends:

- prefill (``forward`` of several tokens, a ``Step``): rows batched through every
  op, the Gated DeltaNet in its chunked form. Not row invariant, and need not be:
  plain and speculative decoding start from the same prefill.
- decode (``forward`` of one token, a ``Step`` of one row): the recurrent form,
  every projection through the row-invariant ``linear_rows`` op.
- verify (``forward_tree``, a ``TreeStep``): every projection through
  ``linear_rows``, the conv, the gated delta rule and attention through their tree
  ops, each node from its parent's state and over its own ancestors; norms and
  activations batched (row invariant, see ``tandem_core.ops.rows``). Every
  verified row equals the decode step's row at that position bit for bit.

Committing a path recomputes the Gated DeltaNet state along it with the recurrent
form (token by token the decode step's own update), from the nodes' kept rule
inputs (q, k, v, decay, beta: a few KiB a node and layer), instead of keeping
every node's state from the verify (a state a node and layer: 3 MiB each on the
27B, 9 GiB for a 64-node tree); the result is the decode step's state bit for
bit and costs the path's length in recurrent steps a layer. The K/V rows of the path are copied from the
verify, the conv tail is the path's last K-1 inputs.

Pending tokens: what ``commit_tree`` appends since the last ``settle`` can be taken
back (``trim_pending``, ``rollback_to``): the engine keeps the recurrent sections
as they were at the settle and the committed nodes' rule inputs, and replays them
up to the new length. ``forward`` settles first: its tokens are permanent.

Every op comes from ``tandem_core.ops`` for the engine's device (a kernel where
one is registered, else the plain-torch reference).

On a CUDA device with Triton importable and bf16 dense weights, the hot verbs run
on ``tandem_qwen38.cuda_graphs.CudaRunner`` over these same buffers: ``forward`` of
one token replays the decode graph, of more runs the chunked prefill; ``forward_tree``
and ``forward_block`` replay the verify graph of the smallest captured width that holds
the tree (``caps.max_tree`` is the widest); ``commit_tree`` is the runner's commit,
which also keeps the path's rule rows so ``trim_pending``/``rollback_to`` replay them
from the state kept at the settle. ``kv.length`` stays on the host; the K/V buffers
hold ``caps.max_tree`` positions past ``max_context`` (a verify writes node ``i``'s
row at ``length + i``). No layer trace there (``caps.trace`` off). The kernels whose
contract equals a reference op's are registered for ``"cuda"``
(``tandem_core.ops.cuda_backend``) when such an engine is built.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tandem_core import ops
from tandem_core.engine import Capabilities, Manifest, MemoryPart, TreeOut
from tandem_core.ops import _tree
from tandem_core.ops import attention as _attention_mod
from tandem_core.ops import rope as _rope
from tandem_core.ops.conv import conv_tail
from tandem_core.spec.selfcheck import Trace
from tandem_core.state import ModelState, View

from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.weights import AttentionWeights, GDNWeights, MLPWeights, Qwen38Weights

__all__ = ["Qwen38Engine", "ContextFull", "Step", "TreeStep", "LiveState", "KVLength", "ENGINE_OPS"]

# the ops this engine calls, resolved once per engine for its device
ENGINE_OPS = ("rms_norm_1p", "gated_rms_norm", "l2_norm", "causal_conv", "gdn_chunk", "gdn_recurrent", "rope",
              "attention", "sigmoid", "silu", "softplus",
              "linear_rows", "causal_conv_tree", "gdn_tree", "attention_tree")

Capture = list[tuple[str, torch.Tensor]]   # (point name, hidden rows [T, H]) in forward order


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
    the engine's ``kv.length`` (a restore sets it). A ``restore`` or ``resume`` calls ``on_change``: the
    engine forgets what described the state before (its verified tree and pending tokens)."""

    def __init__(self, kv: KVLength, sections: dict[str, torch.Tensor], views: dict[str, View],
                 on_change: Callable[[], None]) -> None:
        self._kv = kv
        self._on_change = on_change
        super().__init__(sections, views, kv.length)

    @property  # type: ignore[override]
    def length(self) -> int:
        return self._kv.length

    @length.setter
    def length(self, n: int) -> None:
        self._kv.length = int(n)

    def restore(self, snap: ModelState, length: int | None = None) -> None:
        super().restore(snap, length)
        self._on_change()

    def resume(self, n: int, sections: Any = None) -> None:
        super().resume(n, sections)
        self._on_change()


@dataclass(frozen=True)
class Step:
    """What one ``forward`` appends: ``count`` rows at positions ``start .. start + count - 1``."""

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

    @property
    def rowwise(self) -> bool:
        """A decode step: projections through the row-invariant ``linear_rows`` op."""
        return self.count == 1


@dataclass(frozen=True)
class TreeStep:
    """What one ``forward_tree`` verifies: ``len(parents)`` nodes on top of ``start`` committed tokens,
    node ``i`` at position ``start + depth[i]``."""

    start: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.parents)

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long, device=device) + self.start   # [N]

    @property
    def rowwise(self) -> bool:
        return True


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
    """The last verified tree: what ``commit_tree`` needs of it."""

    step: TreeStep
    rule: dict[int, _RuleRows] = field(default_factory=dict)                     # by GDN slot, [N] rows
    # by attention slot: the nodes' keys and values [N, Hkv, D]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Pending:
    """Tokens committed since the last ``settle``: the sections at ``start`` and the rule rows after it."""

    start: int
    S: torch.Tensor                                   # gdn.S at ``start``
    conv: torch.Tensor                                # gdn.conv at ``start``
    # one entry a commit: by GDN slot (the reference path), or the CUDA runner's ``PathRows``
    rows: list[Any] = field(default_factory=list)
    count: int = 0


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class Qwen38Engine:
    """One sequence of a Qwen3.5-architecture model over shared ``Qwen38Weights``.

    ``max_context``: tokens the buffers hold. ``prefill_chunk``: rows a forward runs
    through all layers at a time. ``gdn_chunk``: tokens per chunk of the chunked
    gated delta rule. ``max_tree``: the most nodes one ``forward_tree`` verifies.
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
        self.prefill_chunk = int(prefill_chunk)
        self.gdn_chunk = int(gdn_chunk)
        self.max_context = int(max_context)
        self.max_tree = int(max_tree)
        widths = _cuda_widths(cfg, weights, self.max_tree)       # () unless the CUDA graph path runs
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in ENGINE_OPS}

        n_gdn, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
        dev, act = self.device, self.act_dtype
        self._S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=dev)
        self._conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=act, device=dev)
        slack = widths[-1] if widths else 0                      # a verify's rows past the last position
        kv_shape = (n_attn, cfg.num_key_value_heads, self.max_context + slack, cfg.head_dim)
        self._K = torch.zeros(kv_shape, dtype=act, device=dev)
        self._V = torch.zeros(kv_shape, dtype=act, device=dev)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, dev)

        self.kv = KVLength()
        self._state = LiveState(self.kv, {"gdn.S": self._S, "gdn.conv": self._conv},
                                {"K": View(self._K, 2), "V": View(self._V, 2)}, self._forget)
        self._hidden: list[torch.Tensor] = []
        self._hidden_cat: torch.Tensor | None = None
        self._tree: _Verified | None = None
        self._pending: _Pending | None = None
        self._cuda: Any = None                                  # the CudaRunner, when the graph path runs
        if widths:
            self._build_cuda(widths)
        self.caps = Capabilities(tree=True, resume=True, recurrent=True, max_context=self.max_context,
                                 max_tree=self.max_tree, hidden_layers=(),
                                 device="cuda" if dev.type == "cuda" else str(dev),
                                 dtype=weights.dtype, trace=self._cuda is None, prefill_chunk=self.prefill_chunk)

    def _build_cuda(self, widths: tuple[int, ...]) -> None:
        """The CUDA graph path over this engine's buffers: fused weights (shared by every engine over these
        weights), the runner, its graphs captured now, and the sections kept at a settle."""
        from tandem_qwen38.cuda_graphs import CudaRunner, fuse_weights

        run = CudaRunner(self.cfg, fuse_weights(self.w, self.cfg), self._S, self._conv, self._K, self._V,
                         max_context=self._K.shape[2], widths=widths, prefill_chunk=self.prefill_chunk)
        with torch.no_grad():
            run.capture()
        self._cuda = run
        self.max_tree = widths[-1]
        self._keep_S = torch.empty_like(self._S)
        self._keep_conv = torch.empty_like(self._conv)

    # -- hot verbs ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64); return fp32 logits ``[T, V]`` (``all_logits``) or ``[1, V]`` (last).

        Runs ``prefill_chunk`` rows at a time through every layer; the result equals one
        full forward within fp32 rounding. One token is a decode step (the rows a verify
        must equal). Settles the pending tokens and drops a verified tree first. The
        returned tensor is new.
        """
        return self._forward(tokens, all_logits, None)

    def forward_tree(self, tokens: torch.Tensor | Sequence[int],
                     parents: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify ``tokens`` ([N] int64) as a tree on top of the sequence (``parents[i] < i``, -1 for a child
        of the last committed token; node ``i`` at position ``kv.length + depth(i)``). Returns fp32
        ``logits [N, V]``: row ``i`` equals, bit for bit, the decode step's row after committing the
        path root..i. Nothing committed changes; the tree stays until the next ``forward_tree``,
        ``forward``, ``commit_tree`` or ``discard_pending``. At most ``caps.max_tree`` nodes."""
        return self._forward_tree(tokens, parents, None)

    def forward_block(self, tokens: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify a chain (node ``i``'s parent is ``i - 1``)."""
        n = int(torch.as_tensor(tokens).numel())
        return self._forward_tree(tokens, list(range(-1, n - 1)), None)

    @torch.no_grad()
    def commit_tree(self, path: Sequence[int] | torch.Tensor) -> None:
        """Append the nodes of ``path`` (indices into the last verified tree, root to leaf) to the sequence:
        their K/V rows, the conv tail and the Gated DeltaNet state after the last of them (recomputed
        along the path by the recurrent form, token by token the decode step's update). The rest of the
        tree leaves no trace.
        The appended tokens are pending until ``settle``. An empty path commits nothing."""
        tree = self._tree
        if tree is None:
            raise RuntimeError("commit_tree: no verified tree (forward_tree first; forward, discard_pending, "
                               "a commit or a state restore drops it)")
        if tree.step.start != self.kv.length:
            raise RuntimeError(f"commit_tree: the tree was verified on {tree.step.start} tokens, the "
                               f"sequence now holds {self.kv.length}")
        idx = [int(i) for i in (path.tolist() if isinstance(path, torch.Tensor) else path)]
        parents = tree.step.parents
        for j, i in enumerate(idx):
            if not 0 <= i < len(parents):
                raise ValueError(f"commit_tree: path[{j}] = {i} is not a node of the verified tree "
                                 f"({len(parents)} nodes)")
            want = -1 if j == 0 else idx[j - 1]
            if parents[i] != want:
                raise ValueError(f"commit_tree: path[{j}] = node {i} has parent {parents[i]}, not {want} "
                                 f"(a path runs root to leaf)")
        self._tree = None
        if not idx:
            return
        if self._cuda is not None:
            self._cuda_commit(idx)
            return
        at = torch.tensor(idx, dtype=torch.long, device=self.device)
        start, P = self.kv.length, len(idx)
        if self._pending is None:
            self._pending = _Pending(start, self._S.clone(), self._conv.clone())
        rule = {slot: rows.take(at) for slot, rows in tree.rule.items()}
        self._advance(rule)
        for slot, (k, v) in tree.kv.items():
            self._K[slot, :, start:start + P] = k.index_select(0, at).transpose(0, 1)
            self._V[slot, :, start:start + P] = v.index_select(0, at).transpose(0, 1)
        self.kv.length = start + P
        self._pending.rows.append(rule)
        self._pending.count += P

    @torch.no_grad()
    def rollback_to(self, n: int) -> None:
        """Forget every token past ``n``, within the pending tokens (committed since the last ``settle``):
        the sections come back from the settle point and the kept rule rows are replayed to ``n``.
        Earlier positions need a cache anchor (``state.resume`` / ``resume_at``). Drops a verified tree."""
        length = self.kv.length
        if not 0 <= n <= length:
            raise ValueError(f"rollback_to({n}): the sequence holds {length} tokens")
        self._tree = None
        if n == length:
            return
        pend = self._pending
        first = length if pend is None else pend.start
        if pend is None or n < first:
            raise ValueError(f"rollback_to({n}): only pending tokens can be taken back (positions {first}.."
                             f"{length}, committed since the last settle); an earlier position needs a cache "
                             f"anchor (state.resume)")
        self._S.copy_(pend.S)
        self._conv.copy_(pend.conv)
        keep = n - pend.start
        if self._cuda is not None:
            if keep:
                from tandem_qwen38.cuda_graphs import PathRows

                rows = PathRows.cat(pend.rows).head(keep)
                self._cuda.replay(rows)
                pend.rows = [rows]
            else:
                pend.rows = []
            pend.count = keep
            self.kv.length = n
            return
        kept: dict[int, _RuleRows] = {}
        if keep:
            kept = {slot: _RuleRows.cat([r[slot] for r in pend.rows]).head(keep) for slot in pend.rows[0]}
            self._advance(kept)
        pend.rows = [kept] if keep else []
        pend.count = keep
        self.kv.length = n

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks: ``[R, V] -> [R]``."""
        return logits.argmax(dim=-1)

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's (or verified tree's) hidden states after the final norm, ``[T, H]`` (``[N, H]``
        by node after ``forward_tree``, kept through its commit); valid until the next forward."""
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
        """Forget the sequence: length 0, recurrent and conv state zero, no tree, nothing pending."""
        self._S.zero_()
        self._conv.zero_()
        self.kv.length = 0
        self._hidden, self._hidden_cat = [], None
        self._forget()

    # -- cold verbs: pending tokens and the caches ---------------------------------------------------
    def settle(self) -> None:
        """Make the pending tokens permanent and free what was kept to take them back."""
        self._pending = None

    def discard_pending(self) -> None:
        """Drop the last verified tree (nothing committed changes)."""
        self._tree = None

    def trim_pending(self, n: int) -> None:
        """Take back the last ``n`` tokens committed since the last ``settle``."""
        count = 0 if self._pending is None else self._pending.count
        if not 0 <= n <= count:
            raise ValueError(f"trim_pending({n}): {count} tokens are pending "
                             f"(committed since the last settle)")
        self.rollback_to(self.kv.length - n)

    def resume_at(self, n: int, sections: dict[str, torch.Tensor] | None = None) -> None:
        """Take the sequence back to ``n`` tokens whose K/V rows are already in the buffers, with the
        recurrent ``sections`` after exactly ``n`` tokens (an anchor's). Without ``sections``, ``n`` must be
        the current length (the caches set the state already and say so). Drops the verified tree and
        the pending tokens (``state.resume``, which this is, raises naming a mismatch)."""
        self._state.resume(n, sections)

    def _forget(self) -> None:
        self._tree = None
        self._pending = None

    # -- diagnostics (tandem_core.spec.selfcheck.LayerTrace) --------------------------------------------
    def trace_forward(self, tokens: torch.Tensor | Sequence[int]) -> Trace:
        """``forward(tokens, all_logits=True)`` that also returns the hidden rows after every layer's mixer
        and MLP (the sequence advances as by ``forward``)."""
        self._no_trace("trace_forward")
        capture: Capture = []
        logits = self._forward(tokens, True, capture)
        return _trace(capture, logits)

    def trace_tree(self, tokens: torch.Tensor | Sequence[int],
                   parents: torch.Tensor | Sequence[int]) -> Trace:
        """``forward_tree`` that also returns the hidden rows after every layer's mixer and MLP (the tree is
        left verified as by ``forward_tree``)."""
        self._no_trace("trace_tree")
        capture: Capture = []
        out = self._forward_tree(tokens, parents, capture)
        return _trace(capture, out.logits)

    def _no_trace(self, verb: str) -> None:
        if self._cuda is not None:
            raise RuntimeError(f"{verb}: the CUDA graph path keeps no per-layer rows (caps.trace is off)")

    # -- the forms ----------------------------------------------------------------------------------
    def _ids(self, tokens: torch.Tensor | Sequence[int], verb: str) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(self.device)
        if ids.numel() == 0:
            raise ValueError(f"{verb}: no tokens")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"{verb}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                             f"(size {self.cfg.vocab_size})")
        return ids

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor | Sequence[int], all_logits: bool,
                 capture: Capture | None) -> torch.Tensor:
        if self._cuda is not None:
            return self._cuda_forward(tokens, all_logits)
        ids = self._ids(tokens, "forward")
        T = int(ids.numel())
        self._check_room(T)
        self.settle()
        self._tree = None
        self._hidden, self._hidden_cat = [], None
        logits = []
        step = Step(self.kv.length, T)
        for s in range(0, T, self.prefill_chunk):
            piece = ids[s:s + self.prefill_chunk]
            step = Step(self.kv.length, int(piece.numel()))
            h = self._layers(piece, step, None, capture)                # h: [t, H] after the final norm
            self.kv.length = step.end
            self._hidden.append(h)
            if all_logits:
                logits.append(self._mm(step)(self.w.head, h))
        if not all_logits:
            logits.append(self._ops["linear_rows"](self.w.head, self._hidden[-1][-1:]))
        return torch.cat(logits).float()

    @torch.no_grad()
    def _forward_tree(self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int],
                      capture: Capture | None) -> TreeOut:
        if self._cuda is not None:
            return self._cuda_tree(tokens, parents)
        ids = self._ids(tokens, "forward_tree")
        step = self._tree_step(int(ids.numel()), parents)
        self._tree = None
        tree = _Verified(step)
        h = self._layers(ids, tree.step, tree, capture)                    # h: [N, H] after the final norm
        self._hidden, self._hidden_cat = [h], None
        self._tree = tree
        return TreeOut(self._ops["linear_rows"](self.w.head, h).float())

    def _check_room(self, T: int) -> None:
        if self.kv.length + T > self.max_context:
            raise ContextFull(f"forward: {self.kv.length} tokens held + {T} new exceed max_context "
                              f"{self.max_context}")

    def _tree_step(self, N: int, parents: torch.Tensor | Sequence[int]) -> TreeStep:
        """The checked ``TreeStep`` of ``N`` nodes with ``parents`` on top of the sequence."""
        par = _tree.as_parents(parents)
        if len(par) != N:
            raise ValueError(f"forward_tree: {N} tokens but {len(par)} parents")
        if N > self.max_tree:
            raise ValueError(f"forward_tree: {N} nodes exceed max_tree {self.max_tree} (caps.max_tree)")
        depth = _tree.depths(par)
        if self.kv.length + max(depth) + 1 > self.max_context:
            raise ContextFull(f"forward_tree: {self.kv.length} tokens held + a path of {max(depth) + 1} "
                              f"exceed max_context {self.max_context}")
        return TreeStep(self.kv.length, tuple(par), tuple(depth))

    # -- the CUDA graph path (``self._cuda``: tandem_qwen38.cuda_graphs.CudaRunner) -------------------
    def _host_ids(self, tokens: torch.Tensor | Sequence[int], verb: str) -> list[int]:
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()
        if not ids:
            raise ValueError(f"{verb}: no tokens")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"{verb}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                             f"(size {self.cfg.vocab_size})")
        return ids

    def _cuda_forward(self, tokens: torch.Tensor | Sequence[int], all_logits: bool) -> torch.Tensor:
        # one token: the decode graph (the rows a verify equals); more: the chunked prefill
        ids = self._host_ids(tokens, "forward")
        self._check_room(len(ids))
        self.settle()
        self._tree = None
        run = self._cuda
        run.length = self.kv.length
        if len(ids) == 1:
            logits = run.decode(ids[0]).float()                              # [1, V], a new tensor
            self._hidden, self._hidden_cat = [run.h[:1]], None
        else:
            hidden: list[torch.Tensor] = []
            logits = run.prefill(ids, all_logits, hidden)                    # fp32, new
            self._hidden, self._hidden_cat = hidden, None
        self.kv.length = run.length
        return logits

    def _cuda_tree(self, tokens: torch.Tensor | Sequence[int],
                   parents: torch.Tensor | Sequence[int]) -> TreeOut:
        ids = self._host_ids(tokens, "forward_tree")
        step = self._tree_step(len(ids), parents)
        self._tree = None
        run = self._cuda
        run.length = self.kv.length
        logits = run.verify(ids, step.parents).float()                       # [N, V], a new tensor
        self._hidden, self._hidden_cat = [run.h[:step.count]], None
        self._tree = _Verified(step)
        return TreeOut(logits)

    def _cuda_commit(self, idx: list[int]) -> None:
        # the runner's commit (K/V rows, conv tails, the state replayed along the path), keeping the path's
        # rule rows; the sections at the settle are kept once, in buffers allocated with the engine
        if self._pending is None:
            self._keep_S.copy_(self._S)
            self._keep_conv.copy_(self._conv)
            self._pending = _Pending(self.kv.length, self._keep_S, self._keep_conv)
        run = self._cuda
        run.length = self.kv.length
        rows = run.commit(idx, keep=True)
        self.kv.length = run.length
        self._pending.rows.append(rows)
        self._pending.count += len(idx)

    def _mm(self, step: Step | TreeStep) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """How this step multiplies by a weight: row-invariant for a decode step and a verify."""
        return self._ops["linear_rows"] if step.rowwise else _batched

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
                capture: Capture | None) -> torch.Tensor:
        # ids: [T] -> hidden after the final norm [T, H]; a Step advances the state, a TreeStep fills ``tree``
        cfg, w = self.cfg, self.w
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
        out = norm(x, w.norm, cfg.rms_norm_eps)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out

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
            if step.recurrent:
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
                                step.mask(self.device), D ** -0.5)               # o: [T, Hq, D]
        o = o.reshape(T, hq * D) * op["sigmoid"](gate).to(self.act_dtype)
        return mm(w.o, o)

    def _mlp(self, x: torch.Tensor, w: MLPWeights, step: Step | TreeStep) -> torch.Tensor:
        # x: [T, H] -> [T, H]: down(silu(gate(x)) * up(x))
        mm = self._mm(step)
        return mm(w.down, self._ops["silu"](mm(w.gate, x)).to(self.act_dtype) * mm(w.up, x))

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
        if self._cuda is not None:
            from tandem_core.ops import triton_matmul
            from tandem_qwen38 import cuda_graphs

            files.add(Path(inspect.getsourcefile(cuda_graphs) or "").resolve())
            kernels = ("triton_matmul.py", "triton_fused.py", "triton_gdn.py", "triton_attention.py")
            files |= {Path(inspect.getsourcefile(triton_matmul) or "").with_name(n).resolve() for n in kernels}
            settings["path"] = "cuda_graphs"
            settings["widths"] = list(self._cuda.widths)
            settings["matmul_plans"] = {f"{n}x{k}": asdict(p) for (n, k), p in sorted(self._cuda.plans.items())}
        return Manifest(tuple(sorted(str(f) for f in files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        parts = [
            MemoryPart("weights", self.w.nbytes, dev),
            MemoryPart("gdn.S", nbytes(self._S), dev),
            MemoryPart("gdn.conv", nbytes(self._conv), dev),
            MemoryPart("kv", nbytes(self._K) + nbytes(self._V), dev),
        ]
        if self._cuda is not None:
            keep = nbytes(self._keep_S) + nbytes(self._keep_conv)
            parts.append(MemoryPart("cuda.workspace", self._cuda.workspace_bytes() + keep, dev))
        return parts

    def __repr__(self) -> str:
        return (f"Qwen38Engine({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, "
                f"{self.kv.length}/{self.max_context} tokens)")


def _cuda_widths(cfg: Qwen38Config, weights: Qwen38Weights, max_tree: int) -> tuple[int, ...]:
    """The verify widths the CUDA graph path captures for ``max_tree``, or ``()`` when it does not run here
    (not a CUDA device, no Triton, or weights and shapes its kernels do not read). On a CUDA device it
    also registers the CUDA kernels of the reference ops (``tandem_core.ops.cuda_backend``)."""
    if weights.device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return ()
    from tandem_core.ops import cuda_backend
    from tandem_qwen38.cuda_graphs import runner_widths, unsupported

    cuda_backend.install()
    return () if unsupported(cfg, weights) else runner_widths(max_tree)


def _trace(capture: Capture, logits: torch.Tensor) -> Trace:
    """Capture points (one entry a prefill chunk) as a ``Trace``: rows by point, chunks concatenated."""
    names: list[str] = []
    rows: dict[str, list[torch.Tensor]] = {}
    for name, t in capture:
        if name not in rows:
            names.append(name)
            rows[name] = []
        rows[name].append(t)
    return Trace(tuple(names), tuple(torch.cat(rows[n]) for n in names), logits)
