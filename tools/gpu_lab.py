"""Kernel lab for the Qwen3.8 CUDA path at the 27B shape: where a step's time goes, and matmul variants.

    python3 tools/gpu_lab.py --out DIR [--parts bw,mm,profile] [--budget S]

- ``bw``: the copy bandwidth (read + write) and the read bandwidth (a sum over 8 GiB of bf16).
- ``mm``: every weight matmul of a decode step (257 launches) as one CUDA graph at 1 and 64 rows:
  cuBLAS (``torch.mm``), layout ``xw`` and ``wx`` with plans tuned per shape at one row, and
  ``wx`` launched with programmatic dependent launch (PDL), with and without an L2 prefetch of
  each program's first weight tiles before it waits. Writes the chosen plans to ``plans.json``.
- ``profile``: the per-kernel device time (torch profiler, eager) of a decode step, a 64-node
  verify and a 4096-token prefill chunk at 4K context, summed by kernel; and the graph replay
  times of decode and verify 16/64 with PDL off and on.

Everything goes to ``DIR/lab.json``; the tables are printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_gpu import SHAPE, copy_bandwidth, graph_ms, log, phase, random_weights, timed  # noqa: E402


def read_bandwidth(torch) -> float:
    a = torch.randn(1 << 32, dtype=torch.bfloat16, device="cuda")              # 8 GiB
    for _ in range(2):
        a.sum(dtype=torch.float32)
    ts = timed(torch, lambda: a.sum(dtype=torch.float32), 8)

    return (1 << 33) / (statistics.median(ts) / 1e3) / 1e12


def decode_mats(fw):
    from tandem_qwen38.cuda_graphs import GdnW

    mats = []
    for ly in fw.layers:
        m = ly.mixer
        mats += [(m.w_in, False), (m.w_out, True)] if isinstance(m, GdnW) else [(m.w_qkv, False), (m.w_o, True)]
        mats += [(ly.w_gu, False), (ly.w_down, True)]
    mats.append((fw.head, False))
    return mats


def tune(torch, tm, shapes, layout: str, R: dict) -> dict:
    """Per weight shape, the fastest of a few plans at one row (each also compiled at 64 rows)."""
    chosen = {}
    for (N, K), (w, may_split) in shapes.items():
        cands = []
        tiles = ((64, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (32, 256, 4, 4)) if layout == "xw" else \
            ((64, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (128, 256, 8, 3), (64, 128, 4, 6))
        for BN, BK, wp, st in tiles:
            for split in ((1, 2, 4) if may_split else (1,)):
                if K % (BK * split) == 0:
                    cands.append(tm.MatmulPlan(BN, BK, split, wp, st, layout))
        best, best_t, rows = None, None, []
        for p in cands:
            try:
                xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in (64, 1)}
                o = {M: tm.skinny_matmul(xs[M], w, p) for M in xs}
                torch.cuda.synchronize()
                t = statistics.median(timed(torch, lambda: tm.skinny_matmul(xs[1], w, p, out=o[1]), 10))
            except Exception as exc:
                log(f"plan {p} for {N}x{K}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append((p, t))
            if best_t is None or t < best_t * 0.985:
                best, best_t = p, t
        tm.set_plan(N, K, best)
        gbps = w.numel() * 2 / best_t / 1e6
        chosen[f"{N}x{K}"] = {"plan": best.__dict__, "ms": best_t, "GBps": gbps,
                              "all": [(p.__dict__, t) for p, t in rows]}
        log(f"{layout} {N}x{K}: {best} {best_t * 1e3:.1f} us ({gbps:.0f} GB/s)")
    R.setdefault("plans", {})[layout] = chosen
    return chosen


def run_mm(torch, fw, R: dict) -> None:
    from tandem_core.ops import triton_matmul as tm
    from tandem_core.ops import triton_pdl as pdl

    mats = decode_mats(fw)
    shapes: dict = {}
    for w, s in mats:
        shapes.setdefault(tuple(w.shape), (w, s))
    K_max = max(w.shape[1] for w, _ in mats)
    res = R.setdefault("mm", {})
    xs = {M: torch.randn(M, K_max, device="cuda", dtype=torch.bfloat16) for M in (1, 64)}

    def cublas(M):
        outs = [torch.empty(M, w.shape[0], device="cuda", dtype=torch.bfloat16) for w, _ in mats]

        def body():
            for (w, _), o in zip(mats, outs):
                torch.mm(xs[M][:, :w.shape[1]], w.t(), out=o)
        return body

    def ours(M):
        outs = []
        for w, _ in mats:
            p = tm.plan_for(*w.shape)
            outs.append(torch.empty((p.split, M, w.shape[0]) if p.split > 1 else (M, w.shape[0]),
                                    dtype=torch.float32 if p.split > 1 else torch.bfloat16, device="cuda"))

        def body():
            for (w, _), o in zip(mats, outs):
                tm.skinny_matmul(xs[M][:, :w.shape[1]], w, out=o)
        return body

    for M in (1, 64):
        res[f"cublas_{M}"] = graph_ms(torch, cublas(M))
        log(f"cuBLAS graph M={M}: {res[f'cublas_{M}']:.2f} ms")
    best = (None, None, None)              # (ms at one row, layout, prefetch)
    by_layout = {}
    for layout in ("xw", "wx"):
        tune(torch, tm, shapes, layout, R)
        for M in (1, 64):
            pdl.set_enabled(False)
            res[f"{layout}_{M}"] = graph_ms(torch, ours(M))
            log(f"{layout} graph M={M}: {res[f'{layout}_{M}']:.2f} ms")
        tuned = by_layout[layout] = dict(tm.plans())
        if best[0] is None or res[f"{layout}_1"] < best[0]:
            best = (res[f"{layout}_1"], layout, -1)
        for pf in (0, 2, 6):
            for (N, K), p in tuned.items():
                tm.set_plan(N, K, tm.MatmulPlan(p.BN, p.BK, p.split, p.warps, p.stages, p.layout, pf))
            pdl.set_enabled(True)
            try:
                for M in (1, 64):
                    res[f"{layout}_pdl{pf}_{M}"] = graph_ms(torch, ours(M))
                    log(f"{layout} PDL prefetch {pf} graph M={M}: {res[f'{layout}_pdl{pf}_{M}']:.2f} ms")
                if res[f"{layout}_pdl{pf}_1"] < best[0]:
                    best = (res[f"{layout}_pdl{pf}_1"], layout, pf)
            except Exception as exc:
                res[f"{layout}_pdl{pf}_error"] = repr(exc)[:300]
                log(f"{layout} PDL prefetch {pf}: {exc!r}"[:300])
            pdl.set_enabled(False)
        for (N, K), p in tuned.items():
            tm.set_plan(N, K, p)
    # the runner's plans from here on: the fastest layout and prefetch at one row
    _, layout, pf = best
    for (N, K), p in by_layout[layout].items():
        tm.set_plan(N, K, tm.MatmulPlan(p.BN, p.BK, p.split, p.warps, p.stages, p.layout, max(pf, 0)))
    res["chosen"] = {"layout": layout, "prefetch": pf, "ms": best[0]}
    (Path(R["out"]) / "plans.json").write_text(json.dumps({f"{N}x{K}": p.__dict__ for (N, K), p in tm.plans().items()}))
    log(f"chosen: {res['chosen']}")


def run_profile(torch, cfg, fw, R: dict, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tandem_core.ops import triton_pdl as pdl
    from tandem_qwen38.cuda_graphs import CudaRunner

    n_gdn, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
    max_ctx = 32768 + 1024
    S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                    dtype=torch.float32, device="cuda")
    conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=torch.bfloat16, device="cuda")
    K = torch.zeros(n_attn, cfg.num_key_value_heads, max_ctx, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    V = torch.zeros_like(K)
    P = R.setdefault("profile", {})
    gen = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    for use_pdl in (False, True):
        pdl.set_enabled(use_pdl)
        run = CudaRunner(cfg, fw, S, conv, K, V, max_context=max_ctx, widths=(1, 16, 64), prefill_chunk=4096,
                         pdl=use_pdl)
        run.reset()
        run.prefill(ids(4096))
        run.capture()
        key = "pdl" if use_pdl else "plain"
        L = run.length
        tok = ids(64)
        times = {}
        times["decode"] = statistics.median(timed(torch, lambda: (run.decode(tok[0]), setattr(run, "length", L)),
                                                  20))
        for W in (16, 64):
            times[f"verify{W}"] = statistics.median(timed(torch, lambda: run.verify(tok[:W], [-1] + list(range(W - 1))),
                                                          10))
        run.length = L
        P[f"graph_{key}"] = times
        log(f"graphs ({key}): {times}")
        if use_pdl:
            # 32K context: decode and verify 64
            run.prefill(ids(32768 - run.length))
            L = run.length
            t32 = statistics.median(timed(torch, lambda: (run.decode(tok[0]), setattr(run, "length", L)), 20))
            v32 = statistics.median(timed(torch, lambda: run.verify(tok[:64], [-1] + list(range(63))), 10))
            P["graph_pdl_32k"] = {"decode": t32, "verify64": v32}
            log(f"32K (pdl): decode {t32:.2f} verify64 {v32:.2f}")
            run.length = 4096
        if not use_pdl:
            # eager kernels, one step each, under the profiler
            def step_decode():
                m = run.decode_meta
                run._fill_tree(m, [tok[0]], [-1])
                m.h("head")[2] = 1
                m.h("path")[0] = 0
                m.upload()
                run._step(1, m, True)

            def step_verify():
                m = run.metas[64]
                run._fill_tree(m, tok[:64], [-1] + list(range(63)))
                m.upload()
                run._step(64, m, False)

            def prefill():
                run.prefill(ids(4096))
                run.length = L

            for name, fn in (("decode", step_decode), ("verify64", step_verify), ("prefill4096", prefill)):
                fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                run.length = L
                agg: dict = {}
                for ev in prof.events():
                    if ev.device_type.name != "CUDA":
                        continue
                    nm = ev.name[:60]
                    a = agg.setdefault(nm, [0, 0.0])
                    a[0] += 1
                    a[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                tot = sum(v[1] for v in agg.values())
                rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
                P[name] = {"total_us": tot, "kernels": [(k, v[0], round(v[1], 1)) for k, v in rows[:30]]}
                log(f"profile {name}: {tot / 1e3:.2f} ms of kernels in {sum(v[0] for v in agg.values())} launches")
                for k, c, us in P[name]["kernels"][:14]:
                    log(f"   {us / 1e3:8.3f} ms {c:5d}x  {k}")
        run.graphs.clear()
        torch.cuda.empty_cache()
    pdl.set_enabled(False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="bw,mm,profile")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import torch

    from tandem_qwen38.config import read_config

    torch.backends.cuda.matmul.allow_tf32 = False
    parts = a.parts.split(",")
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "out": str(a.out)}
    cfg = read_config(SHAPE)
    if "bw" in parts:
        with phase(R, "bw"):
            R["copy_TBps"] = copy_bandwidth(torch)
            R["read_TBps"] = read_bandwidth(torch)
            log(f"copy {R['copy_TBps']:.2f} TB/s, read {R['read_TBps']:.2f} TB/s")
    with phase(R, "build"):
        fw = random_weights(cfg, torch)
        torch.cuda.synchronize()
        R["decode_read_GB"] = (fw.nbytes - fw.embed.numel() * 2) / 1e9
    if "mm" in parts:
        with phase(R, "mm"):
            run_mm(torch, fw, R)
    if "profile" in parts:
        with phase(R, "profile"):
            run_profile(torch, cfg, fw, R, a.out)
    (a.out / "lab.json").write_text(json.dumps(R, indent=1, default=str))
    print(json.dumps({k: v for k, v in R.items() if k not in ("plans", "profile")}, indent=1, default=str))
    if "errors" in R:
        for k, v in R["errors"].items():
            print("ERROR", k, v[-1500:])


if __name__ == "__main__":
    main()
