"""The Qwen3.8 CUDA path: fused weights, decode and tree verify as CUDA graphs over the engine's buffers,
commit, and chunked prefill.

``CudaRunner`` works on the engine's own buffers (``gdn.S``, ``gdn.conv``, ``K``, ``V``) and
keeps the sequence length on the host. Every hot step is one graph replay:

    decode(token)            graph "decode": the one-node tree, its state stored in place
    verify(tokens, parents)  graph of the smallest captured width >= N (1..128); nothing committed
    commit(path)             three launches: K/V rows, conv tails, the Gated DeltaNet state replayed
                             along the path (every layer in one launch); ``keep=True`` also returns
                             the path's rule rows (``PathRows``) so that ``replay`` can redo it
    replay(rows)             the state advanced along kept rows (taking back pending tokens)
    prefill(ids)             eager, ``prefill_chunk`` rows at a time: cuBLAS projections, the chain conv
                             kernel over the chunk, the chunked gated delta rule, flash
                             attention (lower-right causal) over the cache

A round's inputs (length, positions, the tree's windows, plans and ancestor table) go
in one pinned host buffer copied to the device without a host sync; the only sync in a
round is reading the picks. Decode and verify run the same kernels with the same
configuration on every row (``tandem_core.ops.triton_*``), so a verified row equals the
decode row bit for bit.

Weights: each layer's projections that read the same input are one matrix
(``[qkv | z | b | a]``, ``[gate | up]``, ``[q | k | v]``), so one launch reads them;
``fuse_weights`` builds them from ``Qwen38Weights`` and rebinds each dense weight to its
rows of the fused matrix (same values, no second copy); on weights fused before (another
engine over the same ``Qwen38Weights``) it returns the same matrices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tandem_core.engine.runner import graph_capture, widths_up_to
from tandem_core.settings import SETTINGS as _SETTINGS
from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.plugin import SETTINGS_DECLARED

__all__ = ["WIDTHS", "GdnW", "AttnW", "LayerW", "FusedWeights", "fuse_weights", "CudaRunner", "tree_tables",
           "PathRows", "runner_widths", "unsupported"]

WIDTHS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# the plugin's settings, declared here as well as through its hook: tools and tests build runners with entry
# points off (equal declarations: declaring twice is a no-op)
for _setting in SETTINGS_DECLARED:
    _SETTINGS.declare(_setting)


@dataclass
class GdnW:
    w_in: torch.Tensor      # [C + Hv*Dv + 2*Hv, H] bf16: qkv | z | b | a
    conv: torch.Tensor      # [C, K] fp32
    norm: torch.Tensor      # [Dv] fp32
    w_out: torch.Tensor     # [H, Hv*Dv]


@dataclass
class AttnW:
    w_qkv: torch.Tensor     # [2*Hq*D + 2*Hkv*D, H]: q (per head query | gate) | k | v
    q_norm: torch.Tensor    # [D] fp32
    k_norm: torch.Tensor    # [D] fp32
    w_o: torch.Tensor       # [H, Hq*D]


@dataclass
class LayerW:
    in_norm: torch.Tensor   # [H] fp32
    post_norm: torch.Tensor
    mixer: GdnW | AttnW
    w_gu: torch.Tensor      # [2I, H]: gate | up
    w_down: torch.Tensor    # [H, I]


@dataclass
class FusedWeights:
    embed: torch.Tensor     # [V, H] bf16
    head: torch.Tensor      # [V, H] bf16
    norm: torch.Tensor      # [H] fp32
    layers: list[LayerW]
    A_log: torch.Tensor     # [L_gdn, Hv] fp32
    dt_bias: torch.Tensor   # [L_gdn, Hv] fp32

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.head, self.norm, self.A_log, self.dt_bias]
        for ly in self.layers:
            out += [ly.in_norm, ly.post_norm, ly.w_gu, ly.w_down]
            m = ly.mixer
            out += [m.w_in, m.conv, m.norm, m.w_out] if isinstance(m, GdnW) else [m.w_qkv, m.q_norm, m.k_norm,
                                                                                   m.w_o]
        return out


def _fuse(linears: Sequence[Any]) -> torch.Tensor:
    """Concatenate dense weights by rows and point each at its rows of the result (values unchanged).
    Weights that already lie one after another in one storage (fused before) are returned as that matrix."""
    ws = [lin.weight for lin in linears]
    first = ws[0]
    rows = sum(int(w.shape[0]) for w in ws)
    K = int(first.shape[1])
    step = K * first.element_size()
    ptr = first.data_ptr()
    adjacent = True
    for w in ws:
        same = w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same and w.is_contiguous() and w.shape[1] == K and w.dtype == first.dtype and w.data_ptr() == ptr):
            adjacent = False
            break
        ptr += int(w.shape[0]) * step
    if adjacent:
        return first.as_strided((rows, K), (K, 1))
    fused = torch.cat(ws, dim=0).contiguous()
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = fused[row:row + n]
        row += n
    return fused


def fuse_weights(weights: Any, cfg: Qwen38Config) -> FusedWeights:
    """``FusedWeights`` over a loaded ``Qwen38Weights`` (dense bf16 projections on a CUDA device)."""
    from tandem_qwen38.weights import GDNWeights

    layers: list[LayerW] = []
    alog, dtb = [], []
    for lw in weights.layers:
        m = lw.mixer
        mixer: GdnW | AttnW
        if isinstance(m, GDNWeights):
            mixer = GdnW(_fuse([m.in_qkv, m.in_z, m.in_b, m.in_a]), m.conv.float().contiguous(), m.norm.float(),
                         m.out.weight)
            alog.append(m.A_log.float())
            dtb.append(m.dt_bias.float())
        else:
            mixer = AttnW(_fuse([m.q, m.k, m.v]), m.q_norm.float(), m.k_norm.float(), m.o.weight)
        layers.append(LayerW(lw.input_norm.float(), lw.post_norm.float(), mixer,
                             _fuse([lw.mlp.gate, lw.mlp.up]), lw.mlp.down.weight))
    dev = weights.device
    return FusedWeights(weights.embed, weights.head.weight, weights.norm.float(), layers,
                        torch.stack(alog) if alog else torch.zeros(0, cfg.linear_num_value_heads, device=dev),
                        torch.stack(dtb) if dtb else torch.zeros(0, cfg.linear_num_value_heads, device=dev))


def unsupported(cfg: Qwen38Config, weights: Any) -> str | None:
    """Why ``CudaRunner`` cannot run this model (None: it can): bf16 dense weights without bias on a CUDA
    device, head sizes the kernels tile (powers of two for attention, at least 16 for the recurrent rule)."""
    from tandem_core.linear import DenseLinear

    if weights.device.type != "cuda":
        return f"weights on {weights.device}, not a CUDA device"
    if weights.dtype != "bf16":
        return f"weights in {weights.dtype}, the CUDA kernels read bf16"
    for lin in weights.linears():
        if not isinstance(lin, DenseLinear) or lin.bias is not None or lin.weight.dtype != torch.bfloat16:
            fmt = getattr(lin, "format", type(lin).__name__)
            return f"a weight in format {fmt} (the kernels read dense bf16 without bias)"
    D = cfg.head_dim
    if cfg.attention_layers and (D < 16 or D & (D - 1)):
        return f"head_dim {D} is not a power of two >= 16"
    if cfg.linear_layers and min(cfg.linear_key_head_dim, cfg.linear_value_head_dim) < 16:
        return "linear attention heads narrower than 16"
    return None


def runner_widths(max_tree: int) -> tuple[int, ...]:
    """``WIDTHS`` up to the first that holds ``max_tree`` (``tandem_core.engine.runner.widths_up_to``)."""
    return widths_up_to(WIDTHS, max_tree)


class PathRows(NamedTuple):
    """Committed tokens' Gated DeltaNet inputs, one row a token, every GDN layer: what ``replay`` needs to
    redo their state update (the tree kernel's own inputs, so the replay is the commit bit for bit)."""

    qkv: torch.Tensor       # [L_gdn, P, C] fp32: conv + silu output, q and k heads L2-normalised
    proj: torch.Tensor      # [L_gdn, P, n_in] bf16: the input projection (conv inputs | z | b | a)

    @property
    def count(self) -> int:
        return int(self.qkv.shape[1])

    def head(self, n: int) -> "PathRows":
        return PathRows(self.qkv[:, :n], self.proj[:, :n])

    @staticmethod
    def cat(parts: Sequence["PathRows"]) -> "PathRows":
        if len(parts) == 1:
            return parts[0]
        return PathRows(torch.cat([p.qkv for p in parts], dim=1), torch.cat([p.proj for p in parts], dim=1))


# -- the tree's tables -------------------------------------------------------------------------------------
def tree_tables(parents: Sequence[int], kw: int) -> tuple[list[int], list[list[int]], list[list[int]], list[int]]:
    """For a tree (``parents[i] < i``; -1: child of the sequence): each node's depth, its conv window (the
    ``kw - 1`` inputs before it: ``< kw - 1`` a tail column, else ``kw - 1 + node``), its ancestor chain
    (``anc[i][d]``, the node at depth ``d`` on its path, itself last), and the Gated DeltaNet plan."""
    from tandem_core.ops.triton_gdn import tree_plan

    depth: list[int] = []
    anc: list[list[int]] = []
    win: list[list[int]] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree: parents[{i}] = {p} is not an earlier node")
        chain = [i] if p < 0 else anc[p] + [i]
        anc.append(chain)
        depth.append(len(chain) - 1)
        seq = list(range(kw - 1)) + [kw - 1 + a for a in chain[:-1]]      # the tail, then the ancestors
        win.append(seq[-(kw - 1):])
    return depth, win, anc, tree_plan(list(parents)).packed()


class _Meta:
    """One width's round inputs: a pinned host buffer and its device copy, with named int32 views."""

    def __init__(self, W: int, kw: int, device: torch.device) -> None:
        self.W = W
        sizes = {"head": 4, "pos": W, "win": W * (kw - 1), "plan": 3 * W, "anc": W * W, "path": W,
                 "pplan": 3 * W}
        self.off: dict[str, tuple[int, int]] = {}
        o = 0
        for k, n in sizes.items():
            self.off[k] = (o, n)
            o += n
        pin = device.type == "cuda"
        self.host = torch.zeros(o, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(o, dtype=torch.int32, device=device)
        self.ids_host = torch.zeros(W, dtype=torch.int64, pin_memory=pin)
        self.ids = torch.zeros(W, dtype=torch.int64, device=device)
        self.np = self.host.numpy()
        self.done = torch.cuda.Event() if pin else None

    def writable(self) -> None:
        """Wait until the last upload has left the pinned buffer (a step may be queued behind others)."""
        if self.done is not None:
            self.done.synchronize()

    def d(self, name: str) -> torch.Tensor:
        o, n = self.off[name]
        return self.dev[o:o + n]

    def h(self, name: str) -> np.ndarray:
        o, n = self.off[name]
        return self.np[o:o + n]

    def upload(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        self.ids.copy_(self.ids_host, non_blocking=True)
        if self.done is not None:
            self.done.record()


class CudaRunner:
    """Decode, verify, commit and prefill of one sequence on a CUDA device.

    ``S: [L_gdn, Hv, Dk, Dv]`` fp32, ``conv: [L_gdn, C, K-1]`` bf16, ``K, V: [L_attn, Hkv, max_context, D]``
    bf16 are the engine's buffers (read and written in place); ``length`` is the committed tokens.
    """

    def __init__(self, cfg: Qwen38Config, fw: FusedWeights, S: torch.Tensor, conv: torch.Tensor,
                 K: torch.Tensor, V: torch.Tensor, *, max_context: int, widths: Sequence[int] = WIDTHS,
                 prefill_chunk: int = 8192, pdl: bool | None = None, attn_split: int | None = None) -> None:
        from tandem_core.ops import rope as _rope
        from tandem_core.ops import triton_attention as ta
        from tandem_core.ops import triton_matmul as tm
        from tandem_core.ops import triton_pdl
        from tandem_core.settings import SETTINGS

        if pdl is None:
            pdl = bool(SETTINGS.get("CUDA_PDL")) and torch.cuda.get_device_capability(S.device)[0] >= 9
        triton_pdl.set_enabled(pdl)
        self.cfg, self.fw = cfg, fw
        self.S, self.conv, self.K, self.V = S, conv, K, V
        self.max_context = int(max_context)
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        if self.widths[0] != 1 or self.widths[-1] > tm.MAX_ROWS:
            raise ValueError(f"widths {self.widths}: need 1 and at most {tm.MAX_ROWS}")
        self.prefill_chunk = int(prefill_chunk)
        self.device = dev = S.device
        self.length = 0
        c = cfg
        self.H, self.I = c.hidden_size, c.intermediate_size
        self.hq, self.hkv, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.hk, self.hv, self.dk, self.dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                                              c.linear_key_head_dim, c.linear_value_head_dim)
        self.kw, self.C = c.linear_conv_kernel_dim, c.conv_dim
        self.zdim = self.hv * self.dv
        self.col_b = self.C + self.zdim
        self.col_a = self.col_b + self.hv
        self.n_in = self.col_a + self.hv
        self.slots = [c.slot(i) for i in range(c.num_hidden_layers)]
        self.freqs = _rope.inv_freq(c.rotary_dim, c.rope_theta, dev)

        # matmul plans, one per weight shape for every row count this runner multiplies (decode and verify
        # alike: the row invariance rests on it); a projection whose consumer reads bf16 is not split
        self.plans: dict[tuple[int, int], Any] = {}
        whole: set[tuple[int, int]] = {(int(fw.head.shape[0]), int(fw.head.shape[1]))}
        for ly in fw.layers:
            m = ly.mixer
            for w in ([m.w_in, ly.w_gu] if isinstance(m, GdnW) else [m.w_qkv, ly.w_gu]):
                whole.add((int(w.shape[0]), int(w.shape[1])))
            for w in (ly.w_down, m.w_out if isinstance(m, GdnW) else m.w_o):
                self.plans[(int(w.shape[0]), int(w.shape[1]))] = tm.plan_for(int(w.shape[0]), int(w.shape[1]))
        for N, Kd in whole:
            p = tm.plan_for(N, Kd)
            self.plans[(N, Kd)] = dataclasses.replace(p, split=1)
        split_max = max(p.split for p in self.plans.values())

        W = self.widths[-1]
        bf, f32 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.float32, device=dev)
        n_gdn = len(c.linear_layers)
        self.x = torch.zeros(W, self.H, **bf)
        self.h = torch.zeros(W, self.H, **bf)
        self.parts = torch.zeros(split_max, W, self.H, **f32)
        self.pbuf = torch.zeros(W, self.H, **bf)
        self.gu = torch.zeros(W, 2 * self.I, **bf)
        self.act = torch.zeros(W, self.I, **bf)
        self.proj = torch.zeros(max(n_gdn, 1), W, self.n_in, **bf)          # kept per layer for the commit
        self.qkvc = torch.zeros(max(n_gdn, 1), W, self.C, **f32)
        self.o = torch.zeros(W, self.hv, self.dv, **f32)
        self.onorm = torch.zeros(W, self.zdim, **bf)
        self.branch = torch.zeros(W, self.hv, self.dk, self.dv, **f32)
        self.aproj = torch.zeros(W, 2 * self.hq * self.D + 2 * self.hkv * self.D, **bf)
        self.qrot = torch.zeros(W, self.hq * self.D, **bf)
        self.aout = torch.zeros(W, self.hq * self.D, **bf)
        self.ascratch = ta.AttnScratch(W, self.hq, self.D, self.max_context, dev, split=attn_split or ta.SPLIT)
        self.logits = torch.zeros(W, c.vocab_size, **bf)
        self.metas = {w: _Meta(w, self.kw, dev) for w in self.widths}
        self.decode_meta = _Meta(1, self.kw, dev)
        self.commit_meta = _Meta(W, self.kw, dev)
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self._tree_n = 0
        self._tree_parents: list[int] = []
        self.gdn_plan = None

    # -- one step over all layers (decode or verify), width W, on the meta's buffers ---------------------
    def _step(self, W: int, meta: _Meta, decode: bool) -> None:
        from tandem_core.ops import triton_attention as ta
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg
        from tandem_core.ops import triton_matmul as tm

        c, fw = self.cfg, self.fw
        eps = c.rms_norm_eps
        head = meta.d("head")
        n = head[1:2]
        torch.index_select(fw.embed, 0, meta.ids[:W], out=self.x[:W])
        x, h = self.x[:W], self.h[:W]
        parts: torch.Tensor | None = None
        for i, ly in enumerate(fw.layers):
            tf.add_rms_norm_1p(x, parts, ly.in_norm, eps, h)
            m, s = ly.mixer, self.slots[i]
            if isinstance(m, GdnW):
                proj = self.proj[s, :W]
                tm.skinny_matmul(h, m.w_in, self._plan(m.w_in), out=proj)
                tf.conv_tree(proj, self.conv[s], m.conv, meta.d("win").view(W, self.kw - 1), n,
                             self.qkvc[s, :W], self.dk, 2 * self.hk, W)
                tg.gdn_tree(self.qkvc[s:s + 1], self.proj[s:s + 1], self.col_b, self.col_a,
                            fw.A_log[s:s + 1], fw.dt_bias[s:s + 1], self.S[s:s + 1], self.branch, self.o,
                            meta.d("plan"), n, write_out=True, final_store=decode, scale=self.dk ** -0.5,
                            num_k_heads=self.hk)
                tf.gated_rms_norm(self.o[:W], proj[:, self.C:], m.norm, eps, self.onorm[:W])
                parts = self._mm_parts(self.onorm[:W], m.w_out)
            else:
                ap = self.aproj[:W]
                tm.skinny_matmul(h, m.w_qkv, self._plan(m.w_qkv), out=ap)
                tf.qk_post(ap, m.q_norm, m.k_norm, self.freqs, meta.d("pos"), head, self.qrot[:W], self.K[s],
                           self.V[s], self.hq, self.hkv, self.D, c.rotary_dim, eps, W)
                ta.tree_attention(self.qrot[:W], ap, self.K[s], self.V[s], head, meta.d("pos"),
                                  meta.d("anc").view(W, W), self.ascratch, self.aout[:W], hq=self.hq,
                                  hkv=self.hkv, head_dim=self.D, scale=self.D ** -0.5, rows=W)
                parts = self._mm_parts(self.aout[:W], m.w_o)
            tf.add_rms_norm_1p(x, parts, ly.post_norm, eps, h)
            tm.skinny_matmul(h, ly.w_gu, self._plan(ly.w_gu), out=self.gu[:W])
            tf.silu_mul(self.gu[:W], self.act[:W])
            parts = self._mm_parts(self.act[:W], ly.w_down)
        tf.add_rms_norm_1p(x, parts, fw.norm, eps, h)
        tm.skinny_matmul(h, fw.head, self._plan(fw.head), out=self.logits[:W])
        if decode and len(self.fw.A_log):
            tf.conv_commit(self.conv, self.proj[:, :W], meta.d("path"), head[2:3])

    def _mm_parts(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` by the weight's plan into the step's buffers (bf16 rows, or fp32 partials of a split
        K)."""
        from tandem_core.ops import triton_matmul as tm

        p = self._plan(w)
        M = x.shape[0]
        if p.split == 1:
            return tm.skinny_matmul(x, w, p, out=self.pbuf[:M])
        out = self.parts[:p.split, :M]
        tm.skinny_matmul(x, w, p, out=out)
        return out

    def _plan(self, w: torch.Tensor) -> Any:
        return self.plans[(int(w.shape[0]), int(w.shape[1]))]

    # -- round inputs -------------------------------------------------------------------------------------
    def _fill_tree(self, meta: _Meta, tokens: Sequence[int], parents: Sequence[int]) -> None:
        n, W, kw = len(tokens), meta.W, self.kw
        depth, win, anc, plan = tree_tables(parents, kw)
        meta.writable()
        L = self.length
        meta.np[:] = 0
        meta.h("head")[:3] = (L, n, 0)
        meta.h("pos")[:n] = [L + d for d in depth]
        meta.h("pos")[n:] = L
        wv = meta.h("win").reshape(W, kw - 1)
        wv[:n] = win
        wv[n:] = list(range(kw - 1))
        meta.h("plan")[:3 * n] = plan
        av = meta.h("anc").reshape(W, W)
        for i, a in enumerate(anc):
            av[i, :len(a)] = a
        ids = meta.ids_host.numpy()
        ids[:n] = tokens
        ids[n:] = 0

    def _width(self, n: int) -> int:
        for w in self.widths:
            if w >= n:
                return w
        raise ValueError(f"verify: {n} nodes exceed the widest captured width {self.widths[-1]}")

    # -- hot verbs -----------------------------------------------------------------------------------------
    def decode(self, token: int) -> torch.Tensor:
        """Append ``token``; return its logits ``[1, V]`` bf16 (a view, valid until the next step)."""
        if self.length + 1 > self.max_context:
            raise ValueError(f"decode: context full ({self.max_context})")
        meta = self.decode_meta
        self._fill_tree(meta, [int(token)], [-1])
        meta.h("head")[2] = 1
        meta.h("path")[0] = 0
        meta.upload()
        g = self.graphs.get("decode")
        if g is not None:
            g.replay()
        else:
            self._step(1, meta, True)
        self.length += 1
        self._tree_n = 0
        return self.logits[:1]

    def verify(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Verify a tree on top of the sequence; return its logits ``[N, V]`` bf16 (a view, valid until the
        next step). Nothing is committed."""
        n = len(tokens)
        if n == 0 or n != len(parents):
            raise ValueError(f"verify: {n} tokens and {len(parents)} parents")
        if self.length + n > self.max_context:
            raise ValueError(f"verify: {self.length} tokens held + {n} nodes exceed max_context {self.max_context}")
        W = self._width(n)
        meta = self.metas[W]
        self._fill_tree(meta, [int(t) for t in tokens], [int(p) for p in parents])
        meta.upload()
        g = self.graphs.get(W)
        if g is not None:
            g.replay()
        else:
            self._step(W, meta, False)
        self._tree_n = n
        self._tree_parents = [int(p) for p in parents]
        return self.logits[:n]

    def commit(self, path: Sequence[int], keep: bool = False) -> PathRows | None:
        """Append the verified tree's nodes ``path`` (root to leaf) to the sequence. ``keep``: also return the
        path's rule rows (new tensors), for a later ``replay`` from the state before this commit."""
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg

        d = len(path)
        if d == 0:
            return None
        if self._tree_n == 0:
            raise RuntimeError("commit: no verified tree")
        prev = -1
        for i in path:
            if not 0 <= i < self._tree_n or self._tree_parents[i] != prev:
                raise ValueError(f"commit: path {list(path)} is not a root-to-leaf path of the verified tree")
            prev = i
        meta = self.commit_meta
        meta.writable()
        meta.np[:] = 0
        meta.h("head")[:3] = (self.length, d, d)
        meta.h("path")[:d] = path
        meta.h("pplan")[:3 * d] = [*path, *([-1] * d), *([-1] * d)]
        meta.upload()
        head = meta.d("head")
        n_gdn = len(self.cfg.linear_layers)
        if len(self.cfg.attention_layers):
            tf.kv_commit(self.K, self.V, head, meta.d("path"), head[2:3])
        if n_gdn:
            tf.conv_commit(self.conv, self.proj, meta.d("path"), head[2:3])
            tg.gdn_tree(self.qkvc, self.proj, self.col_b, self.col_a, self.fw.A_log, self.fw.dt_bias, self.S,
                        self.branch, self.o, meta.d("pplan"), head[2:3], write_out=False, final_store=True,
                        scale=self.dk ** -0.5, num_k_heads=self.hk, layers=n_gdn)
        self.length += d
        self._tree_n = 0
        if not keep:
            return None
        at = meta.d("path")[:d]
        return PathRows(self.qkvc[:n_gdn].index_select(1, at), self.proj[:n_gdn].index_select(1, at))

    def replay(self, rows: PathRows) -> None:
        """Advance the recurrent state (``S``, ``conv``) along ``rows`` as one chain: the commit's own
        launches on the same inputs, so the state equals the commits' (and plain decode's) bit for bit. The caller puts
        the state the rows start from in place first and keeps ``length``."""
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg

        P, n_gdn = rows.count, len(self.cfg.linear_layers)
        if P == 0 or n_gdn == 0:
            return
        plan = torch.tensor([*range(P), *([-1] * P), *([-1] * P)], dtype=torch.int32).to(self.device)
        n = torch.tensor([P], dtype=torch.int32).to(self.device)
        tf.conv_commit(self.conv, rows.proj, plan[:P], n)
        tg.gdn_tree(rows.qkv, rows.proj, self.col_b, self.col_a, self.fw.A_log, self.fw.dt_bias, self.S,
                    self.branch, self.o, plan, n, write_out=False, final_store=True, scale=self.dk ** -0.5,
                    num_k_heads=self.hk, layers=n_gdn)

    def workspace_bytes(self) -> int:
        """Bytes of the runner's own buffers (rows, partials, scratch, logits, round inputs)."""
        ts = [self.x, self.h, self.parts, self.pbuf, self.gu, self.act, self.proj, self.qkvc, self.o,
              self.onorm, self.branch, self.aproj, self.qrot, self.aout, self.logits]
        a = self.ascratch
        ts += [a.m, a.l, a.acc, a.tm, a.tl, a.tacc]
        for m in [*self.metas.values(), self.decode_meta, self.commit_meta]:
            ts += [m.dev, m.ids]
        return sum(t.numel() * t.element_size() for t in ts)

    def picks(self, logits: torch.Tensor) -> list[int]:
        """The greedy picks of a step's rows (the round's one host sync)."""
        return logits.argmax(dim=-1).tolist()

    # -- graphs --------------------------------------------------------------------------------------------
    def capture(self, widths: Sequence[int] | None = None) -> None:
        """Capture the decode graph and the verify graph of every width (after a warm-up run of each, which
        compiles the kernels). The buffers keep their contents; the sequence is unchanged."""
        L0 = self.length
        S_keep = self.S.clone()
        conv_keep = self.conv.clone()
        todo: list[Any] = ["decode", *(widths or self.widths)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in todo:
                W = 1 if key == "decode" else int(key)
                meta = self.decode_meta if key == "decode" else self.metas[W]
                self._fill_tree(meta, [0] * W, [-1] + list(range(W - 1)))
                if key == "decode":
                    meta.h("head")[2] = 1
                    meta.h("path")[0] = 0
                meta.upload()
                self._step(W, meta, key == "decode")
                g = torch.cuda.CUDAGraph()
                with graph_capture(g, stream):
                    self._step(W, meta, key == "decode")
                self.graphs[key] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.S.copy_(S_keep)
        self.conv.copy_(conv_keep)
        self.length = L0
        self._tree_n = 0

    # -- prefill -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: Sequence[int] | torch.Tensor, all_logits: bool = False,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Append ``ids``; return fp32 logits of the last row ``[1, V]`` (or every row's). ``hidden``: a list
        that gets each chunk's rows after the final norm (``[t, H]`` bf16, new tensors)."""
        t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        T = int(t.numel())
        if T == 0:
            raise ValueError("prefill: no tokens")
        if self.length + T > self.max_context:
            raise ValueError(f"prefill: {self.length} + {T} tokens exceed max_context {self.max_context}")
        outs = []
        for s in range(0, T, self.prefill_chunk):
            h = self._prefill_rows(t[s:s + self.prefill_chunk])
            if hidden is not None:
                hidden.append(h)
            if all_logits:
                outs.append(F.linear(h, self.fw.head).float())
        if not all_logits:
            outs.append(F.linear(h[-1:], self.fw.head).float())
        self._tree_n = 0
        return torch.cat(outs)

    def _prefill_rows(self, ids: torch.Tensor) -> torch.Tensor:
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_gdn as tg

        c, fw = self.cfg, self.fw
        eps = c.rms_norm_eps
        T, L, dev = int(ids.numel()), self.length, self.device
        x = fw.embed[ids].contiguous()                                        # x: [T, H]
        h = torch.empty_like(x)
        meta = torch.tensor([L, T], dtype=torch.int32, device=dev)
        pos = torch.arange(L, L + T, dtype=torch.int32, device=dev)
        chain = torch.arange(T, dtype=torch.int32, device=dev)               # the chunk as a path, for the tails
        n_rows = meta[1:2]
        qkvc = torch.empty(T, self.C, dtype=torch.float32, device=dev)
        parts: torch.Tensor | None = None
        for i, ly in enumerate(fw.layers):
            tf.add_rms_norm_1p(x, parts, ly.in_norm, eps, h)
            m, s = ly.mixer, self.slots[i]
            if isinstance(m, GdnW):
                proj = F.linear(h, m.w_in)                                    # [T, C + Hv*Dv + 2Hv]
                # conv + silu (+ L2 norm of the q and k heads) of the chain, then the tail moves on
                tf.conv_chain(proj, self.conv[s], m.conv, qkvc, self.dk, 2 * self.hk)
                tf.conv_commit(self.conv[s:s + 1], proj[None], chain, n_rows)
                q, k, v = torch.split(qkvc, [self.hk * self.dk, self.hk * self.dk, self.zdim], dim=-1)
                q = q.reshape(T, self.hk, self.dk)
                k = k.reshape(T, self.hk, self.dk)
                b = proj[:, self.col_b:self.col_a].float()
                a = proj[:, self.col_a:self.n_in].float()
                beta = 1.0 / (1.0 + torch.exp(-b))
                g = -fw.A_log[s].exp() * F.softplus(a + fw.dt_bias[s])
                o, S = tg.gdn_chunk(q, k, v.reshape(T, self.hv, self.dv), g, beta, self.S[s],
                                    scale=self.dk ** -0.5)
                self.S[s].copy_(S)
                onorm = torch.empty(T, self.zdim, dtype=x.dtype, device=dev)
                tf.gated_rms_norm(o, proj[:, self.C:], m.norm, eps, onorm)
                parts = F.linear(onorm, m.w_out)
            else:
                ap = F.linear(h, m.w_qkv)
                qrot = torch.empty(T, self.hq * self.D, dtype=x.dtype, device=dev)
                tf.qk_post(ap, m.q_norm, m.k_norm, self.freqs, pos, meta, qrot, self.K[s], self.V[s], self.hq,
                           self.hkv, self.D, c.rotary_dim, eps, T)
                o = _flash(qrot.view(T, self.hq, self.D), self.K[s, :, :L + T], self.V[s, :, :L + T],
                           self.D ** -0.5)                                    # [T, Hq, D] bf16
                gate = ap[:, :2 * self.hq * self.D].view(T, self.hq, 2 * self.D)[..., self.D:]
                o = o * torch.sigmoid(gate.float()).to(x.dtype)
                parts = F.linear(o.reshape(T, self.hq * self.D), m.w_o)
            tf.add_rms_norm_1p(x, parts, ly.post_norm, eps, h)
            gu = F.linear(h, ly.w_gu)
            act = torch.empty(T, self.I, dtype=x.dtype, device=dev)
            tf.silu_mul(gu, act)
            parts = F.linear(act, ly.w_down)
        tf.add_rms_norm_1p(x, parts, fw.norm, eps, h)
        self.length = L + T
        return h

    def reset(self) -> None:
        self.S.zero_()
        self.conv.zero_()
        self.length = 0
        self._tree_n = 0


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``T`` new rows (the last ``T`` of ``S`` positions) over ``k, v: [Hkv, S, D]``:
    flash attention with bottom-right alignment; ``q: [T, Hq, D]`` -> ``[T, Hq, D]``."""
    T, hq, D = q.shape
    hkv = k.shape[0]
    qq = q.transpose(0, 1).unsqueeze(0)                                      # [1, Hq, T, D]
    kk, vv = k.unsqueeze(0), v.unsqueeze(0)                                  # [1, Hkv, S, D]
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, True, False, scale=scale)[0]
    except RuntimeError:
        rep = hq // hkv
        kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal_lower_right(T, k.shape[1]),
                                             scale=scale)
    return out[0].transpose(0, 1)
