"""``LlamaCudaRunner``: the Llama arithmetic over static buffers, decode and tree verify as CUDA graphs.

The eager ``LlamaRunner`` (``tandem_llama.model``) launches every op of a step from Python: on an
H200 a decode step of SmolLM2-135M (30 layers) takes 30-50 ms, bound by kernel launches
(``docs/measurements/block-drafter.md``). This runner computes a decode step and a verify of
``W`` nodes as one function of static buffers, ``_step(W)``, so that each can be captured once
as a CUDA graph and replayed with one launch:

    per width W (``WIDTHS`` up to the first that holds ``max_tree``; decode is W = 1):
        ids   [W] int64      the nodes' tokens (0 past the tree)
        pos   [W] int64      ``L + depth`` (``L`` past the tree): the rotary rows
        slot  [W] int64      ``L + i``: where node i writes its key and value (decode: ``L`` itself)
        head  [2] int32      ``(L, n)``: committed tokens, nodes
        pos32 [W] int32, anc [W, W] int32   the attention kernel's tables: ``anc[i, d]`` node i's
                             ancestor at depth d, i itself at its own depth

A round writes them in one pinned host buffer per width and copies it to the device without a
host sync, then replays the width's graph (``graphs=False``: runs ``_step`` directly). The graph
writes the K/V rows and leaves the hidden rows, the taps and fp32 logits in its own output
tensors; ``decode``/``verify`` return a copy of the logits (the caller owns it) and views of the
rest (valid until the next call).

One step (read top-down; the eager runner's arithmetic, each matmul through ``linear_rows``)::

    x = embed(ids)
    per layer:  h = rms_norm(x); qkv = linear_rows(qkv, h); q, k = rope(q, k; pos)
                K[slot], V[slot] = k, v
                x += linear_rows(o, tree_attention(q; L, pos, anc))
                x += linear_rows(down, silu(gate) * up)     (gate | up one matmul)
    logits = linear_rows(head, rms_norm(x))

On CUDA each residual add and the norm after it are one Triton program a row
(``triton_fused.add_rms_norm_1p``, handed ``w - 1`` for its ``1 + w`` form) and ``silu(gate) * up``
is ``triton_fused.silu_mul``: row-invariant kernels, fewer launches. Elsewhere the eager
runner's ops (``F.rms_norm``, ``tandem_core.ops.act.silu``).

Row invariance: every op of a step computes each row alone (``linear_rows``: on CUDA the skinny
matmul ``tandem_core.ops.triton_matmul.skinny_matmul`` called straight, a plan per weight shape; norms, rotary and
the elementwise ops per row; attention per node over keys chosen by position alone), and the
rows past the tree are computed but never read, so row ``i`` of a verify of width ``W`` equals
the decode row at its position after committing its path, bit for bit, whatever ``W``.
Attention on CUDA is ``tandem_core.ops.triton_attention.tree_attention``: its tail program
gathers a node's keys by position (committed slots below ``L``, the ancestors' slots
``L + anc[i, d]`` above), so a node sees the keys plain decode sees at the same offsets. That
kernel multiplies its output by an output gate ``sigmoid(gate)`` (Qwen's gated attention); this
runner hands it a constant gate of ``GATE_ONE``, whose sigmoid is exactly 1.0 in fp32 and bf16,
so the output is the attention itself bit for bit. Elsewhere (the CPU, ``graphs=False``) the
same contract in torch: per node, its keys gathered by position (``slots_of``) and the eager
runner's one-row SDPA call.

Commit copies the path's K/V rows from ``L + path[d]`` to ``L + d`` (every layer: one gather,
one scatter). Prefill is the eager runner's (chunked, batched matmuls, causal SDPA). The K/V
buffers have ``widths[-1]`` positions of slack past ``max_context`` (a verify's scratch slots).

Taps are honoured (the block drafter reads them): a graph keeps its taps' output tensors, and
``tap`` with other layers captures the graphs again. ``capture`` (the self-check's per-layer
rows) runs the step without its graph: the same kernels on the same buffers, so the same bits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem_core.engine import Capture, LogitRows, Manifest, MemoryPart, Rows, Step, TreeStep, tensor_bytes
from tandem_core.engine.graph_tables import GATE_ONE, WIDTHS, runner_widths, slots_of, tree_tables
from tandem_core.engine.runner import graph_capture
from tandem_llama.config import LlamaConfig
from tandem_llama.model import HEAD_BLOCK_BYTES, LlamaRunner, rope_rows
from tandem_llama.weights import LlamaWeights

__all__ = ["GATE_ONE", "WIDTHS", "LlamaCudaRunner", "runner_widths", "slots_of", "tree_tables", "unsupported"]



def unsupported(cfg: LlamaConfig, weights: LlamaWeights) -> str | None:
    """Why the CUDA graph path cannot run these weights (None: it can): Triton, dense bf16 weights without bias
    on a CUDA device, a head size the attention kernel tiles (a power of two, 16 .. 256), norm weights that the
    Triton norm's ``1 + w`` form gives back exactly from ``w - 1``."""
    from tandem_core.linear import DenseLinear

    dev = weights.norm.device
    if dev.type != "cuda":
        return f"weights on {dev}, not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if weights.norm.dtype != torch.bfloat16:
        return f"weights in {weights.norm.dtype}, the CUDA kernels read bf16"
    for lw in weights.layers:
        for lin in (lw.qkv, lw.o, lw.gate_up, lw.down):
            if not isinstance(lin, DenseLinear) or lin.bias is not None or lin.weight.dtype != torch.bfloat16:
                return f"a weight held as {type(lin).__name__} (the kernels read dense bf16 without bias)"
    D = cfg.head_dim
    if D < 16 or D > 256 or D & (D - 1):
        return f"head_dim {D} is not a power of two in 16..256"
    for t in [*(t for lw in weights.layers for t in (lw.attn_norm, lw.mlp_norm)), weights.norm]:
        w = t.float()
        if not torch.equal(1.0 + (w - 1.0), w):
            return "a norm weight is not exactly 1 + (w - 1) in fp32 (the Triton norm multiplies by 1 + w)"
    return None


class _Meta:
    """One width's round inputs: a host buffer (pinned on CUDA) and its device copy, int64
    ``[ids W | pos W | slot W]`` and int32 ``[L, n | pos W | anc W*W]``."""

    def __init__(self, W: int, device: torch.device) -> None:
        self.W = W
        pin = device.type == "cuda"
        self.h64 = torch.zeros(3 * W, dtype=torch.long, pin_memory=pin)
        self.h32 = torch.zeros(2 + W + W * W, dtype=torch.int32, pin_memory=pin)
        self.d64 = torch.zeros(3 * W, dtype=torch.long, device=device)
        self.d32 = torch.zeros(2 + W + W * W, dtype=torch.int32, device=device)
        self.ids, self.pos, self.slot = self.d64[:W], self.d64[W:2 * W], self.d64[2 * W:]
        self.head, self.pos32 = self.d32[:2], self.d32[2:2 + W]
        self.anc = self.d32[2 + W:].view(W, W)
        self._done = torch.cuda.Event() if pin else None
        # the host's copy of the tree this buffer holds (the torch attention reads it)
        self.L, self.n, self.anc_host = 0, 0, [[0]]

    def fill(self, L: int, tokens: Sequence[int], parents: Sequence[int]) -> None:
        W, n = self.W, len(tokens)
        depth, anc = tree_tables(parents)
        if self._done is not None:
            self._done.synchronize()                  # the last upload has left the host buffer
        h64, h32 = self.h64.numpy(), self.h32.numpy()
        h64[:] = 0
        h32[:] = 0
        h64[:n] = tokens
        h64[W:W + n] = [L + d for d in depth]
        h64[W + n:2 * W] = L
        h64[2 * W:] = range(L, L + W)
        h32[:2] = (L, n)
        h32[2:2 + W] = h64[W:2 * W]
        av = h32[2 + W:].reshape(W, W)
        for i, a in enumerate(anc):
            av[i, :len(a)] = a
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        if self._done is not None:
            self._done.record()
        self.L, self.n, self.anc_host = L, n, anc


@dataclasses.dataclass
class _Out:
    """What one step leaves: hidden rows after the final norm, fp32 logits, taps (tensors of the graph's pool
    when captured)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    taps: dict[int, torch.Tensor]


class LlamaCudaRunner(LlamaRunner):
    """The Llama runner over static buffers: decode and verify as one ``_step`` per width, captured as CUDA graphs
    when ``graphs`` (a CUDA device only). ``graphs=False`` runs the same step eagerly, on any device (the CPU tests
    run the conformance suite on it). Prefill, the weights, the K/V layout and ``parts`` are ``LlamaRunner``'s."""

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
        graphs: bool = True,
    ) -> None:
        widths = runner_widths(int(max_tree))
        super().__init__(cfg, weights, max_context=int(max_context) + widths[-1], prefill_chunk=prefill_chunk,
                         max_tree=widths[-1], head_block_bytes=head_block_bytes, device=device)
        self.widths = widths
        self.use_graphs = bool(graphs) and self.device.type == "cuda"
        if graphs and self.device.type == "cuda":
            why = unsupported(cfg, weights)
            if why is not None:
                raise ValueError(f"LlamaCudaRunner: cannot capture graphs: {why}")
        self._buffer_len = int(self.k_cache.shape[2])
        self._triton = self._kernels(cfg, weights)
        self.metas = {w: _Meta(w, self.device) for w in widths}
        norms = [t for lw in weights.layers for t in (lw.attn_norm, lw.mlp_norm)] + [weights.norm]
        # the Triton norm multiplies by (1 + w): it is handed w - 1 in fp32 (exact: unsupported() checks it)
        self._norms = [t.float() - 1.0 for t in norms] if self._triton else norms
        nh, hd = cfg.num_heads, cfg.head_dim
        if self._triton:
            from tandem_core.ops import triton_attention as ta

            self._scratch = ta.AttnScratch(widths[-1], nh, hd, self._buffer_len, self.device)
            self._gate = torch.full((widths[-1], 2 * nh * hd), GATE_ONE, dtype=self.act, device=self.device)
        self.graphs: dict[int, Any] = {}
        self._outs: dict[int, _Out] = {}
        self._tree_L, self._tree_W = 0, 0
        self._tree_parents: tuple[int, ...] = ()
        self.spec = dataclasses.replace(self.spec, max_context=int(max_context),
                                        graph_widths=widths if self.use_graphs else ())
        if self.use_graphs:
            self.capture()

    def _kernels(self, cfg: LlamaConfig, weights: LlamaWeights) -> bool:
        """Whether the step runs the Triton kernels (attention, norms, ``silu * up``): bf16 weights their kernels
        read on a CUDA device; else the torch ops of the same contracts."""
        return self.device.type == "cuda" and self.act == torch.bfloat16 and unsupported(cfg, weights) is None

    # -- the runner verbs ---------------------------------------------------------------------------------
    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """No sections; views ``K`` and ``V`` (token axis 2, with the verify's slack past ``max_context``)."""
        return super().buffers()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        self._tree_W = 0
        return super().prefill(ids, step, logits=logits, capture=capture)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        """The one-node tree at ``step.start``: its key and value land at slot ``start`` itself."""
        out = self._run(1, step.start, [int(ids[0])], [-1], capture)
        self._tree_W = 0
        return Rows(out.hidden[:1], out.logits[:1].clone(), {li: t[:1] for li, t in out.taps.items()})

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        n = tree.count
        W = next((w for w in self.widths if w >= n), None)
        if W is None:
            raise ValueError(f"verify: {n} nodes exceed the widest width {self.widths[-1]}")
        out = self._run(W, tree.start, [int(t) for t in ids.tolist()], list(tree.parents), capture)
        self._tree_L, self._tree_W, self._tree_parents = tree.start, W, tuple(tree.parents)
        return Rows(out.hidden[:n], out.logits[:n].clone(), {li: t[:n] for li, t in out.taps.items()})

    @torch.no_grad()
    def commit(self, tree: TreeStep, path: Sequence[int]) -> None:
        """The path's K/V rows from their scratch slots ``start + node`` to ``start .. start + len(path) - 1``."""
        if not self._tree_W or self._tree_L != tree.start or self._tree_parents != tuple(tree.parents):
            raise RuntimeError("LlamaCudaRunner.commit: not the tree last verified")
        start, P = tree.start, len(path)
        src = torch.tensor([start + int(i) for i in path], dtype=torch.long, device=self.device)
        dst = torch.arange(start, start + P, dtype=torch.long, device=self.device)
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))
        self._tree_W = 0

    def tap(self, layers: tuple[int, ...]) -> None:
        """Taps change what a step leaves: graphs captured with other taps are captured again."""
        layers = tuple(layers)
        if layers == self._taps:
            return
        self._taps = layers
        if self.graphs:
            self.capture()

    def reset(self) -> None:
        self._tree_W = 0
        super().reset()

    # -- one step ------------------------------------------------------------------------------------------
    def _run(self, W: int, L: int, tokens: list[int], parents: list[int], capture: Capture | None) -> _Out:
        meta = self.metas[W]
        meta.fill(L, tokens, parents)
        g = self.graphs.get(W)
        if g is None or capture is not None:
            return self._step(W, capture)
        g.replay()
        return self._outs[W]

    def _step(self, W: int, capture: Capture | None = None) -> _Out:
        """Width ``W``'s rows over the static buffers (``self.metas[W]``): K/V rows written at the slots, nothing
        read from the host when attention is the kernel's (capturable)."""
        cfg, w, m = self.cfg, self.w, self.metas[W]
        lin = self._lin
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.q_dim, cfg.kv_dim
        cos = self.cos.index_select(0, m.pos)[:, None, :]                    # [W, 1, hd]
        sin = self.sin.index_select(0, m.pos)[:, None, :]
        taps: dict[int, torch.Tensor] = {}
        x = w.embed.rows(m.ids).to(self.act)                                 # [W, H]
        x, h = self._add_norm(x, None, 0)
        for li, lw in enumerate(w.layers):
            qkv = lin(lw.qkv, h)                                             # [W, q_dim + 2 kv_dim]
            qk = rope_rows(qkv[:, :q_dim + kv_dim].view(W, nh + nkv, hd), cos, sin)
            v = qkv[:, q_dim + kv_dim:].view(W, nkv, hd)
            kc, vc = self.k_cache[li], self.v_cache[li]                      # [nkv, S, hd]
            kc.index_copy_(1, m.slot, qk[:, nh:].transpose(0, 1))
            vc.index_copy_(1, m.slot, v.transpose(0, 1))
            x, h = self._add_norm(x, lin(lw.o, self._tree_attention(qk, kc, vc, m)), 2 * li + 1)
            if capture is not None:
                capture.append((f"layer {li} attention", x[:m.n].clone()))
            x, h = self._add_norm(x, lin(lw.down, self._silu_mul(lin(lw.gate_up, h))), 2 * li + 2)
            if capture is not None:
                capture.append((f"layer {li} mlp", x[:m.n].clone()))
            if li in self._taps:
                taps[li] = x.clone()                                         # x moves on in place on CUDA
        if capture is not None:
            capture.append(("final norm", h[:m.n].clone()))
        return _Out(h, lin(w.lm_head, h).float() if self._triton else self._head_rows(h), taps)

    def _lin(self, lin: Any, x: torch.Tensor) -> torch.Tensor:
        """``linear_rows(lin, x)``. On CUDA the skinny matmul straight into its own output (``cuda_backend.
        linear_rows`` without its copy: the same kernel and plan, so the same bits; fp32 partials, where the plan
        cuts K, added in index order)."""
        if not self._triton:
            return self._ops["linear_rows"](lin, x)
        from tandem_core.ops import triton_matmul as tm

        wt = lin.weight
        piece = tm.skinny_matmul(x if x.stride(1) == 1 else x.contiguous(), wt,
                                 tm.plan_for(int(wt.shape[0]), int(wt.shape[1])))
        return tm.reduce_parts(piece).to(x.dtype) if piece.dim() == 3 else piece

    def _add_norm(self, x: torch.Tensor, d: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + d`` (``d`` None: ``x``) and its RMS norm by norm ``k`` (``_norms``: each layer's attention and MLP
        norms in order, then the final one). On CUDA one Triton program a row (``triton_fused.add_rms_norm_1p``
        with the weight as ``w - 1``, exact: ``unsupported`` checks it), ``x`` updated in place; elsewhere the
        eager runner's ops."""
        if self._triton:
            from tandem_core.ops import triton_fused as tf

            h = torch.empty_like(x)
            tf.add_rms_norm_1p(x, d, self._norms[k], self.cfg.rms_norm_eps, h)
            return x, h
        if d is not None:
            x = x + d
        return x, F.rms_norm(x, (self.cfg.hidden_size,), self._norms[k], self.cfg.rms_norm_eps)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gu = [gate | up]`` (``[W, 2I]`` -> ``[W, I]``), row by row."""
        inter = self.cfg.intermediate_size
        if self._triton:
            from tandem_core.ops import triton_fused as tf

            return tf.silu_mul(gu, torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device))
        return self._ops["silu"](gu[:, :inter]).to(self.act) * gu[:, inter:]

    def _tree_attention(self, qk: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, m: _Meta) -> torch.Tensor:
        """Each node over the keys plain decode sees at its position (``[W, nh + nkv, hd]`` queries first, the
        layer's ``[nkv, S, hd]`` caches with the nodes' rows at their slots) -> ``[W, nh * hd]``."""
        nh, hd = self.cfg.num_heads, self.cfg.head_dim
        W = m.W
        if self._triton:
            from tandem_core.ops import triton_attention as ta

            q = qk[:, :nh].reshape(W, nh * hd)
            out = torch.empty(W, nh * hd, dtype=self.act, device=self.device)
            return ta.tree_attention(q, self._gate[:W], kc, vc, m.head, m.pos32, m.anc, self._scratch, out, hq=nh,
                                     hkv=self.cfg.num_kv_heads, head_dim=hd, scale=self._scale, rows=W)
        out = qk.new_zeros(W, nh * hd)
        for i in range(m.n):
            at = torch.tensor(slots_of(m.L, m.anc_host[i]), dtype=torch.long, device=self.device)
            k, v = kc.index_select(1, at), vc.index_select(1, at)
            out[i] = self._attend(qk[i:i + 1].clone(), k, v, None, 1)[0]
        return out

    # -- graphs --------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every width's step as a CUDA graph (after a warm-up run of each, which builds the kernels). The
        warm-up and the capture write K/V only in the slack past ``max_context``; the sequence is unchanged."""
        self.graphs, self._outs = {}, {}
        L = self.spec.max_context                                            # the slack: never a committed row
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(stream):
            for W in self.widths:
                self.metas[W].fill(L, [0] * W, [-1, *range(W - 1)])
                self._step(W)
                g = torch.cuda.CUDAGraph()
                # thread-local: a recapture (``tap``) may run while a sibling engine computes on another thread
                with graph_capture(g, stream, capture_error_mode="thread_local"):
                    self._outs[W] = self._step(W)
                self.graphs[W] = g
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    # -- what computes the rows ------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The eager runner's, with this file, the attention kernel's (on CUDA), the path and the widths."""
        base = super().manifest()
        files = set(base.files) | {str(Path(__file__).resolve())}
        if self._triton:
            from tandem_core.ops import triton_attention, triton_fused, triton_matmul

            files |= {str(Path(str(m.__file__)).resolve()) for m in (triton_attention, triton_fused, triton_matmul)}
        settings = {**base.settings, "path": "static_graphs" if self.use_graphs else "static",
                    "widths": list(self.widths), "attention": "triton" if self._triton else "torch"}
        return Manifest(tuple(sorted(files)), settings, base.extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        parts = super().memory_parts()
        ts = [t for m in self.metas.values() for t in (m.d64, m.d32)]
        if self._triton:
            s = self._scratch
            ts += [s.m, s.l, s.acc, s.tm, s.tl, s.tacc, self._gate]
        return [*parts, MemoryPart("step buffers", tensor_bytes(*ts), dev)]

    def __repr__(self) -> str:
        mode = "graphs" if self.use_graphs else "static"
        return (f"LlamaCudaRunner({self.cfg.num_layers} layers, {self.spec.dtype}, {self.device}, {mode}, "
                f"widths {self.widths[0]}..{self.widths[-1]})")
