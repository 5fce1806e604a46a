"""Layout and audit of a Llama checkpoint, and the weights the engine multiplies by.

Two sources:

- a GGUF file (llama.cpp's names: ``token_embd.weight``, ``blk.N.attn_q.weight``,
  ...). llama.cpp's converter permutes the rows of Q and K within each head so
  that its interleaved rotary form computes what Hugging Face's half-split form
  computes; like transformers, we undo that permutation (on the raw rows, which
  is exact in every block format) and use the half-split form.
- a Hugging Face safetensors directory (``model.layers.N.self_attn.q_proj.weight``, ...),
  read through the core's ``Layout`` and audit.

The audit runs before anything is dequantised: a missing tensor, an unexpected
one, a wrong shape or an unsupported type stops the load, naming the tensor.
Q, K and V are stacked into one ``qkv`` Linear and gate and up into one
``gate_up`` (fewer, larger matmuls); every weight is a ``Linear`` made through
the registered weight formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem_core.checkpoint.audit import AuditError, Expect, audit
from tandem_core.checkpoint.layout import Layout
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint
from tandem_core.linear import Linear, make_linear
from tandem_llama.config import LlamaConfig
from tandem_llama.formats import FORMAT_OF_QTYPE, FORMATS, GGMLWeight, as_raw, concat_rows
from tandem_llama.gguf_reader import GGUFFile, GGUFTensor

__all__ = [
    "DenseEmbedding",
    "LayerWeights",
    "LlamaWeights",
    "audit_gguf",
    "gguf_expected",
    "load_gguf",
    "load_hf",
    "qk_unpermute",
]

Progress = Callable[[int, int, str], None]


class DenseEmbedding:
    """A dense embedding table ``[V, H]`` on a device: ``rows(ids)`` is the lookup (``GGMLWeight``'s verb)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.shape = (int(table.shape[0]), int(table.shape[1]))
        self.nbytes = table.numel() * table.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.table)

    def dense(self) -> torch.Tensor:
        return self.table


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H] fp32
    qkv: Linear  # [q_dim + 2 kv_dim, H]
    o: Linear  # [H, q_dim]
    mlp_norm: torch.Tensor  # [H] fp32
    gate_up: Linear  # [2 I, H]: gate rows then up rows
    down: Linear  # [H, I]


@dataclass(frozen=True)
class LlamaWeights:
    embed: GGMLWeight | DenseEmbedding  # [V, H]; ``rows(ids)`` is the lookup
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H] fp32
    lm_head: Linear  # [V, H] (the embedding itself when tied)
    rope_freqs: torch.Tensor | None  # [head_dim / 2] frequency divisors (GGUF rope_freqs.weight), or None
    files: tuple[Path, ...]
    formats: dict[str, int]  # tensors read per format
    head_tied: bool
    dense: bool

    def nbytes(self) -> int:
        """Bytes held for the weights (each shared tensor once)."""
        seen: set[int] = set()
        total = 0
        items: list[Any] = [self.embed, self.lm_head, self.norm]
        for lw in self.layers:
            items += [lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down]
        for it in items:
            if id(it) in seen:
                continue
            seen.add(id(it))
            total += it.numel() * it.element_size() if isinstance(it, torch.Tensor) else _held(it)
        return total


def _held(lin: Any) -> int:
    return int(lin.nbytes)


def on_device(w: LlamaWeights, device: str, dtype: torch.dtype,
              progress: Progress | None = None) -> LlamaWeights:
    """``w`` with every weight dense on ``device`` in ``dtype`` (the GPU path multiplies dense weights:
    ``tandem_core.ops.cuda_backend``'s row-invariant kernel for bf16, cuBLAS row by row otherwise), one tensor
    at a time so the host holds one dequantised copy at most; ``progress`` gets bytes moved to the device."""
    from tandem_core.linear import DenseLinear

    total = w.nbytes() // 4 * torch.empty(0, dtype=dtype).element_size()
    moved = 0

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        out = t.to(device=device, dtype=dtype)
        moved += out.numel() * out.element_size()
        if progress is not None:
            progress(min(moved, total), total, f"to {device}")
        return out

    embed = DenseEmbedding(move(w.embed.dense()))
    layers = tuple(LayerWeights(attn_norm=move(lw.attn_norm), qkv=DenseLinear(move(lw.qkv.dense())),
                                o=DenseLinear(move(lw.o.dense())), mlp_norm=move(lw.mlp_norm),
                                gate_up=DenseLinear(move(lw.gate_up.dense())), down=DenseLinear(move(lw.down.dense())))
                   for lw in w.layers)
    head = DenseLinear(embed.table) if w.head_tied else DenseLinear(move(w.lm_head.dense()))
    rope = None if w.rope_freqs is None else w.rope_freqs.to(device)
    return LlamaWeights(embed=embed, layers=layers, norm=move(w.norm), lm_head=head, rope_freqs=rope,
                        files=w.files, formats=dict(w.formats), head_tied=w.head_tied, dense=True)


def qk_unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``hf_rows = gguf_rows[perm]`` (transformers'
    ``reverse_permute_weights``: each head's rows ``[dim, 2]`` read as ``[2, dim]``)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


# -- GGUF ----------------------------------------------------------------------------------------

_GGUF_LAYER = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def gguf_expected(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (torch order) for every tensor the engine reads (``output.weight``
    only when the head is not tied)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (v, h)
    shapes = {
        "attn_norm": (h,),
        "attn_q": (cfg.q_dim, h),
        "attn_k": (cfg.kv_dim, h),
        "attn_v": (cfg.kv_dim, h),
        "attn_output": (h, cfg.q_dim),
        "ffn_norm": (h,),
        "ffn_gate": (i, h),
        "ffn_up": (i, h),
        "ffn_down": (h, i),
    }
    for n in range(cfg.num_layers):
        for part in _GGUF_LAYER:
            out[f"blk.{n}.{part}.weight"] = shapes[part]
    return out


def audit_gguf(gf: GGUFFile, cfg: LlamaConfig) -> None:
    """Every tensor the config needs, of its shape and a readable type; no tensor the engine would ignore."""
    expected = gguf_expected(cfg)
    tensors = gf.tensors
    optional = {"rope_freqs.weight": (cfg.head_dim // 2,)}
    for name in tensors:
        if name not in expected and name not in optional:
            raise AuditError(
                f"{gf.path.name}: tensor {name!r} is not part of a Llama model this plugin reads"
            )
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AuditError(f"{gf.path.name} is missing tensor {missing[0]!r}{more}")
    for name, t in tensors.items():
        want = expected.get(name) or optional[name]
        if tuple(t.shape) != tuple(want):
            raise AuditError(
                f"{gf.path.name}: tensor {name!r} has shape {list(t.shape)}, the config needs {list(want)}"
            )
        if t.qtype not in FORMAT_OF_QTYPE:
            raise AuditError(
                f"{gf.path.name}: tensor {name!r} is {t.qtype}; tandem-llama reads "
                f"{', '.join(FORMAT_OF_QTYPE)}"
            )
        if len(t.shape) == 1 and t.qtype not in ("F32", "F16", "BF16"):
            raise AuditError(f"{gf.path.name}: vector {name!r} is {t.qtype}, expected a float type")


def _vector(t: GGUFTensor) -> torch.Tensor:
    raw = as_raw(t.data).reshape(1, -1)
    return FORMATS[FORMAT_OF_QTYPE[t.qtype]](raw, dense=True).dense().reshape(-1).clone()


def _stacked(parts: list[tuple[str, torch.Tensor]], *, dense: bool) -> Any:
    """Stack raw row blocks of the same format into one Linear (exact); mixed formats go through
    ``concat_rows``."""
    fmts = {f for f, _ in parts}
    if len(fmts) == 1:
        fmt = fmts.pop()
        return make_linear(fmt, torch.cat([r for _, r in parts], dim=0), dense=dense)
    return concat_rows([make_linear(f, r, dense=dense) for f, r in parts], dense=dense)


def load_gguf(
    gf: GGUFFile, cfg: LlamaConfig, *, dense: bool = True, progress: Progress | None = None
) -> LlamaWeights:
    """Audit, then build every Linear (the Q/K rows un-permuted to Hugging Face's order)."""
    audit_gguf(gf, cfg)
    tensors = gf.tensors
    total = sum(t.nbytes for t in tensors.values())
    done = 0
    counts: dict[str, int] = {}

    def raw(name: str) -> tuple[str, torch.Tensor]:
        nonlocal done
        t = tensors[name]
        counts[t.qtype] = counts.get(t.qtype, 0) + 1
        done += t.nbytes
        if progress is not None:
            progress(done, total, "weights")
        fmt = FORMAT_OF_QTYPE[t.qtype]
        return fmt, as_raw(t.data)

    def vector(name: str) -> torch.Tensor:
        nonlocal done
        t = tensors[name]
        counts[t.qtype] = counts.get(t.qtype, 0) + 1
        done += t.nbytes
        return _vector(t)

    layers = []
    for n in range(cfg.num_layers):
        p = f"blk.{n}."
        fq, q = raw(p + "attn_q.weight")
        fk, k = raw(p + "attn_k.weight")
        q = q[qk_unpermute(cfg.q_dim, cfg.num_heads)]
        k = k[qk_unpermute(cfg.kv_dim, cfg.num_kv_heads)]
        qkv = _stacked([(fq, q), (fk, k), raw(p + "attn_v.weight")], dense=dense)
        o = make_linear(*raw(p + "attn_output.weight"), dense=dense)
        gate_up = _stacked([raw(p + "ffn_gate.weight"), raw(p + "ffn_up.weight")], dense=dense)
        down = make_linear(*raw(p + "ffn_down.weight"), dense=dense)
        layers.append(
            LayerWeights(vector(p + "attn_norm.weight"), qkv, o, vector(p + "ffn_norm.weight"), gate_up, down)
        )
    embed = make_linear(*raw("token_embd.weight"), dense=dense)
    head = embed if cfg.tie_word_embeddings else make_linear(*raw("output.weight"), dense=dense)
    rope_freqs = vector("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    return LlamaWeights(
        embed,
        tuple(layers),
        vector("output_norm.weight"),
        head,
        rope_freqs,
        (gf.path,),
        counts,
        cfg.tie_word_embeddings,
        dense,
    )


# -- Hugging Face safetensors ---------------------------------------------------------------------

_DTYPE_FORMAT = {torch.float32: "ggml.f32", torch.float16: "ggml.f16", torch.bfloat16: "ggml.bf16"}
_HF_IGNORED_SUFFIX = ("rotary_emb.inv_freq",)


def hf_expected(cfg: LlamaConfig) -> dict[str, Expect]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out = {
        "embed_tokens.weight": Expect((v, h)),
        "norm.weight": Expect((h,)),
        "lm_head.weight": Expect((v, h)),
    }
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        out.update(
            {
                p + "input_layernorm.weight": Expect((h,)),
                p + "post_attention_layernorm.weight": Expect((h,)),
                p + "self_attn.q_proj.weight": Expect((cfg.q_dim, h)),
                p + "self_attn.k_proj.weight": Expect((cfg.kv_dim, h)),
                p + "self_attn.v_proj.weight": Expect((cfg.kv_dim, h)),
                p + "self_attn.o_proj.weight": Expect((h, cfg.q_dim)),
                p + "mlp.gate_proj.weight": Expect((i, h)),
                p + "mlp.up_proj.weight": Expect((i, h)),
                p + "mlp.down_proj.weight": Expect((h, i)),
            }
        )
    return out


def load_hf(
    directory: str | Path, cfg: LlamaConfig, *, dense: bool = True, progress: Progress | None = None
) -> LlamaWeights:
    ckpt = SafetensorsCheckpoint(directory)
    try:
        res = Layout().resolve(ckpt.keys(), cfg.tie_word_embeddings)
    except ValueError as exc:
        raise AuditError(f"{ckpt.dir}: {exc}") from None
    expected = hf_expected(cfg)
    for canon, key in res.names.items():
        if canon not in expected and not canon.endswith(_HF_IGNORED_SUFFIX):
            raise AuditError(f"{ckpt.dir}: tensor {key!r} is not part of a Llama model this plugin reads")
    audit(ckpt, expected, res.names)
    total = sum(ckpt.info(res.names[c]).end - ckpt.info(res.names[c]).begin for c in expected)
    done = 0
    counts: dict[str, int] = {}

    def raw(canon: str) -> tuple[str, torch.Tensor]:
        nonlocal done
        info = ckpt.info(res.names[canon])
        t = ckpt.get(info.key)
        fmt = _DTYPE_FORMAT[t.dtype]
        counts[fmt] = counts.get(fmt, 0) + 1
        done += info.end - info.begin
        if progress is not None:
            progress(done, total, "weights")
        return fmt, t

    def vector(canon: str) -> torch.Tensor:
        return raw(canon)[1].to(torch.float32)

    layers = []
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        qkv = _stacked(
            [
                raw(p + "self_attn.q_proj.weight"),
                raw(p + "self_attn.k_proj.weight"),
                raw(p + "self_attn.v_proj.weight"),
            ],
            dense=dense,
        )
        o = make_linear(*raw(p + "self_attn.o_proj.weight"), dense=dense)
        gate_up = _stacked([raw(p + "mlp.gate_proj.weight"), raw(p + "mlp.up_proj.weight")], dense=dense)
        down = make_linear(*raw(p + "mlp.down_proj.weight"), dense=dense)
        layers.append(
            LayerWeights(
                vector(p + "input_layernorm.weight"),
                qkv,
                o,
                vector(p + "post_attention_layernorm.weight"),
                gate_up,
                down,
            )
        )
    embed = make_linear(*raw("embed_tokens.weight"), dense=dense)
    head = embed if res.head_tied else make_linear(*raw("lm_head.weight"), dense=dense)
    return LlamaWeights(
        embed,
        tuple(layers),
        vector("norm.weight"),
        head,
        None,
        tuple(ckpt.iter_files()),
        counts,
        res.head_tied,
        dense,
    )
