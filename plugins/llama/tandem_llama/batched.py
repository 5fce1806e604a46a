"""``BatchedLlama``: many sequences at once through the Llama arithmetic, for bulk work off the serving path.

The drafter trainer's data stage (``tandem train-drafter``) asks a target for thousands of greedy answers and,
in its train stage, for the hidden rows of thousands of sequences. The serving engine (``LlamaRunner``) runs one
sequence; this class runs a batch of them over the same weights (``LlamaWeights``, shared, read-only), left
padded: row ``b`` of ``B`` sequences padded to ``P`` tokens starts at column ``P - len_b``, its positions
count from 0 at its first real token, and every query sees only its own row's real keys at or before it
(a pad query sees itself, so no softmax is empty; nothing reads a pad row). The KV buffers are
``[B, n_kv, P + max_new, head_dim]`` per layer.

The layer is the runner's (rmsnorm, one ``qkv`` matmul, half-split rotary, grouped-query attention, one
``gate_up`` matmul, ``silu``) with every matmul batched over all rows and one SDPA call over the batch. The
answers are the engine's greedy answers up to the rounding of a batched matmul and a padded attention: in fp32
on the CPU they equal them token for token on the tiny checkpoints (``test_llama_batched.py``); in bf16 on a
GPU an argmax whose top two logits lie within bf16 rounding may pick the other token, after which that answer
continues differently. That is fine for training data (the answer is still the model's own greedy text at
that precision); it is not the serving path and is never used to emit tokens to a client.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tandem_core import ops
from tandem_llama.config import LlamaConfig
from tandem_llama.model import rope_tables
from tandem_llama.weights import LlamaWeights

__all__ = ["BatchedLlama"]


class BatchedLlama:
    """Batched greedy generation and hidden rows over ``weights`` on ``device`` (the weights' own dtype for the
    activations: fp32 on the CPU, bf16 on CUDA as served). A forward over whole sequences (the prompts, or
    ``hidden``'s sequences) runs in row chunks of about ``chunk_tokens`` tokens, so its activations and its
    attention scores stay bounded whatever the batch."""

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, device: str = "cpu",
                 chunk_tokens: int = 16384) -> None:
        self.cfg, self.w = cfg, weights
        self.chunk_tokens = int(chunk_tokens)
        self.device = torch.device(device)
        self.act = weights.norm.dtype
        self._silu = ops.get("silu", self.device)
        self._tables = 0
        self.cos = self.sin = torch.empty(0)

    def _rope(self, n: int) -> None:
        if n > self._tables:
            size = max(n, 2 * self._tables, 256)
            cos, sin = rope_tables(self.cfg, size, self.w.rope_freqs)
            self.cos = cos.to(self.device, self.act)
            self.sin = sin.to(self.device, self.act)
            self._tables = size

    # -- one forward of new columns over the buffers ----------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, start: int, valid: torch.Tensor,
                 kv: list[tuple[torch.Tensor, torch.Tensor]] | None, taps: Sequence[int] = ()
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``ids, pos: [B, T]`` at columns ``start .. start + T`` (``pos``: each row's own positions);
        ``valid: [B, start + T]`` the real (unpadded) columns; ``kv``: per layer ``(K, V)`` buffers
        ``[B, n_kv, S, hd]`` written at those columns (None: no buffers, the columns attend to themselves only,
        ``start`` must be 0). Returns the rows after the final norm ``[B, T, H]`` and the residual after each
        layer in ``taps``."""
        cfg, w = self.cfg, self.w
        B, T = ids.shape
        end = start + T
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim, eps, hsize = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps, (cfg.hidden_size,)
        self._rope(int(pos.max()) + 1)
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]        # [B, T, 1, hd]
        cols = torch.arange(end, device=self.device)
        qcols = torch.arange(start, end, device=self.device)
        see = valid[:, None, :] & (cols[None, None, :] <= qcols[None, :, None])       # [B, T, end]
        see = see | (cols[None, None, :] == qcols[None, :, None])                    # a pad row sees itself
        g = nh // nkv
        mask = see.repeat(1, g, 1)[:, None]                                           # [B, 1, g*T, end]
        out: dict[int, torch.Tensor] = {}
        x = w.embed.rows(ids.reshape(-1)).to(self.act).view(B, T, -1)
        for li, lw in enumerate(w.layers):
            h = F.rms_norm(x, hsize, lw.attn_norm, eps)
            qkv = lw.qkv.matmul(h)                                                    # [B, T, q + 2kv]
            qk = qkv[..., : q_dim + kv_dim].view(B, T, nh + nkv, hd)
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
            # grouped queries: kv head j serves q heads j*g .. j*g+g-1 -> [B, nkv, g*T, hd] (no K/V copies)
            q = qk[:, :, :nh].reshape(B, T, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, hd)
            k = qk[:, :, nh:].transpose(1, 2)                                         # [B, nkv, T, hd]
            v = qkv[..., q_dim + kv_dim :].view(B, T, nkv, hd).transpose(1, 2)
            if kv is not None:
                kc, vc = kv[li]
                kc[:, :, start:end] = k
                vc[:, :, start:end] = v
                k, v = kc[:, :, :end], vc[:, :, :end]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)  # [B, nkv, g*T, hd]
            a = a.reshape(B, nkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, q_dim)
            x = x + lw.o.matmul(a)
            h = F.rms_norm(x, hsize, lw.mlp_norm, eps)
            gu = lw.gate_up.matmul(h)
            inter = cfg.intermediate_size
            x = x + lw.down.matmul(self._silu(gu[..., :inter]).to(self.act) * gu[..., inter:])
            if li in taps:
                out[li] = x
        return F.rms_norm(x, hsize, w.norm, eps), out

    def _pad(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        P = max(len(s) for s in seqs)
        pads = [P - len(s) for s in seqs]
        ids = torch.zeros(len(seqs), P, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, pads[b]:] = torch.tensor(list(s), dtype=torch.long)
        pad_t = torch.tensor(pads, dtype=torch.long)
        pos = (torch.arange(P)[None, :] - pad_t[:, None]).clamp(min=0)
        valid = torch.arange(P)[None, :] >= pad_t[:, None]
        return ids.to(self.device), pos.to(self.device), valid.to(self.device), pads

    def _rows(self, cols: int) -> int:
        """Rows one forward of ``cols`` columns takes: about ``chunk_tokens`` tokens a forward."""
        return max(1, self.chunk_tokens // max(1, cols))

    # -- the verbs ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new: int, stop_ids: Sequence[int] = ()
                 ) -> list[list[int]]:
        """Each prompt's greedy answer: up to ``max_new`` tokens, ending with (and including) the first stop
        id when one comes, as the engine's decode loop records ``generated``."""
        if not prompts:
            return []
        if any(len(p) < 1 for p in prompts) or max_new < 1:
            raise ValueError("BatchedLlama.generate: every prompt needs a token and max_new must be positive")
        cfg = self.cfg
        B = len(prompts)
        ids, pos, valid, _ = self._pad(prompts)
        P = int(ids.shape[1])
        S = P + max_new
        if S > cfg.max_position_embeddings:
            raise ValueError(f"BatchedLlama.generate: {S} columns exceed the model's "
                             f"{cfg.max_position_embeddings} positions")
        shape = (B, cfg.num_kv_heads, S, cfg.head_dim)
        kv = [(torch.empty(shape, dtype=self.act, device=self.device),
               torch.empty(shape, dtype=self.act, device=self.device)) for _ in range(cfg.num_layers)]
        valid_all = torch.ones(B, S, dtype=torch.bool, device=self.device)
        valid_all[:, :P] = valid
        last = []
        for r in range(0, B, self._rows(P)):           # the prompts' forward in row chunks (bounded activations)
            e = min(B, r + self._rows(P))
            h, _ = self._forward(ids[r:e], pos[r:e], 0, valid_all[r:e, :P], [(k[r:e], v[r:e]) for k, v in kv])
            last.append(h[:, -1])
        stops = torch.tensor(sorted({int(t) for t in stop_ids}) or [-1], device=self.device)
        nxt = self.w.lm_head.matmul(torch.cat(last)).float().argmax(-1)                 # [B]
        cur = pos[:, -1] + 1                                                            # each row's next position
        picks = [nxt]
        done = torch.isin(nxt, stops)
        for t in range(1, max_new):
            if bool(done.all()):
                break
            h, _ = self._forward(nxt[:, None], cur[:, None], P + t - 1, valid_all[:, : P + t], kv)
            nxt = self.w.lm_head.matmul(h[:, -1]).float().argmax(-1)
            cur = cur + 1
            picks.append(nxt)
            done = done | torch.isin(nxt, stops)
        grid = torch.stack(picks, dim=1).tolist()                                       # [B, n]
        stop_set = {int(t) for t in stop_ids}
        answers: list[list[int]] = []
        for row in grid:
            ans: list[int] = []
            for tok in row:
                ans.append(int(tok))
                if tok in stop_set:
                    break
            answers.append(ans)
        return answers

    @torch.inference_mode()
    def hidden(self, seqs: Sequence[Sequence[int]], layers: Sequence[int]) -> list[torch.Tensor]:
        """Each sequence's residual rows after ``layers`` (the runner's taps), concatenated along the width:
        ``[len, len(layers) * H]`` in the activation dtype, on the device."""
        if not seqs:
            return []
        ids, pos, valid, pads = self._pad(seqs)
        out: list[torch.Tensor] = []
        step = self._rows(int(ids.shape[1]))
        for r in range(0, len(seqs), step):
            _, taps = self._forward(ids[r:r + step], pos[r:r + step], 0, valid[r:r + step], None, tuple(layers))
            both = torch.cat([taps[li] for li in layers], dim=-1)                       # [b, P, nL * H]
            out += [both[b - r, pads[b]:] for b in range(r, min(len(seqs), r + step))]
        return out
