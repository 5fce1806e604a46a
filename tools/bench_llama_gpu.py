"""Benchmark the Llama runners on a CUDA device: plain decode and tree verify, eager against CUDA graphs.

Three runners over the same weights (the default model unless ``--model``): ``eager`` (``LlamaRunner``, every
op launched from Python), ``static`` (``LlamaCudaRunner(graphs=False)``: the static-buffer step, each op still
launched) and ``graphs`` (``LlamaCudaRunner``: decode and each verify width replayed as one CUDA graph). For
each: a prompt of ``--prompt`` tokens prefilled, then ``--steps`` greedy decode steps (the pick read back each
step, as the serving loop does): ms a token and tokens a second; then verifies of a chain of ``--verify``
nodes on top of the same state (nothing committed): ms a verify and its cost over one decode step. The static
and graph runners run the same kernels, so their greedy tokens must be equal (checked; a difference fails the
run); the eager runner's bf16 kernels differ, so its agreement is only counted.

    python tools/bench_llama_gpu.py --device cuda --steps 128 --verify 16 --md docs/measurements/h200-llama.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def build(kind: str, cfg: Any, w: Any, device: str, max_context: int, max_tree: int) -> Any:
    from tandem_llama.cuda_runner import LlamaCudaRunner
    from tandem_llama.model import LlamaRunner

    from tandem_core.engine import SequenceEngine

    if kind == "eager":
        runner: Any = LlamaRunner(cfg, w, max_context=max_context, max_tree=max_tree, device=device)
    else:
        runner = LlamaCudaRunner(cfg, w, max_context=max_context, max_tree=max_tree, device=device,
                                 graphs=kind == "graphs")
    return SequenceEngine(runner, name="llama")


def measure(eng: Any, prompt: list[int], steps: int, width: int, repeats: int, sync: Any) -> dict[str, Any]:
    eng.reset()
    t0 = time.perf_counter()
    logits = eng.forward(prompt)
    tok = int(logits[-1].argmax())
    sync()
    prefill_s = time.perf_counter() - t0
    base = eng.state.clone()
    for _ in range(3):                                          # warm-up (kernels built, allocator settled)
        eng.forward([tok])
    eng.state.restore(base)
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(steps):
        t = time.perf_counter()
        tok = int(eng.forward([tok])[0].argmax())                # the pick read back: one sync a step
        times.append(time.perf_counter() - t)
        tokens.append(tok)
    eng.state.restore(base)
    chain = torch.tensor(tokens[:width] + [3] * max(0, width - len(tokens)))
    parents = torch.arange(-1, width - 1)
    vt: list[float] = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        out = eng.forward_tree(chain, parents)
        int(out.logits.argmax(-1)[0])
        if i >= 2:
            vt.append(time.perf_counter() - t)
    eng.discard_pending()
    decode_ms = statistics.median(times) * 1e3
    verify_ms = statistics.median(vt) * 1e3
    return {"prefill_ms": prefill_s * 1e3, "decode_ms": decode_ms, "tok_s": 1e3 / decode_ms,
            "decode_mean_ms": statistics.fmean(times) * 1e3, "verify_ms": verify_ms,
            "verify_over_decode": verify_ms / decode_ms, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model id or path (default: the default model)")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed (default 128)")
    ap.add_argument("--verify", type=int, default=16, help="nodes of the verified chain (default 16)")
    ap.add_argument("--repeats", type=int, default=20, help="verifies timed (default 20)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-tree", type=int, default=64)
    ap.add_argument("--runners", default="eager,static,graphs")
    ap.add_argument("--md", help="write the table (and the command, the machine) to this markdown file")
    ap.add_argument("--json", help="write the numbers to this file")
    a = ap.parse_args(argv)
    on_cuda = a.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print(f"bench_llama_gpu: no CUDA device for --device {a.device}", file=sys.stderr)
        return 2
    kinds = [k for k in a.runners.split(",") if k]
    if not on_cuda and "graphs" in kinds:                       # a CPU run (a smoke test of this script)
        kinds.remove("graphs")

    from tandem_core.loader import load_served
    from tandem_core.plugins import load_plugins
    from tandem_core.serving import ServeArgs

    load_plugins()
    served = load_served(a.model, weights=a.weights, args=ServeArgs(
        model_id="", path=Path("."), device=a.device, dtype="bf16" if on_cuda else "fp32", max_context=a.max_context,
        options={"max_tree": a.max_tree, "graphs": "0"}))
    r = served.engine.runner
    cfg, w = r.cfg, r.w
    del served
    vocab = cfg.vocab_size
    prompt = torch.randint(3, min(vocab, 32000), (a.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    rows: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        t = time.perf_counter()
        eng = build(kind, cfg, w, a.device, a.max_context, a.max_tree)
        sync()
        build_s = time.perf_counter() - t
        rows[kind] = measure(eng, prompt, a.steps, a.verify, a.repeats, sync) | {"build_s": build_s}
        del eng
        if on_cuda:
            torch.cuda.empty_cache()
    bad = 0
    if "static" in rows and "graphs" in rows and rows["static"]["tokens"] != rows["graphs"]["tokens"]:
        bad = 1
        print("bench_llama_gpu: the graph runner's greedy tokens differ from the static runner's", file=sys.stderr)
    ref = rows.get("graphs", rows.get("static"))
    head = (f"| runner | decode ms/token | tokens/s | verify-{a.verify} ms | verify / decode | prefill {a.prompt} ms "
            "| build s | greedy tokens equal to graphs (CPU: static) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for kind, m in rows.items():
        same = sum(x == y for x, y in zip(m["tokens"], ref["tokens"])) if ref else 0
        lines.append(f"| {kind} | {m['decode_ms']:.2f} | {m['tok_s']:.1f} | {m['verify_ms']:.2f} | "
                     f"{m['verify_over_decode']:.2f} | {m['prefill_ms']:.1f} | {m['build_s']:.1f} | "
                     f"{same}/{len(m['tokens'])} |")
    table = "\n".join(lines)
    print(table)
    gpu = torch.cuda.get_device_name(0) if on_cuda else platform.processor() or "cpu"
    machine = f"{gpu}, torch {torch.__version__}, {platform.python_version()}"
    if a.md:
        cmd = "python tools/bench_llama_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(a.md).write_text(f"# Llama runners on CUDA\n\nCommand: `{cmd}`\n\nMachine: {machine}\n\n"
                              f"Median over {a.steps} decode steps and {a.repeats} verifies; model "
                              f"{cfg.num_layers} layers, hidden {cfg.hidden_size}.\n\n{table}\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine, "args": vars(a), "rows": rows}, indent=1))
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
