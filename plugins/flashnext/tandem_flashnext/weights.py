"""The checkpoint side of Flash-Next: layout, expected tensors, audit, and the loaded weights.

- ``LAYOUT`` names every checkpoint key by its canonical name (``embed_tokens.weight``,
  ``lm_head.weight``, ``hyper_connection_mixer.*``, ``layers.N.<module>.<proj>.weight``),
  skipping (and counting) the vision tower; the ``mtp.*`` keys are the MTP head's
  (``tandem_flashnext.mtp``) and are counted apart.
- ``expected_tensors(cfg)`` is what the config says must be there, with shapes. The
  experts are stored one module each (``mlp.experts.E.{gate,up,down}_proj.weight``, as
  ``save_pretrained`` writes them); each PLE table as ``ngram_embedding.shard_K.weight``
  row ranges (``split_ngram_parts`` of them at most, ``torch.chunk``'s sizes), or one
  ``ngram_embedding.weight``; the PLE hashing buffers (``layer_multipliers``,
  ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``), where the checkpoint has them,
  must equal what the config derives.
- ``open_checkpoint(dir, cfg)`` reads the headers, resolves the layout and runs the
  audit before any tensor is read: a missing tensor, a truncated shard, a wrong sha256
  (``SHA256SUMS``), a wrong shape, or a tensor the model does not know stops it, naming it.
- ``load_weights`` reads every tensor but the PLE tables into ``FlashNextWeights`` (each
  projection a ``Linear`` of the registered weight format for the dtype; norms, decay,
  conv taps in fp32) and memory-maps the tables (``ngram.RowTable``): they stay on the
  host, only the rows a step needs are read.
- ``build_weights(tensors, cfg, dtype)`` is the same construction from in-memory tensors
  (by canonical name), for tests and tools.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from tandem_core.checkpoint.audit import AuditError, Expect, audit, read_sums
from tandem_core.checkpoint.layout import Layout, LayoutResult
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
from tandem_core.linear import Linear, make_linear

from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.ngram import MappedPart, NGramHash, RowTable, ngram_hashes

__all__ = [
    "LAYOUT", "MTP_PREFIX", "DTYPES", "normalise_dtype", "expected_tensors", "table_names", "Checkpoint",
    "open_checkpoint", "weights_identity", "HyperWeights", "GDNWeights", "AttentionWeights", "ExpertWeights",
    "MoEWeights", "PLEWeights", "LayerWeights", "FlashNextWeights", "build_weights", "load_weights",
]

MTP_PREFIX = "mtp."
LAYOUT = Layout(
    prefixes=("model.language_model.", "language_model.model.", "language_model.", "model."),
    skip=("model.visual.", "visual.", MTP_PREFIX),
    head_names=("lm_head.weight", "language_model.lm_head.weight"),
)

# requested dtype -> (weight format registered through tandem_weight_formats, activation dtype)
DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("fp32", torch.float32),
    "bf16": ("bf16", torch.bfloat16),
    "fp16": ("fp16", torch.float16),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_INT = (torch.int64,)
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def normalise_dtype(dtype: str) -> str:
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} for the qwen4_exp model")
    return name


# -- what the config says the checkpoint holds ---------------------------------------------------
def _hyper(cfg: FlashNextConfig, combine: bool) -> dict[str, tuple[int, ...]]:
    n, nh, r = cfg.hc_count, cfg.hc_dim, cfg.hc_lowrank
    out = {"hc_norm.weight": (nh,), "input_mix_weight_down.weight": (r, nh), "input_mix_weight_up.weight": (nh, r)}
    if combine:
        out["block_inject_weight.weight"] = (n, nh)
    return out


def _gdn(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv.weight": (cfg.conv_dim, H), "in_proj_z.weight": (cfg.gdn_value_dim, H),
        "in_proj_b.weight": (hv, H), "in_proj_a.weight": (hv, H),
        "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "A_log": (hv,), "dt_bias": (hv,), "norm.weight": (cfg.linear_value_head_dim,),
        "out_proj.weight": (H, cfg.gdn_value_dim),
    }


def _attention(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, D, Di = cfg.hidden_size, cfg.head_dim, cfg.indexer_head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {
        "q_proj.weight": (2 * q, H),   # each head's query, then its output gate
        "k_proj.weight": (kv, H), "v_proj.weight": (kv, H), "o_proj.weight": (H, q),
        "q_norm.weight": (D,), "k_norm.weight": (D,),
        "indexer.index_qk_proj.weight": ((cfg.indexer_n_heads + 1) * Di, H),   # the heads' queries, then one key
        "indexer.q_layernorm.weight": (Di,), "indexer.k_layernorm.weight": (Di,),
    }


def _moe(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    H, I, Is = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = {"gate.weight": (cfg.num_experts, H), "shared_expert_gate.weight": (1, H),
           "shared_expert.gate_proj.weight": (Is, H), "shared_expert.up_proj.weight": (Is, H),
           "shared_expert.down_proj.weight": (H, Is)}
    for e in range(cfg.num_experts):
        out.update({f"experts.{e}.gate_proj.weight": (I, H), f"experts.{e}.up_proj.weight": (I, H),
                    f"experts.{e}.down_proj.weight": (H, I)})
    return out


def _ple(cfg: FlashNextConfig) -> dict[str, tuple[int, ...]]:
    nh, E = cfg.hc_dim, cfg.ple_embed_dim
    return {"key_proj.weight": (nh, E), "value_proj.weight": (cfg.hidden_size, E), "norm_key.weight": (nh,),
            "norm_query.weight": (nh,), "norm_conv.weight": (nh,), "conv1d.weight": (nh, 1, cfg.ple_conv_kernel_size)}


def expected_tensors(cfg: FlashNextConfig) -> dict[str, Expect]:
    """Canonical name -> expected shape, for every tensor the model reads but the PLE tables
    (``table_names``) and the optional PLE hashing buffers."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)}
    out.update({"hyper_connection_mixer." + k: s for k, s in _hyper(cfg, combine=False).items()})
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
            out.update({p + hc + k: s for k, s in _hyper(cfg, combine=True).items()})
        if cfg.is_linear(i):
            out.update({p + "linear_attn." + k: s for k, s in _gdn(cfg).items()})
        else:
            out.update({p + "self_attn." + k: s for k, s in _attention(cfg).items()})
        out.update({p + "mlp." + k: s for k, s in _moe(cfg).items()})
        if cfg.ple_slot(i) is not None:
            out.update({p + "ple." + k: s for k, s in _ple(cfg).items()})
    return {k: Expect(s) for k, s in out.items()}


def _table_prefix(layer: int) -> str:
    return f"layers.{layer}.ple.ple_embedding."


def table_names(names: Iterable[str], layer: int) -> list[str]:
    """The canonical names holding PLE layer ``layer``'s table, in row order: ``ngram_embedding.shard_0..``
    (numbered without a gap) or the one ``ngram_embedding.weight``."""
    pre = _table_prefix(layer) + "ngram_embedding."
    shard = re.compile(re.escape(pre) + r"shard_(\d+)\.weight")
    found = {int(m.group(1)): n for n in names if (m := shard.fullmatch(n))}
    whole = pre + "weight"
    if found and whole in names:
        raise AuditError(f"PLE layer {layer}: both {whole!r} and its shards are in the checkpoint")
    if not found:
        return [whole] if whole in names else []
    order = sorted(found)
    if order != list(range(len(order))):
        gap = next(i for i in range(len(order) + 1) if i not in found)
        raise AuditError(f"PLE layer {layer}: table shard {pre}shard_{gap}.weight is missing "
                         f"(shards {order} are there)")
    return [found[i] for i in order]


def _audit_tables(reader: SafetensorsCheckpoint, names: Mapping[str, str], cfg: FlashNextConfig,
                  hashes: tuple[NGramHash, ...]) -> dict[int, list[str]]:
    """Every PLE table's parts (canonical names by layer), checked: shapes adding up to the table the
    config derives, float dtypes; the hashing buffers, where present, equal to the derived ones."""
    out: dict[int, list[str]] = {}
    for layer in range(cfg.num_hidden_layers):
        m = cfg.ple_slot(layer)
        if m is None:
            continue
        parts = table_names(names, layer)
        if not parts:
            raise AuditError(f"checkpoint {reader.dir} is missing tensor "
                             f"{_table_prefix(layer) + 'ngram_embedding.shard_0.weight'!r} (the PLE table)")
        if len(parts) > cfg.split_ngram_parts:
            raise AuditError(f"PLE layer {layer}: {len(parts)} table shards, the config's split_ngram_parts "
                             f"is {cfg.split_ngram_parts}")
        rows = 0
        for canon in parts:
            info = reader.info(names[canon])
            if len(info.shape) != 2 or info.shape[1] != cfg.ngram_head_dim:
                raise AuditError(f"tensor {info.key!r} has shape {list(info.shape)}, the config needs "
                                 f"[rows, {cfg.ngram_head_dim}] (ple_embed_dim / n-gram heads)")
            if info.torch_dtype not in Expect(()).dtypes:
                raise AuditError(f"tensor {info.key!r} has dtype {info.dtype}, a PLE table is floating point")
            rows += info.shape[0]
        if rows != hashes[m].rows:
            raise AuditError(f"PLE layer {layer}: the table's shards hold {rows} rows, the config's n-gram "
                             f"vocabularies need {hashes[m].rows}")
        out[layer] = parts
        derived = {"layer_multipliers": hashes[m].multipliers, "ngram_heads_vocab_sizes": hashes[m].sizes,
                   "ngram_heads_offsets": hashes[m].offsets}
        for buf, want in derived.items():
            canon = _table_prefix(layer) + buf
            if canon in names:
                got = reader.get(names[canon])
                if got.dtype not in _INT or tuple(got.tolist()) != tuple(want):
                    raise AuditError(f"tensor {names[canon]!r} = {got.tolist()} differs from what the config "
                                     f"derives ({list(want)}): the config does not describe this checkpoint")
    return out


# -- opening and auditing ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """An audited checkpoint: its reader, the resolved layout, the PLE tables' parts, its identity."""

    reader: SafetensorsCheckpoint
    layout: LayoutResult
    expected: dict[str, Expect]
    tables: dict[int, list[str]]          # layer -> canonical names of its table's parts, in row order
    identity: str

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self.layout.skipped)

    @property
    def mtp_keys(self) -> list[str]:
        return sorted(k for k in self.reader.keys() if k.startswith(MTP_PREFIX))


def weights_identity(reader: SafetensorsCheckpoint) -> str:
    """sha256 of what identifies the weights: the ``SHA256SUMS`` manifest when the pack has one, else every
    tensor's name, dtype, shape and byte range with each file's name and size (no tensor bytes read)."""
    h = hashlib.sha256()
    sums = read_sums(reader.dir)
    if sums is not None:
        for name in sorted(sums):
            h.update(f"{name} {sums[name]}\n".encode())
        return h.hexdigest()
    for path in reader.files:
        h.update(f"file {path.name} {path.stat().st_size}\n".encode())
    for key in sorted(reader.infos):
        info = reader.infos[key]
        h.update(f"{key} {info.file.name} {info.dtype} {list(info.shape)} {info.begin} {info.end}\n".encode())
    return h.hexdigest()


def open_checkpoint(directory: str | Path, cfg: FlashNextConfig) -> Checkpoint:
    """Read the headers, resolve the layout, audit. Nothing but the small hashing buffers is read; a failure
    names its tensor or file."""
    reader = SafetensorsCheckpoint(directory)
    try:
        layout = LAYOUT.resolve(reader.keys(), cfg.tie_word_embeddings)
    except ValueError as exc:
        raise AuditError(f"checkpoint {reader.dir}: {exc}") from exc
    expected = expected_tensors(cfg)
    audit(reader, expected, layout.names)
    tables = _audit_tables(reader, layout.names, cfg, ngram_hashes(cfg))
    known = set(expected) | {n for parts in tables.values() for n in parts}
    known |= {_table_prefix(layer) + b for layer in tables for b in _HASH_BUFFERS}
    unknown = sorted(set(layout.names) - known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise AuditError(f"checkpoint {reader.dir}: tensor {layout.names[unknown[0]]!r} is not one the "
                         f"qwen4_exp model reads{more}; its config does not describe this checkpoint")
    return Checkpoint(reader, layout, expected, tables, weights_identity(reader))


# -- the loaded weights ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HyperWeights:
    """A gated residual over ``hc_count`` streams: the streams' norm, the low-rank input mixer, and (for a
    layer's two connections, not the final mixer) the weights that inject the block's output."""

    norm: torch.Tensor          # [n*H] fp32 (zero-centred, one RMS group per stream)
    down: Linear                # [R, n*H]
    up: Linear                  # [n*H, R]
    inject: Linear | None       # [n, n*H]


@dataclass(frozen=True)
class GDNWeights:
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
    """A QSA indexed attention layer: gated attention and its indexer."""

    q: Linear               # [2*Hq*D, H]: per head, D query rows then D gate rows
    k: Linear               # [Hkv*D, H]
    v: Linear               # [Hkv*D, H]
    o: Linear               # [H, Hq*D]
    q_norm: torch.Tensor    # [D] fp32 (zero-centred)
    k_norm: torch.Tensor    # [D] fp32 (zero-centred)
    index_qk: Linear        # [(Hi + 1)*Di, H]: the indexer heads' queries, then its one raw key
    index_q_norm: torch.Tensor   # [Di] fp32 (zero-centred)
    index_k_norm: torch.Tensor   # [Di] fp32 (zero-centred), applied to the pooled block keys


@dataclass(frozen=True)
class ExpertWeights:
    gate: Linear            # [I, H]
    up: Linear              # [I, H]
    down: Linear            # [H, I]


@dataclass(frozen=True)
class MoEWeights:
    router: Linear                          # [E, H]
    experts: tuple[ExpertWeights, ...]      # [E]
    shared: ExpertWeights
    shared_gate: Linear                     # [1, H]


@dataclass(frozen=True)
class PLEWeights:
    hash: NGramHash
    table: RowTable                         # [rows, E / heads] on the host (memory-mapped from the shards)
    key: Linear                             # [n*H, E]
    value: Linear                           # [H, E]
    norm_key: torch.Tensor                  # [n*H] fp32 (zero-centred, grouped per stream)
    norm_query: torch.Tensor                # [n*H] fp32
    norm_conv: torch.Tensor                 # [n*H] fp32
    conv: torch.Tensor                      # [n*H, K] fp32, dilation ngram_size


@dataclass(frozen=True)
class LayerWeights:
    kind: str                               # "linear_attention" or "indexed_attention"
    attn_hc: HyperWeights
    mixer: GDNWeights | AttentionWeights
    mlp_hc: HyperWeights
    moe: MoEWeights
    ple: PLEWeights | None


@dataclass(frozen=True)
class FlashNextWeights:
    """Everything the model multiplies by. Shared, never mutated: several models may hold one."""

    dtype: str                               # "fp32" / "bf16" / "fp16"
    act_dtype: torch.dtype
    device: torch.device
    embed: torch.Tensor                      # [V, H] in act_dtype
    head: Linear                             # [V, H]; reads ``embed`` when the config ties them
    final_hc: HyperWeights                   # the final mixer of the streams (in place of a final norm)
    layers: tuple[LayerWeights, ...]
    tied: bool
    identity: str = ""
    skipped: dict[str, int] = field(default_factory=dict)

    def linears(self) -> Iterable[Linear]:
        yield self.head
        yield from (self.final_hc.down, self.final_hc.up)
        for layer in self.layers:
            for hc in (layer.attn_hc, layer.mlp_hc):
                yield from (hc.down, hc.up)
                if hc.inject is not None:
                    yield hc.inject
            m = layer.mixer
            if isinstance(m, GDNWeights):
                yield from (m.in_qkv, m.in_z, m.in_b, m.in_a, m.out)
            else:
                yield from (m.q, m.k, m.v, m.o, m.index_qk)
            moe = layer.moe
            yield from (moe.router, moe.shared_gate, moe.shared.gate, moe.shared.up, moe.shared.down)
            for ex in moe.experts:
                yield from (ex.gate, ex.up, ex.down)
            if layer.ple is not None:
                yield from (layer.ple.key, layer.ple.value)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield self.embed
        yield self.final_hc.norm
        for layer in self.layers:
            yield from (layer.attn_hc.norm, layer.mlp_hc.norm)
            m = layer.mixer
            if isinstance(m, GDNWeights):
                yield from (m.conv, m.A_log, m.dt_bias, m.norm)
            else:
                yield from (m.q_norm, m.k_norm, m.index_q_norm, m.index_k_norm)
            if layer.ple is not None:
                p = layer.ple
                yield from (p.norm_key, p.norm_query, p.norm_conv, p.conv)

    def tables(self) -> Iterable[RowTable]:
        for layer in self.layers:
            if layer.ple is not None:
                yield layer.ple.table

    @property
    def nbytes(self) -> int:
        """Bytes held on ``device`` (a tied head counted once, with the embedding; the PLE tables not: they
        stay on the host, ``table_bytes``)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        heads = list(self.linears())
        return total + sum(lin.nbytes for lin in (heads[1:] if self.tied else heads))

    @property
    def table_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables())

    def parameter_count(self) -> int:
        """Parameters the model reads (a tied head counted once), the PLE tables included."""
        heads = list(self.linears())
        n = sum(t.numel() for t in self.tensors()) + sum(t.rows * t.width for t in self.tables())
        return n + sum(lin.shape[0] * lin.shape[1] for lin in (heads[1:] if self.tied else heads))


Tables = Callable[[int], RowTable]   # layer -> its PLE table


def build_weights(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], cfg: FlashNextConfig,
                  dtype: str = "fp32", device: str | torch.device = "cpu", *, tables: Tables | None = None,
                  tied: bool | None = None, identity: str = "", skipped: Mapping[str, int] | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> FlashNextWeights:
    """Build ``FlashNextWeights`` from tensors by canonical name (a mapping or a getter).

    ``tables(layer)``: PLE layer ``layer``'s table (default: from the mapping's ``table_names``, in
    memory). ``tied``: the head reads the embedding (default: the config's ``tie_word_embeddings`` when
    no ``lm_head.weight`` is given). ``progress(done, total, what)`` is called per tensor.
    """
    fmt, act = DTYPES[normalise_dtype(dtype)]
    dev = torch.device(device)
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    if tied is None:
        tied = cfg.tie_word_embeddings and not (isinstance(get, Mapping) and "lm_head.weight" in get)
    if tables is None:
        if not isinstance(get, Mapping):
            raise ValueError("build_weights: give tables= when the tensors come from a getter")
        mapping = get

        def tables(layer: int) -> RowTable:
            return RowTable([mapping[n] for n in table_names(mapping, layer)])

    names = [n for n in expected_tensors(cfg) if not (tied and n == "lm_head.weight")]
    total, done = len(names), 0
    hashes = ngram_hashes(cfg)

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

    def hyper(p: str, combine: bool) -> HyperWeights:
        return HyperWeights(vec(p + "hc_norm.weight"), linear(p + "input_mix_weight_down.weight"),
                            linear(p + "input_mix_weight_up.weight"),
                            linear(p + "block_inject_weight.weight") if combine else None)

    def expert(p: str) -> ExpertWeights:
        return ExpertWeights(linear(p + "gate_proj.weight"), linear(p + "up_proj.weight"),
                             linear(p + "down_proj.weight"))

    embed = tensor("embed_tokens.weight").to(device=dev, dtype=act)
    head = make_linear(fmt, embed, device=dev) if tied else linear("lm_head.weight")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_hc = hyper(p + "attn_hyper_connection.", True)
        mixer: GDNWeights | AttentionWeights
        if cfg.is_linear(i):
            a = p + "linear_attn."
            mixer = GDNWeights(
                in_qkv=linear(a + "in_proj_qkv.weight"), in_z=linear(a + "in_proj_z.weight"),
                in_b=linear(a + "in_proj_b.weight"), in_a=linear(a + "in_proj_a.weight"),
                conv=vec(a + "conv1d.weight").reshape(cfg.conv_dim, cfg.linear_conv_kernel_dim),
                A_log=vec(a + "A_log"), dt_bias=vec(a + "dt_bias"), norm=vec(a + "norm.weight"),
                out=linear(a + "out_proj.weight"))
        else:
            a = p + "self_attn."
            mixer = AttentionWeights(
                q=linear(a + "q_proj.weight"), k=linear(a + "k_proj.weight"), v=linear(a + "v_proj.weight"),
                o=linear(a + "o_proj.weight"), q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"),
                index_qk=linear(a + "indexer.index_qk_proj.weight"),
                index_q_norm=vec(a + "indexer.q_layernorm.weight"),
                index_k_norm=vec(a + "indexer.k_layernorm.weight"))
        mlp_hc = hyper(p + "mlp_hyper_connection.", True)
        m = p + "mlp."
        moe = MoEWeights(router=linear(m + "gate.weight"),
                         experts=tuple(expert(f"{m}experts.{e}.") for e in range(cfg.num_experts)),
                         shared=expert(m + "shared_expert."), shared_gate=linear(m + "shared_expert_gate.weight"))
        ple = None
        slot = cfg.ple_slot(i)
        if slot is not None:
            q = p + "ple."
            ple = PLEWeights(
                hash=hashes[slot], table=tables(i), key=linear(q + "key_proj.weight"),
                value=linear(q + "value_proj.weight"), norm_key=vec(q + "norm_key.weight"),
                norm_query=vec(q + "norm_query.weight"), norm_conv=vec(q + "norm_conv.weight"),
                conv=vec(q + "conv1d.weight").reshape(cfg.hc_dim, cfg.ple_conv_kernel_size))
            if ple.table.rows != ple.hash.rows or ple.table.width != cfg.ngram_head_dim:
                raise ValueError(f"PLE layer {i}: table [{ple.table.rows}, {ple.table.width}], the config needs "
                                 f"[{ple.hash.rows}, {cfg.ngram_head_dim}]")
        layers.append(LayerWeights(cfg.layer_types[i], attn_hc, mixer, mlp_hc, moe, ple))
    final_hc = hyper("hyper_connection_mixer.", False)
    return FlashNextWeights(normalise_dtype(dtype), act, dev, embed, head, final_hc, tuple(layers), tied,
                            identity, dict(skipped or {}))


def load_weights(ckpt: Checkpoint, cfg: FlashNextConfig, dtype: str = "fp32", device: str | torch.device = "cpu",
                 progress: Callable[[int, int, str], None] | None = None) -> FlashNextWeights:
    """Read every tensor of an audited checkpoint into ``FlashNextWeights``; the PLE tables memory-mapped."""
    names, reader = ckpt.layout.names, ckpt.reader

    def get(canon: str) -> torch.Tensor:
        return reader.get(names[canon])

    def tables(layer: int) -> RowTable:
        parts = []
        for canon in ckpt.tables[layer]:
            info = reader.info(names[canon])
            parts.append(MappedPart(info.file, reader.data_start[info.file] + info.begin, int(info.shape[0]),
                                    int(info.shape[1]), info.torch_dtype))
        return RowTable.mapped(parts)

    return build_weights(get, cfg, dtype, device, tables=tables, tied=ckpt.layout.head_tied,
                         identity=ckpt.identity, skipped=ckpt.skipped, progress=progress)
