"""``LfmCudaRunner``: the LFM2 arithmetic over static buffers, decode and tree verify as CUDA graphs.

The reference ``Lfm2Runner`` (``tandem_lfm25.model``) launches every op of a step from Python and
groups the experts with host syncs (``torch.unique``, ``nonzero``). This runner computes a decode
step and a verify of ``W`` nodes as one function of static buffers, ``_step(W)``, captured once per
width as a CUDA graph and replayed with one launch:

    per width W (``WIDTHS`` up to the first that holds ``max_tree``; decode is W = 1):
        ids   [W] int64      the nodes' tokens (0 past the tree)
        pos   [W] int64      ``L + depth`` (``L`` past the tree): the rotary rows
        head  [2] int32      ``(L, n)``: committed tokens, nodes
        pos32 [W] int32, anc [W, W] int32   the attention kernel's tables: ``anc[i, d]`` node i's
                             ancestor at depth d, i itself at its own depth
        win   [W, K-1] int32 each node's conv window: below K-1 a column of the committed tail, else
                             ``K-1 + node`` (an ancestor), oldest first
        adv   [1] int32          1: a decode step (width 1 only: the conv tails move on in the step), 0: a verify

A round writes them in one pinned host buffer per width and copies it to the device without a host
sync, then replays the width's graph (``graphs=False``: runs ``_step`` directly). The graph writes the
K/V rows at slots ``L + node`` and each conv layer's nodes' conv inputs (``keep``), and leaves the
hidden rows, taps and fp32 logits in its own output tensors; ``decode``/``verify`` return a copy of the
logits and views of the rest (valid until the next call).

One step (read top-down; the reference runner's arithmetic, each matmul through ``linear_rows``)::

    x = embed(ids); h = rms_norm(x)
    per layer:  conv:       bcx = in_proj(h); o = C * conv(B * X; window)         (triton_conv.gated_conv)
                            d = out_proj(o)
                attention:  qkv = [q | k | v](h); q, k = rope(norm(q)), rope(norm(k)); K, V[L + node] = k, v
                            d = out(tree_attention(q; L, pos, anc))
                x, h = x + d, rms_norm(x + d)
                dense:      d = w2(silu(w1 h) * w3 h)
                MoE:        experts, weights = top-k(sigmoid(router h) + bias) (triton_moe.route_plan)
                            d = grouped_experts(h, experts, weights)               (triton_moe)
                x, h = x + d, rms_norm(x + d)
    logits = head(h)

On CUDA the residual add and the norm after it are one Triton program a row
(``triton_fused.add_rms_norm_1p``, handed ``w - 1`` for its ``1 + w`` form: ``unsupported`` checks the
weights survive it exactly), ``q``/``k`` norm and rope and the K/V writes are
``triton_fused.qk_post`` (ungated), the matmuls the skinny matmul with a plan per weight shape, the
MoE ``tandem_core.ops.triton_moe`` (routing and the experts sorted and blocked on the device; the
rows past the tree run no expert). Attention is ``triton_attention.tree_attention``; it multiplies
its output by ``sigmoid(gate)`` (Qwen's gated attention), and this runner hands it a constant gate of
``GATE_ONE``, whose sigmoid is exactly 1.0 in fp32 and bf16. Elsewhere (the CPU, ``graphs=False``)
every piece is the same contract in torch: the reference ops, each node's keys gathered by position
and its conv window by index.

The projections of few column tiles (the router, ``in_proj``, ``out_proj``, ``q | k | v``, ``o``, ``w2``) take
``step_plan``: K cut in parts until the grid fills the device, each part an fp32 partial, and the next kernel adds
the partials in index order where it reads them (the add-norm, the gated conv, ``qk_post``, and
``triton_moe.route_plan``, which routes and builds the experts' plan in one program); the MoE layer's combine
runs inside the add-norm after it (``triton_moe.combine_add_norm``). Nothing between them reduces in torch.

Row invariance: every op computes each row alone, with a kernel configuration that depends on the
weight shapes only, so row ``i`` of a verify of width ``W`` equals the decode row at its position
after committing its path, bit for bit, whatever ``W`` and whatever else shares its experts.

A decode step moves the conv tails on inside its graph (the conv kernel, on the round's ``adv`` flag);
a verify, of one node too (the same width-1 graph), leaves them. ``commit`` copies the path's K/V rows from ``L + path[d]`` to ``L + d`` (every layer:
one gather, one scatter) and moves every conv tail along the path's kept conv inputs (one gather and
one copy for all layers); it returns those inputs (``Kept``) for ``replay``. Prefill is the reference
runner's (chunked, batched matmuls) with attention through SDPA and the experts through
``triton_moe`` (its prefill plan) on CUDA. The K/V buffers have ``widths[-1]`` positions of slack
past ``max_context`` (a verify's scratch slots).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tandem_core.engine import Capture, LogitRows, Manifest, MemoryPart, Rows, Step, TreeStep, tensor_bytes
from tandem_core.engine.graph_tables import GATE_ONE, WIDTHS, conv_windows, runner_widths, slots_of, tree_tables
from tandem_core.engine.runner import graph_capture
from tandem_core.ops import moe as _core_moe
from tandem_core.ops import rope as _rope
from tandem_lfm25 import moe as _moe
from tandem_lfm25.config import Lfm2Config
from tandem_lfm25.model import Kept, Lfm2Runner
from tandem_lfm25.weights import AttentionWeights, ConvWeights, Lfm2Weights, MLPWeights, MoEWeights

__all__ = ["GATE_ONE", "SMS", "WIDTHS", "LfmCudaRunner", "conv_windows", "runner_widths", "slots_of", "step_plan",
           "tree_tables", "unsupported"]



SMS = 132   # H200 multiprocessors: only ``step_plan``'s split reads it (a constant: a plan never depends on the run)


def step_plan(N: int, K: int) -> Any:
    """The decode and verify step's plan for a weight ``[N, K]`` whose consumer adds the fp32 partials itself:
    ``triton_matmul.plan_for(N, K)`` (its tiles, K step, warps, stages and layout: the same ``tl.dot`` shapes,
    whose row invariance the device checks) with K cut in more parts, doubling while the grid of column tiles
    times parts stays within three programs a multiprocessor (what fits at once: ~60 KB of shared memory a
    program at one row) and each part keeps at least one K step.

    A weight of few column tiles otherwise leaves most of the device idle: measured on the H200 (profile of the
    24B-A2B decode step), the router ``64 x 2048`` ran as one program (7.5 us for 256 KB), ``out_proj 2048 x
    2048`` as 32 (8.4 us for 8 MB, a quarter of the bandwidth). Here: the router 16 parts (16 programs of one
    step), ``2048 x 2048`` 8 (256 programs of two), ``in_proj 6144 x 2048`` 4 (384 of four), the fused
    ``q | k | v 3072 x 2048`` 8 (384), ``w2 2048 x 7168`` 8 (256 of seven); the LM head (1024 tiles) is not cut."""
    from tandem_core.ops import triton_matmul as tm

    p = tm.plan_for(N, K)
    tiles = -(-N // p.BN)
    steps = -(-K // p.BK)
    split = max(1, p.split)
    while tiles * split * 2 <= 3 * SMS and split * 2 <= steps:
        split *= 2
    return dataclasses.replace(p, split=split)


def _norms(weights: Lfm2Weights) -> list[torch.Tensor]:
    """Every RMS norm weight of a step in order: per layer the operator norm and the FFN norm, then the final."""
    return [*(t for lw in weights.layers for t in (lw.operator_norm, lw.ffn_norm)), weights.norm]


def unsupported(cfg: Lfm2Config, weights: Lfm2Weights) -> str | None:
    """Why the CUDA graph path cannot run these weights (None: it can): Triton, dense bf16 weights without bias
    on a CUDA device, a head size the attention kernel tiles (a power of two, 16 .. 256), norm weights that the
    Triton norm's ``1 + w`` form gives back exactly from ``w - 1``, at most 1024 experts."""
    from tandem_core.linear import DenseLinear

    dev = weights.device
    if dev.type != "cuda":
        return f"weights on {dev}, not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if weights.act_dtype != torch.bfloat16:
        return f"weights in {weights.dtype}, the CUDA kernels read bf16"
    for lin in weights.linears():
        if not isinstance(lin, DenseLinear) or lin.bias is not None or lin.weight.dtype != torch.bfloat16 \
                or lin.weight.stride(-1) != 1:
            return f"a weight held as {lin!r} (the kernels read dense bf16 without bias)"
    D = cfg.head_dim
    if cfg.attention_layers and (D < 16 or D > 256 or D & (D - 1)):
        return f"head_dim {D} is not a power of two in 16..256"
    if cfg.num_experts > 1024:
        return f"{cfg.num_experts} experts (the router kernel takes up to 1024)"
    qk = [t for lw in weights.layers if isinstance(lw.mixer, AttentionWeights) for t in (lw.mixer.q_norm,
                                                                                         lw.mixer.k_norm)]
    for t in [*_norms(weights), *qk]:
        w = t.float()
        if not torch.equal(1.0 + (w - 1.0), w):
            return "a norm weight is not exactly 1 + (w - 1) in fp32 (the Triton norm multiplies by 1 + w)"
    return None


# the attention layers' q, k and v weights side by side, one tensor a layer, shared by every runner over one
# weights object (spawned engines) and dropped with it
_FUSED: dict[int, list[torch.Tensor]] = {}


def _fused_qkv(weights: Lfm2Weights) -> list[torch.Tensor]:
    key = id(weights)
    got = _FUSED.get(key)
    if got is None:
        got = [torch.cat([lw.mixer.q.weight, lw.mixer.k.weight, lw.mixer.v.weight])
               for lw in weights.layers if isinstance(lw.mixer, AttentionWeights)]
        _FUSED[key] = got
        weakref.finalize(weights, _FUSED.pop, key, None)
    return got


class _Meta:
    """One width's round inputs: a host buffer (pinned on CUDA) and its device copy, int64 ``[ids W | pos W]`` and
    int32 ``[L, n | pos W | anc W*W | win W*(K-1) | adv]``."""

    def __init__(self, W: int, k1: int, device: torch.device) -> None:
        self.W, self.k1 = W, k1
        pin = device.type == "cuda"
        n32 = 2 + W + W * W + W * k1 + 1
        self.h64 = torch.zeros(2 * W, dtype=torch.long, pin_memory=pin)
        self.h32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.d64 = torch.zeros(2 * W, dtype=torch.long, device=device)
        self.d32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.ids, self.pos = self.d64[:W], self.d64[W:]
        self.head, self.pos32 = self.d32[:2], self.d32[2:2 + W]
        self.n = self.d32[1:2]
        self.anc = self.d32[2 + W:2 + W + W * W].view(W, W)
        self.win = self.d32[2 + W + W * W:n32 - 1].view(W, k1)
        self.adv = self.d32[n32 - 1:]
        self._done = torch.cuda.Event() if pin else None
        # the host's copy of the tree this buffer holds (the torch path reads it)
        self.L, self.count, self.anc_host, self.win_host, self.advance = 0, 0, [[0]], [list(range(k1))], False

    def fill(self, L: int, tokens: Sequence[int], parents: Sequence[int], advance: bool = False) -> None:
        """The round's tree on ``L`` committed tokens; ``advance``: a decode step (one node)."""
        W, n, k1 = self.W, len(tokens), self.k1
        depth, anc = tree_tables(parents)
        win = conv_windows(anc, k1)
        if self._done is not None:
            self._done.synchronize()                  # the last upload has left the host buffer
        h64, h32 = self.h64.numpy(), self.h32.numpy()
        h64[:] = 0
        h32[:] = 0
        h64[:n] = tokens
        h64[W:W + n] = [L + d for d in depth]
        h64[W + n:] = L
        h32[:2] = (L, n)
        h32[2:2 + W] = h64[W:]
        av = h32[2 + W:2 + W + W * W].reshape(W, W)
        for i, a in enumerate(anc):
            av[i, :len(a)] = a
        if k1:
            h32[2 + W + W * W:-1].reshape(W, k1)[:n] = win
        h32[-1] = int(advance)
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        if self._done is not None:
            self._done.record()
        self.L, self.count, self.anc_host, self.win_host, self.advance = L, n, anc, win, bool(advance)


class _Pairs(NamedTuple):
    """A MoE layer's output before its combine (CUDA): each (row, slot) pair's expert output ``d [W * k, H]`` bf16,
    the rows' experts and weights ``[W, k]``, the live rows; the add-norm after it combines them
    (``triton_moe.combine_add_norm``)."""

    d: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    live: torch.Tensor


@dataclasses.dataclass
class _Out:
    """What one step leaves: hidden rows after the final norm, fp32 logits, taps (the graph's pool's tensors)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    taps: dict[int, torch.Tensor]


class LfmCudaRunner(Lfm2Runner):
    """The LFM2 runner over static buffers: decode and verify as one ``_step`` per width, captured as CUDA graphs
    when ``graphs`` (a CUDA device only). ``graphs=False`` runs the same step eagerly, on any device (the CPU tests
    run the conformance suite on it, on the torch form of every kernel). Prefill, the weights, the conv tails and
    the K/V layout are ``Lfm2Runner``'s."""

    def __init__(self, cfg: Lfm2Config, weights: Lfm2Weights, *, max_context: int, max_tree: int = 64,
                 prefill_chunk: int = 512, graphs: bool = True) -> None:
        widths = runner_widths(int(max_tree))
        super().__init__(cfg, weights, max_context=int(max_context) + widths[-1], max_tree=widths[-1],
                         prefill_chunk=prefill_chunk)
        self.widths = widths
        why = unsupported(cfg, weights)
        self._triton = why is None
        if graphs and self.device.type == "cuda" and why is not None:
            raise ValueError(f"LfmCudaRunner: cannot capture graphs: {why}")
        self.use_graphs = bool(graphs) and self._triton
        if self._triton:
            from tandem_core.ops import cuda_backend

            cuda_backend.install()                    # linear_rows (the prefill's last row) on the skinny matmul
            self._ops["linear_rows"] = cuda_backend.linear_rows
        k1 = cfg.conv_state_width
        self.metas = {w: _Meta(w, k1, self.device) for w in widths}
        dev, act, H = self.device, self.act_dtype, cfg.hidden_size
        # each conv layer's nodes' conv inputs B*x of the last verify (what a commit moves the tails along)
        self._keep = torch.zeros(len(cfg.conv_layers), widths[-1], H, dtype=act, device=dev)
        norms = _norms(weights)
        qk = [t for lw in weights.layers if isinstance(lw.mixer, AttentionWeights) for t in (lw.mixer.q_norm,
                                                                                             lw.mixer.k_norm)]
        # the Triton norms multiply by (1 + w): they are handed w - 1 in fp32 (exact: unsupported() checks it)
        self._norm_w = [t.float() - 1.0 for t in norms] if self._triton else norms
        self._qk_w = [t.float() - 1.0 for t in qk] if self._triton else qk
        self._qkv: list[torch.Tensor] = []
        if self._triton:
            from tandem_core.ops import triton_attention as ta

            self._qkv = _fused_qkv(weights)
            hq, D = cfg.num_attention_heads, cfg.head_dim
            self._scratch = ta.AttnScratch(widths[-1], hq, D, int(self._K.shape[2]), dev)
            self._gate = torch.full((widths[-1], 2 * hq * D), GATE_ONE, dtype=act, device=dev)
        self.graphs: dict[int, Any] = {}
        self._outs: dict[int, _Out] = {}
        self._plans: dict[tuple[int, int, bool], Any] = {}          # (N, K, parts) -> MatmulPlan, fixed at first use
        self._tree_L, self._tree_W = 0, 0
        self._tree_parents: tuple[int, ...] = ()
        self.spec = dataclasses.replace(self.spec, max_context=int(max_context),
                                        graph_widths=widths if self.use_graphs else ())
        if self.use_graphs:
            self.capture()

    # -- the runner verbs ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        self._tree_W = 0
        return super().prefill(ids, step, logits=logits, capture=capture)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        """The one-node tree at ``step.start``: its key and value land at slot ``start``; the conv tails move on."""
        self._verified = None
        self._tree_W = 0
        out = self._run(1, step.start, [int(ids[0])], [-1], capture, advance=True)
        return Rows(out.hidden[:1], out.logits[:1].clone(), {li: t[:1] for li, t in out.taps.items()})

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        self._verified = None
        n = tree.count
        W = next((w for w in self.widths if w >= n), None)
        if W is None:
            raise ValueError(f"verify: {n} nodes exceed the widest width {self.widths[-1]}")
        self._tree_W = 0
        out = self._run(W, tree.start, [int(t) for t in ids.tolist()], list(tree.parents), capture)
        self._tree_L, self._tree_W, self._tree_parents = tree.start, W, tuple(tree.parents)
        return Rows(out.hidden[:n], out.logits[:n].clone(), {li: t[:n] for li, t in out.taps.items()})

    @torch.no_grad()
    def commit(self, tree: TreeStep, path: Sequence[int]) -> Kept | None:
        """The path's K/V rows from their scratch slots ``start + node`` to ``start .. start + len(path) - 1``, and
        every conv tail moved along the path's conv inputs (returned, for ``replay``)."""
        if not self._tree_W or self._tree_L != tree.start or self._tree_parents != tuple(tree.parents):
            raise RuntimeError("LfmCudaRunner.commit: the tree is not the one this runner verified last")
        start, P = tree.start, len(path)
        src = torch.tensor([start + int(i) for i in path], dtype=torch.long, device=self.device)
        dst = torch.arange(start, start + P, dtype=torch.long, device=self.device)
        for cache in (self._K, self._V):
            if cache.shape[0]:
                cache.index_copy_(2, dst, cache.index_select(2, src))
        self._tree_W = 0
        if not self.cfg.conv_layers:
            return None
        idx = torch.tensor([int(i) for i in path], dtype=torch.long, device=self.device)
        rows = self._keep.index_select(1, idx)                                   # [L_conv, P, H]
        k1 = self.cfg.conv_state_width
        self._conv.copy_(torch.cat([self._conv, rows.transpose(1, 2)], dim=2)[:, :, P:P + k1])
        return Kept(tuple(rows.unbind(0)))

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
    def _run(self, W: int, L: int, tokens: list[int], parents: list[int], capture: Capture | None,
             advance: bool = False) -> _Out:
        meta = self.metas[W]
        meta.fill(L, tokens, parents, advance)
        g = self.graphs.get(W)
        if g is None or capture is not None:
            return self._step(W, capture)
        g.replay()
        return self._outs[W]

    def _step(self, W: int, capture: Capture | None = None) -> _Out:
        """Width ``W``'s rows over the static buffers (``self.metas[W]``): K/V rows written at the slots, the
        nodes' conv inputs kept, the conv tails moved on in a decode step; nothing read from the host on CUDA."""
        cfg, w, m = self.cfg, self.w, self.metas[W]
        n = m.count
        taps: dict[int, torch.Tensor] = {}
        x = w.embed.index_select(0, m.ids)                                     # x: [W, H]
        x, h = self._add_norm(x, None, 0)
        cos_sin = None if self._triton else _rope.cos_sin(m.pos, self._inv_freq)
        for i, layer in enumerate(w.layers):
            if isinstance(layer.mixer, ConvWeights):
                d = self._conv_step(h, layer.mixer, cfg.slot(i), m)
            else:
                d = self._attention_step(h, layer.mixer, cfg.slot(i), m, cos_sin)
            x, h = self._add_norm(x, d, 2 * i + 1)
            if capture is not None:
                capture.append((f"layer {i} {layer.kind} mixer", x[:n].clone()))
            if isinstance(layer.ffn, MoEWeights):
                d, point = self._moe_step(h, layer.ffn, m), "moe"
            else:
                d, point = self._mlp_step(h, layer.ffn), "mlp"
            x, h = self._add_norm(x, d, 2 * i + 2)
            if capture is not None:
                capture.append((f"layer {i} {point}", x[:n].clone()))
            if i in self._taps:
                taps[i] = x.clone()                                            # x moves on in place on CUDA
        if capture is not None:
            capture.append(("final norm", h[:n].clone()))
        return _Out(h, self._lin(w.head, h).float(), taps)

    def _lin(self, lin: Any, x: torch.Tensor, parts: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """``linear_rows(lin, x)`` (``lin``: a ``Linear``, or a bf16 weight tensor on CUDA). On CUDA the skinny
        matmul straight into its own output (or ``out``, a ``[W, N]`` view with a unit column stride); where the
        plan cuts K, its fp32 partials added in index order and rounded to bf16 (``reduce_parts``).

        ``parts`` (the consumer adds the partials itself, in index order, inside its own kernel: the add-norm, the
        gated conv, ``qk_post``, ``route_plan``): the weight's step plan (``step_plan``: K cut until the grid
        fills the device) and the partials ``[S, W, N]`` fp32 returned as they are (``[W, N]`` bf16 where K is
        not cut). Either way the plan is a function of the weight shape and the call site only."""
        if not self._triton:
            y = self._ops["linear_rows"](lin, x)
            return y if out is None else out.copy_(y)
        from tandem_core.ops import triton_matmul as tm

        wt = lin if isinstance(lin, torch.Tensor) else lin.weight
        N, K = int(wt.shape[0]), int(wt.shape[1])
        plan = self._plans.get((N, K, parts))
        if plan is None:
            plan = self._plans[(N, K, parts)] = step_plan(N, K) if parts else tm.plan_for(N, K)
        xx = x if x.stride(1) == 1 else x.contiguous()
        whole = plan.k_split(K) >= K
        piece = tm.skinny_matmul(xx, wt, plan, out=out if whole and not parts else None)
        if piece.dim() == 3 and not parts:
            piece = tm.reduce_parts(piece).to(x.dtype)
        if out is not None and piece.data_ptr() != out.data_ptr():
            out.copy_(piece)
            return out
        return piece

    def _add_norm(self, x: torch.Tensor, d: torch.Tensor | _Pairs | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + d`` (``d`` None: ``x``) and its RMS norm by norm ``k`` (``_norms``' order; past the last layer's
        FFN norm, the final norm). On CUDA one Triton program a row, ``x`` updated in place; ``d`` may be a
        matmul's fp32 partials ``[S, W, H]`` (added in index order and rounded to bf16 in the same program: the bits
        of ``bf16(reduce_parts(d))``), or a MoE layer's ``_Pairs`` (combined in the same program: the combine
        kernel's arithmetic, then the add-norm's)."""
        if self._triton:
            from tandem_core.ops import triton_fused as tf
            from tandem_core.ops import triton_moe as tm

            h = torch.empty_like(x)
            if isinstance(d, _Pairs):
                tm.combine_add_norm(d.d, d.experts, d.weights, x, self._norm_w[k], self.cfg.norm_eps, h, live=d.live)
            else:
                tf.add_rms_norm_1p(x, d, self._norm_w[k], self.cfg.norm_eps, h)
            return x, h
        assert not isinstance(d, _Pairs)
        if d is not None:
            x = x + d
        return x, self._ops["rms_norm"](x, self._norm_w[k], self.cfg.norm_eps)

    def _conv_step(self, h: torch.Tensor, w: ConvWeights, slot: int, m: _Meta) -> torch.Tensor:
        # h: [W, H] -> [W, H]: out_proj(C * conv(B * X)), each node over its window; decode moves the tail on
        H, W = self.cfg.hidden_size, m.W
        bcx = self._lin(w.in_proj, h, parts=True)                              # bcx: [W, 3H] or [S, W, 3H]
        keep = self._keep[slot, :W]
        if self._triton:
            from tandem_lfm25 import triton_conv

            o = torch.empty(W, H, dtype=h.dtype, device=h.device)
            triton_conv.gated_conv(bcx, self._conv[slot], w.conv, m.win, m.n, keep, o,
                                   advance=m.adv if W == 1 else None)
            return self._lin(w.out_proj, o, parts=True)                        # [S, W, H] into the add-norm
        b, c, xx = bcx[:, :H], bcx[:, H:2 * H], bcx[:, 2 * H:]
        bx = b * xx                                                            # bx: [W, H] the conv inputs
        keep.copy_(bx)
        k1 = self.cfg.conv_state_width
        src = torch.cat([self._conv[slot].t().to(bx.dtype), bx]).float()      # [k1 + W, H]
        wf = w.conv.float()
        y = torch.zeros(W, H, dtype=torch.float32, device=h.device)
        for i in range(m.count):
            idx = [*m.win_host[i], k1 + i]
            acc = src[idx[0]] * wf[:, 0]
            for k in range(1, k1 + 1):
                acc = acc + src[idx[k]] * wf[:, k]
            y[i] = acc
        if m.advance:
            self._conv[slot].copy_(torch.cat([self._conv[slot], bx.t().to(self._conv.dtype)], dim=1)[:, 1:])
        return self._lin(w.out_proj, c * y.to(bx.dtype))

    def _attention_step(self, h: torch.Tensor, w: AttentionWeights, slot: int, m: _Meta,
                        cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        # h: [W, H] -> [W, H]; the nodes' keys and values written at slots L + node
        cfg, W = self.cfg, m.W
        hq, hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        Kc, Vc = self._K[slot], self._V[slot]                                  # [Hkv, S, D]
        scale = D ** -0.5
        if self._triton:
            from tandem_core.ops import triton_attention as ta
            from tandem_core.ops import triton_fused as tf

            raw = self._lin(self._qkv[slot], h, parts=True)                    # raw: [(S,) W, (Hq + 2 Hkv) D]
            q = torch.empty(W, hq * D, dtype=h.dtype, device=h.device)
            tf.qk_post(raw, self._qk_w[2 * slot], self._qk_w[2 * slot + 1], self._inv_freq, m.pos32, m.head, q, Kc,
                       Vc, hq, hkv, D, D, cfg.norm_eps, W, gated=False)
            o = torch.empty(W, hq * D, dtype=h.dtype, device=h.device)
            ta.tree_attention(q, self._gate[:W], Kc, Vc, m.head, m.pos32, m.anc, self._scratch, o, hq=hq, hkv=hkv,
                              head_dim=D, scale=scale, rows=W)
            return self._lin(w.o, o, parts=True)
        assert cos_sin is not None
        cos, sin = cos_sin
        op = self._ops
        q = self._lin(w.q, h).view(W, hq, D)
        k = self._lin(w.k, h).view(W, hkv, D)
        v = self._lin(w.v, h).view(W, hkv, D)
        q = op["rope"](op["rms_norm"](q, self._qk_w[2 * slot], cfg.norm_eps), cos, sin)
        k = op["rope"](op["rms_norm"](k, self._qk_w[2 * slot + 1], cfg.norm_eps), cos, sin)
        at = torch.arange(m.L, m.L + W, device=h.device)
        Kc.index_copy_(1, at, k.transpose(0, 1))
        Vc.index_copy_(1, at, v.transpose(0, 1))
        o = q.new_zeros(W, hq, D)
        for i in range(m.count):
            pos = torch.tensor(slots_of(m.L, m.anc_host[i]), dtype=torch.long, device=h.device)
            mask = torch.ones(1, len(pos), dtype=torch.bool, device=h.device)
            o[i] = op["attention"](q[i:i + 1], Kc.index_select(1, pos), Vc.index_select(1, pos), mask, scale)[0]
        return self._lin(w.o, o.reshape(W, hq * D))

    def _mlp_step(self, h: torch.Tensor, w: MLPWeights) -> torch.Tensor:
        # h: [W, H] -> [W, H]: w2(silu(w1 h) * w3 h)
        if self._triton:
            from tandem_core.ops import triton_fused as tf

            I = int(w.w1.shape[0])
            gu = torch.empty(h.shape[0], 2 * I, dtype=h.dtype, device=h.device)  # [W, 2I]: gate | up, in place
            self._lin(w.w1, h, out=gu[:, :I])
            self._lin(w.w3, h, out=gu[:, I:])
            a = tf.silu_mul(gu, torch.empty(h.shape[0], I, dtype=h.dtype, device=h.device))
            return self._lin(w.w2, a, parts=True)
        return self._lin(w.w2, self._ops["silu"](self._lin(w.w1, h)).to(self.act_dtype) * self._lin(w.w3, h))

    def _moe_step(self, h: torch.Tensor, w: MoEWeights, m: _Meta) -> torch.Tensor | _Pairs:
        # h: [W, H] -> [W, H]: the experts the nodes chose, each once over the nodes that chose it
        cfg = self.cfg
        if self._triton:
            from tandem_core.ops import triton_moe as tm

            logits = self._lin(w.router, h, parts=True)                        # [S, W, E] fp32 (or [W, E])
            E, I2, H = w.gate_up_all.shape
            plan = tm.plan_for(int(E), int(I2) // 2, int(H))
            r = tm.route_plan(logits, w.expert_bias, cfg.num_experts_per_tok, plan, cfg.norm_topk_prob,
                              cfg.routed_scaling_factor, live=m.n)
            d = tm.grouped_experts(h, r.experts, r.weights, w.gate_up_all, w.down_all, plan=plan, live=m.n,
                                   blocks=r, combine=False)                # d: [W * k, H], combined next
            return _Pairs(d, r.experts, r.weights, m.n)
        logits = self._lin(w.router, h)                                        # [W, E]
        n = m.count
        routes = _moe.route(logits[:n], w.expert_bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                            cfg.routed_scaling_factor, self._ops["sigmoid"])
        y = _moe.experts_grouped(h[:n], routes, w.gate_up, w.down, self._ops["linear_rows"], self._ops["silu"])
        return torch.cat([y, h.new_zeros(h.shape[0] - n, h.shape[1])])

    # -- prefill's CUDA pieces (batched: a prefill need not be row invariant) -----------------------------------
    def _attention(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step | TreeStep,
                   kept: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self._triton or isinstance(step, TreeStep) or step.count == 1:
            return super()._attention(x, w, slot, step, kept, cos, sin)
        # x: [T, H] -> [T, H]: K/V rows step.start .. step.end - 1 written, then SDPA over the cache
        cfg, op = self.cfg, self._ops
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = w.q.matmul(x).view(T, hq, D)
        k = w.k.matmul(x).view(T, hkv, D)
        v = w.v.matmul(x).view(T, hkv, D)
        q = op["rope"](op["rms_norm"](q, w.q_norm, cfg.norm_eps), cos, sin)
        k = op["rope"](op["rms_norm"](k, w.k_norm, cfg.norm_eps), cos, sin)
        end = step.end
        self._K[slot, :, step.start:end] = k.transpose(0, 1)
        self._V[slot, :, step.start:end] = v.transpose(0, 1)
        qq = q.transpose(0, 1)[None]                                           # [1, Hq, T, D]
        kk, vv = self._K[slot, :, :end][None], self._V[slot, :, :end][None]   # [1, Hkv, end, D]
        if step.start == 0:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=D ** -0.5, enable_gqa=True)
        else:
            from tandem_core.ops.attention import causal_mask

            mask = causal_mask(step.start, T, self.device)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
        return w.o.matmul(o[0].transpose(0, 1).reshape(T, hq * D))

    def _moe(self, x: torch.Tensor, w: MoEWeights, step: Step | TreeStep) -> torch.Tensor:
        if not self._triton or isinstance(step, TreeStep) or step.count == 1:
            return super()._moe(x, w, step)
        from tandem_core.ops import triton_moe as tm

        cfg = self.cfg
        experts, weights = tm.route(w.router.matmul(x), w.expert_bias, cfg.num_experts_per_tok, "sigmoid",
                                    cfg.norm_topk_prob, cfg.routed_scaling_factor)
        plan = tm.PREFILL_PLAN if x.shape[0] > 64 else None
        return tm.grouped_experts(x, experts, weights, w.gate_up_all, w.down_all, plan=plan)

    # -- graphs --------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every width's step as a CUDA graph (after a warm-up run of each, which builds the kernels). The
        warm-up and the capture write K/V only in the slack past ``max_context``, and the conv tails the decode
        warm-up moves on are put back: the sequence is unchanged."""
        self.graphs, self._outs = {}, {}
        L = self.spec.max_context                                            # the slack: never a committed row
        dev = self.device
        tails = self._conv.clone()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(stream):
            for W in self.widths:
                self.metas[W].fill(L, [0] * W, [-1, *range(W - 1)], advance=W == 1)
                self._step(W)
                g = torch.cuda.CUDAGraph()
                # thread-local: a recapture (``tap``) may run while a sibling engine computes on another thread
                with graph_capture(g, stream, capture_error_mode="thread_local"):
                    self._outs[W] = self._step(W)
                self.graphs[W] = g
            self._conv.copy_(tails)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    # -- what computes the rows ------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The reference runner's, with this file, the kernels' files (on CUDA), the path and the widths."""
        base = super().manifest()
        files = set(base.files) | {str(Path(__file__).resolve()), str(Path(_core_moe.__file__).resolve())}
        if self._triton:
            from tandem_core.ops import triton_attention, triton_fused, triton_matmul, triton_moe
            from tandem_lfm25 import triton_conv

            files |= {str(Path(str(m.__file__)).resolve())
                      for m in (triton_attention, triton_fused, triton_matmul, triton_moe, triton_conv)}
        settings = {**base.settings, "path": "static_graphs" if self.use_graphs else "static",
                    "widths": list(self.widths), "kernels": "triton" if self._triton else "torch"}
        return Manifest(tuple(sorted(files)), settings, base.extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        parts = super().memory_parts()
        ts = [self._keep, *(t for m in self.metas.values() for t in (m.d64, m.d32))]
        if self._triton:
            s = self._scratch
            ts += [s.m, s.l, s.acc, s.tm, s.tl, s.tacc, self._gate]
            parts.append(MemoryPart("fused qkv (shared)", tensor_bytes(*self._qkv), dev))
        return [*parts, MemoryPart("step buffers", tensor_bytes(*ts), dev)]

    def __repr__(self) -> str:
        mode = "graphs" if self.use_graphs else "static"
        return (f"LfmCudaRunner({self.cfg.model_type}, {self.cfg.num_hidden_layers} layers, {self.spec.dtype}, "
                f"{self.device}, {mode}, widths {self.widths[0]}..{self.widths[-1]})")
