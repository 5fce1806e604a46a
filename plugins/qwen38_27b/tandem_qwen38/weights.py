"""The checkpoint side of the model: layout, expected tensors, audit, and the loaded weights.

- ``LAYOUT`` names every checkpoint key by its canonical name
  (``embed_tokens.weight``, ``lm_head.weight``, ``norm.weight``,
  ``layers.N.<module>.<proj>.weight``), skipping (and counting) the vision tower.
  The MTP head's keys (``mtp.*``) keep their own names: the target's layout leaves
  them to the head (``tandem_qwen38.mtp``), and the audit checks them too.
- ``expected_tensors(cfg)`` is what the config says must be there, with shapes;
  ``expected_mtp_tensors(cfg, layers)`` the same for an MTP head of ``layers``
  decoder layers (vLLM's Qwen3.5 MTP: ``mtp.fc`` [H, 2H] over the normed embedding
  and hidden state side by side, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.layers.J.*`` full-attention decoder layers of
  the target's own shape, ``mtp.norm``; the embedding and head are the target's).
- ``open_checkpoint(dir, cfg)`` reads the headers, resolves the layout and runs
  the audit before any tensor is read: a missing tensor, a truncated shard, a
  wrong sha256 (``SHA256SUMS``), a wrong shape, or a tensor the model does not
  know stops it, naming it.
- ``load_weights`` reads every tensor and builds ``Qwen38Weights``: each
  projection a ``Linear`` from the registered weight format for the requested
  dtype, the small vectors (norms, decay, conv taps) in fp32.
- ``build_weights(tensors, cfg, dtype)`` is the same construction from
  in-memory tensors (by canonical name), for tests and tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

import re

from tandem_core.checkpoint.audit import AuditError, Expect
from tandem_core.checkpoint.layout import Layout
from tandem_core.checkpoint.opened import WEIGHT_DTYPES, Checkpoint, weights_identity
from tandem_core.checkpoint.opened import normalise_dtype as _normalise_dtype
from tandem_core.checkpoint.opened import open_checkpoint as _open
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
from tandem_core.linear import Linear, make_linear

from tandem_qwen38.config import Qwen38Config

__all__ = [
    "LAYOUT", "MTP_PREFIX", "DTYPES", "normalise_dtype", "expected_tensors", "expected_mtp_tensors",
    "mtp_layer_count", "Checkpoint", "Qwen38Checkpoint", "open_checkpoint",
    "weights_identity",
    "GDNWeights", "AttentionWeights", "MLPWeights", "LayerWeights", "Qwen38Weights", "build_weights",
    "load_weights",
]

MTP_PREFIX = "mtp."
LAYOUT = Layout(
    prefixes=("model.language_model.", "language_model.model.", "language_model.", "model."),
    skip=("model.visual.", "visual."),          # mtp.* keys keep their own names (the head's)
    head_names=("lm_head.weight", "language_model.lm_head.weight"),
)

DTYPES = WEIGHT_DTYPES


def normalise_dtype(dtype: str) -> str:
    return _normalise_dtype(dtype, "qwen3_5")


# -- what the config says the checkpoint holds ---------------------------------------------------
def _gdn_tensors(cfg: Qwen38Config) -> dict[str, tuple[int, ...]]:
    H, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv.weight": (cfg.conv_dim, H),
        "in_proj_z.weight": (cfg.gdn_value_dim, H),
        "in_proj_b.weight": (hv, H),
        "in_proj_a.weight": (hv, H),
        "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "norm.weight": (cfg.linear_value_head_dim,),
        "out_proj.weight": (H, cfg.gdn_value_dim),
    }


def _attention_tensors(cfg: Qwen38Config) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {
        "q_proj.weight": (2 * q, H),   # each head's query, then its output gate
        "k_proj.weight": (kv, H),
        "v_proj.weight": (kv, H),
        "o_proj.weight": (H, q),
        "q_norm.weight": (D,),
        "k_norm.weight": (D,),
    }


def expected_tensors(cfg: Qwen38Config) -> dict[str, Expect]:
    """Canonical name -> expected shape, for every tensor the engine reads."""
    H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "norm.weight": (H,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if cfg.is_linear(i):
            out.update({p + "linear_attn." + k: s for k, s in _gdn_tensors(cfg).items()})
        else:
            out.update({p + "self_attn." + k: s for k, s in _attention_tensors(cfg).items()})
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
    return {k: Expect(s) for k, s in out.items()}


_MTP_LAYER = re.compile(re.escape(MTP_PREFIX) + r"layers\.(\d+)\.")


def mtp_layer_count(keys: Iterable[str]) -> int:
    """The MTP head's decoder layers, by its keys (``mtp.layers.J.*``: ``max J + 1``; 0 without a head)."""
    found = [int(m.group(1)) for k in keys if (m := _MTP_LAYER.match(k))]
    return max(found) + 1 if found else 0


def expected_mtp_tensors(cfg: Qwen38Config, layers: int) -> dict[str, Expect]:
    """Key -> expected shape, for every tensor of an MTP head of ``layers`` full-attention decoder layers."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "pre_fc_norm_embedding.weight": (H,), "pre_fc_norm_hidden.weight": (H,),
        "fc.weight": (H, 2 * H), "norm.weight": (H,),
    }
    for j in range(layers):
        p = f"layers.{j}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out.update({p + "self_attn." + k: s for k, s in _attention_tensors(cfg).items()})
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
    return {MTP_PREFIX + k: Expect(s) for k, s in out.items()}


# -- opening and auditing ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Qwen38Checkpoint(Checkpoint):
    """An audited checkpoint, with its MTP head's decoder layers (0: it ships none)."""

    mtp_layers: int = 0


def open_checkpoint(directory: str | Path, cfg: Qwen38Config) -> Qwen38Checkpoint:
    """Read the headers, resolve the layout, audit (``tandem_core.checkpoint.opened``): the MTP head's tensors
    with the rest when there are any (each ``mtp.*`` key one the head reads, at the shape the config gives
    it; any other refused by name). Nothing is loaded; a failure names its tensor or file."""
    keys = SafetensorsCheckpoint(directory).keys()
    layers = mtp_layer_count(keys)
    has_head = any(k.startswith(MTP_PREFIX) for k in keys)
    if has_head and cfg.mtp_num_hidden_layers is not None and layers != cfg.mtp_num_hidden_layers:
        raise AuditError(f"checkpoint {Path(directory)}: the MTP head has {layers} decoder layers "
                         f"(mtp.layers.*), the config's mtp_num_hidden_layers is {cfg.mtp_num_hidden_layers}")
    expected = {**expected_tensors(cfg), **(expected_mtp_tensors(cfg, layers) if has_head else {})}
    ckpt = _open(directory, LAYOUT, expected, tied=cfg.tie_word_embeddings, family="qwen3_5")
    return Qwen38Checkpoint(ckpt.reader, ckpt.layout, ckpt.expected, ckpt.identity, layers if has_head else 0)


# -- the loaded weights ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GDNWeights:
    """A Gated DeltaNet layer's weights."""

    in_qkv: Linear          # [2*Hk*Dk + Hv*Dv, H]
    in_z: Linear            # [Hv*Dv, H]
    in_b: Linear            # [Hv, H]
    in_a: Linear            # [Hv, H]
    conv: torch.Tensor      # [conv_dim, K] fp32
    A_log: torch.Tensor     # [Hv] fp32
    dt_bias: torch.Tensor   # [Hv] fp32
    norm: torch.Tensor      # [Dv] fp32 (plain weight of the gated norm)
    out: Linear             # [H, Hv*Dv]


@dataclass(frozen=True)
class AttentionWeights:
    """A gated attention layer's weights."""

    q: Linear               # [2*Hq*D, H]: per head, D query rows then D gate rows
    k: Linear               # [Hkv*D, H]
    v: Linear               # [Hkv*D, H]
    o: Linear               # [H, Hq*D]
    q_norm: torch.Tensor    # [D] fp32 (zero-centred)
    k_norm: torch.Tensor    # [D] fp32 (zero-centred)


@dataclass(frozen=True)
class MLPWeights:
    gate: Linear            # [I, H]
    up: Linear              # [I, H]
    down: Linear            # [H, I]


@dataclass(frozen=True)
class LayerWeights:
    kind: str                               # "linear_attention" or "full_attention"
    input_norm: torch.Tensor                # [H] fp32 (zero-centred)
    mixer: GDNWeights | AttentionWeights
    post_norm: torch.Tensor                 # [H] fp32 (zero-centred)
    mlp: MLPWeights


@dataclass(frozen=True)
class Qwen38Weights:
    """Everything the engine multiplies by. Shared, never mutated: several engines may hold one."""

    dtype: str                               # "fp32" / "bf16" / "fp16": the weights' and activations' dtype
    act_dtype: torch.dtype
    device: torch.device
    embed: torch.Tensor                      # [V, H] in act_dtype
    head: Linear                             # [V, H]; reads ``embed`` when the config ties them
    norm: torch.Tensor                       # [H] fp32 (zero-centred)
    layers: tuple[LayerWeights, ...]
    tied: bool
    identity: str = ""                       # what identifies the checkpoint (weights_identity)
    skipped: dict[str, int] = field(default_factory=dict)

    def linears(self) -> Iterable[Linear]:
        yield self.head
        for layer in self.layers:
            m = layer.mixer
            if isinstance(m, GDNWeights):
                yield from (m.in_qkv, m.in_z, m.in_b, m.in_a, m.out)
            else:
                yield from (m.q, m.k, m.v, m.o)
            yield from (layer.mlp.gate, layer.mlp.up, layer.mlp.down)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield self.embed
        yield self.norm
        for layer in self.layers:
            yield from (layer.input_norm, layer.post_norm)
            m = layer.mixer
            if isinstance(m, GDNWeights):
                yield from (m.conv, m.A_log, m.dt_bias, m.norm)
            else:
                yield from (m.q_norm, m.k_norm)

    @property
    def nbytes(self) -> int:
        """Bytes held (a tied head is counted once, with the embedding)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        heads = list(self.linears())
        return total + sum(lin.nbytes for lin in (heads[1:] if self.tied else heads))

    def parameter_count(self) -> int:
        """Parameters the engine reads (a tied head counted once)."""
        heads = list(self.linears())
        n = sum(t.numel() for t in self.tensors())
        return n + sum(lin.shape[0] * lin.shape[1] for lin in (heads[1:] if self.tied else heads))


def build_weights(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], cfg: Qwen38Config,
                  dtype: str = "fp32", device: str | torch.device = "cpu", *, tied: bool | None = None,
                  identity: str = "", skipped: Mapping[str, int] | None = None,
                  progress: Callable[[int, int, str], None] | None = None,
                  sizes: Mapping[str, int] | None = None) -> Qwen38Weights:
    """Build ``Qwen38Weights`` from tensors by canonical name (a mapping or a getter).

    ``tied``: the head reads the embedding (default: the config's ``tie_word_embeddings``
    when no ``lm_head.weight`` is given). ``progress(done, total, what)`` is called per tensor with the
    bytes read so far (``sizes``: each tensor's stored bytes, for the total; default: the mapping's own),
    ``what`` naming the device they go to. Each tensor is converted and placed on ``device`` as it comes,
    so nothing beyond one tensor is held twice.
    """
    fmt, act = DTYPES[normalise_dtype(dtype)]
    dev = torch.device(device)
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    if tied is None:
        tied = cfg.tie_word_embeddings and not (isinstance(get, Mapping) and "lm_head.weight" in get)
    names = [n for n in expected_tensors(cfg) if not (tied and n == "lm_head.weight")]
    if sizes is None and isinstance(get, Mapping):
        sizes = {n: get[n].numel() * get[n].element_size() for n in names if n in get}
    total = sum((sizes or {}).get(n, 0) for n in names) or len(names)
    done = 0
    what = f"to {dev}"

    def tensor(name: str) -> torch.Tensor:
        nonlocal done
        t = fetch(name)
        done += (sizes or {}).get(name, 0) if sizes else 1
        if progress is not None:
            progress(min(done, total), total, what)
        return t

    def linear(name: str) -> Linear:
        return make_linear(fmt, tensor(name), device=dev)

    def vec(name: str) -> torch.Tensor:
        return tensor(name).to(device=dev, dtype=torch.float32)

    embed = tensor("embed_tokens.weight").to(device=dev, dtype=act)
    head = make_linear(fmt, embed, device=dev) if tied else linear("lm_head.weight")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        input_norm = vec(p + "input_layernorm.weight")
        mixer: GDNWeights | AttentionWeights
        if cfg.is_linear(i):
            a = p + "linear_attn."
            mixer = GDNWeights(
                in_qkv=linear(a + "in_proj_qkv.weight"), in_z=linear(a + "in_proj_z.weight"),
                in_b=linear(a + "in_proj_b.weight"), in_a=linear(a + "in_proj_a.weight"),
                conv=vec(a + "conv1d.weight").reshape(cfg.conv_dim, cfg.linear_conv_kernel_dim),
                A_log=vec(a + "A_log"), dt_bias=vec(a + "dt_bias"), norm=vec(a + "norm.weight"),
                out=linear(a + "out_proj.weight"),
            )
        else:
            a = p + "self_attn."
            mixer = AttentionWeights(
                q=linear(a + "q_proj.weight"), k=linear(a + "k_proj.weight"), v=linear(a + "v_proj.weight"),
                o=linear(a + "o_proj.weight"), q_norm=vec(a + "q_norm.weight"),
                k_norm=vec(a + "k_norm.weight"),
            )
        post_norm = vec(p + "post_attention_layernorm.weight")
        mlp = MLPWeights(gate=linear(p + "mlp.gate_proj.weight"), up=linear(p + "mlp.up_proj.weight"),
                         down=linear(p + "mlp.down_proj.weight"))
        layers.append(LayerWeights(cfg.layer_types[i], input_norm, mixer, post_norm, mlp))
    norm = vec("norm.weight")
    return Qwen38Weights(normalise_dtype(dtype), act, dev, embed, head, norm, tuple(layers), tied,
                         identity, dict(skipped or {}))


def load_weights(ckpt: Checkpoint, cfg: Qwen38Config, dtype: str = "fp32", device: str | torch.device = "cpu",
                 progress: Callable[[int, int, str], None] | None = None) -> Qwen38Weights:
    """Read every tensor of an audited checkpoint into ``Qwen38Weights``, each straight onto ``device``."""
    names = ckpt.layout.names
    dev = torch.device(device)

    def get(canon: str) -> torch.Tensor:
        return ckpt.reader.get(names[canon], dev)

    sizes = {canon: ckpt.reader.nbytes(key) for canon, key in names.items()}
    return build_weights(get, cfg, dtype, dev, tied=ckpt.layout.head_tied, identity=ckpt.identity,
                         skipped=ckpt.skipped, progress=progress, sizes=sizes)

