#!/usr/bin/env python
"""How long the lookup drafter takes per proposal at a long context (not a test: a measurement).

Builds an agent-shaped token sequence (file content quoted again and again between
fresh text) of ``--context`` tokens, tells the drafter the prompt, then asks for a
proposal and commits one token, ``--rounds`` times; optionally with a corpus store of
``--corpus-tokens`` tokens of the same kind. Reports CPU time per call (thread time,
so a busy machine's other processes do not count), the best of ``--repeat`` runs.

    python tools/bench_lookup.py --context 32768 --corpus-tokens 2000000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agent_tokens(rng: random.Random, base: list[int], n: int, vocab: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if rng.random() < 0.5:
            a = rng.randrange(len(base) - 600)
            out += base[a:a + rng.randrange(50, 600)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randrange(20, 300))]
    return out[:n]


def run(make, seq: list[int], context: int, rounds: int, max_nodes: int) -> dict[str, float]:
    d = make()
    t = time.thread_time()
    d.begin(seq[:context])
    begin_ms = (time.thread_time() - t) * 1e3
    ctx = list(seq[:context])
    prop: list[float] = []
    acc: list[float] = []
    nodes = 0
    for i in range(context, context + rounds):
        t = time.thread_time()
        p = d.propose(ctx, max_nodes)
        prop.append(time.thread_time() - t)
        nodes += len(p)
        t = time.thread_time()
        d.accepted([seq[i]])
        acc.append(time.thread_time() - t)
        ctx.append(seq[i])
    prop.sort()
    return {"begin_ms": begin_ms, "mean_us": statistics.mean(prop) * 1e6,
            "median_us": statistics.median(prop) * 1e6, "p99_us": prop[int(0.99 * len(prop))] * 1e6,
            "nodes": nodes / rounds,
            "accepted_us": statistics.mean(acc) * 1e6}


def main(argv: list[str] | None = None) -> int:
    try:
        import tandem_drafters  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "plugins" / "drafters"))
    sys.path.insert(0, str(ROOT))
    from tandem_drafters.corpus import build_store
    from tandem_drafters.lookup import LookupDrafter

    from tandem_core.drafter import TargetInfo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--max-nodes", type=int, default=64)
    ap.add_argument("--corpus-tokens", type=int, default=0, help="0: no corpus store")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=50000)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    base = [rng.randrange(args.vocab) for _ in range(8000)]
    seq = agent_tokens(rng, base, args.context + args.rounds, args.vocab)
    configs = [("sequence", lambda: LookupDrafter(corpus=""))]
    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus_tokens:
            docs, total = [], 0
            while total < args.corpus_tokens:
                docs.append(agent_tokens(rng, base, rng.randrange(500, 5000), args.vocab))
                total += len(docs[-1])
            t = time.perf_counter()
            path = build_store(docs, Path(tmp) / "bench.tlk", "0" * 64)
            print(f"corpus store: {total} tokens, built in {time.perf_counter() - t:.1f} s")
            t = time.perf_counter()
            LookupDrafter(TargetInfo(tokenizer="0" * 64), corpus=path)
            print(f"corpus store: opened (sha256 checked) in {(time.perf_counter() - t) * 1e3:.0f} ms")
            target = TargetInfo(tokenizer="0" * 64)
            configs.append(("sequence+corpus", lambda: LookupDrafter(target, corpus=path)))
        for name, make in configs:
            runs = [run(make, seq, args.context, args.rounds, args.max_nodes) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["mean_us"])
            print(f"{name:16s} context {args.context}: propose mean {best['mean_us']:.0f} us, median "
                  f"{best['median_us']:.0f} us, p99 {best['p99_us']:.0f} us ({best['nodes']:.1f} nodes); "
                  f"accepted(1 token) {best['accepted_us']:.0f} us; begin {best['begin_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
