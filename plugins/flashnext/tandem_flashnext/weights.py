"""The checkpoint side of Flash-Next: the audit, and the loaded weights.

- ``open_checkpoint(dir, cfg)`` reads the headers, resolves the layout
  (``tandem_flashnext.layout``) and runs the audit before any tensor is read: a missing
  tensor, a truncated shard, a wrong sha256 (``SHA256SUMS``), a wrong shape, a PLE table
  whose shards do not add up, hashing buffers other than the config derives, or a tensor
  the model does not know (the MTP head's included) stops it, naming it.
- ``load_weights`` reads every tensor but the PLE tables into ``FlashNextWeights`` (each
  projection a ``Linear`` of the registered weight format for the dtype; norms, decay,
  conv taps in fp32) and memory-maps the tables (``ngram.RowTable``): they stay on the
  host, only the rows a step needs are read.
- ``build_weights(tensors, cfg, dtype)`` is the same construction from in-memory tensors
  (by canonical name), for tests and tools. ``Builder`` is the construction's vocabulary
  (a ``Linear``, a vector, an attention layer, a MoE by name), shared with the MTP head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from tandem_core.checkpoint.opened import weights_identity
from tandem_core.checkpoint.audit import AuditError, Expect, audit
from tandem_core.checkpoint.layout import LayoutResult
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
from tandem_core.linear import Linear, make_linear

from tandem_flashnext.config import FlashNextConfig
from tandem_flashnext.layout import (HASH_BUFFERS, LAYOUT, MTP_PREFIX, expected_mtp_tensors, expected_tensors,
                                     mtp_layer_count, table_names, table_prefix, unused_tensors)
from tandem_flashnext.ngram import MappedPart, NGramHash, RowTable, ngram_hashes

__all__ = [
    "DTYPES", "normalise_dtype", "Checkpoint", "open_checkpoint", "weights_identity", "HyperWeights",
    "GDNWeights", "AttentionWeights", "ExpertWeights", "MoEWeights", "PLEWeights", "LayerWeights",
    "FlashNextWeights", "Builder", "build_weights", "load_weights",
]

# requested dtype -> (weight format registered through tandem_weight_formats, activation dtype)
DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("fp32", torch.float32),
    "bf16": ("bf16", torch.bfloat16),
    "fp16": ("fp16", torch.float16),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_INT = (torch.int64,)


def normalise_dtype(dtype: str) -> str:
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} for the qwen4_exp model")
    return name


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
                             f"{table_prefix(layer) + 'ngram_embedding.shard_0.weight'!r} (the PLE table)")
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
            canon = table_prefix(layer) + buf
            if canon in names:
                got = reader.get(names[canon])
                if got.dtype not in _INT or tuple(got.tolist()) != tuple(want):
                    raise AuditError(f"tensor {names[canon]!r} = {got.tolist()} differs from what the config "
                                     f"derives ({list(want)}): the config does not describe this checkpoint")
    return out


# -- opening and auditing ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """An audited checkpoint: its reader, the resolved layout (the MTP head's keys keep their own names), the
    PLE tables' parts, its identity."""

    reader: SafetensorsCheckpoint
    layout: LayoutResult
    expected: dict[str, Expect]
    tables: dict[int, list[str]]          # layer -> canonical names of its table's parts, in row order
    identity: str
    mtp_layers: int = 0                   # the MTP head's decoder layers (0: the checkpoint has none)
    unused: tuple[str, ...] = ()          # tensors accepted but never read (layout.unused_tensors)

    @property
    def skipped(self) -> dict[str, int]:
        """Keys nothing reads, by skipped prefix (the vision tower) or by name (``unused``); the MTP head's
        keys are read by the head."""
        out = {k: n for k, n in self.layout.skipped.items() if k != MTP_PREFIX}
        out.update({u: 1 for u in self.unused})
        return out


def open_checkpoint(directory: str | Path, cfg: FlashNextConfig) -> Checkpoint:
    """Read the headers, resolve the layout, audit (the MTP head's tensors too, when there are any).
    Nothing but the small hashing buffers is read; a failure names its tensor or file."""
    reader = SafetensorsCheckpoint(directory)
    try:
        layout = LAYOUT.resolve(reader.keys(), cfg.tie_word_embeddings)
    except ValueError as exc:
        raise AuditError(f"checkpoint {reader.dir}: {exc}") from exc
    mtp_keys = [k for k in reader.keys() if k.startswith(MTP_PREFIX)]
    mtp_layers = mtp_layer_count(mtp_keys)
    if mtp_keys and cfg.mtp_num_hidden_layers is not None and mtp_layers != cfg.mtp_num_hidden_layers:
        raise AuditError(f"checkpoint {reader.dir}: the MTP head has {mtp_layers} decoder layers "
                         f"(mtp.layers.*), the config's mtp_num_hidden_layers is {cfg.mtp_num_hidden_layers}")
    expected = expected_tensors(cfg)
    expected_mtp = expected_mtp_tensors(cfg, mtp_layers) if mtp_keys else {}
    names = {**layout.names, **{k: k for k in mtp_keys}}
    unused = {k: e for k, e in unused_tensors(cfg).items() if k in names}
    audit(reader, {**expected, **expected_mtp, **unused}, names)
    tables = _audit_tables(reader, layout.names, cfg, ngram_hashes(cfg))
    known = set(expected) | set(unused) | {n for parts in tables.values() for n in parts}
    known |= {table_prefix(layer) + b for layer in tables for b in HASH_BUFFERS}
    unknown = sorted(set(layout.names) - known) + sorted(set(mtp_keys) - set(expected_mtp) - set(unused))
    if unknown:
        key = layout.names.get(unknown[0], unknown[0])
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise AuditError(f"checkpoint {reader.dir}: tensor {key!r} is not one the qwen4_exp model "
                         f"reads{more}; its config does not describe this checkpoint")
    return Checkpoint(reader, layout, expected, tables, weights_identity(reader), mtp_layers,
                      tuple(sorted(names[k] for k in unused)))


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


class Builder:
    """Weights by canonical name: a ``Linear`` of the dtype's registered format, an fp32 vector, and the
    layer parts the target and the MTP head share. ``progress(done, total, what)`` is called per tensor."""

    def __init__(self, get: Callable[[str], torch.Tensor], cfg: FlashNextConfig, dtype: str,
                 device: str | torch.device, total: int,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
        self.fmt, self.act = DTYPES[normalise_dtype(dtype)]
        self.device = torch.device(device)
        self.cfg, self._get, self._progress = cfg, get, progress
        self.total, self.done = total, 0

    def tensor(self, name: str) -> torch.Tensor:
        t = self._get(name)
        self.done += 1
        if self._progress is not None:
            self._progress(self.done, self.total, "weights")
        return t

    def linear(self, name: str) -> Linear:
        return make_linear(self.fmt, self.tensor(name), device=self.device)

    def vec(self, name: str) -> torch.Tensor:
        return self.tensor(name).to(device=self.device, dtype=torch.float32)

    def hyper(self, p: str, combine: bool) -> HyperWeights:
        return HyperWeights(self.vec(p + "hc_norm.weight"), self.linear(p + "input_mix_weight_down.weight"),
                            self.linear(p + "input_mix_weight_up.weight"),
                            self.linear(p + "block_inject_weight.weight") if combine else None)

    def expert(self, p: str) -> ExpertWeights:
        return ExpertWeights(self.linear(p + "gate_proj.weight"), self.linear(p + "up_proj.weight"),
                             self.linear(p + "down_proj.weight"))

    def attention(self, a: str) -> AttentionWeights:
        return AttentionWeights(
            q=self.linear(a + "q_proj.weight"), k=self.linear(a + "k_proj.weight"),
            v=self.linear(a + "v_proj.weight"), o=self.linear(a + "o_proj.weight"),
            q_norm=self.vec(a + "q_norm.weight"), k_norm=self.vec(a + "k_norm.weight"),
            index_qk=self.linear(a + "indexer.index_qk_proj.weight"),
            index_q_norm=self.vec(a + "indexer.q_layernorm.weight"),
            index_k_norm=self.vec(a + "indexer.k_layernorm.weight"))

    def moe(self, m: str) -> MoEWeights:
        return MoEWeights(router=self.linear(m + "gate.weight"),
                          experts=tuple(self.expert(f"{m}experts.{e}.") for e in range(self.cfg.num_experts)),
                          shared=self.expert(m + "shared_expert."),
                          shared_gate=self.linear(m + "shared_expert_gate.weight"))

    def gdn(self, a: str) -> GDNWeights:
        cfg = self.cfg
        return GDNWeights(
            in_qkv=self.linear(a + "in_proj_qkv.weight"), in_z=self.linear(a + "in_proj_z.weight"),
            in_b=self.linear(a + "in_proj_b.weight"), in_a=self.linear(a + "in_proj_a.weight"),
            conv=self.vec(a + "conv1d.weight").reshape(cfg.conv_dim, cfg.linear_conv_kernel_dim),
            A_log=self.vec(a + "A_log"), dt_bias=self.vec(a + "dt_bias"), norm=self.vec(a + "norm.weight"),
            out=self.linear(a + "out_proj.weight"))

    def ple(self, q: str, layer: int, hash_: NGramHash, table: RowTable) -> PLEWeights:
        cfg = self.cfg
        if table.rows != hash_.rows or table.width != cfg.ngram_head_dim:
            raise ValueError(f"PLE layer {layer}: table [{table.rows}, {table.width}], the config needs "
                             f"[{hash_.rows}, {cfg.ngram_head_dim}]")
        return PLEWeights(
            hash=hash_, table=table, key=self.linear(q + "key_proj.weight"),
            value=self.linear(q + "value_proj.weight"), norm_key=self.vec(q + "norm_key.weight"),
            norm_query=self.vec(q + "norm_query.weight"), norm_conv=self.vec(q + "norm_conv.weight"),
            conv=self.vec(q + "conv1d.weight").reshape(cfg.hc_dim, cfg.ple_conv_kernel_size))


def build_weights(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], cfg: FlashNextConfig,
                  dtype: str = "fp32", device: str | torch.device = "cpu", *, tables: Tables | None = None,
                  tied: bool | None = None, identity: str = "", skipped: Mapping[str, int] | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> FlashNextWeights:
    """Build ``FlashNextWeights`` from tensors by canonical name (a mapping or a getter).

    ``tables(layer)``: PLE layer ``layer``'s table (default: from the mapping's ``table_names``, in
    memory). ``tied``: the head reads the embedding (default: the config's ``tie_word_embeddings`` when
    no ``lm_head.weight`` is given). ``progress(done, total, what)`` is called per tensor.
    """
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    if tied is None:
        tied = cfg.tie_word_embeddings and not (isinstance(get, Mapping) and "lm_head.weight" in get)
    if tables is None:
        if not isinstance(get, Mapping):
            raise ValueError("build_weights: give tables= when the tensors come from a getter")
        mapping = get

        def tables(layer: int) -> RowTable:
            return RowTable([mapping[n] for n in table_names(mapping, layer)])

    total = len([n for n in expected_tensors(cfg) if not (tied and n == "lm_head.weight")])
    b = Builder(fetch, cfg, dtype, device, total, progress)
    hashes = ngram_hashes(cfg)
    embed = b.tensor("embed_tokens.weight").to(device=b.device, dtype=b.act)
    head = make_linear(b.fmt, embed, device=b.device) if tied else b.linear("lm_head.weight")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        attn_hc = b.hyper(p + "attn_hyper_connection.", True)
        mixer = b.gdn(p + "linear_attn.") if cfg.is_linear(i) else b.attention(p + "self_attn.")
        mlp_hc = b.hyper(p + "mlp_hyper_connection.", True)
        moe = b.moe(p + "mlp.")
        slot = cfg.ple_slot(i)
        ple = None if slot is None else b.ple(p + "ple.", i, hashes[slot], tables(i))
        layers.append(LayerWeights(cfg.layer_types[i], attn_hc, mixer, mlp_hc, moe, ple))
    final_hc = b.hyper("hyper_connection_mixer.", False)
    return FlashNextWeights(normalise_dtype(dtype), b.act, b.device, embed, head, final_hc, tuple(layers),
                            tied, identity, dict(skipped or {}))


def load_weights(ckpt: Checkpoint, cfg: FlashNextConfig, dtype: str = "fp32",
                 device: str | torch.device = "cpu",
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
