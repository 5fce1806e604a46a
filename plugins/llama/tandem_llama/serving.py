"""``serve(args, ctx) -> Served`` for a Llama model: a ``.gguf`` file or a Hugging Face checkpoint directory.

From a GGUF file everything comes from the file: the config (``llama.*``), the
weights, the tokenizer (rebuilt from ``tokenizer.ggml.*``) and the chat
template (``tokenizer.chat_template``). From a directory: ``config.json``, the
safetensors shards, ``tokenizer.json`` and the template of
``tokenizer_config.json`` / ``chat_template.jinja``. A directory holding no
``config.json`` and exactly one ``.gguf`` file serves that file.

Llama models write tool calls in the Hermes JSON form and no ``<think>`` block.
Options read (``ServeArgs.options``): ``max_tree``, the widest tree one verify
carries (default 64); ``graphs`` (default on), off to run the CUDA path without CUDA graphs.

On the CPU the engine computes in fp32 over the file's own formats. On a CUDA
device (``args.device``) the weights are read lean (quantised, as stored) and
moved one tensor at a time, dense in ``args.dtype`` (bf16 or fp32), to the device
(``weights.on_device``): the host never holds more than one dequantised tensor.
There the runner is ``LlamaCudaRunner`` (decode and verify captured as CUDA graphs over static
buffers) when its kernels read the weights (bf16, Triton; ``cuda_runner.unsupported`` says why
not otherwise), else the eager ``LlamaRunner`` (``make_runner``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem_core.engine import Engine, SequenceEngine
from tandem_core.serving import ServeArgs, ServeContext, Served
from tandem_core.settings import SETTINGS
from tandem_core.tokenizer import HFTokenizer, load_chat_template
from tandem_llama.config import LlamaConfig, config_of, from_hf
from tandem_llama.gguf_reader import GGUFFile, build_tokenizer, stop_ids
from tandem_llama.model import LlamaRunner
from tandem_llama.weights import LlamaWeights, load_gguf, load_hf, on_device

__all__ = ["build_engine", "make_runner", "resolve_path", "serve"]


def make_runner(cfg: LlamaConfig, weights: LlamaWeights, *, graphs: bool = True, cuda_runner: bool | None = None,
                **kw: Any) -> LlamaRunner:
    """The runner for where the weights are: ``LlamaCudaRunner`` (CUDA graphs unless ``graphs`` is off) on a CUDA
    device whose weights its kernels read when ``cuda_runner`` (default: the ``LLAMA_CUDA_RUNNER`` setting, off
    until the runner is proven on a GPU), else the eager ``LlamaRunner`` (the CPU's, and the reference).
    ``kw``: the runners' own arguments (``max_context``, ``prefill_chunk``, ``max_tree``, ``device``)."""
    from tandem_core.settings import SETTINGS
    from tandem_llama.cuda_runner import unsupported

    if cuda_runner is None:
        cuda_runner = bool(SETTINGS.get("LLAMA_CUDA_RUNNER"))
    if (cuda_runner and torch.device(kw.get("device", "cpu")).type == "cuda"
            and unsupported(cfg, weights) is None):
        from tandem_llama.cuda_runner import LlamaCudaRunner

        return LlamaCudaRunner(cfg, weights, graphs=graphs, **kw)
    return LlamaRunner(cfg, weights, **kw)


def build_engine(cfg: LlamaConfig, weights: LlamaWeights, *, graphs: bool = True, **kw: Any) -> SequenceEngine:
    """A ``SequenceEngine`` over ``make_runner(cfg, weights, graphs=graphs, **kw)`` (its own buffers, shared
    weights)."""
    return SequenceEngine(make_runner(cfg, weights, graphs=graphs, **kw), name="llama")


def resolve_path(path: str | Path) -> tuple[str, Path]:
    """``("gguf", file)`` or ``("hf", directory)``; fails naming the path when it is neither."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p}: a model file must be a .gguf file")
        return "gguf", p
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
        raise ValueError(f"{p}: no config.json and {found}: cannot tell which model to load")
    raise FileNotFoundError(f"{p}: no such model file or directory")


def serve(args: ServeArgs, ctx: ServeContext) -> Served:
    device = torch.device(args.device)
    dtypes = {"cpu": {"fp32": torch.float32}, "cuda": {"bf16": torch.bfloat16, "fp32": torch.float32}}
    if args.dtype not in dtypes.get(device.type, {}):
        raise ValueError(f"tandem-llama cannot run {args.dtype} on {args.device}: it runs fp32 on cpu; "
                         f"bf16, fp32 on cuda")
    if args.threads:
        torch.set_num_threads(int(args.threads))
    on_cuda = device.type == "cuda"
    dense = bool(SETTINGS.get("LLAMA_DENSE")) and not on_cuda     # on CUDA: read lean, dequantise on the way
    chunk = int(SETTINGS.get("LLAMA_PREFILL_CHUNK"))
    max_tree = int(args.options.get("max_tree", 64))
    graphs = str(args.options.get("graphs", "1")).lower() not in ("0", "false", "no", "off")
    kind, path = resolve_path(args.path)
    ctx.mark("open")
    tokenizer: HFTokenizer
    if kind == "gguf":
        gf = GGUFFile(path)
        cfg = config_of(gf)
        spec = gf.tokenizer_spec()
        ctx.mark("config")
        tokens = spec.tokens
        tokenizer = HFTokenizer(
            build_tokenizer(spec, where=path.name),
            eos_tokens=[tokens[spec.eos_id]] if spec.eos_id is not None else [],
            bos_token=tokens[spec.bos_id] if spec.bos_id is not None else None,
            extra_eos_ids=stop_ids(spec),
        )
        template = gf.chat_template
        ctx.mark("tokenizer")
        weights = load_gguf(gf, cfg, dense=dense, progress=ctx.progress)
    else:
        import json

        cfg = from_hf(json.loads((path / "config.json").read_text()), where=str(path / "config.json"))
        ctx.mark("config")
        tokenizer = HFTokenizer.from_dir(path)
        if cfg.eos_token_ids:
            tokenizer.eos_token_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *cfg.eos_token_ids]))
        template = load_chat_template(path)
        ctx.mark("tokenizer")
        weights = load_hf(path, cfg, dense=dense, progress=ctx.progress)
    if on_cuda:
        weights = on_device(weights, str(device), dtypes["cuda"][args.dtype], progress=ctx.progress)
    ctx.mark("weights")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"{path.name}: the tokenizer has {tokenizer.vocab_size} tokens, the model's embedding "
            f"{cfg.vocab_size}"
        )
    max_ctx = min(int(args.max_context) or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if max_ctx < int(args.max_context):
        ctx.log(f"llama: context capped at the model's {cfg.max_position_embeddings} tokens")

    def spawn() -> Engine:
        return build_engine(cfg, weights, max_context=max_ctx, prefill_chunk=chunk, max_tree=max_tree,
                            device=str(device), graphs=graphs)

    engine = spawn()
    ctx.mark("engine")
    if template is None:
        ctx.log(f"llama: {path.name} carries no chat template; chat requests cannot be rendered")
    info = _info(kind, path, cfg, weights, engine, tokenizer, ctx)
    return Served(
        model_id=args.model_id,
        engine=engine,
        tokenizer=tokenizer,
        chat_template=template or "",
        tool_format="hermes_json",
        reasoning=False,
        think_in_prompt=False,
        stop_ids=tuple(tokenizer.eos_token_ids),
        info=info,
        spawn=spawn,
    )


def _info(
    kind: str,
    path: Path,
    cfg: LlamaConfig,
    weights: LlamaWeights,
    engine: Engine,
    tokenizer: HFTokenizer,
    ctx: ServeContext,
) -> dict[str, Any]:
    """The record ``/health`` shows."""
    return {
        "family": "llama",
        "format": "gguf" if kind == "gguf" else "safetensors",
        "device": engine.caps.device,
        "dtype": engine.caps.dtype,
        "path": str(path),
        "weights": {
            "files": [{"name": p.name, "bytes": p.stat().st_size} for p in weights.files],
            "formats": dict(weights.formats),
            "dense_fp32": weights.dense,
            "held_bytes": weights.nbytes(),
            "head_tied": weights.head_tied,
        },
        "config": {
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab": cfg.vocab_size,
            "max_context": engine.caps.max_context,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.kind,
        },
        "fingerprints": {"tokenizer": tokenizer.fingerprint(), "manifest": engine.manifest().fingerprint()},
        "load_stages": list(ctx.stages),
        "memory_parts": [p._asdict() for p in engine.memory_parts()],
    }
