"""Kernel lab for the Qwen3.8 CUDA path at the 27B shape: where a step's time goes, and matmul variants.

    python3 tools/gpu_lab.py --out DIR [--parts bw,mm,attn,profile] [--pdl]

- ``bw``: the copy bandwidth (read + write) and the read bandwidth (a sum over 8 GiB of bf16).
- ``mm``: every weight matmul of a decode step (257 launches) as one CUDA graph at 1 and 64 rows:
  cuBLAS (``torch.mm``), layouts ``xw``, ``wx`` and ``wy`` with plans tuned per shape at one row
  (``bench_gpu.tune_plans``), each launched plainly and with programmatic dependent launch (PDL).
  Writes the plans of the faster layout (which the profile then runs) to ``plans.json``.
- ``attn``: the attention of 16 layers (each its own cache) as one CUDA graph, at 4K and 32K
  context, 1 and 64 rows, for prefix splits of 64, 128 and 256 positions and 1 to 3 pipeline stages.
- ``profile``: the per-kernel device time (torch profiler, eager) of a decode step, a 64-node
  verify and a 4096-token prefill chunk at 4K context, summed by kernel; and the graph replay
  times of decode and verify 16/64 at 4K and 32K (``--pdl``: also with programmatic dependent launch).

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

from bench_gpu import (SHAPE, copy_bandwidth, decode_mats, graph_ms, log, phase, random_weights,  # noqa: E402
                       timed, tune_plans)


def read_bandwidth(torch) -> float:
    a = torch.randn(1 << 32, dtype=torch.bfloat16, device="cuda")              # 8 GiB
    for _ in range(2):
        a.sum(dtype=torch.float32)
    ts = timed(torch, lambda: a.sum(dtype=torch.float32), 8)

    return (1 << 33) / (statistics.median(ts) / 1e3) / 1e12


def run_mm(torch, fw, R: dict) -> None:
    from tandem_core.ops import triton_matmul as tm
    from tandem_core.ops import triton_pdl as pdl

    mats = decode_mats(fw)
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
        pls = [tm.plan_for(*w.shape) for w, _ in mats]
        outs = [torch.empty((p.split, M, w.shape[0]) if p.split > 1 else (M, w.shape[0]),
                            dtype=torch.float32 if p.split > 1 else torch.bfloat16, device="cuda")
                for (w, _), p in zip(mats, pls)]

        def body():
            for (w, _), p, o in zip(mats, pls, outs):
                tm.skinny_matmul(xs[M][:, :w.shape[1]], w, p, out=o)
        return body

    for M in (1, 64):
        res[f"cublas_{M}"] = graph_ms(torch, cublas(M))
        log(f"cuBLAS graph M={M}: {res[f'cublas_{M}']:.2f} ms")
    by_layout = {}
    for layout in ("xw", "wx", "wy"):
        R.setdefault("plans", {})[layout] = tune_plans(torch, fw, (layout,), 0.0)     # fastest at one row
        by_layout[layout] = dict(tm.plans())
        for use_pdl in (False, True):
            pdl.set_enabled(use_pdl)
            for M in (1, 64):
                key = f"{layout}{'_pdl' if use_pdl else ''}_{M}"
                res[key] = graph_ms(torch, ours(M))
                log(f"{layout} graph{' (PDL)' if use_pdl else ''} M={M}: {res[key]:.2f} ms")
        pdl.set_enabled(False)
    # the plans from here on (the profile's runners): the layout fastest at one row
    layout = min(by_layout, key=lambda lay: res[f"{lay}_1"])
    for (N, K), p in by_layout[layout].items():
        tm.set_plan(N, K, p)
    res["chosen"] = layout
    (Path(R["out"]) / "plans.json").write_text(json.dumps({f"{N}x{K}": p.__dict__ for (N, K), p in tm.plans().items()}))
    log(f"chosen: {layout}")


def run_attn(torch, cfg, R: dict) -> None:
    from tandem_core.ops import triton_attention as ta

    hq, hkv, D, n_attn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(cfg.attention_layers)
    S_max = 32768 + 256
    K = torch.randn(n_attn, hkv, S_max, D, dtype=torch.bfloat16, device="cuda")
    V = torch.randn_like(K)
    res = R.setdefault("attn", {})
    for W in (1, 64):
        q = torch.randn(W, hq * D, dtype=torch.bfloat16, device="cuda")
        raw = torch.randn(W, 2 * hq * D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(W, hq * D, dtype=torch.bfloat16, device="cuda")
        anc = torch.tril(torch.arange(W, dtype=torch.int32, device="cuda")[None, :].expand(W, W)).contiguous()
        for L in (4096, 32768):
            meta = torch.tensor([L, W], dtype=torch.int32, device="cuda")
            pos = torch.arange(L, L + W, dtype=torch.int32, device="cuda")
            for split, stages in ((64, 2), (128, 2), (256, 2), (128, 1), (256, 1), (256, 3)):
                sc = ta.AttnScratch(W, hq, D, S_max, "cuda", split=split)
                ta.PARTS_STAGES = stages

                def body():
                    for i in range(n_attn):
                        ta.tree_attention(q, raw, K[i], V[i], meta, pos, anc, sc, out, hq=hq, hkv=hkv, head_dim=D,
                                          scale=D ** -0.5, rows=W)
                key = f"rows{W}_ctx{L}_split{split}_stages{stages}"
                try:
                    res[key] = graph_ms(torch, body)
                except Exception as exc:                          # a config that does not fit (shared memory)
                    log(f"attention {key}: {type(exc).__name__}")
                    continue
                log(f"attention x{n_attn} {key}: {res[key]:.3f} ms")
    ta.PARTS_STAGES = 2
    del K, V
    torch.cuda.empty_cache()


def run_profile(torch, cfg, fw, R: dict, out: Path, pdl_too: bool = False) -> None:
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

    variants = [("plain", dict(pdl=False))]
    if pdl_too:
        variants.append(("pdl", dict(pdl=True)))
    for key, kw in variants:
        pdl.set_enabled(kw["pdl"])
        run = CudaRunner(cfg, fw, S, conv, K, V, max_context=max_ctx, widths=(1, 16, 64), prefill_chunk=4096, **kw)
        run.reset()
        run.prefill(ids(4096))
        run.capture()
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
        if key == variants[-1][0]:
            # 32K context: decode and verify 64
            run.prefill(ids(32768 - run.length))
            L32 = run.length
            t32 = statistics.median(timed(torch, lambda: (run.decode(tok[0]), setattr(run, "length", L32)), 20))
            v32 = statistics.median(timed(torch, lambda: run.verify(tok[:64], [-1] + list(range(63))), 10))
            P[f"graph_{key}_32k"] = {"decode": t32, "verify64": v32}
            log(f"32K ({key}): decode {t32:.2f} verify64 {v32:.2f}")
            run.length = L
        if key == "plain":
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
                P[f"{name}_{key}"] = {"total_us": tot, "kernels": [(k, v[0], round(v[1], 1)) for k, v in rows[:30]]}
                log(f"profile {name}: {tot / 1e3:.2f} ms of kernels in {sum(v[0] for v in agg.values())} launches")
                for k, c, us in P[f"{name}_{key}"]["kernels"][:14]:
                    log(f"   {us / 1e3:8.3f} ms {c:5d}x  {k}")
        run.graphs.clear()
        torch.cuda.empty_cache()
    pdl.set_enabled(False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="bw,mm,attn,profile")
    ap.add_argument("--pdl", action="store_true", help="profile: graphs with PDL as well")
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
    if "attn" in parts:
        with phase(R, "attn"):
            run_attn(torch, cfg, R)
    if "mm" in parts:
        with phase(R, "mm"):
            run_mm(torch, fw, R)
    if "profile" in parts:
        with phase(R, "profile"):
            run_profile(torch, cfg, fw, R, a.out, a.pdl)
    (a.out / "lab.json").write_text(json.dumps(R, indent=1, default=str))
    print(json.dumps({k: v for k, v in R.items() if k not in ("plans", "profile")}, indent=1, default=str))
    if "errors" in R:
        for k, v in R["errors"].items():
            print("ERROR", k, v[-1500:])


if __name__ == "__main__":
    main()
