"""``CudaMTPHead``: Qwen3.8's MTP head on a CUDA device, its draft and its short appends as CUDA graphs.

The arithmetic of ``tandem_qwen38.mtp.MTPHead`` (which it extends: the same buffers, the same state, and its
prefill form for long appends) with the kernels of the target's graph runner (``tandem_qwen38.cuda_graphs``),
every one row-invariant (``tandem_core.ops.triton_*``):

    a step (rows at L .. L + n - 1)
        embed(tokens) -> add_rms_norm_1p (pre_fc_norm_embedding)  -> cat[:, :H]
        hidden rows   -> add_rms_norm_1p (pre_fc_norm_hidden)     -> cat[:, H:]
        fc (skinny matmul, K split in fp32 parts) -> x; add_rms_norm_1p (input norm) -> h
        [q|gate|k|v] (one fused matmul) -> qk_post (q/k norms, rope, K/V rows written in place at L + j)
        -> tree_attention over the head's own K/V (a chain: row j sees 0 .. L + j) with the output gate
        -> o_proj; add_rms_norm_1p (post norm); [gate|up]; silu_mul; down; add_rms_norm_1p (mtp.norm) -> out
    launch(token, p, depth)   ONE graph replay (one graph a depth, 1..``max_depth``): depth k is the step at
                              p + k on (token | the previous depth's argmax, mtp.hidden | the previous
                              out); then the shared lm_head and the top two by softmax (probabilities from
                              the log-sum-exp), into static [depth, 2] buffers; no host sync until they are read
    append(tokens, rows, s)   the rows s - 1 .. s + T - 2 in one graph replay of the smallest captured width
                              that holds them (``widths``: the target runner's verify widths); a longer append
                              (a prefill chunk) is the reference's prefill form over the same buffers

A round's inputs (positions, the launch's token) go in one pinned host buffer copied without a sync. The
graphs are captured at construction, their warm-up rows written in the K/V slack past ``max_context``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from tandem_core.engine import MemoryPart, tensor_bytes
from tandem_core.engine.runner import graph_capture

from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.cuda_graphs import _fuse
from tandem_qwen38.mtp import MTPHead, MTPWeights
from tandem_qwen38.weights import AttentionWeights, Qwen38Weights

__all__ = ["CudaMTPHead", "MAX_DEPTH"]

MAX_DEPTH = 8       # the deepest draft captured (the drafter's depth is 3 by default)


@dataclasses.dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv: torch.Tensor     # [2*Hq*D + 2*Hkv*D, H]: q (per head query | gate) | k | v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_o: torch.Tensor
    w_gu: torch.Tensor      # [2I, H]
    w_down: torch.Tensor


class CudaMTPHead(MTPHead):
    """The MTP head as CUDA graphs over bf16 dense weights on a CUDA device (``cuda_graphs.unsupported`` holds
    for the target: the same kernels read the head)."""

    graphed = True

    def __init__(self, cfg: Qwen38Config, target: Qwen38Weights, weights: MTPWeights, *, max_context: int,
                 widths: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), max_depth: int = MAX_DEPTH) -> None:
        from tandem_core.ops import triton_attention as ta
        from tandem_core.ops import triton_matmul as tm

        self.widths = tuple(sorted({int(w) for w in widths} | {1}))
        self.max_depth = int(max_depth)
        slack = max(self.widths[-1], self.max_depth)
        super().__init__(cfg, target, weights, max_context=max_context, slack=slack)
        c, dev = cfg, self.device
        self.H, self.I = c.hidden_size, c.intermediate_size
        self.hq, self.hkv, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.embed = target.embed
        self.head_w = target.head.weight
        self.w_fc = weights.fc.weight
        self.ly: list[_Layer] = []
        for lw in weights.layers:
            a = lw.mixer
            assert isinstance(a, AttentionWeights)
            self.ly.append(_Layer(lw.input_norm.float(), lw.post_norm.float(), _fuse([a.q, a.k, a.v]),
                                  a.q_norm.float(), a.k_norm.float(), a.o.weight,
                                  _fuse([lw.mlp.gate, lw.mlp.up]), lw.mlp.down.weight))
        # matmul plans by weight shape: a projection whose consumer reads bf16 is not split
        self.plans: dict[tuple[int, int], Any] = {}
        whole = {tuple(self.head_w.shape)} | {tuple(x.w_qkv.shape) for x in self.ly} | {tuple(x.w_gu.shape)
                                                                                        for x in self.ly}
        for w in [self.w_fc, *(x.w_o for x in self.ly), *(x.w_down for x in self.ly)]:
            self.plans[(int(w.shape[0]), int(w.shape[1]))] = tm.plan_for(int(w.shape[0]), int(w.shape[1]))
        for N, K in whole:
            self.plans[(int(N), int(K))] = dataclasses.replace(tm.plan_for(int(N), int(K)), split=1)
        split_max = max(p.split for p in self.plans.values())

        W = self.widths[-1]
        bf, f32 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.float32, device=dev)
        qkv = int(self.ly[0].w_qkv.shape[0])
        self.xin = torch.zeros(W, self.H, **bf)           # the rows' token embeddings
        self.src = torch.zeros(W, self.H, **bf)           # the rows' hidden inputs (an append's)
        self.cat = torch.zeros(W, 2 * self.H, **bf)
        self.x = torch.zeros(W, self.H, **bf)
        self.h = torch.zeros(W, self.H, **bf)
        self.out = torch.zeros(W, self.H, **bf)           # after mtp.norm: the carry and the head's input
        self.parts = torch.zeros(split_max, W, self.H, **f32)
        self.pbuf = torch.zeros(W, self.H, **bf)
        self.ap = torch.zeros(W, qkv, **bf)
        self.qrot = torch.zeros(W, self.hq * self.D, **bf)
        self.aout = torch.zeros(W, self.hq * self.D, **bf)
        self.gu = torch.zeros(W, 2 * self.I, **bf)
        self.act = torch.zeros(W, self.I, **bf)
        self.logits = torch.zeros(1, c.vocab_size, **bf)
        self.scratch = ta.AttnScratch(W, self.hq, self.D, int(self._K.shape[2]), dev)
        self.top_tokens = torch.zeros(self.max_depth, 2, dtype=torch.long, device=dev)
        self.top_probs = torch.zeros(self.max_depth, 2, **f32)
        # round inputs, one pinned buffer: the launch's [L, n, pos, anc] a depth, then an append's meta, pos and
        # (constant) chain ancestors
        self._off_app = 4 * self.max_depth
        n_int = self._off_app + 2 + W
        pin = dev.type == "cuda"
        self.host = torch.zeros(n_int, dtype=torch.int32, pin_memory=pin)
        self.dmeta = torch.zeros(n_int, dtype=torch.int32, device=dev)
        self.ids_host = torch.zeros(W, dtype=torch.long, pin_memory=pin)
        self.ids = torch.zeros(W, dtype=torch.long, device=dev)
        self.anc = torch.tensor([[d if d <= j else 0 for d in range(W)] for j in range(W)], dtype=torch.int32,
                                device=dev)
        self.zero_anc = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        self._done = torch.cuda.Event() if pin else None
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        from tandem_core.ops import rope as _rope

        self.freqs = _rope.inv_freq(c.rotary_dim, c.rope_theta, dev)
        if dev.type == "cuda":        # elsewhere (the kernels under TRITON_INTERPRET) each step runs eagerly
            with torch.no_grad():
                self.capture()

    # -- one step of ``rows`` rows (those < meta[1] real) on the head's layer ``slot`` -------------------------
    def _step(self, rows: int, hidden: torch.Tensor, meta: torch.Tensor, pos: torch.Tensor, anc: torch.Tensor,
              slot: int, kv_only: bool = False) -> None:
        """The head's layer over ``rows`` rows: K/V written at ``pos``, ``out`` (after ``mtp.norm``) computed. With
        ``kv_only`` it stops once K and V are written (an append: its rows are read by later launches only through
        the cache, and nothing reads its ``out``), skipping the attention, ``o`` and the MLP."""
        from tandem_core.ops import triton_attention as ta
        from tandem_core.ops import triton_fused as tf
        from tandem_core.ops import triton_matmul as tm

        R, H, eps, w, ly = rows, self.H, self.eps, self.w, self.ly[slot]
        tf.add_rms_norm_1p(self.xin[:R], None, w.norm_embed, eps, self.cat[:R, :H])
        tf.add_rms_norm_1p(hidden, None, w.norm_hidden, eps, self.cat[:R, H:])
        x, h = self.x[:R], self.h[:R]
        x.zero_()
        tf.add_rms_norm_1p(x, self._mm_parts(self.cat[:R], self.w_fc), ly.in_norm, eps, h)
        tm.skinny_matmul(h, ly.w_qkv, self._plan(ly.w_qkv), out=self.ap[:R])
        K, V = self._K[slot], self._V[slot]
        tf.qk_post(self.ap[:R], ly.q_norm, ly.k_norm, self.freqs, pos, meta, self.qrot[:R], K, V, self.hq,
                   self.hkv, self.D, self.cfg.rotary_dim, eps, R)
        if kv_only:
            return
        ta.tree_attention(self.qrot[:R], self.ap[:R], K, V, meta, pos, anc, self.scratch, self.aout[:R],
                          hq=self.hq, hkv=self.hkv, head_dim=self.D, scale=self.D ** -0.5, rows=R)
        tf.add_rms_norm_1p(x, self._mm_parts(self.aout[:R], ly.w_o), ly.post_norm, eps, h)
        tm.skinny_matmul(h, ly.w_gu, self._plan(ly.w_gu), out=self.gu[:R])
        tf.silu_mul(self.gu[:R], self.act[:R])
        tf.add_rms_norm_1p(x, self._mm_parts(self.act[:R], ly.w_down), w.norm, eps, self.out[:R])

    def _mm_parts(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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

    # -- the graphs' bodies ------------------------------------------------------------------------------------
    def _launch_body(self, depth: int) -> None:
        from tandem_core.ops import triton_matmul as tm

        lm = self.dmeta[:self._off_app].view(self.max_depth, 4)
        tok = self.ids[:1]
        hidden = self._hidden
        for k in range(depth):
            torch.index_select(self.embed, 0, tok, out=self.xin[:1])
            self._step(1, hidden, lm[k, 0:2], lm[k, 2:3], self.zero_anc, k % self.layers)
            tm.skinny_matmul(self.out[:1], self.head_w, self._plan(self.head_w), out=self.logits)
            z = self.logits[0].float()
            top = torch.topk(z, 2)
            self.top_tokens[k].copy_(top.indices)
            self.top_probs[k].copy_((top.values - torch.logsumexp(z, 0)).exp())
            tok = self.top_tokens[k, :1]
            hidden = self.out[:1]

    def _append_body(self, W: int) -> None:
        o = self._off_app
        torch.index_select(self.embed, 0, self.ids[:W], out=self.xin[:W])
        self._step(W, self.src[:W], self.dmeta[o:o + 2], self.dmeta[o + 2:o + 2 + W], self.anc[:W, :W], 0,
                   kv_only=True)

    def _writable(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def _upload(self) -> None:
        self.dmeta.copy_(self.host, non_blocking=True)
        self.ids.copy_(self.ids_host, non_blocking=True)
        if self._done is not None:
            self._done.record()

    def _fill_launch(self, token: int, position: int) -> None:
        self._writable()
        lm = self.host[:self._off_app].view(self.max_depth, 4).numpy()
        for k in range(self.max_depth):
            lm[k] = (position + k, 1, position + k, 0)
        self.ids_host[0] = int(token)

    def _fill_append(self, at: int, n: int, W: int) -> None:
        self._writable()
        o = self._off_app
        h = self.host.numpy()
        h[o:o + 2] = (at, n)
        h[o + 2:o + 2 + W] = [at + j for j in range(W)]

    def _replay(self, key: tuple[str, int]) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
        elif key[0] == "launch":
            self._launch_body(key[1])
        else:
            self._append_body(key[1])

    def capture(self) -> None:
        """Capture the launch graph of every depth and the append graph of every width (after a warm-up run of
        each, which compiles the kernels); the warm-up rows land in the slack past ``max_context``."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in [*(("launch", d) for d in range(1, self.max_depth + 1)),
                        *(("append", w) for w in self.widths)]:
                kind, n = key
                if kind == "launch":
                    self._fill_launch(0, self.max_context)
                else:
                    self._fill_append(self.max_context, n, n)
                self._upload()
                body = (lambda: self._launch_body(n)) if kind == "launch" else (lambda: self._append_body(n))
                body()
                g = torch.cuda.CUDAGraph()
                with graph_capture(g, stream):
                    body()
                self.graphs[key] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # -- the DraftHead verbs -----------------------------------------------------------------------------------
    @torch.no_grad()
    def launch(self, token: int, position: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``DraftHead.launch``: one graph replay (the depth's); the top two ``[depth, 2]`` are views of static
        buffers, valid until the next launch."""
        depth = int(depth)
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"MTP head: depth {depth} outside the captured 1..{self.max_depth}")
        if position < 0 or position + depth > self.max_context:
            raise ValueError(f"MTP head: draft rows {position}..{position + depth - 1} are outside "
                             f"0..{self.max_context - 1}")
        self._fill_launch(int(token), int(position))
        self._upload()
        self._replay(("launch", depth))
        return self.top_tokens[:depth], self.top_probs[:depth]

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, rows: torch.Tensor, start: int, *, decode_form: bool = False) -> None:
        """``DraftHead.append``: up to the widest captured width, one graph replay (every row computed as a
        one-row step would: the kernels are row-invariant); longer, the reference's prefill form."""
        T, start = int(tokens.numel()), int(start)
        if T == 0:
            return
        n = T if start > 0 else T - 1
        if n > self.widths[-1]:
            super().append(tokens, rows, start)
            return
        if n > 0:
            at = start - 1 if start > 0 else 0
            if start + T - 1 > self.max_context:
                raise ValueError(f"MTP head: rows up to {start + T - 2} exceed max_context {self.max_context}")
            W = next(w for w in self.widths if w >= n)
            self._writable()
            ids = self.ids_host.numpy()
            toks = tokens.reshape(-1).numpy()         # the engine's ids, on the host
            ids[:n] = toks if start > 0 else toks[1:]
            src = rows.to(self.act_dtype)
            if start > 0:
                self.src[:1].copy_(self._hidden)
                self.src[1:n].copy_(src[:n - 1])
            else:
                self.src[:n].copy_(src[:n])
            self._fill_append(at, n, W)
            self._upload()
            self._replay(("append", W))
        self._hidden.copy_(rows[-1:].to(self.act_dtype))

    def memory_parts(self) -> list[MemoryPart]:
        ts = [self.xin, self.src, self.cat, self.x, self.h, self.out, self.parts, self.pbuf, self.ap, self.qrot,
              self.aout, self.gu, self.act, self.logits, self.dmeta, self.ids, self.anc]
        s = self.scratch
        ts += [s.m, s.l, s.acc, s.tm, s.tl, s.tacc]
        return [*super().memory_parts(), MemoryPart("mtp.cuda.workspace", tensor_bytes(*ts), str(self.device))]

    def __repr__(self) -> str:
        return (f"CudaMTPHead(qwen3_5, {self.layers} layers, {self.max_context} positions, depth 1.."
                f"{self.max_depth}, widths {self.widths[0]}..{self.widths[-1]})")
