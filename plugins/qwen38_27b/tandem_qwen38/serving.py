"""``serve(args, ctx) -> Served``: everything the server needs for a Qwen3.5-architecture checkpoint.

Stages (each marked on ``ctx``): ``config`` (strict read of config.json),
``audit`` (headers, layout and audit: nothing loaded yet), ``weights`` (every
tensor, ``ctx.progress`` per tensor), ``engine`` (buffers for ``max_context``),
``tokenizer`` (tokenizer.json and the chat template). The model writes a
``<think>`` block (``reasoning``) and tool calls in Qwen's XML form
(``tool_format="qwen_xml"``). ``spawn`` builds another engine over the same
weight objects with its own buffers. Options read: ``prefill_chunk`` (default the
``QWEN38_PREFILL_CHUNK`` setting; 0 there: ``prefill_chunk_for`` the device) and ``max_tree`` (the widest
verify, default 64).

A checkpoint's MTP head (``mtp.*``, ``tandem_qwen38.mtp``) is audited with the rest, loaded beside the
target and offered through the engine (``caps.mtp``, ``mtp_head()``), each engine with the head's own KV
rows (its CUDA graphs beside the CUDA graph runner, ``tandem_qwen38.mtp_cuda``); ``--spec mtp`` drafts with it
(``tandem_drafters.mtp``), and ``--spec auto`` includes it where its drafts are graphs or on the CPU
(``tandem_core.server.speculation.resolve_drafters``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tandem_core.checkpoint import hfdir
from tandem_core.checkpoint.hfdir import ServeError
from tandem_core.engine import Runner, SequenceEngine
from tandem_core.serving import ServeArgs, ServeContext, Served
from tandem_core.settings import SETTINGS
from tandem_core.tokenizer import HFTokenizer, load_chat_template

from tandem_qwen38.config import Qwen38Config, read_config
from tandem_qwen38.model import Qwen38Runner
from tandem_qwen38.mtp import MTPHead, MTPWeights, load_mtp
from tandem_qwen38.weights import Qwen38Weights, load_weights, normalise_dtype, open_checkpoint

__all__ = ["serve", "ServeError", "think_in_prompt", "build_engine", "make_runner", "make_head", "prefill_chunk_for",
           "CPU_PREFILL_CHUNK", "CUDA_PREFILL_CHUNK"]

CPU_PREFILL_CHUNK = 512      # the CPU path's chunk (memory for the chunk's activations stays small)
CUDA_PREFILL_CHUNK = 8192    # the CUDA path's (H200, 27B shape: 11,000 tok/s at 8K against 10,977 in chunks of 4096)


def make_runner(cfg: Qwen38Config, weights: Qwen38Weights, *, max_context: int, prefill_chunk: int,
                gdn_chunk: int = 64, max_tree: int = 64) -> Runner:
    """The runner for where the weights are: the CUDA graph runner on a CUDA device with Triton and weights
    its kernels read (bf16 dense; ``cuda_graphs.unsupported`` says why not otherwise), else the
    plain-torch reference runner. On a CUDA device the CUDA kernels of the reference ops are registered
    too (``tandem_core.ops.cuda_backend``)."""
    if weights.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from tandem_core.ops import cuda_backend
        from tandem_qwen38.cuda_graphs import unsupported

        cuda_backend.install()
        if unsupported(cfg, weights) is None:
            from tandem_qwen38.cuda_runner import Qwen38CudaRunner

            return Qwen38CudaRunner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk,
                                    max_tree=max_tree)
    return Qwen38Runner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk,
                        gdn_chunk=gdn_chunk, max_tree=max_tree)


def build_engine(cfg: Qwen38Config, weights: Qwen38Weights, max_context: int, prefill_chunk: int,
                 max_tree: int = 64, gdn_chunk: int = 64, mtp: MTPWeights | None = None) -> SequenceEngine:
    """The core's sequence engine over the runner for the weights' device (``make_runner``); with ``mtp`` (the
    checkpoint's head) it offers the head, with KV rows of its own for ``max_context`` positions."""
    runner = make_runner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk, gdn_chunk=gdn_chunk,
                         max_tree=max_tree)
    return SequenceEngine(runner, name="qwen3_5", head=None if mtp is None else make_head(cfg, weights, mtp, runner,
                                                                                          max_context))


def make_head(cfg: Qwen38Config, weights: Qwen38Weights, mtp: MTPWeights, runner: Runner,
              max_context: int) -> MTPHead:
    """The MTP head beside ``runner``: its CUDA graphs (``tandem_qwen38.mtp_cuda``) beside the CUDA graph runner
    (the same kernels read it; a commit's rows fit its widths), else the plain-torch head."""
    from tandem_qwen38.cuda_runner import Qwen38CudaRunner      # imports no kernel: Triton loads at a first build

    if isinstance(runner, Qwen38CudaRunner):
        from tandem_qwen38.mtp_cuda import CudaMTPHead

        return CudaMTPHead(cfg, weights, mtp, max_context=max_context, widths=runner.spec.graph_widths)
    return MTPHead(cfg, weights, mtp, max_context=max_context)


def prefill_chunk_for(requested: int, device: Any) -> int:
    """The prefill chunk: ``requested`` when positive, else the device's default (``CUDA_PREFILL_CHUNK`` on a
    CUDA device, ``CPU_PREFILL_CHUNK`` elsewhere)."""
    return hfdir.prefill_chunk_for(requested, device, cpu=CPU_PREFILL_CHUNK, cuda=CUDA_PREFILL_CHUNK)


def serve(args: ServeArgs, ctx: ServeContext) -> Served:
    """Load the checkpoint at ``args.path`` and build the engine, the tokenizer and the template."""
    d = Path(args.path)
    cfg = read_config(hfdir.read_config_json(d, "qwen3_5"))
    dtype = normalise_dtype(args.dtype)
    ctx.mark("config")

    ckpt = open_checkpoint(d, cfg)
    ctx.mark("audit")
    weights = load_weights(ckpt, cfg, dtype, args.device, progress=ctx.progress)
    mtp = load_mtp(ckpt, cfg, dtype, args.device)
    ctx.mark("weights")

    max_context = hfdir.context_for(args.max_context, cfg.max_position_embeddings, ctx)
    prefill_chunk = prefill_chunk_for(int(args.options.get("prefill_chunk", SETTINGS.get("QWEN38_PREFILL_CHUNK"))),
                                      weights.device)
    max_tree = int(args.options.get("max_tree", 64))
    engine = build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=mtp)
    ctx.mark("engine")

    tokenizer = HFTokenizer.from_dir(d)
    template = load_chat_template(d)
    if not template:
        raise ServeError(f"{d}: no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                         f"chat_template)")
    stop_ids = hfdir.stop_ids(d, tokenizer, cfg.eos_token_ids)
    opens_think = think_in_prompt(template)
    ctx.mark("tokenizer")

    manifest = engine.manifest()
    info: dict[str, Any] = {
        "weights": str(d),
        "architecture": cfg.architecture,
        "dtype": dtype,
        "device": str(weights.device),
        "parameters": weights.parameter_count(),
        "layers": {"gated_deltanet": len(cfg.linear_layers), "attention": len(cfg.attention_layers)},
        "mtp_head": {"layers": ckpt.mtp_layers, "served": mtp is not None,
                     "parameters": 0 if mtp is None else mtp.parameter_count()},
        "max_context": max_context,
        "prefill_chunk": prefill_chunk,
        "tied_head": weights.tied,
        "skipped": ckpt.skipped,
        "fingerprints": {"weights": weights.identity, "tokenizer": tokenizer.fingerprint(),
                         "manifest": manifest.fingerprint()},
        "memory": [part._asdict() for part in engine.memory_parts()],
    }
    ctx.log(f"qwen3_5: {info['parameters']:,} parameters in {dtype} on {weights.device}, "
            f"{sum(ckpt.skipped.values())} tensors skipped ({', '.join(sorted(ckpt.skipped)) or 'none'})")

    def spawn() -> SequenceEngine:
        return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=mtp)

    return Served(
        model_id=args.model_id,
        engine=engine,
        tokenizer=tokenizer,
        chat_template=template,
        tool_format="qwen_xml",
        reasoning=True,
        think_in_prompt=opens_think,
        stop_ids=stop_ids,
        info=info,
        spawn=spawn,
    )


def think_in_prompt(template: str) -> bool:
    """True when the template's generation prompt ends inside an open ``<think>`` block.

    Renders the template (sandboxed) for one user message with and without the
    generation prompt; the suffix the generation prompt adds decides.
    """
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None, **kw: json.dumps(value, indent=indent,
                                                                      ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "2025-01-01"
    try:
        tmpl = env.from_string(template)
        messages = [{"role": "user", "content": "hello"}]
        with_prompt = tmpl.render(messages=messages, add_generation_prompt=True, tools=None)
        without = tmpl.render(messages=messages, add_generation_prompt=False, tools=None)
    except TemplateError as exc:
        raise ServeError(f"the chat template does not render a one-message conversation: {exc}") from exc
    suffix = with_prompt[len(without):] if with_prompt.startswith(without) else with_prompt
    opened = suffix.rfind("<think>")
    return opened >= 0 and suffix.find("</think>", opened) < 0
