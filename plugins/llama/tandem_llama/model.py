"""``LlamaEngine``: one Llama sequence (batch 1) on preallocated KV buffers.

A decoder layer (read top-down)::

    h    = rmsnorm(x) * attn_norm
    q,k,v = qkv(h)                 # one matmul: [T, q_dim + 2 kv_dim]
    q,k  = rope(q, k)              # half-split rotary (Hugging Face's form) at positions [n, n+T)
    K[l, :, n:n+T], V[...] = k, v  # the KV buffers: [L, n_kv, max_ctx, head_dim]
    x   += o(attention(q, K[:n+T], V[:n+T]))   # grouped-query, causal
    h    = rmsnorm(x) * mlp_norm
    x   += down(silu(gate(h)) * up(h))        # gate and up in one matmul

then ``logits = lm_head(rmsnorm(x) * norm)`` (the embedding itself when tied).

Everything runs in fp32. Long inputs run in prefill chunks (``prefill_chunk``
tokens); a chunk reads the rows the earlier chunks wrote, so the result equals
one full forward up to matmul blocking.

The live state is one ``ModelState`` over the KV buffers (views ``K`` and ``V``,
token axis 2, no sections): ``engine.state.length`` is the sequence length, and
a ``restore`` into it lands in the buffers the engine reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem_core.engine import Capabilities, Manifest, MemoryPart
from tandem_core.ops.attention import causal_mask
from tandem_core.state import ModelState, View
from tandem_llama.config import LlamaConfig, inv_freq
from tandem_llama.weights import LlamaWeights

__all__ = ["LlamaEngine", "attend", "rope_rows", "rope_tables"]

_HERE = Path(__file__).resolve().parent
# the files whose code computes the rows an engine stores (its manifest)
_ROW_FILES = ("model.py", "formats.py", "weights.py", "config.py", "gguf_reader.py")


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


class _KV:
    """``kv.length``: the tokens the sequence holds (the live state's length)."""

    __slots__ = ("_state",)

    def __init__(self, state: ModelState) -> None:
        self._state = state

    @property
    def length(self) -> int:
        return self._state.length


class LlamaEngine:
    """Batch 1, fp32, CPU. Owns its KV buffers and shares ``weights`` (read-only) with any sibling engine."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: LlamaWeights,
        *,
        max_context: int,
        prefill_chunk: int = 512,
        device: str = "cpu",
    ) -> None:
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        self.cfg = cfg
        self.w = weights
        self.max_context = int(max_context)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.caps = Capabilities(
            tree=False,
            resume=False,
            recurrent=False,
            max_context=self.max_context,
            max_tree=0,
            hidden_layers=(),
            device=device,
            dtype="fp32",
        )
        L, nkv, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        # the KV buffers: [L, n_kv, max_ctx, head_dim], token axis 2. Positions past the sequence's length
        # are never read, so the buffers start uninitialised (their pages are touched as the sequence grows).
        self.k_cache = torch.empty(L, nkv, self.max_context, hd, dtype=torch.float32)
        self.v_cache = torch.empty(L, nkv, self.max_context, hd, dtype=torch.float32)
        self._state = ModelState({}, {"K": View(self.k_cache, 2), "V": View(self.v_cache, 2)}, 0)
        self.kv = _KV(self._state)
        self.cos, self.sin = rope_tables(cfg, self.max_context, weights.rope_freqs)
        self._hidden = torch.empty(0, cfg.hidden_size)
        self._half = hd // 2
        self._group = cfg.num_heads // nkv
        self._scale = hd**-0.5

    # -- hot verbs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64); logits ``[T, V]`` (``all_logits``) or ``[1, V]`` (the last)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        t = int(ids.numel())
        if t == 0:
            raise ValueError("forward needs at least one token")
        n = self._state.length
        if n + t > self.max_context:
            raise ValueError(f"sequence of {n + t} tokens exceeds the engine's context of {self.max_context}")
        hiddens, logits = [], []
        for s in range(0, t, self.prefill_chunk):
            chunk = ids[s : s + self.prefill_chunk]
            h = self._run(chunk, n + s)  # [c, H] after the final norm
            hiddens.append(h)
            if all_logits:
                logits.append(self.w.lm_head.matmul(h))
        self._hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        if all_logits:
            return logits[0] if len(logits) == 1 else torch.cat(logits)
        return self.w.lm_head.matmul(self._hidden[-1:])

    def _run(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Run ``ids`` ([T]) at positions ``[n, n+T)``; write their K/V rows; return the normed hidden
        ``[T, H]``."""
        cfg, w = self.cfg, self.w
        t = int(ids.numel())
        end = n + t
        nh, nkv, hd, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self._group
        qk_heads = nh + nkv
        q_dim, kv_dim, inter = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
        eps = cfg.rms_norm_eps
        hsize = (cfg.hidden_size,)
        cos = self.cos[n:end, None, :]  # [T, 1, hd]
        sin = self.sin[n:end, None, :]
        mask = None
        if t > 1:  # causal over [0, end): row i (position n+i) sees keys 0..n+i
            mask = causal_mask(n, t).repeat(g, 1)  # [g*T, end]
        x = w.embed.rows(ids)  # [T, H]
        for li, lw in enumerate(w.layers):
            h = F.rms_norm(x, hsize, lw.attn_norm, eps)
            qkv = lw.qkv.matmul(h)  # [T, q_dim + 2 kv_dim]
            qk = qkv[:, : q_dim + kv_dim].view(t, qk_heads, hd)
            qk = rope_rows(qk, cos, sin)  # rotary, [T, nh + nkv, hd]
            kc, vc = self.k_cache[li], self.v_cache[li]  # [nkv, max_ctx, hd]
            kc[:, n:end].copy_(qk[:, nh:].transpose(0, 1))
            vc[:, n:end].copy_(qkv[:, q_dim + kv_dim :].view(t, nkv, hd).transpose(0, 1))
            # grouped queries: kv head j serves q heads j*g .. j*g+g-1 -> [nkv, g*T, hd]
            q = qk[:, :nh].reshape(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
            a = attend(q, kc[:, :end], vc[:, :end], mask, self._scale)  # [nkv, g*T, hd]
            a = a.reshape(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, q_dim)  # [T, nh*hd]
            x = x + lw.o.matmul(a)
            h = F.rms_norm(x, hsize, lw.mlp_norm, eps)
            gu = lw.gate_up.matmul(h)  # [T, 2I]
            x = x + lw.down.matmul(F.silu(gu[:, :inter]) * gu[:, inter:])
        self._state.length = end
        return F.rms_norm(x, hsize, w.norm, eps)

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks ``[R, V] -> [R]``."""
        return logits.argmax(dim=-1)

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's hidden states after the final norm, ``[T, H]`` (valid until the next
        forward)."""
        return self._hidden

    @property
    def state(self) -> ModelState:
        return self._state

    def reset(self) -> None:
        self._state.length = 0
        self._hidden = torch.empty(0, self.cfg.hidden_size)

    # -- cold verbs -----------------------------------------------------------------------------
    def cache_state(self) -> ModelState:
        """The live state (K and V views, no sections), ``length == kv.length``."""
        return self._state

    def manifest(self) -> Manifest:
        cfg = self.cfg
        return Manifest(
            files=tuple(str(_HERE / f) for f in _ROW_FILES),
            settings={"dense": self.w.dense, "prefill_chunk": self.prefill_chunk},
            extra={
                "model": "llama",
                "config": repr(cfg),
                "weights": [str(p) for p in self.w.files],
                "formats": self.w.formats,
                "torch": torch.__version__,
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
