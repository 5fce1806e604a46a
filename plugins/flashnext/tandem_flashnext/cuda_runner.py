"""``FlashNextCudaRunner``: the Flash-Next arithmetic over static buffers, decode and tree verify as CUDA graphs.

The reference ``FlashNextRunner`` (``tandem_flashnext.model``) launches every op from Python, selects the
indexed-attention blocks row by row and groups the experts with host syncs. This runner computes a decode
step and a verify of ``W`` nodes as one function of static buffers, ``_step(key)``, captured once per key
(``"decode"`` and every verify width of ``runner_widths``) as a CUDA graph and replayed with one launch.

A round's inputs (``_Meta``: one pinned host buffer per key, copied to the device without a host sync):

    ids, pos, at  [W] int64     the nodes' tokens, positions ``L + depth`` and cache slots ``L + node``
    head [2] int32              ``(L, n)``: committed tokens, nodes
    anc  [W, W]                 ``anc[i, d]``: node i's ancestor at depth d (itself at its own depth)
    win  [W, K-1]               each node's Gated DeltaNet conv window (a tail column, else ``K-1 + node``)
    pwin [W, Kp]                each node's PLE dilated-conv taps over ``[tail | the nodes' inputs]``
    plan [3W], path [W]         the gated-delta tree plan (``triton_gdn.tree_plan``), the decode's path
    emb  [L_ple, W, E]          the PLE rows: the n-gram ids hashed and their table rows gathered on the host

The PLE tables never leave the host (memory-mapped from the shards): the step's tokens and the n-gram context
(read from the ``ngram.ctx`` section, a node's window from its own path) are known before the step, so their
rows are gathered into the pinned ``emb`` and copied with the rest.

One step (read top-down; each matmul the row-invariant skinny matmul on CUDA, ``linear_rows`` elsewhere)::

    x = embed(ids) repeated over the n streams                        x: [W, n*H]
    per layer:  PLE layers:  x += ple(x, emb)                       (the gate a head_scores row dot, the dilated
                                                                     conv over each node's path)
                h, inject = hyper(x);  x += inject * mixer(h)
                    GDN:  [qkv|z|b|a](h) -> triton_fused.conv_tree -> triton_gdn.gdn_tree -> gated_rms_norm -> out
                    QSA:  q, k, v, indexer q / raw key; K, V, IK written at slots L + node;
                          block scores: the committed blocks' keys (view ``BK``) and each node's frontier blocks
                          (pooled from its own path's raw keys), top-k on the device, the tail always;
                          triton_qsa.gathered_attention over the selected slots, times sigmoid(gate)
                h, inject = hyper(x);  x += inject * moe(h)    (triton_moe: softmax top-k renormalised, grouped
                                                                 experts; the shared expert under its gate)
    logits = head(final_mixer(x))

The view ``BK [L_attn, cap, Di]`` holds, at the last position of each complete block, that block's pooled key
(mean of its raw keys, ``index_k_norm``, rope at the block's start; zeros elsewhere), so a step scores the
committed blocks without pooling them again. It is position-indexed like ``K``/``V``/``IK``: a commit moves its
rows, a cache restore brings it back with the rest.

Row invariance: every op computes each row alone with a configuration that depends on shapes other than the
row count (the matmul plans on the weight shape, the attention splits on the selection's width), the top-k
keys carry the block index so ties break the same way in every call; so row ``i`` of a verify equals the
decode row after committing its path, bit for bit.

A decode advances every section inside its graph (the Gated DeltaNet state stored in place, the conv tails, the
PLE conv tail, the n-gram context, the last streams); a verify advances nothing. ``commit`` moves the path's
K/V/IK/BK rows from ``L + node`` to ``L + depth`` and advances the sections along the path's kept rows (the
tree kernel replaying the rule, as the decode would); it returns the rows for ``replay``. Prefill is the
reference runner's (chunked, eager), then the complete blocks' keys are written into ``BK``.

``graphs=False`` runs the same step eagerly on any device: on the CPU the torch form of every kernel (the
reference ops, ``triton_qsa``'s references), the Gated DeltaNet and the experts through the reference's own
functions — the CPU tests run the conformance suite on it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import weakref
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from tandem_core.engine import Capture, LogitRows, Manifest, MemoryPart, Rows, Step, TreeStep, tensor_bytes
from tandem_core.engine.graph_tables import WIDTHS, conv_windows, runner_widths, tree_tables
from tandem_core.engine.runner import graph_capture
from tandem_core.ops import rope as _rope
from tandem_core.ops.attention import causal_mask
from tandem_core.ops.conv import conv_tail

from tandem_flashnext import triton_qsa as tq
from tandem_flashnext.blocks import gated_deltanet, moe
from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.model import FlashNextRunner, PathRows
from tandem_flashnext.ngram import context_after, read_context, tree_windows, windows
from tandem_flashnext.qsa import _scores as _qsa_scores
from tandem_flashnext.qsa import block_keys
from tandem_flashnext.steps import tree_step
from tandem_flashnext.weights import AttentionWeights, FlashNextWeights, GDNWeights, HyperWeights, MoEWeights

__all__ = ["WIDTHS", "FlashNextCudaRunner", "GpuPathRows", "conv_windows", "ple_windows", "runner_widths",
           "select_blocks", "tree_tables", "unsupported"]

_TIE_BITS = 20          # the top-k key: a score's bits above, the block's column (inverted) below


def ple_windows(anc: Sequence[Sequence[int]], tail: int, taps: int, dilation: int) -> list[list[int]]:
    """Each node's dilated-conv taps ``k = 0 .. taps-1`` (tap k reads the input ``(taps-1-k) * dilation`` back on
    its path) as rows of ``[tail columns | the nodes' inputs]``: ``c < tail`` a tail column, ``tail + j`` node j."""
    out = []
    for a in anc:
        full = [*range(tail), *(tail + j for j in a)]
        win = full[len(full) - (tail + 1):]
        out.append([win[k * dilation] for k in range(taps)])
    return out


def select_blocks(committed: torch.Tensor, frontier: torch.Tensor, nbc: torch.Tensor, top: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The blocks a row attends to, on the device without a host sync. ``committed: [W, NB]`` scores of the
    committed blocks (``-1``: not a complete block), ``frontier: [W, F]`` scores of blocks ``nbc .. nbc+F-1``
    (pooled from the row's own path; ``-1``: not complete), ``nbc: [W]`` committed complete blocks. Returns
    ``(blocks [W, k], valid [W, k])``, ``k = min(top, NB + F)``: the best ``top`` complete blocks (a tie to the
    lower block), as the reference's ``topk`` of the scores of every complete block."""
    vals, picked = top_keys(committed, frontier, top)                            # [W, k]
    valid = vals >= 0
    NB = committed.shape[1]
    blocks = torch.where(picked < NB, picked, nbc[:, None] + (picked - NB))
    return blocks, valid


def top_keys(committed: torch.Tensor, frontier: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_blocks``' top-k: ``(keys [W, k] int64, columns [W, k])``, a key the score's bits above the
    inverted column (distinct keys: a tie goes to the lower column; negative: not a complete block)."""
    scores = torch.cat([committed, frontier], dim=1) + 0.0                       # -0.0 -> +0.0
    cols = torch.arange(scores.shape[1], device=scores.device)
    if scores.shape[1] >= 1 << _TIE_BITS:
        raise ValueError(f"select_blocks: {scores.shape[1]} blocks exceed the top-k key's {1 << _TIE_BITS}")
    bits = scores.view(torch.int32).long()
    key = torch.where(scores >= 0, bits * (1 << _TIE_BITS) + ((1 << _TIE_BITS) - 1 - cols), -1 - cols)
    vals, picked = key.topk(min(int(top), scores.shape[1]), dim=1)
    return vals, picked


def unsupported(cfg: FlashNextConfig, weights: FlashNextWeights) -> str | None:
    """Why the CUDA graph path cannot run these weights (None: it can): Triton, dense bf16 weights without bias on
    a CUDA device, head sizes the kernels tile, the Gated DeltaNet's silu-gated norm, at most 1024 experts."""
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
    if cfg.attention_layers and min(cfg.head_dim, cfg.indexer_head_dim) < 16:
        return f"head_dim {cfg.head_dim} / indexer_head_dim {cfg.indexer_head_dim} below 16 (the attention tiles)"
    if cfg.attention_layers and cfg.num_attention_heads % cfg.num_key_value_heads:
        return f"{cfg.num_attention_heads} query heads do not group over {cfg.num_key_value_heads} KV heads"
    if cfg.linear_layers and min(cfg.linear_key_head_dim, cfg.linear_value_head_dim) < 16:
        return "linear attention heads narrower than 16"
    if cfg.linear_layers and cfg.output_gate != "silu":
        return f"the Gated DeltaNet's {cfg.output_gate} output gate (only the silu-gated norm has a kernel)"
    if cfg.num_experts > 1024:
        return f"{cfg.num_experts} experts (the router kernel takes up to 1024)"
    return None


# -- the weights in the kernels' layouts, shared by every runner over one weights object ------------------------
@dataclasses.dataclass
class _Fused:
    gdn_in: list[torch.Tensor]          # per GDN slot [C + Hv*Dv + 2Hv, H]: qkv | z | b | a
    A_log: torch.Tensor                 # [L_gdn, Hv] fp32
    dt_bias: torch.Tensor               # [L_gdn, Hv] fp32
    gate_up: list[torch.Tensor]         # per layer [E, 2I, H] (each expert's gate and up rebound to its rows)
    down: list[torch.Tensor]            # per layer [E, H, I]
    shared_gu: list[torch.Tensor]       # per layer [2Is, H]
    attn_qkv: list[torch.Tensor]        # per attention slot [2*Hq*D + 2*Hkv*D, H]: q (query | gate a head) | k | v


_FUSED: dict[int, _Fused] = {}


def _stack_rebind(linears: Sequence[Any]) -> torch.Tensor:
    """``[len, N, K]`` of dense weights (values unchanged), each ``Linear`` rebound to its slice: no second copy."""
    stacked = torch.stack([lin.weight for lin in linears])
    for i, lin in enumerate(linears):
        lin.weight = stacked[i]
    return stacked


def _cat_rebind(linears: Sequence[Any]) -> torch.Tensor:
    fused = torch.cat([lin.weight for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = fused[row:row + n]
        row += n
    return fused


def _fused(cfg: FlashNextConfig, weights: FlashNextWeights) -> _Fused:
    key = id(weights)
    got = _FUSED.get(key)
    if got is not None:
        return got
    gdn_in, alog, dtb, gate_up, down, shared, qkv = [], [], [], [], [], [], []
    for layer in weights.layers:
        m = layer.mixer
        if isinstance(m, GDNWeights):
            gdn_in.append(_cat_rebind([m.in_qkv, m.in_z, m.in_b, m.in_a]))
            alog.append(m.A_log.float())
            dtb.append(m.dt_bias.float())
        else:
            qkv.append(_cat_rebind([m.q, m.k, m.v]))
        mo = layer.moe
        I = mo.experts[0].gate.shape[0]
        gu = torch.empty(len(mo.experts), 2 * I, cfg.hidden_size, dtype=mo.experts[0].gate.weight.dtype,
                         device=weights.device)
        for e, ex in enumerate(mo.experts):                   # expert by expert: the peak is one expert's copy
            gu[e, :I].copy_(ex.gate.weight)
            gu[e, I:].copy_(ex.up.weight)
            ex.gate.weight, ex.up.weight = gu[e, :I], gu[e, I:]
        gate_up.append(gu)
        down.append(_stack_rebind([ex.down for ex in mo.experts]))
        shared.append(_cat_rebind([mo.shared.gate, mo.shared.up]))
    hv, dev = cfg.linear_num_value_heads, weights.device
    got = _Fused(gdn_in, torch.stack(alog) if alog else torch.zeros(0, hv, device=dev),
                 torch.stack(dtb) if dtb else torch.zeros(0, hv, device=dev), gate_up, down, shared, qkv)
    _FUSED[key] = got
    weakref.finalize(weights, _FUSED.pop, key, None)
    return got


class GpuPathRows(NamedTuple):
    """Committed tokens' rows, one a token (the CUDA form's ``replay`` record): the tree kernel's own inputs."""

    qkvc: torch.Tensor                 # [L_gdn, P, C] fp32: conv + silu, q and k heads L2-normalised
    proj: torch.Tensor                 # [L_gdn, P, n_in] bf16: the input projection (conv inputs | z | b | a)
    ple_in: torch.Tensor               # [L_ple, P, n*H] the PLE dilated conv's inputs
    ids: torch.Tensor                  # [P] the tokens
    streams: torch.Tensor | None       # [P, n*H] the streams before the final mixer

    @property
    def count(self) -> int:
        return int(self.ids.numel())

    def head(self, n: int) -> "GpuPathRows":
        return GpuPathRows(self.qkvc[:, :n], self.proj[:, :n], self.ple_in[:, :n], self.ids[:n],
                           None if self.streams is None else self.streams[:n])

    @staticmethod
    def cat(parts: Sequence["GpuPathRows"]) -> "GpuPathRows":
        if len(parts) == 1:
            return parts[0]
        s = None if parts[0].streams is None else torch.cat([p.streams for p in parts])   # type: ignore[misc]
        return GpuPathRows(torch.cat([p.qkvc for p in parts], 1), torch.cat([p.proj for p in parts], 1),
                           torch.cat([p.ple_in for p in parts], 1), torch.cat([p.ids for p in parts]), s)


class _Meta:
    """One key's round inputs: a host buffer (pinned on CUDA) and its device copy (see the module docstring)."""

    def __init__(self, W: int, k1: int, kp: int, n_ple: int, E: int, act: torch.dtype,
                 device: torch.device) -> None:
        self.W, self.k1, self.kp = W, k1, kp
        pin = device.type == "cuda"
        self.sizes32 = {"head": 2, "pos32": W, "anc": W * W, "win": W * k1, "plan": 3 * W, "path": W,
                        "pwin": W * kp}
        self.off: dict[str, tuple[int, int]] = {}
        o = 0
        for name, n in self.sizes32.items():
            self.off[name] = (o, n)
            o += n
        self.h64 = torch.zeros(3 * W, dtype=torch.long, pin_memory=pin)
        self.h32 = torch.zeros(o, dtype=torch.int32, pin_memory=pin)
        self.hemb = torch.zeros(n_ple, W, E, dtype=act, pin_memory=pin)
        self.d64 = torch.zeros(3 * W, dtype=torch.long, device=device)
        self.d32 = torch.zeros(o, dtype=torch.int32, device=device)
        self.emb = torch.zeros(n_ple, W, E, dtype=act, device=device)
        self.ids, self.pos, self.at = self.d64[:W], self.d64[W:2 * W], self.d64[2 * W:]
        self.head, self.n = self.d("head"), self.d("head")[1:2]
        self.pos32 = self.d("pos32")
        self.anc = self.d("anc").view(W, W)
        self.win = self.d("win").view(W, k1)
        self.plan, self.path = self.d("plan"), self.d("path")
        self.pwin = self.d("pwin").view(W, kp)
        self._done = torch.cuda.Event() if pin else None
        self.pool_head: torch.Tensor | None = None      # [0, W * F] int32 on the device (the runner sets it)
        # the host's copy of the round (the torch form and the PLE gather read it)
        self.L, self.count, self.parents, self.decode = 0, 0, (-1,), False

    def d(self, name: str) -> torch.Tensor:
        o, n = self.off[name]
        return self.d32[o:o + n]

    def tensors(self) -> list[torch.Tensor]:
        return [self.d64, self.d32, self.emb]

    def host_bytes(self) -> int:
        return tensor_bytes(self.h64, self.h32, self.hemb)

    def fill(self, L: int, tokens: Sequence[int], parents: Sequence[int], decode: bool, ple_taps: tuple[int, int],
             emb: Sequence[torch.Tensor]) -> None:
        """The round's tree on ``L`` committed tokens; ``emb``: each PLE layer's ``[n, E]`` gathered rows."""
        from tandem_core.ops.triton_gdn import tree_plan

        W, n, k1 = self.W, len(tokens), self.k1
        depth, anc = tree_tables(parents)
        if self._done is not None:
            self._done.synchronize()                  # the last upload has left the host buffers
        h64, h32 = self.h64.numpy(), self.h32.numpy()
        h64[:] = 0
        h32[:] = 0
        h64[:n] = tokens
        h64[W:W + n] = [L + d for d in depth]
        h64[W + n:2 * W] = L
        h64[2 * W:] = range(L, L + W)

        def part(name: str) -> Any:
            o, m = self.off[name]
            return h32[o:o + m]

        part("head")[:] = (L, n)
        part("pos32")[:] = h64[W:2 * W]
        av = part("anc").reshape(W, W)
        for i, a in enumerate(anc):
            av[i, :len(a)] = a
        if k1:
            wv = part("win").reshape(W, k1)
            wv[:n] = conv_windows(anc, k1)
            wv[n:] = list(range(k1))
        part("plan")[:3 * n] = tree_plan(list(parents)).packed()
        part("path")[:1] = 0
        tail, dil = ple_taps
        if self.kp:
            pv = part("pwin").reshape(W, self.kp)
            pv[:n] = ple_windows(anc, tail, self.kp, dil)
        for m, rows in enumerate(emb):
            self.hemb[m, :n].copy_(rows)
            self.hemb[m, n:].zero_()
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        if len(emb):
            self.emb.copy_(self.hemb, non_blocking=True)
        if self._done is not None:
            self._done.record()
        self.L, self.count, self.parents, self.decode = L, n, tuple(int(p) for p in parents), bool(decode)


@dataclasses.dataclass
class _Out:
    """What one step leaves: hidden rows after the final mixer, fp32 logits, taps (the graph's pool's tensors)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    taps: dict[int, torch.Tensor]


class FlashNextCudaRunner(FlashNextRunner):
    """The Flash-Next runner over static buffers: decode and verify as one ``_step`` per key, captured as CUDA
    graphs when ``graphs`` (a CUDA device only). ``graphs=False`` runs the same step eagerly on any device (the
    CPU tests run the conformance suite on it, on the torch form of every kernel). Prefill, the weights and the
    sections are ``FlashNextRunner``'s; the views gain ``BK`` (the committed blocks' pooled keys)."""

    def __init__(self, cfg: FlashNextConfig, weights: FlashNextWeights, *, max_context: int, max_tree: int = 64,
                 prefill_chunk: int = 512, gdn_chunk: int = 64, last_streams: bool = False,
                 graphs: bool = True, vector_prefill: bool | None = None,
                 device_select: bool | None = None) -> None:
        widths = runner_widths(int(max_tree))
        why = unsupported(cfg, weights)
        if why is None:
            from tandem_core.ops import cuda_backend

            # before the reference resolves its ops: every engine's prefill then runs the same kernels
            cuda_backend.install()
        super().__init__(cfg, weights, max_context=int(max_context) + widths[-1], prefill_chunk=prefill_chunk,
                         gdn_chunk=gdn_chunk, max_tree=widths[-1], last_streams=last_streams)
        self.widths = widths
        self._triton = why is None
        # the indexed attention's prefill with every row's selection at once (default: on CUDA)
        self._vector_prefill = self._triton if vector_prefill is None else bool(vector_prefill)
        # the step's block selection in the device form (top-k keys carrying the block, the slots by path) also
        # in the torch form (default: on CUDA only; the torch form otherwise selects node by node as the reference)
        self._device_select = self._triton if device_select is None else bool(device_select)
        if graphs and self.device.type == "cuda" and why is not None:
            raise ValueError(f"FlashNextCudaRunner: cannot capture graphs: {why}")
        self.use_graphs = bool(graphs) and self._triton
        dev, act, Wm = self.device, self.act_dtype, widths[-1]
        cap = int(self._K.shape[2])
        n_gdn, n_attn, n_ple = len(cfg.linear_layers), len(cfg.attention_layers), len(cfg.ple_layer_ids)
        r = cfg.indexer_compress_ratio
        if n_attn and (cap // r) + (Wm + r - 1) // r >= 1 << _TIE_BITS:
            raise ValueError(f"FlashNextCudaRunner: {cap} positions make {cap // r} blocks, more than the top-k "
                             f"key's {1 << _TIE_BITS}")
        self._BK = torch.zeros(n_attn, cap, cfg.indexer_head_dim, dtype=act, device=dev)
        self._views["BK"] = type(self._views["IK"])(self._BK, 1)
        k1, kp = cfg.linear_conv_kernel_dim - 1, cfg.ple_conv_kernel_size if n_ple else 0
        E = cfg.ple_embed_dim if n_ple else 0
        self._ple_taps = (cfg.ple_conv_tail, cfg.ple_conv_dilation)
        self.metas: dict[Any, _Meta] = {w: _Meta(w, k1, kp, n_ple, E, act, dev) for w in widths}
        self.metas["decode"] = _Meta(1, k1, kp, n_ple, E, act, dev)
        r = cfg.indexer_compress_ratio
        for meta in self.metas.values():                # the frontier blocks a width pools: W * F of them
            meta.pool_head = torch.tensor([0, meta.W * ((r - 1 + meta.W) // r)], dtype=torch.int32, device=dev)
        nH = cfg.hc_dim
        # what a verify keeps for the commit: the streams, the PLE conv inputs, the Gated DeltaNet's rows
        self._streams = torch.zeros(Wm, nH, dtype=act, device=dev)
        self._ple_keep = torch.zeros(n_ple, Wm, nH, dtype=act, device=dev)
        self._vids = torch.zeros(Wm, dtype=torch.long, device=dev)
        self._rule: dict[int, Any] = {}                                       # the torch form's RuleRows
        self._fw: _Fused | None = None
        if self._triton:
            self._fw = _fused(cfg, weights)
            C, hv, dk, dv = cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
                cfg.linear_value_head_dim
            self._n_in = C + hv * dv + 2 * hv
            self._proj = torch.zeros(max(n_gdn, 1), Wm, self._n_in, dtype=act, device=dev)
            self._qkvc = torch.zeros(max(n_gdn, 1), Wm, C, dtype=torch.float32, device=dev)
            self._o = torch.zeros(Wm, hv, dv, dtype=torch.float32, device=dev)
            self._onorm = torch.zeros(Wm, hv * dv, dtype=act, device=dev)
            self._branch = torch.zeros(Wm, hv, dk, dv, dtype=torch.float32, device=dev)
            self._attn = tq.AttnParts(Wm, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dev)
        self.graphs: dict[Any, Any] = {}
        self._outs: dict[Any, _Out] = {}
        self._tree: tuple[int, tuple[int, ...], int] | None = None             # (start, parents, width)
        self.spec = dataclasses.replace(self.spec, max_context=int(max_context),
                                        graph_widths=widths if self.use_graphs else ())
        if self.use_graphs:
            self.capture()

    # -- the runner verbs ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        self._tree = None
        rows = super().prefill(ids, step, logits=logits, capture=capture)
        self._block_keys_after(step.start, step.end)
        return rows

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        """The one-node tree at ``step.start``, every section advanced in the step."""
        self._verified = None
        self._tree = None
        out = self._run("decode", step.start, [int(ids[0])], [-1], capture)
        return Rows(out.hidden[:1], out.logits[:1].clone(), {li: t[:1] for li, t in out.taps.items()})

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        self._verified = None
        n = tree.count
        W = next((w for w in self.widths if w >= n), None)
        if W is None:
            raise ValueError(f"verify: {n} nodes exceed the widest width {self.widths[-1]}")
        self._tree = None
        tokens = [int(t) for t in ids.tolist()]
        out = self._run(W, tree.start, tokens, list(tree.parents), capture)
        self._vids[:n].copy_(ids.to(self.device))
        self._tree = (tree.start, tuple(tree.parents), W)
        return Rows(out.hidden[:n], out.logits[:n].clone(), {li: t[:n] for li, t in out.taps.items()})

    @torch.no_grad()
    def commit(self, tree: TreeStep, path: Sequence[int]) -> PathRows | GpuPathRows:
        """The path's K/V/IK/BK rows from slots ``start + node`` to ``start + depth``, every section advanced along
        the path's kept rows as the decode would; returns the rows (``replay``'s record)."""
        if self._tree is None or self._tree[0] != tree.start or self._tree[1] != tuple(tree.parents):
            raise RuntimeError("FlashNextCudaRunner.commit: the tree is not the one this runner verified last")
        start, P, dev = tree.start, len(path), self.device
        idx = torch.tensor([int(i) for i in path], dtype=torch.long, device=dev)
        src, dst = idx + start, torch.arange(start, start + P, dtype=torch.long, device=dev)
        for t in (self._K, self._V):
            if t.shape[0]:
                t.index_copy_(2, dst, t.index_select(2, src))
        for t in (self._IK, self._BK):
            if t.shape[0]:
                t.index_copy_(1, dst, t.index_select(1, src))
        streams = self._streams.index_select(0, idx) if self._h_last is not None else None
        ids = self._vids.index_select(0, idx)
        rows: PathRows | GpuPathRows
        if self._triton:
            rows = GpuPathRows(self._qkvc[:len(self.cfg.linear_layers)].index_select(1, idx),
                               self._proj[:len(self.cfg.linear_layers)].index_select(1, idx),
                               self._ple_keep.index_select(1, idx), ids, streams)
        else:
            rows = PathRows({s: r.take(idx) for s, r in self._rule.items()},
                            {m: self._ple_keep[m].index_select(0, idx) for m in range(self._ple_keep.shape[0])},
                            ids, streams)
        self._advance(rows)
        self._tree = None
        self._rule = {}
        return rows

    @torch.no_grad()
    def replay(self, kept: Sequence[Any], n: int) -> Any:
        parts = list(kept)
        rows = (GpuPathRows.cat(parts) if isinstance(parts[0], GpuPathRows) else PathRows.cat(parts)).head(n)
        self._advance(rows)
        return rows

    def _advance(self, rows: Any) -> None:
        if not isinstance(rows, GpuPathRows):
            super()._advance(rows)
            return
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg

        P, cfg, dev = rows.count, self.cfg, self.device
        n_gdn = len(cfg.linear_layers)
        if P == 0:
            return
        if n_gdn:
            assert self._fw is not None
            chain = torch.tensor([*range(P), *([-1] * P), *([-1] * P)], dtype=torch.int32).to(dev)
            n = torch.tensor([P], dtype=torch.int32).to(dev)
            C, hv = cfg.conv_dim, cfg.linear_num_value_heads
            tf.conv_commit(self._conv, rows.proj, chain[:P], n)
            tg.gdn_tree(rows.qkvc, rows.proj, C + hv * cfg.linear_value_head_dim,
                        C + hv * cfg.linear_value_head_dim + hv, self._fw.A_log, self._fw.dt_bias, self._S,
                        self._branch, self._o, chain, n, write_out=False, final_store=True,
                        scale=cfg.linear_key_head_dim ** -0.5, num_k_heads=cfg.linear_num_key_heads, layers=n_gdn)
        for m in range(rows.ple_in.shape[0]):
            self._ple_conv[m].copy_(conv_tail(self._ple_conv[m], rows.ple_in[m]))
        self._ctx.copy_(context_after(self._ctx, rows.ids + 1))
        if self._h_last is not None and rows.streams is not None:
            self._h_last.copy_(rows.streams[-1])

    def tap(self, layers: tuple[int, ...]) -> None:
        """Taps change what a step leaves: graphs captured with other taps are captured again."""
        layers = tuple(layers)
        if layers == self._taps:
            return
        self._taps = layers
        if self.graphs:
            self.capture()

    def reset(self) -> None:
        self._tree = None
        self._rule = {}
        super().reset()

    # -- one round ------------------------------------------------------------------------------------------
    def _ple_rows(self, tokens: list[int], parents: list[int], decode: bool) -> list[torch.Tensor]:
        """Each PLE layer's table rows for the round's nodes ``[n, E]``, gathered on the host (the n-gram context
        is the section's: one small read from the device)."""
        cfg = self.cfg
        if not cfg.ple_layer_ids:
            return []
        ctx = read_context(self._ctx.to("cpu"), self._eos)
        ids = torch.tensor(tokens, dtype=torch.long)
        win = windows(ctx, ids) if decode else tree_windows(ctx, ids, parents)     # [n, ngram_size]
        out = []
        for layer in self.w.layers:
            if layer.ple is not None:
                rows = layer.ple.hash.ids(win)                                         # [n, heads]
                out.append(layer.ple.table.gather(rows, self.act_dtype).reshape(len(tokens), -1))
        return out

    def _run(self, key: Any, L: int, tokens: list[int], parents: list[int], capture: Capture | None) -> _Out:
        meta = self.metas[key]
        decode = key == "decode"
        meta.fill(L, tokens, parents, decode, self._ple_taps, self._ple_rows(tokens, parents, decode))
        g = self.graphs.get(key)
        if g is None or capture is not None:
            return self._step(key, capture)
        g.replay()
        return self._outs[key]

    def _step(self, key: Any, capture: Capture | None = None) -> _Out:
        """The rows of ``self.metas[key]``'s round over the static buffers: K/V/IK/BK written at the slots, what a
        commit needs kept, every section advanced in a decode; nothing read back by the host on CUDA."""
        cfg, w, m = self.cfg, self.w, self.metas[key]
        decode, W, n = key == "decode", m.W, m.count
        nh = cfg.hc_count
        taps: dict[int, torch.Tensor] = {}
        cos, sin = _rope.cos_sin(m.pos, self._inv_freq)                          # [W, R] each
        geo = self._geometry(m) if cfg.attention_layers else None
        x = w.embed.index_select(0, m.ids).repeat(1, nh)                          # x: [W, n*H]
        for i, layer in enumerate(w.layers):
            if layer.ple is not None:
                slot_p = cfg.ple_slot(i)
                assert slot_p is not None
                x = x + self._ple_step(x, layer.ple, slot_p, m, decode)
            h, inject = self._hyper(x, layer.attn_hc)
            assert inject is not None
            if isinstance(layer.mixer, GDNWeights):
                out = self._gdn_step(h, layer.mixer, cfg.slot(i), m, decode)
            else:
                assert geo is not None
                out = self._qsa_step(h, layer.mixer, cfg.slot(i), m, cos, sin, geo)
            if capture is not None:
                capture.append((f"layer {i} {layer.kind} mixer", _rows_of(out)[:n].clone()))
            x = self._inject(x, out, inject)
            h, inject = self._hyper(x, layer.mlp_hc)
            assert inject is not None
            out = self._moe_step(h, layer.moe, i, m)
            if capture is not None:
                capture.append((f"layer {i} mlp", out[:n].clone()))
            x = self._inject(x, out, inject)
            if i in self._taps:
                taps[i] = x.clone()
        if decode:
            self._ctx.copy_(torch.cat([self._ctx, m.ids[:1] + 1])[1:])
            if self._h_last is not None:
                self._h_last.copy_(x[0])
        elif self._h_last is not None:
            self._streams[:W].copy_(x)
        hid, _ = self._hyper(x, w.final_hc)
        if capture is not None:
            capture.append(("final norm", hid[:n].clone()))
        return _Out(hid, self._lin(w.head, hid).float(), taps)

    # -- the pieces -----------------------------------------------------------------------------------------
    def _lin(self, lin: Any, x: torch.Tensor) -> torch.Tensor:
        """``linear_rows(lin, x)`` (``lin``: a ``Linear``, or a bf16 weight tensor on CUDA): on CUDA the skinny
        matmul with the plan of the weight's shape (fp32 partials added in index order)."""
        if not self._triton:
            return self._op["linear_rows"](lin, x)
        from tandem_core.ops import triton_matmul as tm

        wt = lin if isinstance(lin, torch.Tensor) else lin.weight
        piece = tm.skinny_matmul(x if x.stride(1) == 1 else x.contiguous(), wt,
                                 tm.plan_for(int(wt.shape[0]), int(wt.shape[1])))
        return tm.reduce_parts(piece).to(x.dtype) if piece.dim() == 3 else piece

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
        """Zero-centred RMS norm of each of ``groups`` groups of the rows ``x: [R, groups*D]`` (``weight [groups*D]``,
        or ``[D]`` shared by the groups)."""
        R = x.shape[0]
        wt = weight if weight.numel() == x.shape[1] else weight.repeat(groups)
        if self._triton:
            return tq.group_norm1p(x if x.stride(1) == 1 else x.contiguous(), wt.float().contiguous(),
                                   self.cfg.rms_norm_eps, groups)
        return self._op["rms_norm_1p"](x.reshape(R, groups, -1), wt.view(groups, -1),
                                       self.cfg.rms_norm_eps).reshape(R, -1)

    def _parts(self, wt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The skinny matmul's own output: ``[W, N]`` bf16, or fp32 partials ``[S, W, N]`` where the plan cuts K."""
        from tandem_core.ops import triton_matmul as tm

        return tm.skinny_matmul(x if x.stride(1) == 1 else x.contiguous(), wt,
                                tm.plan_for(int(wt.shape[0]), int(wt.shape[1])))

    def _hyper(self, x: torch.Tensor, hw: HyperWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the streams x: [W, n*H] -> the block's input [W, H] and the inject weights [W, n] (blocks.hyper_mix)
        op, nh, act = self._op, self.cfg.hc_count, x.dtype
        W = x.shape[0]
        normed = self._norm(x, hw.norm, nh)                                        # normed: [W, n*H]
        if self._triton:                                   # four launches past the norm and the matmuls
            mix = tq.act(self._parts(hw.down.weight, normed), 1.0 / nh, 1.0, "silu")       # [W, R]
            mixed = tq.hyper_combine(self._lin(hw.up, mix), normed, nh)                      # [W, H]
            if hw.inject is None:
                return mixed, None
            return mixed, tq.act(self._parts(hw.inject.weight, normed), 1.0 / nh, 2.0, "sigmoid")
        mix = op["silu"](self._lin(hw.down, normed) / nh).to(act)                  # mix: [W, R]
        mix = op["sigmoid"](self._lin(hw.up, mix)).to(act).view(W, nh, -1)         # mix: [W, n, H]
        gated = mix * normed.view(W, nh, -1)
        mixed = gated[:, 0]
        for s in range(1, nh):
            mixed = mixed + gated[:, s]
        mixed = mixed / nh
        if hw.inject is None:
            return mixed, None
        return mixed, (2 * op["sigmoid"](self._lin(hw.inject, normed) / nh)).to(act)

    def _inject(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        # each stream gets the block's output times its weight (blocks.hyper_inject); on CUDA x in place
        if self._triton:
            return tq.inject_add(x, out, inject)
        return x + (out[:, None, :] * inject[:, :, None]).reshape(x.shape[0], -1)

    def _ple_step(self, x: torch.Tensor, p: Any, slot: int, m: _Meta, decode: bool) -> torch.Tensor:
        # x: [W, n*H] -> what the PLE module adds [W, n*H] (tandem_flashnext.ple.ple over the gathered rows)
        cfg, op, act = self.cfg, self._op, x.dtype
        nh, H, W = cfg.hc_count, cfg.hidden_size, m.W
        emb = m.emb[slot]                                                          # emb: [W, E]
        key = self._norm(self._lin(p.key, emb), p.norm_key, nh)                    # [W, n*H]
        query = self._norm(x, p.norm_query, nh)
        value = self._lin(p.value, emb)                                            # [W, H]
        ones = torch.ones(W * nh, dtype=torch.int32, device=x.device)
        scores = tq.head_scores if self._triton else tq.head_scores_ref
        gate = scores(query.view(W * nh, 1, H), key.view(W * nh, 1, H), ones, math.sqrt(H), False).view(W, nh)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        u = op["sigmoid"](gate).to(act)[:, :, None] * value[:, None, :]            # u: [W, n, H]
        normed = self._norm(u.reshape(W, nh * H), p.norm_conv, nh)                 # the conv's inputs
        tail = self._ple_conv[slot]                                                # [n*H, Wt]
        if not decode:
            self._ple_keep[slot, :W].copy_(normed)
        src = torch.cat([tail.t().to(act), normed]).float()                        # src: [Wt + W, n*H]
        wc = p.conv.float()
        y = src.index_select(0, m.pwin[:, 0].long()) * wc[:, 0]
        for k in range(1, wc.shape[1]):
            y = y + src.index_select(0, m.pwin[:, k].long()) * wc[:, k]
        if decode:
            tail.copy_(torch.cat([tail, normed.t().to(tail.dtype)], dim=1)[:, 1:])
        return u.reshape(W, nh * H) + op["silu"](y).to(act)

    def _gdn_step(self, h: torch.Tensor, w: GDNWeights, slot: int, m: _Meta, decode: bool) -> torch.Tensor:
        # h: [W, H] -> [W, H] over the slot's state; a decode stores the state, a verify keeps the rows
        cfg, W, n = self.cfg, m.W, m.count
        if not self._triton:
            step: Step | TreeStep = Step(m.L, 1) if decode else tree_step(m.L, m.parents)
            out, rule = gated_deltanet(self._op, self._op["linear_rows"], h[:n], w, cfg, step, self._S[slot],
                                       self._conv[slot], self.gdn_chunk)
            if rule is not None:
                self._rule[slot] = rule
            return torch.cat([out, out.new_zeros(W - n, out.shape[1])]) if W > n else out
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg
        from tandem_core.ops import triton_matmul as tm

        assert self._fw is not None
        fw, C = self._fw, cfg.conv_dim
        hv, dv, hk, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_num_key_heads, \
            cfg.linear_key_head_dim
        wi = fw.gdn_in[slot]
        proj = self._proj[slot, :W]
        tm.skinny_matmul(h, wi, _whole(wi), out=proj)
        tf.conv_tree(proj, self._conv[slot], w.conv, m.win, m.n, self._qkvc[slot, :W], dk, 2 * hk, W)
        col_b = C + hv * dv
        tg.gdn_tree(self._qkvc[slot:slot + 1], self._proj[slot:slot + 1], col_b, col_b + hv,
                    fw.A_log[slot:slot + 1], fw.dt_bias[slot:slot + 1], self._S[slot:slot + 1], self._branch,
                    self._o, m.plan, m.n, write_out=True, final_store=decode, scale=dk ** -0.5, num_k_heads=hk)
        if decode:
            tf.conv_commit(self._conv[slot:slot + 1], self._proj[slot:slot + 1], m.path, m.n)
        tf.gated_rms_norm(self._o[:W], proj[:, C:], w.norm, cfg.rms_norm_eps, self._onorm[:W])
        return self._parts(w.out.weight, self._onorm[:W])               # the inject adds any split's partials

    def _moe_step(self, h: torch.Tensor, w: MoEWeights, layer: int, m: _Meta) -> torch.Tensor:
        # h: [W, H] -> [W, H]: the experts the nodes chose, each once over the nodes that chose it, and the shared
        # expert under its sigmoid gate
        cfg, op, act = self.cfg, self._op, h.dtype
        if not self._triton:
            n = m.count
            y = moe(op, op["linear_rows"], h[:n], w, cfg.num_experts_per_tok)
            return torch.cat([y, y.new_zeros(h.shape[0] - n, y.shape[1])]) if h.shape[0] > n else y
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_moe as tmoe

        assert self._fw is not None
        fw = self._fw
        experts, weights = tmoe.route(self._lin(w.router, h), None, cfg.num_experts_per_tok, "softmax", True, 1.0,
                                      0.0)
        routed = tmoe.grouped_experts(h, experts, weights, fw.gate_up[layer], fw.down[layer], live=m.n)
        gu = self._lin(fw.shared_gu[layer], h)                                     # [W, 2Is]
        a = tf.silu_mul(gu, torch.empty(h.shape[0], gu.shape[1] // 2, dtype=act, device=h.device))
        shared = self._lin(w.shared.down, a) * tq.act(self._parts(w.shared_gate.weight, h), 1.0, 1.0, "sigmoid")
        return routed + shared

    # -- prefill's device forms (batched: a prefill need not be row invariant) -------------------------------------
    def _experts(self, step: Step | TreeStep) -> Any:
        if not self._triton or isinstance(step, TreeStep) or step.count == 1:
            return None
        return self._moe_prefill

    def _moe_prefill(self, x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        # x: [T, H] -> [T, H]: routing and the grouped experts on the device (triton_moe's prefill plan), the shared
        # expert batched
        from tandem_core.ops import triton_moe as tmoe

        assert self._fw is not None
        cfg, op, act = self.cfg, self._op, x.dtype
        layer = next(i for i, lw in enumerate(self.w.layers) if lw.moe is w)
        experts, weights = tmoe.route(w.router.matmul(x), None, cfg.num_experts_per_tok, "softmax", True, 1.0, 0.0)
        plan = tmoe.PREFILL_PLAN if x.shape[0] > 64 else None
        routed = tmoe.grouped_experts(x, experts, weights, self._fw.gate_up[layer], self._fw.down[layer], plan=plan)
        sh = w.shared
        gu = torch.nn.functional.linear(x, self._fw.shared_gu[layer])
        I = gu.shape[1] // 2
        a = op["silu"](gu[:, :I]).to(act) * gu[:, I:]
        shared = sh.down.matmul(a) * op["sigmoid"](w.shared_gate.matmul(x)).to(act)
        return routed + shared

    def _mixer(self, mixer: Any, slot: int, step: Step | TreeStep, rec: Any, mm: Any, cos: torch.Tensor,
               sin: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self._vector_prefill and isinstance(mixer, AttentionWeights) and isinstance(step, Step) \
                and step.count > 1:
            return self._qsa_prefill(h, mixer, slot, step, cos, sin)
        return super()._mixer(mixer, slot, step, rec, mm, cos, sin, h)

    def _qsa_prefill(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        """``qsa.indexed_attention``'s prefill with the selection of every row at once (no loop over rows, no host
        read): the rows' block scores over every complete block, each row's top-k among its own complete blocks
        (a tie to whichever ``topk`` returns first), the tail, then one masked attention (SDPA)."""
        cfg, op, act = self.cfg, self._op, x.dtype
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hi, di, r = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
        qg = w.q.matmul(x).view(T, hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, hq * D)
        k = w.k.matmul(x).view(T, hkv, D)
        v = w.v.matmul(x).view(T, hkv, D)
        q = op["rope"](op["rms_norm_1p"](q, w.q_norm, cfg.rms_norm_eps), cos, sin)
        k = op["rope"](op["rms_norm_1p"](k, w.k_norm, cfg.rms_norm_eps), cos, sin)
        iqk = w.index_qk.matmul(x)
        iq = op["rope"](op["rms_norm_1p"](iqk[:, :hi * di].reshape(T, hi, di), w.index_q_norm, cfg.rms_norm_eps),
                        cos, sin)                                                  # iq: [T, Hi, Di]
        start, end = step.start, step.end
        K, V, IK = self._K[slot], self._V[slot], self._IK[slot]
        K[:, start:end], V[:, start:end], IK[start:end] = k.transpose(0, 1), v.transpose(0, 1), iqk[:, hi * di:]
        dev = x.device
        nb_all = end // r
        pos = torch.arange(start, end, device=dev)                                 # [T]
        nb = (pos + 1) // r                                                        # each row's complete blocks
        chosen = causal_mask(start, T, dev)                                        # [T, end]
        if nb_all:
            keys = block_keys(op, IK, nb_all, w, cfg, self._inv_freq)              # [nb_all, Di]
            scores = _qsa_scores(iq, keys, cfg)                                    # [T, nb_all]
            live = torch.arange(nb_all, device=dev)[None, :] < nb[:, None]
            scores = scores.masked_fill(~live, float("-inf"))
            top = min(cfg.block_topk, nb_all)
            best = scores.topk(top, dim=1).indices                                 # [T, top]
            ok = best < nb[:, None]
            pick = torch.zeros(T, nb_all, dtype=torch.bool, device=dev)
            pick.scatter_(1, best, ok)
            blocks = pick.repeat_interleave(r, dim=1)                              # [T, nb_all * r]
            tail = torch.arange(end, device=dev)[None, :] >= (nb * r)[:, None]     # the incomplete block
            sel = tail.clone()
            sel[:, :nb_all * r] |= blocks
            chosen = chosen & sel
        qq = q.transpose(0, 1)[None]                                               # [1, Hq, T, D]
        rep = hq // hkv                                          # the KV heads repeated: any SDPA backend takes a mask
        kk = K[:, :end].repeat_interleave(rep, dim=0)[None]                        # [1, Hq, end, D]
        vv = V[:, :end].repeat_interleave(rep, dim=0)[None]
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=chosen[None, None],
                                                             scale=D ** -0.5)
        o = o[0].transpose(0, 1).reshape(T, hq * D) * op["sigmoid"](gate).to(act)
        return w.o.matmul(o)

    # -- QSA indexed attention on the device ----------------------------------------------------------------------
    def _geometry(self, m: _Meta) -> dict[str, torch.Tensor]:
        """The round's block geometry, shared by every attention layer (device tensors, no host read): committed
        complete blocks ``nbc``, each node's frontier blocks (their cache slots), its tail's slots and whether the
        node completes a block."""
        cfg, W, dev = self.cfg, m.W, self.device
        r = cfg.indexer_compress_ratio
        F = (r - 1 + W) // r
        L = m.head[0:1].long()                                                   # [1]
        pos = m.pos                                                              # [W] int64
        nbc = (L // r).expand(W)                                                 # [W]
        nb = (pos + 1) // r
        nf = nb - nbc                                                            # [W] in 0..F
        anc = m.anc.long()

        def slots(t: torch.Tensor) -> torch.Tensor:
            # positions t: [W, X] of node rows -> cache slots (committed as they are, else the path's node)
            d = (t - L).clamp(0, W - 1)
            return torch.where(t < L, t, L + anc.gather(1, d))

        jr = torch.arange(r, device=dev)
        fpos = (nbc[:, None, None] + torch.arange(F, device=dev)[None, :, None]) * r + jr   # [W, F, r]
        tpos = nb[:, None] * r + jr[None, :]                                       # [W, r]
        return {"nbc": nbc, "nf": nf, "fslots": slots(fpos.reshape(W, -1)).clamp(min=0),
                "fstart": (nbc[:, None] + torch.arange(F, device=dev)[None, :]) * r,
                "tslots": torch.where(tpos <= pos[:, None], slots(tpos), -1), "own": (pos + 1) % r == 0,
                "L": L, "anc": anc, "nbc32": nbc.to(torch.int32).contiguous(), "nf32": nf.to(torch.int32)}

    def _pool(self, raw: torch.Tensor, starts: torch.Tensor, w: AttentionWeights,
              head: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks' keys from their raw keys ``raw: [B, r, Di]`` at block starts ``[B]``: the mean (summed row by
        row), ``index_k_norm``, rope at the start (``qsa.block_keys``) -> ``[B, Di]``. On CUDA the norm and the
        rope are one ``qk_post`` launch (``head``: the device's ``[0, B]``; made here when None)."""
        r = raw.shape[1]
        f = raw.float()
        total = f[:, 0]
        for j in range(1, r):
            total = total + f[:, j]
        mean = (total / r).to(raw.dtype)
        if self._triton:
            from tandem_core.ops import triton_fused as tf

            B = mean.shape[0]
            if head is None:
                head = torch.tensor([0, B], dtype=torch.int32, device=mean.device)
            out = torch.zeros_like(mean)
            K0 = self._K[0]
            tf.qk_post(mean, w.index_k_norm, w.index_k_norm, self._inv_freq, starts.to(torch.int32), head, out, K0,
                       K0, 1, 0, mean.shape[1], self.cfg.rotary_dim, self.cfg.rms_norm_eps, B, gated=False)
            return out
        pooled = self._norm(mean, w.index_k_norm, 1)
        cos, sin = _rope.cos_sin(starts, self._inv_freq)
        return self._op["rope"](pooled[:, None, :], cos, sin)[:, 0]

    def _qsa_step(self, h: torch.Tensor, w: AttentionWeights, slot: int, m: _Meta, cos: torch.Tensor,
                  sin: torch.Tensor, geo: dict[str, torch.Tensor]) -> torch.Tensor:
        # h: [W, H] -> [W, H]; the nodes' K, V, raw keys and (completed) block keys written at slots L + node
        cfg, op, act, W = self.cfg, self._op, h.dtype, m.W
        hq, hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hi, di, r = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
        Kc, Vc, IK, BK = self._K[slot], self._V[slot], self._IK[slot], self._BK[slot]
        if self._triton:               # one matmul for q | k | v, then norms, rope and the K/V rows in one launch
            from tandem_core.ops import triton_fused as tf
            from tandem_core.ops import triton_matmul as tm

            assert self._fw is not None
            wq = self._fw.attn_qkv[slot]
            raw = tm.skinny_matmul(h, wq, _whole(wq))                              # [W, 2HqD + 2HkvD]
            q = torch.zeros(W, hq * D, dtype=act, device=h.device)       # rows past the tree stay zero
            tf.qk_post(raw, w.q_norm, w.k_norm, self._inv_freq, m.pos32, m.head, q, Kc, Vc, hq, hkv, D,
                       cfg.rotary_dim, cfg.rms_norm_eps, W)                        # K, V rows at L + node
            gate = raw[:, :2 * hq * D].reshape(W, hq, 2 * D)[..., D:].reshape(W, hq * D)
        else:
            qg = self._lin(w.q, h).view(W, hq, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(W, hq * D)
            k = self._lin(w.k, h).view(W, hkv, D)
            v = self._lin(w.v, h).view(W, hkv, D)
            q = op["rope"](self._norm(q.reshape(W, hq * D), w.q_norm, hq).view(W, hq, D), cos, sin)
            k = op["rope"](self._norm(k.reshape(W, hkv * D), w.k_norm, hkv).view(W, hkv, D), cos, sin)
            Kc.index_copy_(1, m.at, k.transpose(0, 1).to(Kc.dtype))
            Vc.index_copy_(1, m.at, v.transpose(0, 1).to(Vc.dtype))
        iqk = self._lin(w.index_qk, h)                                             # [W, (Hi + 1)*Di]
        if self._triton:                            # the indexer's queries: norm and rope, one launch
            from tandem_core.ops import triton_fused as tf

            iq = torch.zeros(W, hi * di, dtype=act, device=h.device)
            tf.qk_post(iqk, w.index_q_norm, w.index_q_norm, self._inv_freq, m.pos32, m.head, iq, Kc, Vc, hi, 0, di,
                       cfg.rotary_dim, cfg.rms_norm_eps, W, gated=False)
            iq = iq.view(W, hi, di)
        else:
            iq = self._norm(iqk[:, :hi * di], w.index_q_norm, hi).view(W, hi, di)
            iq = op["rope"](iq, cos, sin)                                          # iq: [W, Hi, Di]
        ik = iqk[:, hi * di:]                                                      # ik: [W, Di] raw keys
        IK.index_copy_(0, m.at, ik.to(IK.dtype))
        # each node's frontier blocks, pooled from its own path's raw keys: [W, F, Di]
        F = geo["fstart"].shape[1]
        fk = self._pool(IK.index_select(0, geo["fslots"].reshape(-1)).view(W * F, r, di),
                        geo["fstart"].reshape(-1), w, m.pool_head).view(W, F, di)
        last = (geo["nf"] - 1).clamp(min=0)
        own = fk.gather(1, last[:, None, None].expand(W, 1, di))[:, 0]
        BK.index_copy_(0, m.at, torch.where(geo["own"][:, None], own, torch.zeros_like(own)))
        bk = BK[r - 1::r]                                                          # the committed blocks' keys
        if self._device_select:                     # scores, top-k and the attended slots on the device
            div = math.sqrt(di)
            scores = tq.head_scores if self._triton else tq.head_scores_ref
            sc = scores(iq, bk, geo["nbc32"], div, True)                           # [W, NB]
            sf = scores(iq, fk, geo["nf32"], div, True)                            # [W, F]
            vals, cols = top_keys(sc, sf, cfg.block_topk)                          # [W, k]
            slots = tq.slots if self._triton else tq.slots_ref
            sel = slots(vals, cols, m.head, m.pos, m.anc, int(bk.shape[0]), r)     # sel: [W, k*r + r]
        else:
            blocks, valid = self._select_host(iq, bk, fk, m)
            tok = (blocks[:, :, None] * r + torch.arange(r, device=h.device)).reshape(W, -1)
            L, anc = geo["L"], geo["anc"]
            tslot = torch.where(tok < L, tok, L + anc.gather(1, (tok - L).clamp(0, W - 1)))
            tslot = torch.where(valid[:, :, None].expand(-1, -1, r).reshape(W, -1), tslot, -1)
            sel = torch.cat([tslot, geo["tslots"]], dim=1).to(torch.int32)         # sel: [W, k*r + r]
        scale = D ** -0.5
        if self._triton:
            o = tq.gathered_attention(q, Kc, Vc, sel, scale, hkv, self._attn)
        else:
            o = tq.gathered_attention_ref(q.reshape(W, hq * D), Kc, Vc, sel, scale, hkv)
        o = o * op["sigmoid"](gate).to(act)
        return self._parts(w.o.weight, o) if self._triton else self._lin(w.o, o)

    def _select_host(self, iq: torch.Tensor, bk: torch.Tensor, fk: torch.Tensor, m: _Meta) -> tuple[
            torch.Tensor, torch.Tensor]:
        """The torch form's selection, node by node from the host's tree: the reference's scores and ``topk`` over
        exactly the node's complete blocks (committed, then its frontier), so that its ties fall as the
        reference's do (``torch.topk`` leaves the order of equal scores unspecified; the device form breaks them
        to the lower block). ``(blocks [W, k], valid [W, k])`` as ``select_blocks``."""
        cfg, W = self.cfg, m.W
        r = cfg.indexer_compress_ratio
        k = min(cfg.block_topk, bk.shape[0] + fk.shape[1])
        blocks = torch.zeros(W, k, dtype=torch.long, device=iq.device)
        valid = torch.zeros(W, k, dtype=torch.bool, device=iq.device)
        depth, _ = tree_tables(m.parents)
        nbc = m.L // r
        for i in range(m.count):
            nb = (m.L + depth[i] + 1) // r
            if nb == 0:
                continue
            keys = torch.cat([bk[:nbc], fk[i, :nb - nbc]])
            best = _qsa_scores(iq[i], keys, cfg).topk(min(cfg.block_topk, nb), dim=0).indices
            blocks[i, :best.numel()] = best
            valid[i, :best.numel()] = True
        return blocks, valid

    def _block_keys_after(self, start: int, end: int) -> None:
        """``BK`` rows ``start .. end - 1`` after a prefill wrote the raw keys there: each block completed in the
        range its key at its last position, zeros elsewhere."""
        cfg = self.cfg
        if not cfg.attention_layers or end <= start:
            return
        r = cfg.indexer_compress_ratio
        self._BK[:, start:end].zero_()
        lo, hi = (start + r) // r - 1, end // r                                    # blocks lo .. hi - 1
        if hi <= lo:
            return
        starts = torch.arange(lo, hi, device=self.device) * r
        for i, layer in enumerate(self.w.layers):
            if isinstance(layer.mixer, AttentionWeights):
                s = cfg.slot(i)
                raw = self._IK[s, lo * r:hi * r].view(hi - lo, r, -1)
                self._BK[s, starts + r - 1] = self._pool(raw, starts, layer.mixer).to(self._BK.dtype)

    # -- graphs --------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture the decode graph and every width's verify graph (after a warm-up run of each, which builds the
        kernels). The warm-ups and captures write K/V/IK/BK only in the slack past ``max_context``, and the sections
        the decode moves on are put back: the sequence is unchanged."""
        self.graphs, self._outs = {}, {}
        L = self.spec.max_context
        dev = self.device
        keep = {name: t.clone() for name, t in self._sections.items()}
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(stream):
            for key in ["decode", *self.widths]:
                W = self.metas[key].W
                self.metas[key].fill(L, [0] * W, [-1, *range(W - 1)], key == "decode", self._ple_taps,
                                     [torch.zeros(W, self.cfg.ple_embed_dim, dtype=self.act_dtype)
                                      for _ in self.cfg.ple_layer_ids])
                self._step(key)
                g = torch.cuda.CUDAGraph()
                with graph_capture(g, stream, capture_error_mode="thread_local"):
                    self._outs[key] = self._step(key)
                self.graphs[key] = g
            for name, t in self._sections.items():
                t.copy_(keep[name])
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)

    # -- what computes the rows ------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The reference runner's, with this file and the kernels' files (on CUDA), the path and the widths."""
        base = super().manifest()
        files = set(base.files) | {str(Path(__file__).resolve()), str(Path(tq.__file__).resolve())}
        if self._triton:
            from tandem_core.ops import triton_fused, triton_gdn, triton_matmul, triton_moe

            files |= {str(Path(str(mod.__file__)).resolve())
                      for mod in (triton_fused, triton_gdn, triton_matmul, triton_moe)}
        settings = {**base.settings, "path": "static_graphs" if self.use_graphs else "static",
                    "widths": list(self.widths), "kernels": "triton" if self._triton else "torch"}
        return Manifest(tuple(sorted(files)), settings, base.extra)

    def memory_parts(self) -> list[MemoryPart]:
        """The reference's parts (the PLE tables on the host, memory-mapped), the block keys, the step buffers on
        the device and the pinned host rows the PLE gather fills."""
        dev = str(self.device)
        parts = super().memory_parts()
        ts = [self._streams, self._ple_keep, self._vids, *(t for m in self.metas.values() for t in m.tensors())]
        if self._triton:
            ts += [self._proj, self._qkvc, self._o, self._onorm, self._branch, *self._attn.tensors()]
        host = "cpu (pinned)" if self.device.type == "cuda" else "cpu"
        return [*parts, MemoryPart("indexer.block_keys", tensor_bytes(self._BK), dev),
                MemoryPart("step buffers", tensor_bytes(*ts), dev),
                MemoryPart("ple.rows", sum(m.host_bytes() for m in self.metas.values()), host)]

    def __repr__(self) -> str:
        mode = "graphs" if self.use_graphs else "static"
        return (f"FlashNextCudaRunner({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, {mode}, "
                f"widths {self.widths[0]}..{self.widths[-1]})")


def _rows_of(out: torch.Tensor) -> torch.Tensor:
    """A mixer's output rows ``[W, H]`` (its fp32 partials added in index order and rounded, as the inject does)."""
    if out.dim() == 2:
        return out
    from tandem_core.ops import triton_matmul as tm

    return tm.reduce_parts(out).to(torch.bfloat16)


def _whole(w: torch.Tensor) -> Any:
    """The plan of a projection whose consumer reads bf16 rows (the fused Gated DeltaNet input): K not split."""
    from tandem_core.ops import triton_matmul as tm

    return dataclasses.replace(tm.plan_for(int(w.shape[0]), int(w.shape[1])), split=1)
