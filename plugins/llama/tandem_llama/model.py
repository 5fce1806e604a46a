"""``LlamaEngine``: one Llama sequence (batch 1) on preallocated KV buffers, with the speculation verbs.

A decoder layer (read top-down)::

    h    = rmsnorm(x) * attn_norm
    q,k,v = qkv(h)                 # one matmul: [T, q_dim + 2 kv_dim]
    q,k  = rope(q, k)              # half-split rotary (Hugging Face's form) at positions [n, n+T)
    K[l, :, n:n+T], V[...] = k, v  # the KV buffers: [L, n_kv, max_ctx, head_dim]
    x   += o(attention(q, K[:n+T], V[:n+T]))   # grouped-query, causal
    h    = rmsnorm(x) * mlp_norm
    x   += down(silu(gate(h)) * up(h))        # gate and up in one matmul

then ``logits = lm_head(rmsnorm(x) * norm)`` (the embedding itself when tied).
Everything runs in fp32.

Three forms of one layer code, chosen by what a call appends:

- prefill (``forward`` of several tokens, a ``Step``): rows batched through every
  matmul (``prefill_chunk`` tokens at a time; a chunk reads the rows the earlier
  chunks wrote). Not row invariant, and need not be: plain and speculative
  decoding start from the same prefill.
- decode (``forward`` of one token, a ``Step`` of one row): every matmul through
  the row-invariant ``linear_rows`` op (``tandem_core.ops.rows``), the output head
  block by block of its rows (``head_blocks``, about 8 MiB each), attention one
  fused SDPA call over ``K[:, :n+1]``.
- verify (``forward_tree``, a ``TreeStep``): the same ``linear_rows`` for every
  matmul (the head in the same blocks, so a block stays in the CPU's cache while
  every row goes through it), and attention node by node in depth-first order,
  each node writing its key and value at ``n + depth`` (scratch past the
  sequence) and making the decode step's own SDPA call over
  ``K[:, :n + depth + 1]`` (the per-row form ``tandem_core.ops.attention.
  attention_tree`` documents). Norms, rotary, residual adds and the activation
  run batched: they are row invariant (``F.rms_norm`` and rotary measured so on
  the CPU; the activation is ``tandem_core.ops.act.silu``, since ATen's ``silu``
  is not). Every verified row equals the decode step's row at that position bit
  for bit; the load-time self-check proves it on the machine that serves.

Committing a path copies its nodes' K/V rows (kept from the verify) to the
sequence's next positions. There is no recurrent state, so ``rollback_to`` can
take the sequence back to any length: it only moves ``kv.length``.

The live state is one ``ModelState`` over the KV buffers (views ``K`` and ``V``,
token axis 2, no sections): ``engine.state.length`` is the sequence length; a
``restore`` or ``resume`` into it lands in the buffers the engine reads and drops
the verified tree and the pending tokens (they described the state it replaced).

Hot verbs: ``forward``, ``forward_tree``, ``forward_block``, ``commit_tree``,
``rollback_to``, ``picks``, ``hidden_post_norm``, ``kv.length``, ``state``,
``reset``. Cold verbs: ``caps``, ``cache_state``, ``resume_at``, ``settle``,
``discard_pending``, ``trim_pending``, ``manifest``, ``memory_parts``.
Diagnostics: ``trace_forward`` / ``trace_tree`` (the self-check's ``LayerTrace``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem_core import ops
from tandem_core.engine import Capabilities, Manifest, MemoryPart, TreeOut
from tandem_core.ops import _tree
from tandem_core.ops.attention import causal_mask
from tandem_core.ops.rows import ALIGN
from tandem_core.spec.selfcheck import Trace
from tandem_core.state import ModelState, View
from tandem_llama.config import LlamaConfig, inv_freq
from tandem_llama.formats import GGMLWeight
from tandem_llama.weights import LayerWeights, LlamaWeights

__all__ = [
    "ENGINE_OPS",
    "HEAD_BLOCK_BYTES",
    "LlamaEngine",
    "Step",
    "TreeStep",
    "attend",
    "head_blocks",
    "rope_rows",
    "rope_tables",
]

_HERE = Path(__file__).resolve().parent
# the files whose code computes the rows an engine stores (its manifest; the ops' files are added)
_ROW_FILES = ("model.py", "formats.py", "weights.py", "config.py", "gguf_reader.py")
# the core ops this engine calls, resolved once per engine for its device
ENGINE_OPS = ("linear_rows", "silu")
# a decode step and a verify multiply by the output head in row blocks of about this many bytes (fp32), the
# same blocks for both: a verify of N rows then reads each block from the CPU's cache N times instead of
# reading the whole head (the largest weight: 113 MB for SmolLM2) from memory once a row
HEAD_BLOCK_BYTES = 8 << 20

Capture = list[tuple[str, torch.Tensor]]  # (point name, hidden rows [T, H]) in forward order


def rope_tables(
    cfg: LlamaConfig, n: int, rope_freqs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[n, head_dim]`` fp32: the half-split rotary tables for positions ``0..n-1``
    (``rope_freqs`` divides the frequencies, llama.cpp's form of Llama 3 scaling). ``sin``'s first half
    is negated, so that ``rope(x) = x * cos + roll(x, half) * sin``."""
    inv = inv_freq(cfg)
    if rope_freqs is not None:
        inv = inv / rope_freqs.to(torch.float32)
    pos = torch.arange(n, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]  # [n, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
    cos, sin = emb.cos(), emb.sin()
    half = cfg.head_dim // 2
    sin[:, :half].neg_()
    return cos.contiguous(), sin.contiguous()


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary on ``x: [T, H, D]`` with ``rope_tables``' rows ``cos, sin: [T, 1, D]``
    (``sin``'s first half negated): ``x * cos + rotate_half(x) * sin`` computed as
    ``x * cos + roll(x, D/2) * sin``. A new tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped queries ``q: [Hkv, R, D]`` (R = group x rows) over ``k, v: [Hkv, S, D]``; ``mask: [R, S]`` bool
    (True: may attend) or None (every row sees every position). Returns ``[Hkv, R, D]``.

    One fused SDPA call with 4-d inputs (torch's CPU flash kernel): a single parallel region, where
    separate matmul/softmax/matmul calls would each wait on every thread (costly on a busy machine)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]


def head_blocks(head: Any, block_bytes: int = HEAD_BLOCK_BYTES) -> tuple[tuple[int, int, Any], ...]:
    """The output head as ``(start, end, Linear)`` row blocks of about ``block_bytes`` of fp32 (views, no
    copy); a head of another ``Linear`` kind is one block."""
    n, k = head.shape
    if not isinstance(head, GGMLWeight):
        return ((0, n, head),)
    rows = max(1, block_bytes // (4 * k))
    return tuple((s, min(n, s + rows), head.row_block(s, min(n, s + rows))) for s in range(0, n, rows))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` laid out as a freshly computed tensor: contiguous, starting ``ALIGN``-aligned (a decode step's
    operands always are; a row sliced out of a batch may not be)."""
    if x.is_contiguous() and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class Step:
    """What one ``forward`` appends: ``count`` rows at positions ``start .. start + count - 1``."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def rowwise(self) -> bool:
        """A decode step (one row): every matmul through the row-invariant ``linear_rows``."""
        return self.count == 1


@dataclass(frozen=True)
class TreeStep:
    """What one ``forward_tree`` verifies: ``len(parents)`` nodes on top of ``start`` committed tokens,
    node ``i`` at position ``start + depth[i]``; ``order`` is the depth-first preorder."""

    start: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    order: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.parents)

    @property
    def rowwise(self) -> bool:
        return True


@dataclass
class _Verified:
    """The last verified tree: its step and, by layer, the nodes' keys and values ``[N, Hkv, D]``."""

    step: TreeStep
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class _LiveState(ModelState):
    """The engine's live state over its KV buffers. A ``restore`` or ``resume`` calls ``on_change``: the
    engine forgets what described the state before (its verified tree and pending tokens)."""

    def __init__(self, views: dict[str, View], on_change: Callable[[], None]) -> None:
        super().__init__({}, views, 0)
        self._on_change = on_change

    def restore(self, snap: ModelState, length: int | None = None) -> None:
        super().restore(snap, length)
        self._on_change()

    def resume(self, n: int, sections: Mapping[str, torch.Tensor] | None = None) -> None:
        super().resume(n, sections)
        self._on_change()


class _KV:
    """``kv.length``: the tokens the sequence holds (the live state's length)."""

    __slots__ = ("_state",)

    def __init__(self, state: ModelState) -> None:
        self._state = state

    @property
    def length(self) -> int:
        return self._state.length

    def __repr__(self) -> str:
        return f"KV({self._state.length})"


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class LlamaEngine:
    """Batch 1, fp32, CPU. Owns its KV buffers and shares ``weights`` (read-only) with any sibling engine.

    ``max_context``: tokens the buffers hold. ``prefill_chunk``: rows a forward runs through all layers
    at a time. ``max_tree``: the most nodes one ``forward_tree`` verifies. ``head_block_bytes``: the
    output head's row blocks (``head_blocks``).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: LlamaWeights,
        *,
        max_context: int,
        prefill_chunk: int = 512,
        max_tree: int = 64,
        head_block_bytes: int = HEAD_BLOCK_BYTES,
        device: str = "cpu",
    ) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        if max_tree < 1:
            raise ValueError(f"max_tree must be positive, got {max_tree}")
        self.cfg = cfg
        self.w = weights
        self.max_context = int(max_context)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.max_tree = int(max_tree)
        self.caps = Capabilities(
            tree=True,
            resume=True,
            recurrent=False,
            max_context=self.max_context,
            max_tree=self.max_tree,
            hidden_layers=(),
            device=device,
            dtype="fp32",
            trace=True,
            prefill_chunk=self.prefill_chunk,
        )
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, device) for name in ENGINE_OPS}
        L, nkv, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        # the KV buffers: [L, n_kv, max_ctx, head_dim], token axis 2. Positions past the sequence's length
        # are never read, so the buffers start uninitialised (their pages are touched as the sequence grows).
        self.k_cache = torch.empty(L, nkv, self.max_context, hd, dtype=torch.float32)
        self.v_cache = torch.empty(L, nkv, self.max_context, hd, dtype=torch.float32)
        self._state = _LiveState({"K": View(self.k_cache, 2), "V": View(self.v_cache, 2)}, self._forget)
        self.kv = _KV(self._state)
        self.cos, self.sin = rope_tables(cfg, self.max_context, weights.rope_freqs)
        self._hidden = torch.empty(0, cfg.hidden_size)
        self._group = cfg.num_heads // nkv
        self._scale = hd**-0.5
        self._tree: _Verified | None = None
        self._pending_from: int | None = None  # where the tokens committed since the last settle begin
        self._head_blocks = head_blocks(weights.lm_head, head_block_bytes)

    # -- hot verbs ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64); logits ``[T, V]`` (``all_logits``) or ``[1, V]`` (the last).

        One token is a decode step (the rows a verify must equal). Settles the pending tokens and
        drops a verified tree first. The returned tensor is new."""
        return self._forward(tokens, all_logits, None)

    def forward_tree(self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify ``tokens`` ([N] int64) as a tree on top of the sequence (``parents[i] < i``, -1 for a child
        of the last committed token; node ``i`` at position ``kv.length + depth(i)``). Returns fp32
        ``logits [N, V]``: row ``i`` equals, bit for bit, the decode step's row after committing the path
        root..i. Nothing committed changes (K/V positions past the sequence are scratch); the tree stays
        until the next ``forward_tree``, ``forward``, ``commit_tree`` or ``discard_pending``. At most
        ``caps.max_tree`` nodes."""
        return self._forward_tree(tokens, parents, None)

    def forward_block(self, tokens: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify a chain (node ``i``'s parent is ``i - 1``)."""
        n = int(torch.as_tensor(tokens).numel())
        return self._forward_tree(tokens, list(range(-1, n - 1)), None)

    @torch.inference_mode()
    def commit_tree(self, path: Sequence[int] | torch.Tensor) -> None:
        """Append the nodes of ``path`` (indices into the last verified tree, root to leaf: the first's
        parent is -1, each next one's parent is the one before) to the sequence: their K/V rows from the
        verify. The rest of the tree leaves no trace (its rows sit past the new length). The appended
        tokens are pending until ``settle``. An empty path commits nothing; either way the tree is used up."""
        tree = self._tree
        if tree is None:
            raise RuntimeError(
                "commit_tree: no verified tree (forward_tree first; forward, discard_pending, a commit or "
                "a state restore drops it)"
            )
        if tree.step.start != self.kv.length:
            raise RuntimeError(
                f"commit_tree: the tree was verified on {tree.step.start} tokens, the sequence now holds "
                f"{self.kv.length}"
            )
        idx = [int(i) for i in (path.tolist() if isinstance(path, torch.Tensor) else path)]
        parents = tree.step.parents
        for j, i in enumerate(idx):
            if not 0 <= i < len(parents):
                raise ValueError(
                    f"commit_tree: path[{j}] = {i} is not a node of the verified tree ({len(parents)} nodes)"
                )
            want = -1 if j == 0 else idx[j - 1]
            if parents[i] != want:
                raise ValueError(f"commit_tree: path[{j}] = node {i} has parent {parents[i]}, not {want}")
        self._tree = None
        if not idx:
            return
        at = torch.tensor(idx, dtype=torch.long)
        start, P = self.kv.length, len(idx)
        for cache, rows in ((self.k_cache, [k for k, _ in tree.kv]), (self.v_cache, [v for _, v in tree.kv])):
            kept = torch.stack(rows).index_select(1, at)  # [L, P, Hkv, D]: every layer's rows of the path
            cache[:, :, start : start + P] = kept.transpose(1, 2)
        if self._pending_from is None:
            self._pending_from = start
        self._state.length = start + P

    def rollback_to(self, n: int) -> None:
        """Forget every token past ``n`` (any ``0 <= n <= kv.length``: the K/V rows of the first ``n``
        tokens are what the sequence of ``n`` tokens holds, there is no recurrent state to rewind).
        Drops a verified tree; pending tokens past ``n`` are gone with the rest."""
        length = self.kv.length
        if not 0 <= n <= length:
            raise ValueError(f"rollback_to({n}): the sequence holds {length} tokens")
        self._tree = None
        self._state.length = int(n)
        if self._pending_from is not None and n < self._pending_from:
            self._pending_from = int(n)

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks ``[R, V] -> [R]``."""
        return logits.argmax(dim=-1)

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's hidden states after the final norm, ``[T, H]`` (``[N, H]`` by node after
        ``forward_tree``, kept through its commit); valid until the next forward."""
        return self._hidden

    @property
    def state(self) -> ModelState:
        """The live state over the engine's KV buffers (views K, V; no sections)."""
        return self._state

    def reset(self) -> None:
        """Forget the sequence: length 0, no tree, nothing pending."""
        self._state.length = 0
        self._hidden = torch.empty(0, self.cfg.hidden_size)
        self._forget()

    # -- cold verbs: pending tokens and the caches -------------------------------------------------
    def settle(self) -> None:
        """Make the pending tokens permanent (``trim_pending`` can no longer take them back)."""
        self._pending_from = None

    def discard_pending(self) -> None:
        """Drop the last verified tree (nothing committed changes)."""
        self._tree = None

    def trim_pending(self, n: int) -> None:
        """Take back the last ``n`` tokens committed since the last ``settle``."""
        count = self._pending_count()
        if not 0 <= n <= count:
            raise ValueError(f"trim_pending({n}): {count} tokens are pending (committed since the last settle)")
        self.rollback_to(self.kv.length - n)

    def resume_at(self, n: int, sections: dict[str, torch.Tensor] | None = None) -> None:
        """Take the sequence back to ``n`` tokens whose K/V rows are already in the buffers (a common
        prefix); this model has no recurrent ``sections`` (an empty mapping or None). Drops the verified
        tree and the pending tokens (``state.resume``, which this is, raises naming a mismatch)."""
        self._state.resume(n, sections)

    def cache_state(self) -> ModelState:
        """The live state (K and V views, no sections), ``length == kv.length``."""
        return self._state

    def _pending_count(self) -> int:
        return 0 if self._pending_from is None else self.kv.length - self._pending_from

    def _forget(self) -> None:
        self._tree = None
        self._pending_from = None

    # -- diagnostics (tandem_core.spec.selfcheck.LayerTrace) ------------------------------------------
    def trace_forward(self, tokens: torch.Tensor | Sequence[int]) -> Trace:
        """``forward(tokens, all_logits=True)`` that also returns the hidden rows after every layer's
        attention and MLP and after the final norm (the sequence advances as by ``forward``)."""
        capture: Capture = []
        logits = self._forward(tokens, True, capture)
        return _trace(capture, logits)

    def trace_tree(self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int]) -> Trace:
        """``forward_tree`` that also returns the hidden rows at the same points (the tree is left
        verified as by ``forward_tree``)."""
        capture: Capture = []
        out = self._forward_tree(tokens, parents, capture)
        return _trace(capture, out.logits)

    # -- the forms ----------------------------------------------------------------------------------
    def _ids(self, tokens: torch.Tensor | Sequence[int], verb: str) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise ValueError(f"{verb}: no tokens")
        lo, hi = (int(t) for t in torch.aminmax(ids))
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(
                f"{verb}: token id {lo if lo < 0 else hi} is outside the vocabulary (size {self.cfg.vocab_size})"
            )
        return ids

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor | Sequence[int], all_logits: bool, capture: Capture | None) -> torch.Tensor:
        ids = self._ids(tokens, "forward")
        t = int(ids.numel())
        n = self.kv.length
        if n + t > self.max_context:
            raise ValueError(f"sequence of {n + t} tokens exceeds the engine's context of {self.max_context}")
        self._pending_from = None  # a forward's tokens are permanent: settle first
        self._tree = None
        hiddens, logits = [], []
        for s in range(0, t, self.prefill_chunk):
            chunk = ids[s : s + self.prefill_chunk]
            step = Step(n + s, int(chunk.numel()))
            h = self._layers(chunk, step, None, capture)  # [c, H] after the final norm
            self._state.length = step.end
            hiddens.append(h)
            if all_logits:
                logits.append(self._head_rows(h) if step.rowwise else self.w.lm_head.matmul(h))
        self._hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        if all_logits:
            return logits[0] if len(logits) == 1 else torch.cat(logits)
        return self._head_rows(self._hidden[-1:])

    @torch.inference_mode()
    def _forward_tree(
        self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int], capture: Capture | None
    ) -> TreeOut:
        ids = self._ids(tokens, "forward_tree")
        N = int(ids.numel())
        par = _tree.as_parents(parents)
        if len(par) != N:
            raise ValueError(f"forward_tree: {N} tokens but {len(par)} parents")
        if N > self.max_tree:
            raise ValueError(f"forward_tree: {N} nodes exceed max_tree {self.max_tree} (caps.max_tree)")
        depth = _tree.depths(par)
        n = self.kv.length
        if n + max(depth) + 1 > self.max_context:
            raise ValueError(
                f"forward_tree: {n} tokens held + a path of {max(depth) + 1} exceed the engine's context of "
                f"{self.max_context}"
            )
        self._tree = None
        tree = _Verified(TreeStep(n, tuple(par), tuple(depth), tuple(_tree.preorder(par))))
        h = self._layers(ids, tree.step, tree, capture)  # [N, H] after the final norm
        self._hidden = h
        self._tree = tree
        return TreeOut(self._head_rows(h))

    def _head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, V]`` of ``h: [M, H]``, every row through ``linear_rows`` block by block of the head
        (``head_blocks``): the decode step (``M == 1``) and a verify make the same calls for a row."""
        if len(self._head_blocks) == 1:
            return self._ops["linear_rows"](self._head_blocks[0][2], h)
        out = h.new_empty(h.shape[0], self.cfg.vocab_size)
        for start, end, block in self._head_blocks:
            out[:, start:end] = self._ops["linear_rows"](block, h)
        return out

    def _mm(self, step: Step | TreeStep) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """How this step multiplies by a weight: row by row (row invariant) for a decode step and a verify."""
        return self._ops["linear_rows"] if step.rowwise else _batched

    # -- one call's rows through every layer ------------------------------------------------------
    def _layers(
        self, ids: torch.Tensor, step: Step | TreeStep, tree: _Verified | None, capture: Capture | None
    ) -> torch.Tensor:
        # ids: [T] -> hidden after the final norm [T, H]; a Step writes K/V rows, a TreeStep fills ``tree``
        cfg, w = self.cfg, self.w
        eps, hsize = cfg.rms_norm_eps, (cfg.hidden_size,)
        if isinstance(step, TreeStep):
            pos = torch.tensor(step.depth, dtype=torch.long) + step.start  # [N]
            cos, sin = self.cos[pos, None, :], self.sin[pos, None, :]  # [N, 1, hd]
        else:
            cos, sin = self.cos[step.start : step.end, None, :], self.sin[step.start : step.end, None, :]
        x = w.embed.rows(ids)  # x: [T, H]
        for li, lw in enumerate(w.layers):
            x = x + self._attention(F.rms_norm(x, hsize, lw.attn_norm, eps), lw, li, step, tree, cos, sin)
            if capture is not None:
                capture.append((f"layer {li} attention", x.clone()))
            x = x + self._mlp(F.rms_norm(x, hsize, lw.mlp_norm, eps), lw, step)
            if capture is not None:
                capture.append((f"layer {li} mlp", x.clone()))
        out = F.rms_norm(x, hsize, w.norm, eps)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out

    def _attention(
        self,
        h: torch.Tensor,
        lw: LayerWeights,
        li: int,
        step: Step | TreeStep,
        tree: _Verified | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        # h: [T, H] (normed) -> [T, H]; a Step writes K/V rows step.start .. step.end - 1 of layer li
        cfg, mm = self.cfg, self._mm(step)
        t = int(h.shape[0])
        nh, nkv, hd, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self._group
        q_dim, kv_dim = cfg.q_dim, cfg.kv_dim
        qkv = mm(lw.qkv, h)  # [T, q_dim + 2 kv_dim]
        qk = rope_rows(qkv[:, : q_dim + kv_dim].view(t, nh + nkv, hd), cos, sin)  # [T, nh + nkv, hd]
        v = qkv[:, q_dim + kv_dim :].view(t, nkv, hd)  # [T, nkv, hd]
        kc, vc = self.k_cache[li], self.v_cache[li]  # [nkv, max_ctx, hd]
        if isinstance(step, TreeStep):
            assert tree is not None
            a = self._attend_tree(qk, v, kc, vc, step)
            tree.kv.append((qk[:, nh:], v))
        else:
            n, end = step.start, step.end
            kc[:, n:end].copy_(qk[:, nh:].transpose(0, 1))
            vc[:, n:end].copy_(v.transpose(0, 1))
            # causal over [0, end): row i (position n+i) sees keys 0..n+i; one row sees them all
            mask = None if t == 1 else causal_mask(n, t).repeat(g, 1)  # [g*T, end]
            a = self._attend(qk, kc[:, :end], vc[:, :end], mask, t)
        return mm(lw.o, a)

    def _attend(
        self, qk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, t: int
    ) -> torch.Tensor:
        """Grouped attention of ``t`` rows of ``qk`` ([t, nh + nkv, hd], queries first) over ``k, v``
        ([nkv, S, hd]); returns ``[t, nh * hd]``."""
        nh, nkv, hd, g = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, self._group
        # grouped queries: kv head j serves q heads j*g .. j*g+g-1 -> [nkv, g*T, hd]
        q = qk[:, :nh].reshape(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        a = attend(q, k, v, mask, self._scale)  # [nkv, g*T, hd]
        return a.reshape(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    def _attend_tree(
        self, qk: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step: TreeStep
    ) -> torch.Tensor:
        """Each node over the sequence and its ancestors, as the decode step after committing its path:
        in depth-first order, node ``i`` writes its key and value at ``start + depth[i]`` (scratch past the
        sequence; its ancestors were the last written at the depths before it) and makes the decode
        step's one-row call on a fresh copy of its row. Returns ``[N, nh * hd]``."""
        nh = self.cfg.num_heads
        out = qk.new_empty(step.count, nh * self.cfg.head_dim)
        for i in step.order:
            end = step.start + step.depth[i] + 1
            kc[:, end - 1] = qk[i, nh:]
            vc[:, end - 1] = v[i]
            out[i] = self._attend(_aligned(qk[i : i + 1]), kc[:, :end], vc[:, :end], None, 1)[0]
        return out

    def _mlp(self, h: torch.Tensor, lw: LayerWeights, step: Step | TreeStep) -> torch.Tensor:
        # h: [T, H] (normed) -> [T, H]: down(silu(gate(h)) * up(h)); silu from tandem_core.ops.act
        mm, inter = self._mm(step), self.cfg.intermediate_size
        gu = mm(lw.gate_up, h)  # [T, 2I]
        return mm(lw.down, self._ops["silu"](gu[:, :inter]) * gu[:, inter:])

    # -- cold verbs ------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """What computes this engine's rows: the plugin's files, the core ops' files, the settings that
        change arithmetic, the config, the weights and the torch version."""
        cfg = self.cfg
        files = {str(_HERE / f) for f in _ROW_FILES}
        files |= {str(Path(inspect.getsourcefile(fn) or "").resolve()) for fn in self._ops.values()}
        return Manifest(
            files=tuple(sorted(files)),
            settings={"dense": self.w.dense, "prefill_chunk": self.prefill_chunk,
                      "head_block_rows": self._head_blocks[0][1]},
            extra={
                "model": "llama",
                "config": repr(cfg),
                "weights": [str(p) for p in self.w.files],
                "formats": self.w.formats,
                "torch": torch.__version__,
                "ops": {name: f"{fn.__module__}:{fn.__qualname__}" for name, fn in sorted(self._ops.items())},
            },
        )

    def memory_parts(self) -> list[MemoryPart]:
        dev = self.caps.device
        kv = (self.k_cache.numel() + self.v_cache.numel()) * 4
        rope = (self.cos.numel() + self.sin.numel()) * 4
        return [
            MemoryPart("weights", self.w.nbytes(), dev),
            MemoryPart("kv", kv, dev),
            MemoryPart("rope tables", rope, dev),
        ]

    def __repr__(self) -> str:
        return f"LlamaEngine({self.cfg.num_layers} layers, fp32, {self.kv.length}/{self.max_context} tokens)"


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
