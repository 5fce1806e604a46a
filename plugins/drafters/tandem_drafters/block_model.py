"""The block drafter's checkpoint and model (``tandem_drafters.block`` is the drafter and documents the design):
its config (the published DFlash layout, read strictly), the layers, and reading, writing, finding and fetching
its files."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem_core.drafter import TargetInfo

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "WEIGHTS_FILE", "Attention", "BlockConfig", "BlockDrafterError", "BlockModel",
           "Layer", "MLP", "RMSNorm", "default_layers", "fetch_published", "find_checkpoint", "load_checkpoint",
           "read_config", "rope", "save_checkpoint"]


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"


class BlockDrafterError(ValueError):
    """A block drafter checkpoint that is missing, malformed or not runnable (the message names the file and
    the field)."""


@dataclass(frozen=True)
class BlockConfig:
    """A block drafter's shape and what it was built for. ``hidden_size`` is the target's (the block is embedded
    with the target's embedding and read through its head)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    num_target_layers: int = 0
    output_multiplier: float = 1.0
    logit_softcap: float = 0.0
    embed_scale: float = 1.0
    target: str = ""                 # the target's model id (drafters trained here)
    tokenizer: str | None = None     # the target tokenizer's sha256 (drafters trained here)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)   # training record, kept as is

    def to_json(self) -> dict[str, Any]:
        """The published DFlash layout's config.json (a Qwen3 config with ``dflash_config``) plus ``tandem``."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "attention_bias": self.attention_bias,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
        }
        if self.output_multiplier != 1.0:
            out["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.logit_softcap:
            out["dflash_config"]["final_logit_softcapping"] = self.logit_softcap
        if self.embed_scale != 1.0:
            out["dflash_config"]["input_embedding_scale"] = self.embed_scale
        out["tandem"] = {"target": self.target, "tokenizer_sha256": self.tokenizer, **self.extra}
        return out


def default_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` layers spread evenly from layer 1 to layer ``L - 3`` (shallow to deep, as DFlash picks them)."""
    if num_target_layers < 1 or count < 1:
        raise ValueError(f"default_layers: need positive counts, got {num_target_layers} layers and {count}")
    lo, hi = min(1, num_target_layers - 1), max(min(1, num_target_layers - 1), num_target_layers - 3)
    if count == 1:
        return (hi,)
    return tuple(sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}))


def _field(d: Mapping[str, Any], key: str, where: str, kind: type, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise BlockDrafterError(f"{where}: field {key!r} is missing")
        return default
    v = d[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if kind is int and isinstance(v, bool) or not isinstance(v, kind):
        raise BlockDrafterError(f"{where}: field {key!r} must be {kind.__name__}, got {v!r}")
    return v


def read_config(folder: Path | str) -> BlockConfig:
    """The ``config.json`` of a block drafter folder (published DFlash layout, or one trained here)."""
    path = Path(folder) / CONFIG_FILE
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise BlockDrafterError(f"{path}: no such file (a block drafter folder holds {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE})") from None
    except (OSError, ValueError) as exc:
        raise BlockDrafterError(f"{path}: not readable JSON ({exc})") from None
    where = str(path)
    if not isinstance(d, dict):
        raise BlockDrafterError(f"{where}: not a JSON object")
    arch = d.get("architectures") or [ARCHITECTURE]
    if arch != [ARCHITECTURE]:
        raise BlockDrafterError(f"{where}: field 'architectures' is {arch}; only {ARCHITECTURE} (DFlash) runs here")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise BlockDrafterError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' runs here")
    types = d.get("layer_types") or []
    if any(t != "full_attention" for t in types) or d.get("use_sliding_window"):
        raise BlockDrafterError(f"{where}: field 'layer_types' asks for sliding-window attention, which this "
                                "block drafter does not run")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise BlockDrafterError(f"{where}: field 'rope_parameters' must be an object")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise BlockDrafterError(f"{where}: field 'rope_parameters.rope_type' is {rope.get('rope_type')!r}; only "
                                "'default' runs here")
    dc = d.get("dflash_config", {})
    if not isinstance(dc, dict):
        raise BlockDrafterError(f"{where}: field 'dflash_config' must be an object")
    dwhere = where + " dflash_config"
    layers = dc.get("target_layer_ids", d.get("target_layer_ids"))
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise BlockDrafterError(f"{dwhere}: field 'target_layer_ids' must be a non-empty list of layer indices")
    both = {**d, **dc}
    mask = _field(both, "mask_token_id", dwhere, int)
    hidden = _field(d, "hidden_size", where, int)
    heads = _field(d, "num_attention_heads", where, int)
    theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise BlockDrafterError(f"{where}: field 'rope_theta' must be a positive number")
    tandem = d.get("tandem") or {}
    if not isinstance(tandem, dict):
        raise BlockDrafterError(f"{where}: field 'tandem' must be an object")
    tok = tandem.get("tokenizer_sha256")
    if tok is not None and not (isinstance(tok, str) and len(tok) == 64):
        raise BlockDrafterError(f"{where}: field 'tandem.tokenizer_sha256' must be a sha256 (64 hex digits)")
    cfg = BlockConfig(
        hidden_size=hidden,
        num_layers=_field(d, "num_hidden_layers", where, int),
        num_heads=heads,
        num_kv_heads=_field(d, "num_key_value_heads", where, int, heads),
        head_dim=_field(d, "head_dim", where, int, hidden // max(heads, 1)),
        intermediate_size=_field(d, "intermediate_size", where, int),
        vocab_size=_field(d, "vocab_size", where, int),
        target_layer_ids=tuple(layers),
        mask_token_id=mask,
        block_size=_field(both, "block_size", dwhere, int, 16),
        rms_norm_eps=_field(d, "rms_norm_eps", where, float, 1e-6),
        rope_theta=float(theta),
        attention_bias=_field(d, "attention_bias", where, bool, False),
        num_target_layers=_field(d, "num_target_layers", where, int, 0),
        output_multiplier=_field(dc, "output_multiplier", dwhere, float, 1.0),
        logit_softcap=float(_field(dc, "final_logit_softcapping", dwhere, float, 0.0) or 0.0),
        embed_scale=_field(dc, "input_embedding_scale", dwhere, float, 1.0),
        target=str(tandem.get("target", "")),
        tokenizer=tok,
        extra={k: v for k, v in tandem.items() if k not in ("target", "tokenizer_sha256")},
    )
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "block_size"):
        if getattr(cfg, name) < 1:
            raise BlockDrafterError(f"{where}: {name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise BlockDrafterError(f"{where}: num_attention_heads {cfg.num_heads} is not a multiple of "
                                f"num_key_value_heads {cfg.num_kv_heads}")
    if cfg.block_size < 2:
        raise BlockDrafterError(f"{where}: block_size must be at least 2, got {cfg.block_size}")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise BlockDrafterError(f"{dwhere}: mask_token_id {cfg.mask_token_id} is outside the vocabulary "
                                f"({cfg.vocab_size})")
    return cfg


# -- the model ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention: ``x [..., T, D]``, ``cos, sin [T, D]``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        H, nh, nkv, hd, b = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=b)
        self.k_proj = nn.Linear(H, nkv * hd, bias=b)
        self.v_proj = nn.Linear(H, nkv * hd, bias=b)
        self.o_proj = nn.Linear(nh * hd, H, bias=b)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of rows ``x [T, H]``: ``[nkv, T, hd]`` each."""
        T = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(x).view(T, self.nkv, self.hd).transpose(0, 1)
        return rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # x: [Q, H] block rows; ctx_k, ctx_v: [nkv, C, hd]; mask: [Q, C + Q] bool (True: attend) or None (all)
        Q = x.shape[0]
        q = rope(self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd)).transpose(0, 1), cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
        g = self.nh // self.nkv
        if g > 1:
            k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)            # [nh, Q, hd]
        return self.o_proj(a.transpose(0, 1).reshape(Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class BlockModel(nn.Module):
    """The drafter's own weights; parameter names are the published layout's tensor names."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, hd]`` at ``positions [T]``, in the weights' dtype."""
        f = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([f, f], dim=-1)
        dt = self.fc.weight.dtype
        return emb.cos().to(dt), emb.sin().to(dt)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """``[T, len(layers) * H]`` (the target's rows, concatenated in ``target_layer_ids`` order) -> ``[T, H]``."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the projected context rows ``ctx [T, H]`` at ``positions [T]``."""
        cos, sin = self.rope_at(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self._layers()]

    def _layers(self) -> list[Layer]:
        return [cast(Layer, layer) for layer in self.layers]

    def blocks(self, x: torch.Tensor, ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block rows ``x [Q, H]`` (embedded) at ``positions [Q]`` through every layer, over each layer's
        context keys/values; ``mask [Q, C + Q]`` (True: attend) or None (every row sees everything).
        Returns the rows after the final norm, ``[Q, H]``."""
        cos, sin = self.rope_at(positions)
        for layer, (ck, cv) in zip(self._layers(), ctx_kv):
            x = x + layer.self_attn(layer.input_layernorm(x), ck, cv, cos, sin, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, h: torch.Tensor, head: Any) -> torch.Tensor:
        """fp32 logits of final rows ``h`` through the target's head (``head(h) -> [T, V]``)."""
        out = head(h).float() * self.cfg.output_multiplier
        cap = self.cfg.logit_softcap
        return torch.tanh(out / cap) * cap if cap > 0 else out


# -- files ----------------------------------------------------------------------------------------------------


def _expected(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in BlockModel(cfg).state_dict().items()}


def load_checkpoint(folder: Path | str, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> BlockModel:
    """A ``BlockModel`` from a folder in the published layout; refuses a missing, extra or misshapen tensor by
    name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise BlockDrafterError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BlockDrafterError(f"{path}: not a readable safetensors file ({exc})") from None
    want = _expected(cfg)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise BlockDrafterError(f"{path}: tensor {missing[0]!r} is missing ({len(missing)} missing)")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise BlockDrafterError(f"{path}: tensor {extra[0]!r} is not part of a {ARCHITECTURE} of this config "
                                "(a DFlash2 or another layout?)")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise BlockDrafterError(f"{path}: tensor {k!r} has shape {list(tensors[k].shape)}, the config needs "
                                    f"{list(shape)}")
    model = BlockModel(cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def save_checkpoint(model: BlockModel, folder: Path | str, *, dtype: torch.dtype | None = None,
                    cfg: BlockConfig | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (atomically: temporary names, then renamed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = cfg or model.cfg
    state = {k: (v.detach().to("cpu", dtype or v.dtype)).contiguous() for k, v in model.state_dict().items()}
    tmp_w, tmp_c = folder / (WEIGHTS_FILE + ".part"), folder / (CONFIG_FILE + ".part")
    save_file(state, str(tmp_w), metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    tmp_w.replace(folder / WEIGHTS_FILE)
    tmp_c.replace(folder / CONFIG_FILE)
    return folder


def find_checkpoint(target: TargetInfo) -> Path | None:
    """Where the block drafter for ``target`` is: ``TANDEM_BLOCK_DRAFTER``, else the drafter the model's registry
    entry ships (``drafters.block``), pulled beside the model (``tandem pull``); None when neither is there."""
    from tandem_core.settings import SETTINGS

    set_ = str(SETTINGS.get("BLOCK_DRAFTER") or "")
    if set_:
        return Path(set_).expanduser()
    if not target.name:
        return None
    from tandem_core import catalog, pull

    try:
        e = catalog.entry(target.name)
    except catalog.ModelNotFound:
        return None
    return pull.drafter_path(e.data, "block")


def fetch_published(repo: str, into: Path | str) -> Path:
    """Download a published DFlash drafter (``config.json`` + ``model.safetensors`` of a Hugging Face repository
    such as ``z-lab/Qwen3-8B-DFlash-b16``) into ``into``; fails with one clear line without a network."""
    into = Path(into)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise BlockDrafterError(f"fetching {repo} needs huggingface_hub (pip install huggingface_hub), or download "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE} by hand into {into}") from None
    into.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            hf_hub_download(repo, name, local_dir=str(into))
        except Exception as exc:  # noqa: BLE001  (every hub failure: offline, no such repo, refused: one line)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BlockDrafterError(f"could not download {name} of {repo} from the Hugging Face hub ({first}); "
                                    f"with no network, copy {CONFIG_FILE} and {WEIGHTS_FILE} into {into} by hand"
                                    ) from None
    read_config(into)
    return into
