"""What the shared MTP drafter costs a round: the head's append and its launch + read over a Qwen3.8 MTP head (random).

Random weights never get a draft accepted, so the head's worth (its acceptance) cannot be measured here;
its cost can. A Qwen3.8 engine (one full-attention target layer: the target's own forwards are not timed)
and an MTP head of the chosen shape are built from random tensors in memory, a prompt of ``--context``
tokens is prefilled, then each round is what the decode loop does around the verify:

    verify + commit of ``accepted + 1`` tokens (not timed; the commit appends the head's rows)
    head.append(...)           the head's rows of the committed tokens, again (timed: what a commit adds)
    drafter.propose(...)       launch (``depth`` chained head steps) and read (the top two a depth)  (timed)

``--heads`` picks the head's forms: ``graphs`` (on CUDA, ``tandem_qwen38.mtp_cuda.CudaMTPHead``: one graph replay
a launch, one an append) and ``eager`` (the plain-torch ``MTPHead``, one kernel launch an op). The table gives, for
each form, depth and number of accepted tokens, the median of ``--rounds`` rounds: the append, the launch + read,
their sum (the drafter's cost a round), that sum per head step, the round as a fraction of the target's decode
step (``--decode-ms``: the 27B's on the H200 is 13.8 ms, ``docs/measurements/h200-serve.md``) and against the
round's bandwidth floor (the bytes its head steps read: the head's layer and fc, and the output head for each
launch step, at ``--bandwidth`` GB/s). Shapes: ``tiny`` (the tests'), ``small`` (hidden 1024, vocabulary 32768)
and ``27b`` (the published Qwen3.8-27B head: hidden 5120, 24/4 heads of 256, MLP 17408, vocabulary 248320; for a
GPU, bf16).

    python tools/bench_mtp.py [--shape small] [--device cpu] [--dtype fp32] [--context 1024]
                              [--rounds 20] [--depths 1,2,3,4] [--accepted 0,3] [--threads 2]
                              [--heads graphs,eager] [--decode-ms 13.8] [--bandwidth 4200] [--budget 0]
                              [--out docs/measurements/cpu-mtp.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("", "plugins/qwen38_27b", "plugins/drafters"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128),
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256),
}


def build(shape: str, device: str, dtype: str, max_context: int) -> Any:
    """A Qwen3.8 engine of one full-attention layer with an MTP head of ``shape``, every tensor random (the head
    the serving path picks: graphs beside the CUDA runner), and a function giving an engine over the same runner
    and weights with the plain-torch head (``eager``)."""
    from tandem_qwen38.config import read_config
    from tandem_qwen38.mtp import build_mtp
    from tandem_qwen38.serving import build_engine
    from tandem_qwen38.weights import build_weights, expected_mtp_tensors, expected_tensors

    raw = {**SHAPES[shape], "model_type": "qwen3_5_text", "num_hidden_layers": 1,
           "layer_types": ["full_attention"],
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4, "max_position_embeddings": 1 << 18,
           "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                               "partial_rotary_factor": 0.25}}
    cfg = read_config(raw)
    gen = torch.Generator().manual_seed(0)

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        scale = shape[-1] ** -0.5 if len(shape) >= 2 else 0.1
        held = torch.bfloat16 if dtype == "bf16" else torch.float32
        return (torch.randn(shape, generator=gen) * scale).to(held)

    target = {k: random(e.shape) for k, e in expected_tensors(cfg).items()}
    weights = build_weights(target, cfg, dtype, device)
    head = {k: random(e.shape) for k, e in expected_mtp_tensors(cfg, 1).items()}
    mtp = build_mtp(head.__getitem__, cfg, 1, dtype, device)
    engine = build_engine(cfg, weights, max_context, 512, max_tree=16, mtp=mtp)

    def eager() -> Any:
        from tandem_core.engine import SequenceEngine
        from tandem_qwen38.mtp import MTPHead

        return SequenceEngine(engine.runner, name="qwen3_5", head=MTPHead(cfg, weights, mtp, max_context=max_context))

    return engine, eager, cfg, mtp.nbytes, weights.head.nbytes


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(engine: Any, cfg: Any, device: str, context: int, depth: int, accepted: int,
          rounds: int) -> dict[str, float]:
    from tandem_drafters.mtp import MTPDrafter

    drafter = MTPDrafter(engine=engine, depth=depth)
    head = engine.mtp_head()
    gen = torch.Generator().manual_seed(depth * 100 + accepted)
    vocab = cfg.vocab_size
    seq = torch.randint(0, vocab, (context,), generator=gen).tolist()
    engine.reset()
    engine.forward(torch.tensor(seq))
    drafter.begin(seq)
    pending = int(torch.randint(0, vocab, (1,), generator=gen))
    drafter.propose([*seq, pending], 2 * depth)
    capture, launch = [], []
    for i in range(rounds + 3):              # the first three rounds warm up, untimed
        path = torch.randint(0, vocab, (accepted,), generator=gen).tolist()
        tokens = [pending, *path]
        start = engine.kv.length
        engine.forward_tree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1))
        rows = engine.hidden_post_norm()[:len(tokens)].clone()
        before = head.sections()["mtp.hidden"].clone()
        engine.commit_tree(list(range(len(tokens))))
        engine.settle()
        head.sections()["mtp.hidden"].copy_(before)           # the append again, from the same state
        sync(device)
        t0 = time.perf_counter()
        head.append(torch.tensor(tokens), rows, start, decode_form=True)
        drafter.accepted(tokens)
        sync(device)
        t1 = time.perf_counter()
        seq += tokens
        pending = int(torch.randint(0, vocab, (1,), generator=gen))
        drafter.propose([*seq, pending], 2 * depth)
        sync(device)
        t2 = time.perf_counter()
        if i >= 3:
            capture.append((t1 - t0) * 1e3)
            launch.append((t2 - t1) * 1e3)
    c, la = statistics.median(capture), statistics.median(launch)
    return {"capture": c, "launch": la, "round": c + la, "step": (c + la) / (depth + 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--accepted", default="0,3")
    ap.add_argument("--heads", default="graphs,eager", help="the head's forms: graphs (CUDA), eager")
    ap.add_argument("--decode-ms", type=float, default=13.8, help="the target's decode step to compare with")
    ap.add_argument("--bandwidth", type=float, default=4200.0, help="GB/s for the bandwidth floor")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; stop starting forms/depths past it")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="", help="write the table there (markdown) with the command")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    depths = [int(d) for d in args.depths.split(",")]
    accepts = [int(a) for a in args.accepted.split(",")]
    forms = [f for f in args.heads.split(",") if f]
    if not args.device.startswith("cuda"):
        forms = [f for f in forms if f != "graphs"] or ["eager"]
    max_context = args.context + (args.rounds + 3) * (max(accepts) + 1) + max(depths) + 8
    rows = []
    skipped: list[str] = []
    head_bytes = out_bytes = 0
    with torch.inference_mode():
        served, eager, cfg, head_bytes, out_bytes = build(args.shape, args.device, args.dtype, max_context)
        for form in forms:
            if args.budget and time.perf_counter() - t_start > args.budget:
                skipped.append(form)
                continue
            engine = served if form == "graphs" else eager()
            if form == "graphs" and not engine.caps.mtp_graphs:
                skipped.append(f"{form} (this device gets no graphed head)")
                continue
            for depth in depths:
                for acc in accepts:
                    if args.budget and time.perf_counter() - t_start > args.budget:
                        skipped.append(f"{form} depth {depth} accepted {acc}")
                        continue
                    r = bench(engine, cfg, args.device, args.context, depth, acc, args.rounds)
                    rows.append((form, depth, acc, r))
            last = engine
    head = last.mtp_head()
    lines = [
        "| head | depth | accepted tokens a round | append ms | launch + read ms | drafter ms a round "
        "| ms a head step | of a decode step | floor ms | x floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for form, d, a, r in rows:
        floor = ((d + 1) * head_bytes + d * out_bytes) / (args.bandwidth * 1e9) * 1e3
        lines.append(f"| {form} | {d} | {a} | {r['capture']:.2f} | {r['launch']:.2f} | {r['round']:.2f} | "
                     f"{r['step']:.2f} | {r['round'] / args.decode_ms:.1%} | {floor:.2f} | "
                     f"{r['round'] / floor:.1f} |")
    cmd = "python tools/bench_mtp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    about = [
        f"- device: {args.device} ({where}), {os.cpu_count()} logical cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s); load average (1 min) {load:.1f} after the runs",
        f"- head: the `{args.shape}` shape (hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads of {cfg.head_dim}, MLP {cfg.intermediate_size}, vocabulary "
        f"{cfg.vocab_size}), {args.dtype}, random weights; "
        f"{sum(p.nbytes for p in head.memory_parts()) / 2**20:.1f} MiB (its weights and its KV rows for "
        f"{head.max_context} positions; the embedding and output head are the target's)",
        f"- context {args.context} tokens; median of {args.rounds} rounds; a round's append writes the head's "
        f"rows of the committed tokens (accepted + the pending one) as the commit does, its launch runs `depth` "
        f"chained head steps and reads the top two a depth; `ms a head step` divides by depth + 1 (the "
        f"append's); `of a decode step` against {args.decode_ms} ms; the floor reads the head's "
        f"{head_bytes / 1e9:.2f} GB a step and the output head's {out_bytes / 1e9:.2f} GB a launch step at "
        f"{args.bandwidth:.0f} GB/s",
    ]
    if skipped:
        about.append(f"- not run (the --budget of {args.budget:.0f} s ran out, or no graphs here): "
                     f"{', '.join(skipped)}")
    print("\n".join(about + [""] + lines))
    if args.out:
        out = Path(args.out)
        text = [f"# The MTP drafter's cost a round ({args.device})", "", f"Command: `{cmd}`", "", *about, "",
                *lines, "",
                "Random weights never have a draft accepted (the head's guesses are noise to the target), so "
                "acceptance, and the speed-up it buys, can only be measured on a trained checkpoint; this is "
                "what the drafter adds to a round whatever its acceptance.", ""]
        out.write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
