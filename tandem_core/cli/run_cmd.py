"""``tandem run``: the smallest useful command — a greedy continuation of a prompt.

Usage errors (an empty ``--prompt``, ``--ids`` that are not integers or not in the vocabulary,
``--max-tokens`` below 1) exit 2 with one line; a model that does not load exits 1 with one
line naming the file and the field (``tandem_core.cli.load``). Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from tandem_core.cli import CliError
from tandem_core.cli.main import positive_int


def configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registry id or a checkpoint path (default: the default model)")
    p.add_argument("--weights", help="the checkpoint path, when --model is a registry id")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded without special tokens)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as one user message in the chat template")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="where the model runs (default auto: the first CUDA device torch sees, else the CPU)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="what it computes in (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--max-context", type=positive_int, default=4096)
    p.add_argument("--print-ids", action="store_true", help="print the generated token ids too")
    p.add_argument("--verbose", action="store_true", help="print the load stages on stderr")


def _ids(text: str) -> list[int]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise CliError("--ids: no token ids given")
    bad = next((x for x in parts if not x.isdigit()), None)
    if bad is not None:
        raise CliError(f"--ids: {bad!r} is not a token id (a non-negative integer)")
    return [int(x) for x in parts]


def run_run(args: argparse.Namespace) -> int:
    import torch

    from tandem_core.cli.load import load, placement
    from tandem_core.serving import ServeArgs, ServeContext

    ids = _ids(args.ids) if args.ids is not None else None
    if args.prompt is not None and not args.prompt:
        raise CliError("--prompt: empty (give some text, or --ids)")
    ctx = ServeContext(log=(lambda line: print(line, file=sys.stderr)) if args.verbose else None)
    device, dtype = placement(args.device, args.dtype)
    served = load(args.model, args.weights, ServeArgs(model_id="", path=None, device=device, dtype=dtype,  # type: ignore[arg-type]
                                                      max_context=args.max_context), ctx)
    tok = served.tokenizer
    if ids is not None:
        bad = next((t for t in ids if t >= tok.vocab_size), None)
        if bad is not None:
            raise CliError(f"--ids: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})")
    elif args.chat:
        from tandem_core.server.template import TemplateError, render_chat

        try:
            text = render_chat(served, [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        except TemplateError as exc:
            raise CliError(f"--chat: {exc}") from None
        ids = tok.encode(text)
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise CliError("--prompt: encodes to no tokens")
    limit = served.engine.caps.max_context
    if limit and len(ids) >= limit:
        raise CliError(f"the prompt has {len(ids)} tokens and the context holds {limit}")
    eng = served.engine
    stop = set(served.stop_ids)
    out: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = eng.forward(torch.tensor(ids, dtype=torch.long))
        for _ in range(min(args.max_tokens, limit - len(ids) if limit else args.max_tokens)):
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
