"""Where a decode step's time goes on the GPU: a kernel-by-kernel profile of the CUDA runners (a script, not a test).

For each target (random bf16 weights built in GPU memory, batch 1, through the core's ``SequenceEngine`` exactly as
serving drives it), the engine is prefilled to ``--context`` tokens, then ``--steps`` decode steps (and a verify of
each ``--verify`` width) run under ``torch.profiler`` (CUPTI records the kernels a CUDA graph replays). Printed and
written under ``--out`` (``profile.md``, ``profile.json``):

- per verb: wall ms a step (host call through the pick), the kernels' summed device time a step, the span from the
  step's first kernel start to its last kernel end, and the idle time between kernels inside that span (the
  launch/dependency bubbles a fusion would remove);
- the kernels grouped by name: microseconds a step, calls a step, share of the step;
- one decode step's first ``--sequence`` kernels in order, each with its duration and the gap before it.

Targets: ``lfm24`` (LFM2.5-24B-A2B shape), ``lfm8`` (the LFM2-8B-A1B-like shape), ``qwen27`` (Qwen3.8-27B),
``flashnext`` (the published Flash-Next shape with the cuts of ``tools/bench_flashnext_gpu.py``: 224 experts, the
PLE base at 100,000).

    python tools/profile_gpu.py --out /tmp/prof --targets lfm24,lfm8,qwen27
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def build(target: str, context: int, max_tree: int) -> Any:
    """The engine for ``target`` with random weights at its shape."""
    if target.startswith("lfm"):
        import bench_lfm25_gpu as bl
        from tandem_lfm25.config import read_config
        from tandem_lfm25.cuda_runner import LfmCudaRunner

        from tandem_core.engine import SequenceEngine

        raw = bl.raw_config(bl.SHAPES["24b-a2b" if target == "lfm24" else "8b-a1b"], context + 256)
        cfg = read_config(raw)
        w = bl.random_weights(cfg)
        runner = LfmCudaRunner(cfg, w, max_context=context + 256, max_tree=max_tree, prefill_chunk=context)
        return SequenceEngine(runner, name=cfg.model_type), cfg.vocab_size
    if target == "qwen27":
        import bench_gpu as bg
        from tandem_qwen38.config import read_config
        from tandem_qwen38.serving import build_engine

        cfg = read_config(bg.SHAPE)
        w = bg.random_qwen38_weights(cfg, torch)
        return build_engine(cfg, w, context + 1024, 4096, max_tree=max_tree), cfg.vocab_size
    if target == "flashnext":
        import bench_flashnext_gpu as bf
        from tandem_flashnext.config import read_config
        from tandem_flashnext.serving import make_runner

        from tandem_core.engine import SequenceEngine

        cfg = read_config(bf.raw_config(bf.SHAPES["published"], 224, 100_000, context + 256))
        w = bf.random_weights(cfg, "cuda", "bf16")
        runner = make_runner(cfg, w, max_context=context + 256, prefill_chunk=context, max_tree=max_tree,
                             cuda_runner=True)
        return SequenceEngine(runner, name="qwen4_exp"), cfg.vocab_size
    raise SystemExit(f"profile_gpu: unknown target {target!r} (lfm24, lfm8, qwen27, flashnext)")


def kernels(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device kernel the profile recorded, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    out.sort(key=lambda k: k[1])
    return out


def split_steps(ks: list[tuple[str, float, float]], n: int) -> list[list[tuple[str, float, float]]]:
    """The kernels cut into ``n`` steps at the ``n - 1`` largest gaps (steps are separated by the host's sync)."""
    if n <= 1 or len(ks) < n:
        return [ks]
    gaps = sorted(range(1, len(ks)), key=lambda i: ks[i][1] - ks[i - 1][2], reverse=True)[: n - 1]
    cuts = [0, *sorted(gaps), len(ks)]
    return [ks[a:b] for a, b in zip(cuts, cuts[1:])]


def profile_verb(fn: Any, reps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            walls.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    ks = kernels(prof)
    steps = split_steps(ks, reps)
    busy = [sum(e - s for _, s, e in st) / 1e3 for st in steps]
    span = [(st[-1][2] - st[0][1]) / 1e3 for st in steps if st]
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, s, e in ks:
        by[name][0] += e - s
        by[name][1] += 1
    total = sum(v[0] for v in by.values()) or 1.0
    rows = sorted(((n, v[0] / reps, v[1] / reps, v[0] / total) for n, v in by.items()), key=lambda r: -r[1])
    seq = []
    if steps and steps[len(steps) // 2]:
        st = steps[len(steps) // 2]
        prev = st[0][1]
        for name, s, e in st:
            seq.append((name, e - s, s - prev))
            prev = e
    return {"wall_ms": statistics.median(walls), "kernel_ms": statistics.median(busy) if busy else 0.0,
            "span_ms": statistics.median(span) if span else 0.0, "kernels_per_step": len(ks) / reps,
            "steps_found": len(steps), "by_name": rows, "sequence": seq}


def run_target(target: str, a: argparse.Namespace) -> dict[str, Any]:
    widths = [int(x) for x in a.verify.split(",") if x]
    eng, vocab = build(target, a.context, max(widths + [16]))
    prompt = torch.randint(3, vocab, (a.context,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.reset()
    tok = [int(eng.forward(prompt)[-1].argmax())]
    base = eng.state.clone()
    res: dict[str, Any] = {"target": target, "context": a.context}

    def decode() -> None:
        tok.append(int(eng.forward([tok[-1]])[0].argmax()))

    eng.state.restore(base)
    res["decode"] = profile_verb(decode, a.steps)
    eng.state.restore(base)
    for wv in widths:
        chain = [tok[0]] + [3 + i for i in range(wv - 1)]
        parents = list(range(-1, wv - 1))

        def verify(chain: list[int] = chain, parents: list[int] = parents) -> None:
            out = eng.forward_tree(chain, parents)
            int(out.logits[0].argmax())
            eng.discard_pending()

        res[f"verify{wv}"] = profile_verb(verify, max(4, a.steps // 4))
    return res                                                   # the engine goes with this frame


def short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def report(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    lines = [f"# GPU profile ({torch.cuda.get_device_name(0)}, torch {torch.__version__})", "",
             (f"    python tools/profile_gpu.py --targets {a.targets} --context {a.context} --steps {a.steps} "
              f"--verify {a.verify}"), ""]
    for r in results:
        lines += [f"## {r['target']} at {r['context']} tokens of context", "",
                  "| verb | wall ms | kernel ms | span ms | idle in span ms | kernels a step |", "|---|---|---|---|---|---|"]
        verbs = [k for k in r if k == "decode" or k.startswith("verify")]
        for v in verbs:
            p = r[v]
            lines.append(f"| {v} | {p['wall_ms']:.3f} | {p['kernel_ms']:.3f} | {p['span_ms']:.3f} | "
                         f"{p['span_ms'] - p['kernel_ms']:.3f} | {p['kernels_per_step']:.0f} |")
        for v in verbs:
            lines += ["", f"{v}: kernels by name (top {a.top})", "", "| kernel | us a step | calls a step | share |",
                      "|---|---|---|---|"]
            for n, us, c, sh in r[v]["by_name"][: a.top]:
                lines.append(f"| `{short(n)}` | {us:.1f} | {c:.1f} | {sh:.1%} |")
        lines += ["", f"decode: one step's first {a.sequence} kernels (us, gap before)", "", "```"]
        for n, d, g in r["decode"]["sequence"][: a.sequence]:
            lines.append(f"{d:8.1f} {g:6.1f}  {short(n, 110)}")
        lines += ["```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-out/profile"))
    p.add_argument("--targets", default="lfm24,lfm8,qwen27")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--verify", default="16,64")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sequence", type=int, default=90)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_gpu: needs a CUDA device")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for t in a.targets.split(","):
        try:
            results.append(run_target(t, a))
            torch.cuda.empty_cache()
        except Exception as e:                                   # one target failing leaves the others
            import traceback

            traceback.print_exc()
            results.append({"target": t, "context": a.context, "error": f"{type(e).__name__}: {e}"[:400]})
        for r in results:                    # the JSON keeps the sequence the report prints, not every kernel
            for v in r.values():
                if isinstance(v, dict) and "sequence" in v:
                    v["sequence"] = v["sequence"][: a.sequence]
        (a.out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
        ok = [r for r in results if "error" not in r]
        (a.out / "profile.md").write_text(report(ok, a))
    print(report([r for r in results if "error" not in r], a))
    for r in results:
        if "error" in r:
            print(f"{r['target']}: {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
