"""``tandem train-drafter`` (train a block drafter for a model by self-distillation) and ``tandem fetch-drafter``
(download a published DFlash drafter). ``tandem_drafters.train`` documents the stages."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem_core.cli import CliError

__all__ = ["configure_fetch", "configure_train", "run_fetch", "run_train"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registry model id or a checkpoint path (default: the default model)")
    p.add_argument("--weights", help="a checkpoint file or folder (overrides the registry's)")
    p.add_argument("-o", "--out", required=True, help="the work folder: data/, ckpt/, drafter/ (the result), log.jsonl")
    p.add_argument("--stage", choices=["all", "data", "train"], default="all")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="the target's (default per device)")
    g = p.add_argument_group("data")
    g.add_argument("--samples", type=int, default=2000, help="prompts to answer (default 2000)")
    g.add_argument("--max-new", type=int, default=256, help="answer tokens at most (default 256)")
    g.add_argument("--max-prompt", type=int, default=768, help="longer prompts are skipped (default 768)")
    g.add_argument("--workers", type=int, default=1, help="processes answering prompts, each with an engine")
    g.add_argument("--batch", type=int, default=0, metavar="N",
                   help="prompts answered at once by the target's batched generator (default: 256 on CUDA, 8 on "
                        "the CPU; 1: one prompt at a time through the serving engine, features in the shards)")
    g.add_argument("--sources", nargs="*", default=[], metavar="DIR",
                   help="folders of Python sources (default: the standard library and the installed packages)")
    g.add_argument("--data-budget", type=float, default=0.0, metavar="SECONDS", help="stop answering after this")
    g = p.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    g.add_argument("--target-layers", type=int, default=4, help="target layers read, spread evenly (default 4)")
    g.add_argument("--target-layer-ids", type=_ints, default=(), metavar="I,J,...", help="the target layers read")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--mask-token", type=int, default=None, help="the mask token id (default: the last id)")
    g.add_argument("--intermediate", type=int, default=0, help="drafter MLP width (default 16/9 of the hidden)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--samples-per-step", type=int, default=8)
    g.add_argument("--anchors", type=int, default=16, help="blocks drawn from each sample a step")
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--checkpoint-every", type=int, default=200)
    g.add_argument("--held-out", type=float, default=0.05, help="the fraction of samples held out (default 0.05)")
    g.add_argument("--train-budget", type=float, default=0.0, metavar="SECONDS", help="stop training after this")
    g.add_argument("--save-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fresh", action="store_true", help="start training again instead of resuming")


def run_train(args: argparse.Namespace) -> int:
    from tandem_core.cli.load import LoadFailed, one_line, placement
    from tandem_drafters import train as T

    if args.samples < 1 or args.steps < 1 or args.block_size < 2 or args.layers < 1 or args.workers < 1:
        raise CliError("--samples, --steps, --layers and --workers must be positive and --block-size at least 2")
    if args.batch < 0:
        raise CliError(f"--batch must be 0 (auto) or positive, got {args.batch}")
    device, dtype = placement(args.device, args.dtype)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    log = T.jsonl_logger(out / "log.jsonl")
    try:
        served = T._load(args.model, args.weights, device, dtype, args.max_prompt + args.max_new + 8)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001  (a load error is one line, like `tandem serve`'s)
        raise LoadFailed(one_line(exc)) from None
    caps = served.engine.caps
    if not caps.hidden_layers or served.engine.target_parts() is None:
        raise CliError(f"{served.model_id}: its engine lends no hidden rows or no embedding and head to a drafter")
    layers = T.pick_layers(len(caps.hidden_layers), args.target_layers, args.target_layer_ids)
    bad = [i for i in layers if i not in caps.hidden_layers]
    if bad:
        raise CliError(f"--target-layer-ids: layers {bad} are not among the target's {len(caps.hidden_layers)}")
    if args.stage in ("all", "data"):
        batch = args.batch or T.auto_batch(served.engine, device)
        if batch > 1 and T.batched_of(served.engine) is None:
            raise CliError(f"--batch {batch}: the engine of {served.model_id} has no batched generator (use --batch 1)")
        T.generate(T.DataOptions(model=args.model, weights=args.weights, out=out, samples=args.samples,
                                 max_new=args.max_new, max_prompt=args.max_prompt, layers=layers, device=device,
                                 dtype=dtype, seed=args.seed, workers=args.workers, sources=tuple(args.sources),
                                 time_budget=args.data_budget, batch=batch, shard_every=max(32, batch)), log,
                   served if args.workers <= 1 else None)
    if args.stage in ("all", "train"):
        shape = T.drafter_shape(int(caps.hidden_size), args.layers, intermediate=args.intermediate)
        cfg = T.new_config(served, served.model_id, layers, args.block_size, args.mask_token, shape)
        o = T.TrainOptions(model=args.model, weights=args.weights, out=out, steps=args.steps, lr=args.lr,
                           warmup=args.warmup, samples_per_step=args.samples_per_step, anchors=args.anchors,
                           checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                           held_out=args.held_out, device=device, dtype=dtype, seed=args.seed,
                           time_budget=args.train_budget, save_dtype=args.save_dtype, fresh=args.fresh)
        try:
            end = T.train(o, cfg, log, served)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(f"drafter: {out / 'drafter'} (trained {end['step']} steps, kept step {end.get('drafter_step')}: "
              f"held-out loss {end.get('held_loss')}, tau {end.get('held_tau')})")
    return 0


def configure_fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", help="a Hugging Face repository of a published DFlash drafter (z-lab/Qwen3-8B-DFlash-b16)")
    p.add_argument("-o", "--out", required=True, help="the folder to write config.json and model.safetensors into")


def run_fetch(args: argparse.Namespace) -> int:
    from tandem_drafters.block import BlockDrafterError, fetch_published

    try:
        path = fetch_published(args.repo, Path(args.out).expanduser())
    except BlockDrafterError as exc:
        raise CliError(str(exc)) from None
    print(f"{args.repo}: {path} (serve with TANDEM_BLOCK_DRAFTER={path} --spec lookup,block)", file=sys.stdout)
    return 0
