"""``serve(args, ctx) -> Served``: everything the server needs for an LFM2-family checkpoint (``lfm2_moe``, ``lfm2``).

Stages (each marked on ``ctx``): ``config`` (strict read of config.json), ``audit`` (headers, layout and
audit: nothing loaded yet), ``weights`` (every tensor, ``ctx.progress`` per tensor), ``engine`` (the
core's ``SequenceEngine`` over the runner, buffers for ``max_context``), ``tokenizer`` (tokenizer.json and
the chat template: the checkpoint's own, else the plugin's ``chat_template.jinja``, LFM2.5's format).

The model writes no reasoning block. Its tool calls are LFM2's Pythonic list between
``<|tool_call_start|>`` and ``<|tool_call_end|>``: ``tool_format="lfm2_pythonic"``, the format this
plugin registers (``tandem_lfm25.toolformat.Lfm2Pythonic``: the parser in ``toolcall``, the grammar of
a forced call, the prompt text).

``spawn`` builds another engine over the same weight objects with its own buffers. Options read:
``prefill_chunk`` (default the ``LFM25_PREFILL_CHUNK`` setting; 0 there: 512 on the CPU, 8192 on CUDA),
``max_tree`` (the widest verify, default 64) and ``graphs`` (default on; off: the CUDA runner without CUDA
graphs).

The runner (``make_runner``): on a CUDA device with bf16 weights and Triton, ``LfmCudaRunner`` (decode and
verify captured as CUDA graphs over static buffers, the Triton kernels; ``cuda_runner.unsupported`` says why not
otherwise, and the ``LFM25_CUDA_RUNNER`` setting turns it off), else the reference ``Lfm2Runner``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from tandem_core.checkpoint import hfdir
from tandem_core.checkpoint.hfdir import ServeError
from tandem_core.engine import Runner, SequenceEngine
from tandem_core.serving import ServeArgs, ServeContext, Served
from tandem_core.settings import SETTINGS
from tandem_core.tokenizer import HFTokenizer, load_chat_template

from tandem_lfm25.config import Lfm2Config, read_config
from tandem_lfm25.model import Lfm2Runner
from tandem_lfm25.weights import Lfm2Weights, load_weights, normalise_dtype, open_checkpoint
from tandem_lfm25.plugin import SETTINGS_DECLARED

__all__ = ["serve", "ServeError", "build_engine", "make_runner", "runner_choice", "plugin_template",
           "CPU_PREFILL_CHUNK", "CUDA_PREFILL_CHUNK"]

# declared here as well as through the plugin hook: tools and tests build engines without the plugin manager
# (entry points off), and the declarations are equal, so declaring twice is a no-op
for _setting in SETTINGS_DECLARED:
    SETTINGS.declare(_setting)

CPU_PREFILL_CHUNK = 512      # the CPU path's chunk (the chunk's activations stay small)
CUDA_PREFILL_CHUNK = 8192    # a GPU's: the prompt lengths the prefill figure is asked at


def runner_choice(cfg: Lfm2Config, weights: Lfm2Weights, cuda_runner: bool | None = None) -> str | None:
    """Why the weights get the reference runner rather than ``LfmCudaRunner`` (None: they get the CUDA one)."""
    from tandem_lfm25.cuda_runner import unsupported

    if cuda_runner is None:
        cuda_runner = bool(SETTINGS.get("LFM25_CUDA_RUNNER"))
    if not cuda_runner:
        return "the LFM25_CUDA_RUNNER setting is off"
    return unsupported(cfg, weights)


def make_runner(cfg: Lfm2Config, weights: Lfm2Weights, *, max_context: int, prefill_chunk: int,
                max_tree: int = 64, graphs: bool = True, cuda_runner: bool | None = None) -> Runner:
    """The runner for where the weights are: ``LfmCudaRunner`` (CUDA graphs unless ``graphs`` is off) where
    ``runner_choice`` finds no reason against it, else the plain-torch reference runner, on any device (its ops
    are the kernels registered for the device where there are any, else the references)."""
    if runner_choice(cfg, weights, cuda_runner) is None:
        from tandem_lfm25.cuda_runner import LfmCudaRunner

        return LfmCudaRunner(cfg, weights, max_context=max_context, max_tree=max_tree, prefill_chunk=prefill_chunk,
                             graphs=graphs)
    return Lfm2Runner(cfg, weights, max_context=max_context, max_tree=max_tree, prefill_chunk=prefill_chunk)


def build_engine(cfg: Lfm2Config, weights: Lfm2Weights, max_context: int, prefill_chunk: int,
                 max_tree: int = 64, graphs: bool = True) -> SequenceEngine:
    """The core's sequence engine over the runner for the weights' device (``make_runner``)."""
    return SequenceEngine(make_runner(cfg, weights, max_context=max_context, prefill_chunk=prefill_chunk,
                                      max_tree=max_tree, graphs=graphs), name=cfg.model_type)


def plugin_template() -> str:
    """The plugin's chat template (LFM2.5's format), for a checkpoint that ships none."""
    return files("tandem_lfm25").joinpath("chat_template.jinja").read_text()


def serve(args: ServeArgs, ctx: ServeContext) -> Served:
    """Load the checkpoint at ``args.path`` and build the engine, the tokenizer and the template."""
    d = Path(args.path)
    cfg = read_config(hfdir.read_config_json(d, "LFM2"))
    dtype = normalise_dtype(args.dtype)
    ctx.mark("config")

    ckpt = open_checkpoint(d, cfg)
    ctx.mark("audit")
    weights = load_weights(ckpt, cfg, dtype, args.device, progress=ctx.progress)
    ctx.mark("weights")

    max_context = hfdir.context_for(args.max_context, cfg.max_position_embeddings, ctx)
    prefill_chunk = hfdir.prefill_chunk_for(int(args.options.get("prefill_chunk", SETTINGS.get("LFM25_PREFILL_CHUNK"))),
                                            weights.device, cpu=CPU_PREFILL_CHUNK, cuda=CUDA_PREFILL_CHUNK)
    max_tree = int(args.options.get("max_tree", 64))
    graphs = str(args.options.get("graphs", "1")).lower() not in ("0", "false", "no", "off")
    why = runner_choice(cfg, weights)
    if why is not None and weights.device.type == "cuda":
        ctx.log(f"{cfg.model_type}: the reference runner on {weights.device}: {why}")
    engine = build_engine(cfg, weights, max_context, prefill_chunk, max_tree, graphs)
    ctx.mark("engine")

    tokenizer = HFTokenizer.from_dir(d)
    template = load_chat_template(d)
    if not template:
        ctx.log(f"{d}: no chat template in the checkpoint; using the plugin's (LFM2.5's format)")
        template = plugin_template()
    stop_ids = hfdir.stop_ids(d, tokenizer, cfg.eos_token_ids)
    ctx.mark("tokenizer")

    manifest = engine.manifest()
    info: dict[str, Any] = {
        "weights": str(d),
        "architecture": cfg.architecture,
        "dtype": dtype,
        "device": str(weights.device),
        "parameters": weights.parameter_count(),
        "active_parameters": weights.active_parameter_count(cfg.num_experts_per_tok),
        "layers": {"conv": len(cfg.conv_layers), "attention": len(cfg.attention_layers),
                   "moe": len(cfg.moe_layers)},
        "max_context": max_context,
        "prefill_chunk": prefill_chunk,
        "runner": type(engine.runner).__name__,
        "graph_widths": list(engine.caps.graph_widths),
        "tied_head": weights.tied,
        "fingerprints": {"weights": weights.identity, "tokenizer": tokenizer.fingerprint(),
                         "manifest": manifest.fingerprint()},
        "memory": [part._asdict() for part in engine.memory_parts()],
    }
    ctx.log(f"{cfg.model_type}: {info['parameters']:,} parameters ({info['active_parameters']:,} a token) in "
            f"{dtype} on {weights.device}")

    def spawn() -> SequenceEngine:
        return build_engine(cfg, weights, max_context, prefill_chunk, max_tree, graphs)

    return Served(
        model_id=args.model_id,
        engine=engine,
        tokenizer=tokenizer,
        chat_template=template,
        tool_format="lfm2_pythonic",
        reasoning=False,
        think_in_prompt=False,
        stop_ids=stop_ids,
        info=info,
        spawn=spawn,
    )
