"""``LlamaRunner``: the Llama arithmetic of one sequence (batch 1) over preallocated KV buffers.

The core's ``SequenceEngine`` (``tandem_core.engine``) runs the sequence over it (``build_engine``); this
runner only computes.

A decoder layer (read top-down)::

    h    = rmsnorm(x) * attn_norm
    q,k,v = qkv(h)                 # one matmul: [T, q_dim + 2 kv_dim]
    q,k  = rope(q, k)              # half-split rotary (Hugging Face's form) at positions [n, n+T)
    K[l, :, n:n+T], V[...] = k, v  # the KV buffers: [L, n_kv, max_ctx, head_dim]
    x   += o(attention(q, K[:n+T], V[:n+T]))   # grouped-query, causal
    h    = rmsnorm(x) * mlp_norm
    x   += down(silu(gate(h)) * up(h))        # gate and up in one matmul

then ``logits = lm_head(rmsnorm(x) * norm)`` (the embedding itself when tied).
On the CPU everything runs in fp32 over the GGUF's own formats; on a CUDA device the weights are
dense on the device (``weights.on_device``, bf16 by default) and the activations run in their
dtype, logits in fp32. The same layer code runs on both: every op comes from
``tandem_core.ops.get(name, device)`` (on CUDA, ``linear_rows`` of a bf16 dense weight is the
row-invariant Triton kernel of ``tandem_core.ops.cuda_backend``).

On a CUDA device whose weights its kernels read, the serving builds ``LlamaCudaRunner``
(``tandem_llama.cuda_runner``) instead: this runner's prefill and layout, with decode and verify
as one static-buffer step per width captured as CUDA graphs; this runner stays the CPU's and
the reference.

Three forms of one layer code, one for each runner verb:

- prefill (``prefill``, a ``Step`` of several rows): rows batched through every
  matmul (``prefill_chunk`` tokens at a time; a chunk reads the rows the earlier
  chunks wrote). Not row invariant, and need not be: plain and speculative
  decoding start from the same prefill.
- decode (``decode``, a ``Step`` of one row): every matmul through
  the row-invariant ``linear_rows`` op (``tandem_core.ops.rows``), the output head
  block by block of its rows (``head_blocks``, about 8 MiB each), attention one
  fused SDPA call over ``K[:, :n+1]``.
- verify (``verify``, a ``TreeStep``): the same ``linear_rows`` for every
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
sequence's next positions. There is no recurrent state (``buffers()`` has views ``K``
and ``V``, token axis 2, and no sections), so the engine's ``rollback_to`` can take
the sequence back to any length and ``replay`` is never asked for.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem_core import ops
from tandem_core.drafter import TargetParts
from tandem_core.engine import Capture, LogitRows, Manifest, MemoryPart, Rows, RunnerSpec, SequenceEngine, Step, TreeStep
from tandem_core.ops.attention import causal_mask
from tandem_core.ops.rows import ALIGN
from tandem_core.state import View
from tandem_llama.config import LlamaConfig, inv_freq
from tandem_llama.formats import GGMLWeight
from tandem_llama.weights import LayerWeights, LlamaWeights

__all__ = [
    "ENGINE_OPS",
    "HEAD_BLOCK_BYTES",
    "LlamaRunner",
    "build_engine",
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


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class LlamaRunner:
    """Batch 1, on ``device`` in the weights' dtype (fp32 on the CPU). Owns its KV buffers and shares ``weights``
    (read-only) with any sibling.

    ``max_context``: tokens the buffers hold. ``prefill_chunk``: rows a prefill call takes at most.
    ``max_tree``: the most nodes one ``verify`` takes. ``head_block_bytes``: the output head's row blocks
    (``head_blocks``).
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
        self.device = torch.device(device)
        self.act = weights.norm.dtype                   # fp32 on the CPU; the device copy's dtype on CUDA
        L = cfg.num_layers
        self.spec = RunnerSpec(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, max_context=int(max_context),
            max_tree=int(max_tree), prefill_chunk=max(1, int(prefill_chunk)), device=str(self.device),
            dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.act],
            trace=True, hidden_layers=tuple(range(L)),
        )
        if self.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            from tandem_core.ops import cuda_backend

            cuda_backend.install()                      # the row-invariant bf16 matmul for linear_rows
        self._ops: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in ENGINE_OPS}
        nkv, hd = cfg.num_kv_heads, cfg.head_dim
        # the KV buffers: [L, n_kv, max_ctx, head_dim], token axis 2. Positions past the sequence's length
        # are never read, so the buffers start uninitialised (their pages are touched as the sequence grows).
        kv = dict(dtype=self.act, device=self.device)
        self.k_cache = torch.empty(L, nkv, self.spec.max_context, hd, **kv)
        self.v_cache = torch.empty(L, nkv, self.spec.max_context, hd, **kv)
        cos, sin = rope_tables(cfg, self.spec.max_context, weights.rope_freqs)
        self.cos, self.sin = cos.to(**kv), sin.to(**kv)
        self._group = cfg.num_heads // nkv
        self._scale = hd**-0.5
        self._tree_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # by layer, the verified nodes' [N, Hkv, D]
        self._taps: tuple[int, ...] = ()
        self._head_blocks = head_blocks(weights.lm_head, head_block_bytes)

    # -- the runner verbs ---------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """No sections; views ``K`` and ``V`` (token axis 2)."""
        return {}, {"K": View(self.k_cache, 2), "V": View(self.v_cache, 2)}

    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids, step, capture)
        out = None
        if logits == "all":
            out = self.w.lm_head.matmul(h).float()
        elif logits == "last":
            out = self._head_rows(h[-1:])
        return Rows(h, out, taps)

    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        h, taps = self._layers(ids, step, capture)
        return Rows(h, self._head_rows(h), taps)

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        self._tree_kv = []
        h, taps = self._layers(ids, tree, capture)
        return Rows(h, self._head_rows(h), taps)

    def commit(self, tree: TreeStep, path: Sequence[int]) -> None:
        """The path's K/V rows (kept from the verify) at the sequence's next positions."""
        at = torch.tensor(list(path), dtype=torch.long, device=self.device)
        start, P = tree.start, len(path)
        for cache, rows in ((self.k_cache, [k for k, _ in self._tree_kv]),
                            (self.v_cache, [v for _, v in self._tree_kv])):
            kept = torch.stack(rows).index_select(1, at)  # [L, P, Hkv, D]: every layer's rows of the path
            cache[:, :, start : start + P] = kept.transpose(1, 2)
        return None

    def replay(self, kept: Sequence[Any], n: int) -> None:
        raise RuntimeError("LlamaRunner.replay: a runner without sections has nothing to replay")

    def tap(self, layers: tuple[int, ...]) -> None:
        self._taps = tuple(layers)

    def parts(self) -> TargetParts:
        """The embedding and the head, lent to a drafter (the block drafter embeds its block with the one and
        reads its logits through the other)."""
        w = self.w
        return TargetParts(embed=lambda ids: w.embed.rows(ids.to(self.device)).to(self.act),
                           head=lambda h: w.lm_head.matmul(h.to(self.act)).float(),
                           device=str(self.device), dtype=self.act)

    def batched(self) -> Any:
        """A ``tandem_llama.batched.BatchedLlama`` over these weights: many sequences a forward, for bulk work
        off the serving path (the drafter trainer's answers and hidden rows)."""
        from tandem_llama.batched import BatchedLlama

        return BatchedLlama(self.cfg, self.w, str(self.device))

    def reset(self) -> None:
        """No sections to zero; K/V rows past the length are never read."""
        self._tree_kv = []

    def _head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, V]`` of ``h: [M, H]``, every row through ``linear_rows`` block by block of the head
        (``head_blocks``): the decode step (``M == 1``) and a verify make the same calls for a row."""
        if len(self._head_blocks) == 1:
            return self._ops["linear_rows"](self._head_blocks[0][2], h).float()
        out = h.new_empty(h.shape[0], self.cfg.vocab_size)
        for start, end, block in self._head_blocks:
            out[:, start:end] = self._ops["linear_rows"](block, h)
        return out.float()

    def _mm(self, step: Step | TreeStep) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """How this step multiplies by a weight: row by row (row invariant) for a decode step and a verify."""
        return self._ops["linear_rows"] if isinstance(step, TreeStep) or step.count == 1 else _batched

    # -- one call's rows through every layer ------------------------------------------------------
    def _layers(
        self, ids: torch.Tensor, step: Step | TreeStep, capture: Capture | None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # ids: [T] -> hidden after the final norm [T, H]; a Step writes K/V rows, a TreeStep keeps the nodes'
        cfg, w = self.cfg, self.w
        eps, hsize = cfg.rms_norm_eps, (cfg.hidden_size,)
        ids = ids.to(self.device)
        if isinstance(step, TreeStep):
            pos = step.positions(self.device)  # [N]
            cos, sin = self.cos[pos, None, :], self.sin[pos, None, :]  # [N, 1, hd]
        else:
            cos, sin = self.cos[step.start : step.end, None, :], self.sin[step.start : step.end, None, :]
        taps: dict[int, torch.Tensor] = {}
        x = w.embed.rows(ids)  # x: [T, H]
        for li, lw in enumerate(w.layers):
            x = x + self._attention(F.rms_norm(x, hsize, lw.attn_norm, eps), lw, li, step, cos, sin)
            if capture is not None:
                capture.append((f"layer {li} attention", x.clone()))
            x = x + self._mlp(F.rms_norm(x, hsize, lw.mlp_norm, eps), lw, step)
            if capture is not None:
                capture.append((f"layer {li} mlp", x.clone()))
            if li in self._taps:
                taps[li] = x
        out = F.rms_norm(x, hsize, w.norm, eps)
        if capture is not None:
            capture.append(("final norm", out.clone()))
        return out, taps

    def _attention(
        self,
        h: torch.Tensor,
        lw: LayerWeights,
        li: int,
        step: Step | TreeStep,
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
            a = self._attend_tree(qk, v, kc, vc, step)
            self._tree_kv.append((qk[:, nh:], v))
        else:
            n, end = step.start, step.end
            kc[:, n:end].copy_(qk[:, nh:].transpose(0, 1))
            vc[:, n:end].copy_(v.transpose(0, 1))
            # causal over [0, end): row i (position n+i) sees keys 0..n+i; one row sees them all
            mask = None if t == 1 else causal_mask(n, t, self.device).repeat(g, 1)  # [g*T, end]
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
        return mm(lw.down, self._ops["silu"](gu[:, :inter]).to(self.act) * gu[:, inter:])

    # -- what computes the rows ----------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """What computes this engine's rows: the plugin's files, the core ops' files, the settings that
        change arithmetic, the config, the weights and the torch version."""
        cfg = self.cfg
        files = {str(_HERE / f) for f in _ROW_FILES}
        files |= {str(Path(inspect.getsourcefile(fn) or "").resolve()) for fn in self._ops.values()}
        return Manifest(
            files=tuple(sorted(files)),
            settings={"dense": self.w.dense, "head_block_rows": self._head_blocks[0][1],
                      "device": self.device.type, "dtype": self.spec.dtype},
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
        dev = str(self.device)
        kv = (self.k_cache.numel() + self.v_cache.numel()) * self.k_cache.element_size()
        rope = (self.cos.numel() + self.sin.numel()) * self.cos.element_size()
        return [
            MemoryPart("weights", self.w.nbytes(), dev),
            MemoryPart("kv", kv, dev),
            MemoryPart("rope tables", rope, dev),
        ]

    def __repr__(self) -> str:
        return (f"LlamaRunner({self.cfg.num_layers} layers, {self.spec.dtype}, {self.device}, "
                f"{self.spec.max_context} tokens)")


def build_engine(cfg: LlamaConfig, weights: LlamaWeights, **kw: Any) -> SequenceEngine:
    """A ``SequenceEngine`` over a ``LlamaRunner(cfg, weights, **kw)`` (its own KV buffers, shared weights)."""
    return SequenceEngine(LlamaRunner(cfg, weights, **kw), name="llama")


