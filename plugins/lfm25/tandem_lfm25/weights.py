"""The checkpoint side of the LFM2 family: layout, expected tensors, audit, and the loaded weights.

- ``LAYOUT`` names every checkpoint key by its canonical name (the language
  model's own naming with ``model.`` taken off): ``embed_tokens.weight``,
  ``lm_head.weight`` (the embedding when the config ties them),
  ``embedding_norm.weight`` (the final norm, despite its name), and per layer
  ``layers.N.operator_norm.weight``, ``layers.N.ffn_norm.weight``, the mixer
  (``conv.in_proj`` / ``conv.conv`` / ``conv.out_proj``, or ``self_attn.q_proj``
  / ``k_proj`` / ``v_proj`` / ``out_proj`` with ``q_layernorm`` / ``k_layernorm``)
  and the feed-forward (``feed_forward.w1`` / ``w3`` / ``w2``, or the router
  ``feed_forward.gate``, ``feed_forward.expert_bias`` and the experts in the
  checkpoint's own layout, one module an expert:
  ``feed_forward.experts.E.w1`` / ``w3`` ``[I, H]`` and ``w2`` ``[H, I]``; that is
  what LiquidAI publishes and what transformers' ``save_pretrained`` writes).
- ``expected_tensors(cfg)`` is what the config says must be there, with shapes.
- ``open_checkpoint(dir, cfg)`` reads the headers, resolves the layout and runs
  the audit before any tensor is read: a missing tensor, a truncated shard, a
  wrong sha256 (``SHA256SUMS``), a wrong shape, or a tensor the model does not
  know stops it, naming it.
- ``build_weights(tensors, cfg, dtype)`` builds ``Lfm2Weights`` from tensors by
  canonical name: each projection a ``Linear`` of the registered weight format
  for the dtype; the small vectors (norms, conv taps, expert bias) in fp32. An
  expert's ``w1`` and ``w3`` are stacked into one ``[2I, H]`` weight (gate rows,
  then up rows: one matmul where the reference runs two), and every expert of
  a layer lives in one ``[E, 2I, H]`` and one ``[E, H, I]`` tensor, the
  per-expert ``Linear``\\ s being views into them (what a grouped kernel reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from tandem_core.checkpoint.audit import Expect
from tandem_core.checkpoint.layout import Layout
from tandem_core.checkpoint.opened import WEIGHT_DTYPES, Checkpoint, weights_identity
from tandem_core.checkpoint.opened import normalise_dtype as _normalise_dtype
from tandem_core.checkpoint.opened import open_checkpoint as _open
from tandem_core.linear import Linear, make_linear

from tandem_lfm25.config import Lfm2Config

__all__ = [
    "LAYOUT", "DTYPES", "normalise_dtype", "expected_tensors", "Checkpoint", "open_checkpoint",
    "weights_identity", "ConvWeights", "AttentionWeights", "MLPWeights", "MoEWeights", "LayerWeights",
    "Lfm2Weights", "build_weights", "load_weights",
]

LAYOUT = Layout(prefixes=("model.",), skip=(), head_names=("lm_head.weight",))

DTYPES = WEIGHT_DTYPES


def normalise_dtype(dtype: str) -> str:
    return _normalise_dtype(dtype, "LFM2")


# -- what the config says the checkpoint holds ---------------------------------------------------
def _mixer_tensors(cfg: Lfm2Config, layer: int) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    if cfg.is_conv(layer):
        return {
            "conv.in_proj.weight": (3 * H, H),       # B, C and x, side by side
            "conv.conv.weight": (H, 1, cfg.conv_L_cache),
            "conv.out_proj.weight": (H, H),
        }
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.out_proj.weight": (H, q),
        "self_attn.q_layernorm.weight": (D,),
        "self_attn.k_layernorm.weight": (D,),
    }


def _ffn_tensors(cfg: Lfm2Config, layer: int) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    if not cfg.is_moe(layer):
        I = cfg.intermediate_size
        return {"feed_forward.w1.weight": (I, H), "feed_forward.w3.weight": (I, H),
                "feed_forward.w2.weight": (H, I)}
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {"feed_forward.gate.weight": (E, H)}
    if cfg.use_expert_bias:
        out["feed_forward.expert_bias"] = (E,)
    for e in range(E):
        p = f"feed_forward.experts.{e}."
        out.update({p + "w1.weight": (I, H), p + "w3.weight": (I, H), p + "w2.weight": (H, I)})
    return out


def expected_tensors(cfg: Lfm2Config) -> dict[str, Expect]:
    """Canonical name -> expected shape, for every tensor the engine reads."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "embedding_norm.weight": (H,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "operator_norm.weight"] = (H,)
        out[p + "ffn_norm.weight"] = (H,)
        out.update({p + k: s for k, s in _mixer_tensors(cfg, i).items()})
        out.update({p + k: s for k, s in _ffn_tensors(cfg, i).items()})
    return {k: Expect(s) for k, s in out.items()}


# -- opening and auditing ---------------------------------------------------------------------------
def open_checkpoint(directory: str | Path, cfg: Lfm2Config) -> Checkpoint:
    """Read the headers, resolve the layout, audit (``tandem_core.checkpoint.opened``). Nothing is loaded; a
    failure names its tensor or file."""
    return _open(directory, LAYOUT, expected_tensors(cfg), tied=cfg.tie_word_embeddings, family=cfg.model_type)


# -- the loaded weights ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvWeights:
    """A gated short-conv layer's weights."""

    in_proj: Linear         # [3H, H]: B, C, x
    conv: torch.Tensor      # [H, K] fp32 depthwise taps, oldest input first
    out_proj: Linear        # [H, H]


@dataclass(frozen=True)
class AttentionWeights:
    """A grouped-query attention layer's weights."""

    q: Linear               # [Hq*D, H]
    k: Linear               # [Hkv*D, H]
    v: Linear               # [Hkv*D, H]
    o: Linear               # [H, Hq*D]
    q_norm: torch.Tensor    # [D] fp32 (plain RMSNorm weight)
    k_norm: torch.Tensor    # [D] fp32


@dataclass(frozen=True)
class MLPWeights:
    """The dense feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    w1: Linear              # [I, H]
    w3: Linear              # [I, H]
    w2: Linear              # [H, I]


@dataclass(frozen=True)
class MoEWeights:
    """A mixture-of-experts feed-forward: the router, its selection bias, and the experts."""

    router: Linear                      # [E, H]
    expert_bias: torch.Tensor | None    # [E] fp32: added to the scores for selection only
    gate_up: tuple[Linear, ...]         # E x [2I, H]: expert e's w1 rows then its w3 rows (views of gate_up_all)
    down: tuple[Linear, ...]            # E x [H, I]: expert e's w2 (views of down_all)
    gate_up_all: torch.Tensor           # [E, 2I, H] in the weights' dtype
    down_all: torch.Tensor              # [E, H, I]


@dataclass(frozen=True)
class LayerWeights:
    kind: str                                   # "conv" or "full_attention"
    operator_norm: torch.Tensor                 # [H] fp32
    mixer: ConvWeights | AttentionWeights
    ffn_norm: torch.Tensor                      # [H] fp32
    ffn: MLPWeights | MoEWeights


@dataclass(frozen=True)
class Lfm2Weights:
    """Everything the model multiplies by. Shared, never mutated: several runners may hold one."""

    dtype: str                               # "fp32" / "bf16" / "fp16": the weights' and activations' dtype
    act_dtype: torch.dtype
    device: torch.device
    embed: torch.Tensor                      # [V, H] in act_dtype
    head: Linear                             # [V, H]; reads ``embed`` when the config ties them
    norm: torch.Tensor                       # [H] fp32 (embedding_norm, the final norm)
    layers: tuple[LayerWeights, ...]
    tied: bool
    identity: str = ""                       # what identifies the checkpoint (weights_identity)
    skipped: dict[str, int] = field(default_factory=dict)

    def linears(self) -> Iterable[Linear]:
        """Every ``Linear`` (the head first; an expert's are views of its layer's stacked tensors)."""
        yield self.head
        for layer in self.layers:
            m, f = layer.mixer, layer.ffn
            yield from ((m.in_proj, m.out_proj) if isinstance(m, ConvWeights) else (m.q, m.k, m.v, m.o))
            yield from ((f.w1, f.w3, f.w2) if isinstance(f, MLPWeights) else (f.router, *f.gate_up, *f.down))

    def tensors(self) -> Iterable[torch.Tensor]:
        """The plain tensors (embedding, norms, conv taps, expert bias)."""
        yield self.embed
        yield self.norm
        for layer in self.layers:
            yield from (layer.operator_norm, layer.ffn_norm)
            m = layer.mixer
            yield from ((m.conv,) if isinstance(m, ConvWeights) else (m.q_norm, m.k_norm))
            if isinstance(layer.ffn, MoEWeights) and layer.ffn.expert_bias is not None:
                yield layer.ffn.expert_bias

    @property
    def nbytes(self) -> int:
        """Bytes held (a tied head is counted once, with the embedding)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        heads = list(self.linears())
        return total + sum(lin.nbytes for lin in (heads[1:] if self.tied else heads))

    def parameter_count(self) -> int:
        """Parameters the model reads (a tied head counted once)."""
        heads = list(self.linears())
        n = sum(t.numel() for t in self.tensors())
        return n + sum(lin.shape[0] * lin.shape[1] for lin in (heads[1:] if self.tied else heads))

    def active_parameter_count(self, top_k: int) -> int:
        """Parameters one token reads: every expert of a layer counted ``top_k / E`` times."""
        total = self.parameter_count()
        for layer in self.layers:
            if isinstance(layer.ffn, MoEWeights):
                per = sum(lin.shape[0] * lin.shape[1] for lin in (layer.ffn.gate_up[0], layer.ffn.down[0]))
                total -= per * (len(layer.ffn.gate_up) - top_k)
        return total


def build_weights(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], cfg: Lfm2Config,
                  dtype: str = "fp32", device: str | torch.device = "cpu", *, tied: bool | None = None,
                  identity: str = "", skipped: Mapping[str, int] | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> Lfm2Weights:
    """Build ``Lfm2Weights`` from tensors by canonical name (a mapping or a getter).

    ``tied``: the head reads the embedding (default: the config's ``tie_word_embeddings``
    when no ``lm_head.weight`` is given). ``progress(done, total, what)`` is called per tensor.
    """
    fmt, act = DTYPES[normalise_dtype(dtype)]
    dev = torch.device(device)
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    if tied is None:
        tied = cfg.tie_word_embeddings and not (isinstance(get, Mapping) and "lm_head.weight" in get)
    names = [n for n in expected_tensors(cfg) if not (tied and n == "lm_head.weight")]
    total, done = len(names), 0

    def tensor(name: str) -> torch.Tensor:
        nonlocal done
        t = fetch(name)
        done += 1
        if progress is not None:
            progress(done, total, "weights")
        return t

    def linear(name: str) -> Linear:
        return make_linear(fmt, tensor(name), device=dev)

    def vec(name: str) -> torch.Tensor:
        return tensor(name).to(device=dev, dtype=torch.float32)

    def moe(p: str) -> MoEWeights:
        # the stacks are in the dense format's dtype, so make_linear keeps each expert a view of them
        E = cfg.num_experts
        gate_up = torch.stack([torch.cat([tensor(f"{p}experts.{e}.w1.weight"), tensor(f"{p}experts.{e}.w3.weight")])
                               .to(device=dev, dtype=act) for e in range(E)])              # [E, 2I, H]
        down = torch.stack([tensor(f"{p}experts.{e}.w2.weight").to(device=dev, dtype=act)
                            for e in range(E)])                                            # [E, H, I]
        return MoEWeights(
            router=linear(p + "gate.weight"),
            expert_bias=vec(p + "expert_bias") if cfg.use_expert_bias else None,
            gate_up=tuple(make_linear(fmt, gate_up[e], device=dev) for e in range(E)),
            down=tuple(make_linear(fmt, down[e], device=dev) for e in range(E)),
            gate_up_all=gate_up, down_all=down,
        )

    embed = tensor("embed_tokens.weight").to(device=dev, dtype=act)
    head = make_linear(fmt, embed, device=dev) if tied else linear("lm_head.weight")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        op_norm = vec(p + "operator_norm.weight")
        mixer: ConvWeights | AttentionWeights
        if cfg.is_conv(i):
            mixer = ConvWeights(
                in_proj=linear(p + "conv.in_proj.weight"),
                conv=vec(p + "conv.conv.weight").reshape(cfg.hidden_size, cfg.conv_L_cache),
                out_proj=linear(p + "conv.out_proj.weight"),
            )
        else:
            a = p + "self_attn."
            mixer = AttentionWeights(
                q=linear(a + "q_proj.weight"), k=linear(a + "k_proj.weight"), v=linear(a + "v_proj.weight"),
                o=linear(a + "out_proj.weight"), q_norm=vec(a + "q_layernorm.weight"),
                k_norm=vec(a + "k_layernorm.weight"),
            )
        ffn_norm = vec(p + "ffn_norm.weight")
        f = p + "feed_forward."
        ffn: MLPWeights | MoEWeights
        if cfg.is_moe(i):
            ffn = moe(f)
        else:
            ffn = MLPWeights(w1=linear(f + "w1.weight"), w3=linear(f + "w3.weight"), w2=linear(f + "w2.weight"))
        layers.append(LayerWeights(cfg.layer_types[i], op_norm, mixer, ffn_norm, ffn))
    norm = vec("embedding_norm.weight")
    return Lfm2Weights(normalise_dtype(dtype), act, dev, embed, head, norm, tuple(layers), tied,
                       identity, dict(skipped or {}))


def load_weights(ckpt: Checkpoint, cfg: Lfm2Config, dtype: str = "fp32", device: str | torch.device = "cpu",
                 progress: Callable[[int, int, str], None] | None = None) -> Lfm2Weights:
    """Read every tensor of an audited checkpoint into ``Lfm2Weights``."""
    names = ckpt.layout.names

    def get(canon: str) -> torch.Tensor:
        return ckpt.reader.get(names[canon])

    return build_weights(get, cfg, dtype, device, tied=ckpt.layout.head_tied, identity=ckpt.identity,
                         skipped=dict(ckpt.layout.skipped), progress=progress)
