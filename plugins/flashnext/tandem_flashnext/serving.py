"""``serve(args, ctx) -> Served``: everything the server needs for a Flash-Next (``qwen4_exp``) checkpoint.

Stages (each marked on ``ctx``): ``config`` (strict read of config.json), ``audit`` (headers,
layout and audit: nothing loaded yet), ``weights`` (every tensor but the PLE tables, which are
memory-mapped; ``ctx.progress`` per tensor), ``engine`` (the core's ``SequenceEngine`` over a
``FlashNextRunner`` with buffers for ``max_context``), ``tokenizer`` (tokenizer.json and the chat
template). The model writes a ``<think>`` block (``reasoning``) and tool calls in Qwen's XML form
(``tool_format="qwen_xml"``, the format the Qwen plugin registers; ``tandem-qwen38`` is a
dependency). ``spawn`` builds another engine over the same weight objects with its
own buffers. Options read: ``prefill_chunk`` (default the ``FLASHNEXT_PREFILL_CHUNK`` setting) and
``max_tree`` (the widest verify, default 64) and ``graphs`` (default on; off: the CUDA runner without CUDA
graphs).

The runner (``make_runner``): on a CUDA device with bf16 weights and Triton, ``FlashNextCudaRunner`` (decode and
verify captured as CUDA graphs over static buffers, the Triton kernels; ``cuda_runner.unsupported`` says why not
otherwise, and the ``FLASHNEXT_CUDA_RUNNER`` setting turns it off), else the reference ``FlashNextRunner``.

The checkpoint's MTP head (``mtp.*``) is audited with the rest, loaded beside the target (the
embedding and the head are the target's) and offered through the engine (``caps.mtp``,
``mtp_head()``: ``tandem_core.engine.base.MTPEngine``), each engine with the head's own KV rows;
``--spec mtp`` drafts with it (``tandem_drafters.mtp``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem_core.checkpoint import hfdir
from tandem_core.checkpoint.hfdir import ServeError
from tandem_core.engine import Runner, SequenceEngine
from tandem_core.serving import ServeArgs, ServeContext, Served
from tandem_core.settings import SETTINGS
from tandem_core.tokenizer import HFTokenizer, load_chat_template

from tandem_flashnext.config import FlashNextConfig, read_config
from tandem_flashnext.model import FlashNextRunner
from tandem_flashnext.mtp import MTPHead, MTPWeights, load_mtp
from tandem_flashnext.plugin import SETTINGS_DECLARED
from tandem_flashnext.weights import FlashNextWeights, load_weights, normalise_dtype, open_checkpoint

__all__ = ["serve", "ServeError", "build_engine", "make_runner", "runner_choice"]

# declared here as well as through the plugin hook: tools and tests build engines without the plugin manager
# (entry points off), and the declarations are equal, so declaring twice is a no-op
for _setting in SETTINGS_DECLARED:
    SETTINGS.declare(_setting)


def runner_choice(cfg: FlashNextConfig, weights: FlashNextWeights, cuda_runner: bool | None = None) -> str | None:
    """Why the weights get the reference runner rather than ``FlashNextCudaRunner`` (None: they get the CUDA one)."""
    from tandem_flashnext.cuda_runner import unsupported

    if cuda_runner is None:
        cuda_runner = bool(SETTINGS.get("FLASHNEXT_CUDA_RUNNER"))
    if not cuda_runner:
        return "the FLASHNEXT_CUDA_RUNNER setting is off"
    return unsupported(cfg, weights)


def make_runner(cfg: FlashNextConfig, weights: FlashNextWeights, *, max_context: int, prefill_chunk: int,
                max_tree: int = 64, gdn_chunk: int = 64, last_streams: bool = False, graphs: bool = True,
                cuda_runner: bool | None = None) -> Runner:
    """The runner for where the weights are: ``FlashNextCudaRunner`` (CUDA graphs unless ``graphs`` is off) where
    ``runner_choice`` finds no reason against it, else the plain-torch reference runner, on any device."""
    if runner_choice(cfg, weights, cuda_runner) is None:
        from tandem_flashnext.cuda_runner import FlashNextCudaRunner

        return FlashNextCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree,
                                   prefill_chunk=prefill_chunk, gdn_chunk=gdn_chunk, last_streams=last_streams,
                                   graphs=graphs)
    return FlashNextRunner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk, gdn_chunk=gdn_chunk,
                           max_tree=max_tree, last_streams=last_streams)


def build_engine(cfg: FlashNextConfig, weights: FlashNextWeights, max_context: int, prefill_chunk: int,
                 max_tree: int = 64, gdn_chunk: int = 64, last_streams: bool = False,
                 mtp: MTPWeights | None = None, graphs: bool = True) -> SequenceEngine:
    """The core's sequence engine over the runner for the weights' device (``make_runner``); with ``mtp`` (the
    checkpoint's head) it offers the head, with KV rows of its own for ``max_context`` positions."""
    runner = make_runner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk, max_tree=max_tree,
                         gdn_chunk=gdn_chunk, last_streams=last_streams, graphs=graphs)
    head = None if mtp is None else MTPHead(cfg, weights, mtp, max_context=max_context)
    return SequenceEngine(runner, name="qwen4_exp", head=head)


def _mtp_parameters(mtp: MTPWeights) -> int:
    """The head's own parameters (its embedding and output head are the target's)."""
    return sum(t.numel() for t in mtp.tensors()) + sum(lin.shape[0] * lin.shape[1] for lin in mtp.linears())


def _think_in_prompt(served: Served) -> bool:
    """True when the template's generation prompt for one user message ends inside an open ``<think>``."""
    from tandem_core.server.parse import think_open_at_end
    from tandem_core.server.template import TemplateError, render_chat

    try:
        prompt = render_chat(served, [{"role": "user", "content": "hello"}])
    except TemplateError as exc:
        raise ServeError(f"the chat template does not render a one-message conversation: {exc}") from exc
    return think_open_at_end(prompt)


def serve(args: ServeArgs, ctx: ServeContext) -> Served:
    """Load the checkpoint at ``args.path`` and build the engine, the tokenizer and the template."""
    d = Path(args.path)
    cfg = read_config(hfdir.read_config_json(d, "qwen4_exp"))
    dtype = normalise_dtype(args.dtype)
    ctx.mark("config")

    ckpt = open_checkpoint(d, cfg)
    ctx.mark("audit")
    weights = load_weights(ckpt, cfg, dtype, args.device, progress=ctx.progress)
    mtp = load_mtp(ckpt, cfg, dtype, args.device)
    ctx.mark("weights")

    max_context = hfdir.context_for(args.max_context, cfg.max_position_embeddings, ctx)
    prefill_chunk = int(args.options.get("prefill_chunk", SETTINGS.get("FLASHNEXT_PREFILL_CHUNK")))
    if prefill_chunk < 1:
        raise ServeError(f"prefill_chunk {prefill_chunk}: must be positive")
    max_tree = int(args.options.get("max_tree", 64))
    graphs = str(args.options.get("graphs", "1")).lower() not in ("0", "false", "no", "off")
    why = runner_choice(cfg, weights)
    if why is not None and weights.device.type == "cuda":
        ctx.log(f"qwen4_exp: the reference runner on {weights.device}: {why}")
    engine = build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=mtp, graphs=graphs)
    ctx.mark("engine")

    tokenizer = HFTokenizer.from_dir(d)
    template = load_chat_template(d)
    if not template:
        raise ServeError(f"{d}: no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                         f"chat_template)")
    stop_ids = hfdir.stop_ids(d, tokenizer, cfg.eos_token_ids)

    manifest = engine.manifest()
    info: dict[str, Any] = {
        "weights": str(d),
        "architecture": cfg.architecture,
        "dtype": dtype,
        "device": str(weights.device),
        "parameters": weights.parameter_count(),
        "layers": {"gated_deltanet": len(cfg.linear_layers), "indexed_attention": len(cfg.attention_layers),
                   "ple": len(cfg.ple_layer_ids)},
        "experts": {"routed": cfg.num_experts, "per_token": cfg.num_experts_per_tok},
        "mtp_head": {"layers": ckpt.mtp_layers, "served": mtp is not None,
                     "parameters": 0 if mtp is None else _mtp_parameters(mtp)},
        "max_context": max_context,
        "prefill_chunk": prefill_chunk,
        "runner": type(engine.runner).__name__,
        "graph_widths": list(engine.caps.graph_widths),
        "tied_head": weights.tied,
        "skipped": ckpt.skipped,
        "fingerprints": {"weights": weights.identity, "tokenizer": tokenizer.fingerprint(),
                         "manifest": manifest.fingerprint()},
        "memory": [part._asdict() for part in engine.memory_parts()],
    }
    ctx.log(f"qwen4_exp: {info['parameters']:,} parameters in {dtype} on {weights.device} "
            f"({weights.table_bytes / 2**30:.2f} GiB of PLE tables memory-mapped on the host), "
            f"{sum(ckpt.skipped.values())} tensors skipped ({', '.join(sorted(ckpt.skipped)) or 'none'})")

    def spawn() -> SequenceEngine:
        return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, mtp=mtp, graphs=graphs)

    served = Served(model_id=args.model_id, engine=engine, tokenizer=tokenizer, chat_template=template,
                    tool_format="qwen_xml", reasoning=True, stop_ids=stop_ids, info=info, spawn=spawn)
    served = replace(served, think_in_prompt=_think_in_prompt(served))
    ctx.mark("tokenizer")
    return served
