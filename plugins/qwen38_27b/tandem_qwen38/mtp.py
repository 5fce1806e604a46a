"""Qwen3.8's MTP head: vLLM's published Qwen3.5 / Qwen3-Next multi-token predictor, in plain torch.

For a position ``i`` whose hidden state ``h_i`` (the target's, after its final norm: ``Rows.hidden``)
and next token ``x_{i+1}`` are known, the head guesses ``x_{i+2}``:

    u = fc([pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)])      [2H] -> [H]
    u = a full-attention decoder layer of the target's own kind on u: gated attention (q_proj with its
        per-head output gate, q_norm / k_norm, partial rotary) over the head's own rows 0..i, then the
        dense MLP, each behind its zero-centred RMS norm with a residual
    o = norm(u);  logits = lm_head(o)        (the embedding and the head are the target's)

(vLLM ``vllm/model_executor/models/qwen3_5_mtp.py``, ``Qwen3_5MultiTokenPredictor``; every norm is the
zero-centred ``1 + w`` RMS norm.) A deeper draft step feeds ``o`` back in place of ``h`` one position on,
with its guessed token, and runs layer ``k % layers``. The tensors and what is refused are in
``tandem_qwen38.weights`` (``expected_mtp_tensors``); transformers drops ``mtp.*``, so the reference is
written from that design in the tests (``tests/mtp_reference_qwen38.py``).

``MTPHead`` is a ``DraftHead`` (``tandem_core.engine.base``): its own K and V for ``max_context``
positions (views ``mtp.K``, ``mtp.V``) and the target's row at the sequence's last position (section
``mtp.hidden``), all part of the engine's state; ``run`` writes rows at ``start ..`` in the prefill form
(several rows, batched) or the decode form (one row, ``linear_rows``); ``append`` and ``launch`` drive it
for the engine and the drafter (``head_append``, ``head_launch``). On CUDA ``tandem_qwen38.mtp_cuda``'s
``CudaMTPHead`` runs the same arithmetic as CUDA graphs over the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from tandem_core import ops
from tandem_core.engine import HeadRows, MemoryPart, Step, head_append, head_launch, tensor_bytes
from tandem_core.linear import Linear, make_linear
from tandem_core.ops import rope as _rope
from tandem_core.ops.attention import causal_mask

from tandem_qwen38.config import FULL, Qwen38Config
from tandem_qwen38.weights import (DTYPES, AttentionWeights, LayerWeights, MLPWeights, Qwen38Checkpoint,
                                   Qwen38Weights, expected_mtp_tensors, normalise_dtype)

__all__ = ["MTPWeights", "build_mtp", "load_mtp", "MTPHead", "MTP_OPS"]

MTP_OPS = ("rms_norm_1p", "rope", "attention", "sigmoid", "silu", "linear_rows")


@dataclass(frozen=True)
class MTPWeights:
    """The head's own weights; the embedding and the output head it reads are the target's."""

    norm_embed: torch.Tensor            # [H] fp32 (zero-centred)
    norm_hidden: torch.Tensor           # [H] fp32 (zero-centred)
    fc: Linear                          # [H, 2H]: the normed embedding, then the normed hidden state
    layers: tuple[LayerWeights, ...]    # full-attention decoder layers of the target's shape
    norm: torch.Tensor                  # [H] fp32 (zero-centred)

    def linears(self) -> Iterable[Linear]:
        yield self.fc
        for layer in self.layers:
            a = layer.mixer
            assert isinstance(a, AttentionWeights)
            yield from (a.q, a.k, a.v, a.o, layer.mlp.gate, layer.mlp.up, layer.mlp.down)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield from (self.norm_embed, self.norm_hidden, self.norm)
        for layer in self.layers:
            a = layer.mixer
            assert isinstance(a, AttentionWeights)
            yield from (layer.input_norm, layer.post_norm, a.q_norm, a.k_norm)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(*self.tensors()) + sum(lin.nbytes for lin in self.linears())

    def parameter_count(self) -> int:
        held = sum(t.numel() for t in self.tensors())
        return held + sum(lin.shape[0] * lin.shape[1] for lin in self.linears())


def build_mtp(get: Callable[[str], torch.Tensor], cfg: Qwen38Config, layers: int, dtype: str = "fp32",
              device: str | torch.device = "cpu") -> MTPWeights:
    """The head from its tensors by checkpoint key (``mtp.fc.weight``,
    ``mtp.layers.0.self_attn.q_proj.weight``, ...), each projection a ``Linear`` of the requested dtype's
    format, the norms in fp32."""
    fmt, _ = DTYPES[normalise_dtype(dtype)]
    dev = torch.device(device)
    expected = expected_mtp_tensors(cfg, layers)

    def linear(key: str) -> Linear:
        assert key in expected, key
        return make_linear(fmt, get(key), device=dev)

    def vec(key: str) -> torch.Tensor:
        assert key in expected, key
        return get(key).to(device=dev, dtype=torch.float32)

    out = []
    for j in range(layers):
        p = f"mtp.layers.{j}."
        a = p + "self_attn."
        attn = AttentionWeights(q=linear(a + "q_proj.weight"), k=linear(a + "k_proj.weight"),
                                v=linear(a + "v_proj.weight"), o=linear(a + "o_proj.weight"),
                                q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"))
        mlp = MLPWeights(gate=linear(p + "mlp.gate_proj.weight"), up=linear(p + "mlp.up_proj.weight"),
                         down=linear(p + "mlp.down_proj.weight"))
        out.append(LayerWeights(FULL, vec(p + "input_layernorm.weight"), attn,
                                vec(p + "post_attention_layernorm.weight"), mlp))
    return MTPWeights(vec("mtp.pre_fc_norm_embedding.weight"), vec("mtp.pre_fc_norm_hidden.weight"),
                      linear("mtp.fc.weight"), tuple(out), vec("mtp.norm.weight"))


def load_mtp(ckpt: Qwen38Checkpoint, cfg: Qwen38Config, dtype: str = "fp32",
             device: str | torch.device = "cpu") -> MTPWeights | None:
    """The audited checkpoint's MTP head (``open_checkpoint`` checked every ``mtp.*`` tensor), or None."""
    if not ckpt.mtp_layers:
        return None
    dev = torch.device(device)
    return build_mtp(lambda key: ckpt.reader.get(key, dev), cfg, ckpt.mtp_layers, dtype, dev)


def _batched(lin: Any, x: torch.Tensor) -> torch.Tensor:
    return lin.matmul(x)


class MTPHead:
    """The MTP head over the target's ``Qwen38Weights`` (embedding and head) and its own ``MTPWeights``, with
    its own K and V rows for ``max_context`` positions. One sequence; a ``DraftHead``."""

    graphed = False

    def __init__(self, cfg: Qwen38Config, target: Qwen38Weights, weights: MTPWeights, *,
                 max_context: int, slack: int = 0) -> None:
        if not weights.layers:
            raise ValueError("MTP head: no decoder layers")
        self.cfg, self.target, self.w = cfg, target, weights
        self.device, self.act_dtype = target.device, target.act_dtype
        self.max_context = int(max_context)
        self.layers = len(weights.layers)
        self.reads: int | None = None             # the target's hidden state after its final norm
        self.width = cfg.hidden_size
        self._op: dict[str, Callable[..., Any]] = {name: ops.get(name, self.device) for name in MTP_OPS}
        # ``slack`` positions past max_context: the padded rows of a graph's fixed width land there
        shape = (self.layers, cfg.num_key_value_heads, self.max_context + int(slack), cfg.head_dim)
        self._K = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self._V = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self._hidden = torch.zeros(1, cfg.hidden_size, dtype=self.act_dtype, device=self.device)
        self._inv_freq = _rope.inv_freq(cfg.rotary_dim, cfg.rope_theta, self.device)

    def views(self) -> dict[str, tuple[torch.Tensor, int]]:
        """The head's own rows (tensor, token axis): ``mtp.K``, ``mtp.V`` (axis 2)."""
        return {"mtp.K": (self._K, 2), "mtp.V": (self._V, 2)}

    def sections(self) -> dict[str, torch.Tensor]:
        """``mtp.hidden [1, H]``: the target's row at the sequence's last position (what the next row reads)."""
        return {"mtp.hidden": self._hidden}

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        return [MemoryPart("mtp.weights", self.w.nbytes, dev),
                MemoryPart("mtp.kv", tensor_bytes(self._K, self._V, self._hidden), dev)]

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, rows: torch.Tensor, start: int, *, decode_form: bool = False) -> None:
        """``DraftHead.append``: the head's rows ``start - 1 ..`` of appended tokens, in the prefill form."""
        head_append(self, tokens.reshape(-1).to(self.device), rows, int(start), decode_form=decode_form)

    @torch.no_grad()
    def launch(self, token: int, position: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``DraftHead.launch``: ``depth`` decode-form steps from ``mtp.hidden`` at ``position``."""
        return head_launch(self, int(token), int(position), int(depth))

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, *, layer: int = 0,
            logits: bool = True) -> HeadRows:
        """Rows at ``start .. start + T - 1``: ``tokens [T]`` each row's next token, ``hidden [T, H]`` the
        rows it reads. Writes the head's K/V there; the carry is the rows after ``mtp.norm``; ``logits``
        False skips the output head."""
        cfg, op, w = self.cfg, self._op, self.w
        T, eps = int(tokens.numel()), cfg.rms_norm_eps
        if start < 0 or start + T > self.max_context:
            raise ValueError(f"MTP head: positions {start}..{start + T - 1} are outside "
                             f"0..{self.max_context - 1}")
        if hidden.shape != (T, cfg.hidden_size):
            raise ValueError(f"MTP head: hidden rows {list(hidden.shape)}, need [{T}, {cfg.hidden_size}]")
        step = Step(int(start), T)
        mm = op["linear_rows"] if T == 1 else _batched
        norm = op["rms_norm_1p"]
        e = norm(self.target.embed[tokens.reshape(-1).to(self.device)], w.norm_embed, eps)       # [T, H]
        h = norm(hidden.to(device=self.device, dtype=self.act_dtype), w.norm_hidden, eps)        # [T, H]
        x = mm(w.fc, torch.cat([e, h], dim=-1))                                                 # [T, H]
        lw = w.layers[layer % self.layers]
        cos, sin = _rope.cos_sin(step.positions(self.device), self._inv_freq)
        assert isinstance(lw.mixer, AttentionWeights)
        slot = layer % self.layers
        x = x + self._attention(norm(x, lw.input_norm, eps), lw.mixer, slot, step, mm, cos, sin)
        a = norm(x, lw.post_norm, eps)
        x = x + mm(lw.mlp.down, op["silu"](mm(lw.mlp.gate, a)).to(self.act_dtype) * mm(lw.mlp.up, a))
        out = norm(x, w.norm, eps)
        return HeadRows(out, mm(self.target.head, out).float() if logits else None)

    def _attention(self, x: torch.Tensor, w: AttentionWeights, slot: int, step: Step, mm: Any,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]; writes the head's K/V rows step.start .. step.end - 1 of its layer `slot`
        cfg, op = self.cfg, self._op
        T, hq, hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = mm(w.q, x).view(T, hq, 2 * D)                                      # per head: query, gate
        q, gate = qg[..., :D], qg[..., D:].reshape(T, hq * D)
        k = mm(w.k, x).view(T, hkv, D)
        v = mm(w.v, x).view(T, hkv, D)
        q = op["rope"](op["rms_norm_1p"](q, w.q_norm, cfg.rms_norm_eps), cos, sin)
        k = op["rope"](op["rms_norm_1p"](k, w.k_norm, cfg.rms_norm_eps), cos, sin)
        self._K[slot, :, step.start:step.end] = k.transpose(0, 1)
        self._V[slot, :, step.start:step.end] = v.transpose(0, 1)
        o = op["attention"](q, self._K[slot, :, :step.end], self._V[slot, :, :step.end],
                            causal_mask(step.start, step.count, self.device), D ** -0.5)   # [T, Hq, D]
        o = o.reshape(T, hq * D) * op["sigmoid"](gate).to(self.act_dtype)
        return mm(w.o, o)

    def __repr__(self) -> str:
        return f"MTPHead(qwen3_5, {self.layers} layers, {self.max_context} positions)"
