"""``tandem run``: the smallest useful command — a greedy continuation of a prompt."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tandem_core.cli import CliError
from tandem_core.serving import ServeArgs, ServeContext


def configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registry id or a checkpoint path (default: the default model)")
    p.add_argument("--weights", help="the checkpoint path, when --model is a registry id")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded without special tokens)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as one user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--print-ids", action="store_true", help="print the generated token ids too")


def run_run(args: argparse.Namespace) -> int:
    from tandem_core import catalog
    from tandem_core.loader import LoadError, load_served
    from tandem_core.registry import UnknownArchitecture

    ctx = ServeContext(log=lambda line: print(line, file=sys.stderr))
    try:
        served = load_served(args.model, weights=args.weights, ctx=ctx,
                             args=ServeArgs(model_id="", path=None, dtype=args.dtype,  # type: ignore[arg-type]
                                            max_context=args.max_context))
    except (catalog.ModelNotFound, LoadError, UnknownArchitecture) as exc:
        raise CliError(str(exc)) from exc
    tok = served.tokenizer
    if args.ids:
        ids = [int(x) for x in args.ids.split(",") if x.strip()]
    elif args.chat:
        from tandem_core.server.template import render_chat

        text = render_chat(served, [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = tok.encode(text)
    else:
        ids = tok.encode(args.prompt)
    eng = served.engine
    stop = set(served.stop_ids)
    out: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = eng.forward(torch.tensor(ids, dtype=torch.long))
        for _ in range(args.max_tokens):
            nxt = int(eng.picks(logits)[-1])
            if nxt in stop:
                break
            out.append(nxt)
            logits = eng.forward(torch.tensor([nxt], dtype=torch.long))
    dt = time.perf_counter() - t0
    print(tok.decode(out))
    if args.print_ids:
        print(",".join(map(str, out)))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f}s]", file=sys.stderr)
    return 0
