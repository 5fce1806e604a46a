"""The Qwen3.8 27B-shape benchmark on one CUDA GPU (random bf16 weights built on the GPU).

    python3 tools/bench_gpu.py engine --out DIR     our engine: checks, decode, verify curve, prefill, price file
    python3 tools/bench_gpu.py peer --out DIR [--fla DIR]   transformers' Qwen3_5ForCausalLM at the same shape
    python3 tools/bench_gpu.py integrated --out DIR the same shape through the engine's verbs (the CUDA graph
                                                    path wired into the engine) beside a bare CudaRunner
    python3 tools/bench_gpu.py report --out DIR     tables (markdown) from the JSON the others wrote

``engine`` measures the copy bandwidth and the decode floor (every weight read once),
builds the engine on the GPU, checks on the GPU that verified rows equal decode rows bit
for bit (a chain, a tree with interleaved branches, a width past 64) and that greedy
speculative output (chains from a prompt-lookup drafter) equals greedy plain output,
then times decode at 4K and 32K, the verify cost for 1..128 nodes at several contexts,
and prefill at 2K/8K/32K, and writes ``bf16.h200.json`` (the StairCut price file).
Every phase logs its own failure and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "plugins" / "qwen38_27b"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SHAPE = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def phase(results: dict, name: str):
    class _P:
        def __enter__(self):
            log(f"-- {name}")
            return self

        def __exit__(self, et, ev, tb):
            if et is not None:
                results.setdefault("errors", {})[name] = "".join(traceback.format_exception(et, ev, tb))[-3000:]
                log(f"!! {name} failed: {ev!r}")
            return True
    return _P()


def copy_bandwidth(torch) -> float:
    n = 1 << 32                                  # 4 GiB read + 4 GiB written
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    del a, b
    return 2 * n / (statistics.median(ts) / 1e3) / 1e12     # TB/s


def random_weights(cfg, torch, seed: int = 0):
    from tandem_qwen38.cuda_graphs import AttnW, FusedWeights, GdnW, LayerW

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16

    def mat(n, k):
        return (torch.randn(n, k, device=dev, dtype=bf, generator=g) * (k ** -0.5)).contiguous()

    def vec(n, s=0.1):
        return torch.randn(n, device=dev, dtype=torch.float32, generator=g) * s

    H, I = cfg.hidden_size, cfg.intermediate_size
    layers = []
    n_gdn = len(cfg.linear_layers)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_linear(i):
            mixer = GdnW(mat(cfg.conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads, H),
                         vec(cfg.conv_dim * cfg.linear_conv_kernel_dim, 0.5).view(cfg.conv_dim, -1).contiguous(),
                         vec(cfg.linear_value_head_dim, 0.1) + 1.0, mat(H, cfg.gdn_value_dim))
        else:
            D = cfg.head_dim
            mixer = AttnW(mat(2 * cfg.num_attention_heads * D + 2 * cfg.num_key_value_heads * D, H), vec(D),
                          vec(D), mat(H, cfg.num_attention_heads * D))
        layers.append(LayerW(vec(H), vec(H), mixer, mat(2 * I, H), mat(H, I)))
    hv = cfg.linear_num_value_heads
    A_log = torch.log(torch.rand(n_gdn, hv, device=dev, generator=g) * 15 + 1)
    dt_bias = torch.randn(n_gdn, hv, device=dev, generator=g) * 0.5
    embed = torch.randn(cfg.vocab_size, H, device=dev, dtype=bf, generator=g)
    return FusedWeights(embed, mat(cfg.vocab_size, H), vec(H), layers, A_log, dt_bias)


def timed(torch, fn, reps: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1))
    return out


def graph_ms(torch, body, reps: int = 10) -> float:
    """Median ms of one replay of ``body`` captured as a CUDA graph (after a warm-up run outside it)."""
    body()
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        body()
        with torch.cuda.graph(g, stream=st):
            body()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    return statistics.median(timed(torch, g.replay, reps))


def decode_mats(fw) -> list:
    """Every weight matmul of a decode step in order (257 at the 27B shape), each with whether its K may be split
    (its consumer adds fp32 parts rather than reading bf16)."""
    from tandem_qwen38.cuda_graphs import GdnW

    mats = []
    for ly in fw.layers:
        m = ly.mixer
        mats += [(m.w_in, False), (m.w_out, True)] if isinstance(m, GdnW) else [(m.w_qkv, False), (m.w_o, True)]
        mats += [(ly.w_gu, False), (ly.w_down, True)]
    mats.append((fw.head, False))
    return mats


def rows_invariant(torch, tm, w, p) -> bool:
    """Whether plan ``p`` gives each row of ``w``'s product the same bits alone and among 17, 64 and 128 rows (it
    also proves the plan runs at 128 rows)."""
    x = torch.randn(128, w.shape[1], device="cuda", dtype=torch.bfloat16)

    def mm(r):
        y = tm.skinny_matmul(x[:r], w, p)
        return tm.reduce_parts(y) if y.dim() == 3 else y

    full, one, r17, r64 = mm(128), mm(1), mm(17), mm(64)
    return bool(torch.equal(one[0], full[0]) and torch.equal(r17[16], full[16]) and torch.equal(r64, full[:64]))


def tune_plans(torch, fw, layouts=("xw", "wx", "wy"), weight64: float = 0.5) -> dict:
    """Per weight shape, the plan (layout, tiles, split of K, stages) with the lowest
    ``t(1 row) + weight64 * t(64 rows)``, each time one CUDA graph over every layer's matrix of that shape (what a
    step sees: no launch gaps, no weight in L2). A shape whose output a bf16 consumer reads keeps
    ``split == 1``. A plan must also give every row the same bits whatever the row count (``rows_invariant``):
    by construction for ``xw`` and ``wx``, checked for ``wy``; one that does not is refused."""
    from tandem_core.ops import triton_matmul as tm

    shapes: dict[tuple[int, int], tuple[list, bool]] = {}
    for w, may_split in decode_mats(fw):
        ws, ok = shapes.get(tuple(w.shape), ([], True))
        shapes[tuple(w.shape)] = (ws + [w], ok and may_split)
    chosen = {}
    for (N, K), (ws, may_split) in shapes.items():
        cands = []
        for layout, BN, BK, wp, st in (("xw", 64, 128, 4, 4), ("xw", 128, 128, 4, 3), ("wx", 64, 128, 4, 4),
                                       ("wx", 128, 128, 4, 3), ("wx", 64, 256, 4, 3), ("wy", 64, 128, 4, 4),
                                       ("wy", 128, 128, 4, 3), ("wy", 64, 128, 4, 3)):
            if layout not in layouts:
                continue
            for split in ((1, 2, 4) if may_split else (1,)):
                if K % (BK * split) == 0:
                    cands.append(tm.MatmulPlan(BN, BK, split, wp, st, layout))
        best, best_c, rows = None, None, []
        for p in cands:
            try:
                if not rows_invariant(torch, tm, ws[0], p):
                    log(f"plan {p} for {N}x{K}: rows differ with the row count: refused")
                    rows.append((p.__dict__, "not row-invariant", None))
                    continue
                ts = {}
                for M in (1, 64):
                    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                    o = tm.skinny_matmul(x, ws[0], p)
                    ts[M] = graph_ms(torch, lambda: [tm.skinny_matmul(x, w, p, out=o) for w in ws], 5) / len(ws)
            except Exception as exc:                     # a plan that does not fit (shared memory) is skipped
                log(f"plan {p} for {N}x{K}: {type(exc).__name__}")
                continue
            cost = ts[1] + weight64 * ts[64]
            rows.append((p.__dict__, ts[1], ts[64]))
            if best_c is None or cost < best_c:
                best, best_c, best_ts = p, cost, ts
        tm.set_plan(N, K, best)
        gbps = ws[0].numel() * 2 / best_ts[1] / 1e6
        chosen[f"{N}x{K}"] = {"plan": best.__dict__, "us_1": best_ts[1] * 1e3, "us_64": best_ts[64] * 1e3,
                              "GBps_1": gbps, "candidates": rows}
        log(f"plan {N}x{K} (x{len(ws)}): {best} {best_ts[1] * 1e3:.1f} us at 1 row ({gbps:.0f} GB/s), "
            f"{best_ts[64] * 1e3:.1f} us at 64")
    return chosen


def time_tree(torch, cfg) -> dict:
    """The Gated DeltaNet tree kernel over every GDN layer (one launch a layer, as in a step), for a 64-node chain
    and for one node, by warps per program: ``{warps: (ms at 64 nodes, ms at 1)}``."""
    from tandem_core.ops import triton_gdn as tg

    L, hk, hv, dk, dv = len(cfg.linear_layers), cfg.linear_num_key_heads, cfg.linear_num_value_heads, \
        cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = 2 * hk * dk + hv * dv
    f32 = dict(device="cuda", dtype=torch.float32)
    qkv = torch.nn.functional.normalize(torch.randn(L, 64, C, **f32), dim=-1)
    ab = torch.randn(L, 64, 2 * hv, device="cuda", dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(L, hv, **f32), torch.randn(L, hv, **f32) * 0.5
    S = torch.randn(L, hv, dk, dv, **f32) * 0.01
    scratch, o = torch.zeros(1, hv, dk, dv, **f32), torch.zeros(64, hv, dv, **f32)
    out = {}
    keep = tg.TREE_WARPS
    for warps in (1, 2, 4):
        tg.TREE_WARPS = warps
        ts = []
        for n in (64, 1):
            plan = torch.tensor(tg.tree_plan([-1] + list(range(n - 1))).packed(), dtype=torch.int32, device="cuda")
            nn = torch.tensor([n], dtype=torch.int32, device="cuda")
            ts.append(graph_ms(torch, lambda: [tg.gdn_tree(qkv[i:i + 1], ab[i:i + 1], 0, hv, A_log[i:i + 1],
                                                           dt_bias[i:i + 1], S[i:i + 1], scratch, o, plan, nn,
                                                           write_out=True, final_store=False, scale=dk ** -0.5,
                                                           num_k_heads=hk) for i in range(L)], 5))
        out[warps] = tuple(ts)
    tg.TREE_WARPS = keep
    return out


def time_chunk(torch, cfg) -> dict:
    """The chunked rule at 4096 tokens with 16, 32 or 64 value columns per state-kernel program; returns the
    times."""
    from tandem_core.ops import triton_gdn as tg

    T, hk, hv, dk, dv = 4096, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    nrm = torch.nn.functional.normalize
    q, k = (nrm(torch.randn(T, hk, dk, device="cuda"), dim=-1) for _ in range(2))
    v = torch.randn(T, hv, dv, device="cuda")
    g, beta = -torch.rand(T, hv, device="cuda") * 0.3, torch.rand(T, hv, device="cuda")
    S0 = torch.zeros(hv, dk, dv, device="cuda")
    out = {}
    for bv in (16, 32, 64):
        out[bv] = statistics.median(timed(torch, lambda: tg.gdn_chunk(q, k, v, g, beta, S0, scale=dk ** -0.5, BV=bv),
                                          5))
    return out


def lookup_draft(seq: list[int], k: int) -> list[int]:
    """Prompt lookup: the tokens that followed the last earlier occurrence of the last token (or repeats)."""
    last = seq[-1]
    for i in range(len(seq) - 2, -1, -1):
        if seq[i] == last:
            nxt = seq[i + 1:i + 1 + k]
            if nxt:
                return nxt
    return [last] * k


# -- our engine ----------------------------------------------------------------------------------------------
def run_engine(out: Path, budget_s: float, tune: bool = True, max_tree: int = 128, prefill: bool = True,
               prefill_chunk: int = 8192) -> dict:
    import torch

    from tandem_qwen38.config import read_config
    from tandem_qwen38.cuda_graphs import WIDTHS, CudaRunner, runner_widths

    torch.backends.cuda.matmul.allow_tf32 = False
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton
        R["triton"] = triton.__version__
    except Exception:
        pass
    cfg = read_config(SHAPE)
    with phase(R, "bandwidth"):
        bw = copy_bandwidth(torch)
        R["copy_TBps"] = bw
        log(f"copy bandwidth {bw:.2f} TB/s")

    max_ctx = 32768 + 1024
    with phase(R, "build"):
        t = time.time()
        fw = random_weights(cfg, torch)
        torch.cuda.synchronize()
        R["weights_GB"] = fw.nbytes / 1e9
        # bytes one decode step reads: every weight but the embedding table (one row of it)
        R["decode_read_GB"] = (fw.nbytes - fw.embed.numel() * 2) / 1e9
        R["floor_ms"] = fw.nbytes / 1e9 / bw
        R["floor_read_ms"] = R["decode_read_GB"] / bw
        n_gdn, n_attn = len(cfg.linear_layers), len(cfg.attention_layers)
        S = torch.zeros(n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        dtype=torch.float32, device="cuda")
        conv = torch.zeros(n_gdn, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=torch.bfloat16, device="cuda")
        K = torch.zeros(n_attn, cfg.num_key_value_heads, max_ctx, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
        V = torch.zeros_like(K)
        if tune:
            R["plans"] = tune_plans(torch, fw)
            from tandem_core.ops import triton_gdn as tg
            R["chunk_scan_ms"] = time_chunk(torch, cfg)
            log(f"chunked rule at 4096 tokens, ms by value columns per program: {R['chunk_scan_ms']} (the runner "
                f"uses gdn_chunk's default, {tg.SCAN_BV})")
            R["tree_ms"] = time_tree(torch, cfg)
            tg.TREE_WARPS = min(R["tree_ms"], key=lambda w: R["tree_ms"][w][0])
            log(f"tree kernel, {len(cfg.linear_layers)} layers, ms (64 nodes, 1 node) by warps: {R['tree_ms']}; "
                f"runner uses {tg.TREE_WARPS}")
        R["prefill_chunk"] = prefill_chunk
        run = CudaRunner(cfg, fw, S, conv, K, V, max_context=max_ctx, prefill_chunk=prefill_chunk,
                         widths=runner_widths(max_tree))
        from tandem_core.ops import triton_gdn as tg
        R["tree_warps"] = tg.TREE_WARPS
        R["widths"] = list(run.widths)
        R["runner_plans"] = {f"{n}x{k}": p.__dict__ for (n, k), p in run.plans.items()}

        log(f"built {R['weights_GB']:.1f} GB of weights in {time.time() - t:.1f}s; floor {R['floor_ms']:.2f} ms "
            f"(all weights), {R['floor_read_ms']:.2f} ms (bytes a decode reads)")

    with phase(R, "capture"):
        t = time.time()
        run.prefill(torch.randint(0, cfg.vocab_size, (300,)).tolist())      # compiles the prefill path too
        run.capture()
        R["capture_s"] = time.time() - t
        log(f"compiled and captured {len(run.graphs)} graphs in {R['capture_s']:.1f}s")
        mem = torch.cuda.max_memory_allocated() / 1e9
        R["max_mem_GB"] = mem

    gen = torch.Generator().manual_seed(1)

    def rand_ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    def snapshot():
        return run.S.clone(), run.conv.clone(), run.K.clone(), run.V.clone(), run.length

    def restore(s):
        run.S.copy_(s[0]); run.conv.copy_(s[1]); run.K.copy_(s[2]); run.V.copy_(s[3]); run.length = s[4]

    # -- exactness on the GPU ----------------------------------------------------------------------------
    with phase(R, "exact"):
        run.reset()
        first = run.prefill(rand_ids(700)).argmax(-1).item()
        snap = snapshot()
        toks, rows = [int(first)], []
        for _ in range(40):
            lg = run.decode(toks[-1])
            rows.append(lg[0].clone())
            toks.append(int(lg[0].argmax()))
        checks = {}
        # a chain of 40 (width 48), or as long as the widest verify
        restore(snap)
        c = min(40, run.widths[-1])
        v = run.verify(toks[:c], [-1] + list(range(c - 1)))
        checks[f"chain{c}"] = all(torch.equal(v[i], rows[i]) for i in range(c))
        # a tree: the chain's first 24 nodes interleaved with distractor branches, width 96 (two row tiles)
        restore(snap)
        tokens, parents, where = [], [], []
        prev = -1
        for i in range(24 if run.widths[-1] >= 96 else max(1, run.widths[-1] * 3 // 10)):
            tokens.append(toks[i]); parents.append(prev); where.append(len(tokens) - 1); prev = len(tokens) - 1
            for j in range(2):                       # two distractors hanging off this chain node
                tokens.append((toks[i] + 1 + j) % cfg.vocab_size); parents.append(prev)
            if i % 3 == 0:                           # and one grandchild under the first distractor
                tokens.append(5); parents.append(prev + 1)
        v = run.verify(tokens, parents)
        checks["tree_interleaved_n%d" % len(tokens)] = all(torch.equal(v[where[i]], rows[i]) for i in range(len(where)))
        # commit the first 10 chain nodes of that tree, then decode: equals plain decode's row 10
        kc = min(10, len(where))
        run.commit(where[:kc])
        lg = run.decode(toks[kc])
        checks["commit_then_decode"] = bool(torch.equal(lg[0], rows[kc]))
        # state after the commit equals the state after plain decode of the same tokens
        restore(snap)
        for tk in toks[:kc]:
            run.decode(tk)
        S_plain, conv_plain = run.S.clone(), run.conv.clone()
        restore(snap)
        run.verify(tokens, parents)
        run.commit(where[:kc])
        checks["state_after_commit"] = bool(torch.equal(run.S, S_plain) and torch.equal(run.conv, conv_plain))
        if not checks["state_after_commit"]:
            dS = (run.S - S_plain).abs().flatten(1).amax(1)
            dC = (run.conv.float() - conv_plain.float()).abs().flatten(1).amax(1)
            checks["state_diff"] = {"S_layers": [i for i in range(len(dS)) if dS[i] != 0][:8],
                                    "S_max": float(dS.max()), "S_nan": bool(torch.isnan(run.S).any()),
                                    "S_plain_nan": bool(torch.isnan(S_plain).any()),
                                    "conv_layers": [i for i in range(len(dC)) if dC[i] != 0][:8],
                                    "conv_max": float(dC.max())}
        # decode rows vs the prefill path on the same tokens (different kernels: a relative error)
        restore(snap)
        pf = run.prefill(toks[:8], all_logits=True)
        rel = [float((pf[i] - rows[i].float()).norm() / rows[i].float().norm()) for i in range(8)]
        checks["decode_vs_prefill_rel_max"] = max(rel)
        R["exact"] = checks
        log(f"exactness: {checks}")

    with phase(R, "spec_vs_plain"):
        restore(snap)
        plain = [int(first)]
        for _ in range(64):
            plain.append(int(run.decode(plain[-1])[0].argmax()))
        def greedy_spec(draft_of) -> dict:
            """Rounds of verify + walk + commit from the snapshot with ``draft_of(seq)`` chains; vs plain greedy."""
            restore(snap)
            seq, rounds, accepted = [int(first)], 0, 0       # last element: the model's own token, not forwarded
            while len(seq) < 65:
                draft = draft_of(seq)
                v = run.verify([seq[-1]] + draft, [-1] + list(range(len(draft))))
                picks = run.picks(v)
                k = 0
                while k < len(draft) and draft[k] == picks[k]:
                    k += 1
                run.commit(list(range(k + 1)))
                seq += draft[:k] + [picks[k]]
                rounds += 1
                accepted += k
            return {"equal": seq[:65] == plain[:65], "rounds": rounds, "accepted_drafts": accepted}

        import random
        rng = random.Random(0)

        def oracle(k_draft):
            def draft_of(seq):                               # plain's next tokens, one of them sometimes wrong
                pos = len(seq) - 1
                draft = list(plain[pos + 1:pos + 1 + k_draft]) or [seq[-1]]
                bad = rng.randint(0, k_draft + 2)
                if bad < len(draft):
                    draft[bad] = (draft[bad] + 1) % cfg.vocab_size
                return draft
            return draft_of

        R["spec"] = {"lookup": greedy_spec(lambda seq: lookup_draft(seq, 6))}
        for k_draft in (4, 12):
            R["spec"][f"oracle{k_draft}"] = greedy_spec(oracle(k_draft))
        log(f"spec vs plain: {R['spec']}")

    # -- timing ----------------------------------------------------------------------------------------
    def decode_ms(steps: int = 30) -> tuple[float, float]:
        tok = [int(torch.randint(0, cfg.vocab_size, (1,)))]
        graph, full = [], []
        for _ in range(steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            lg = run.decode(tok[-1])
            e1.record()
            tok.append(run.picks(lg)[0])
            full.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            graph.append(e0.elapsed_time(e1))
        return statistics.median(graph[3:]), statistics.median(full[3:])

    def verify_curve(reps: int = 8) -> dict:
        out = {}
        for W in run.widths:
            toks = rand_ids(W)
            ts = timed(torch, lambda: run.verify(toks, [-1] + list(range(W - 1))), reps, warm=1)
            out[W] = statistics.median(ts)
        return out

    def prefill_rate(T: int) -> float:
        run.reset()
        ids = rand_ids(T)
        torch.cuda.synchronize()
        t = time.perf_counter()
        run.prefill(ids)
        torch.cuda.synchronize()
        return T / (time.perf_counter() - t)

    R["decode"], R["verify"], R["prefill"] = {}, {}, {}
    with phase(R, "prefill"):
        if not prefill:
            raise RuntimeError("skipped (--skip-prefill)")
        prefill_rate(2048)                                    # warm
        for T in (2048, 8192, 32768):
            if time.time() - T0 > budget_s:
                log("time budget reached: skipping the rest of prefill")
                break
            R["prefill"][T] = prefill_rate(T)
            log(f"prefill {T}: {R['prefill'][T]:.0f} tok/s")

    with phase(R, "decode_verify"):
        run.reset()
        for ctx in (1024, 4096, 16384, 32768):
            if time.time() - T0 > budget_s:
                log("time budget reached: skipping longer contexts")
                break
            run.prefill(rand_ids(ctx - run.length))
            snapc = (run.length,)
            R["verify"][ctx] = verify_curve()
            if ctx in (4096, 32768):
                g_ms, f_ms = decode_ms()
                R["decode"][ctx] = {"graph_ms": g_ms, "step_ms": f_ms}
                run.length = snapc[0]                          # decode's tokens are dropped (state is not: fine)
            log(f"ctx {ctx}: verify {json.dumps({k: round(v, 2) for k, v in R['verify'][ctx].items()})} "
                f"decode {R['decode'].get(ctx)}")

    with phase(R, "matmul_only"):
        # the weight matmuls alone as a graph, at 1 / 16 / 64 / 128 rows (what the kernels give the bandwidth)
        from tandem_core.ops import triton_matmul as tm
        mats = [w for w, _ in decode_mats(fw)]
        R["matmul_only"] = {}
        for M in (m for m in (1, 16, 64, 128) if m <= run.widths[-1]):
            x = torch.randn(M, max(w.shape[1] for w in mats), device="cuda", dtype=torch.bfloat16)
            outs, pls = [], []
            for w in mats:
                p = run.plans[(int(w.shape[0]), int(w.shape[1]))]
                pls.append(p)
                outs.append(torch.empty((p.split, M, w.shape[0]) if p.split > 1 else (M, w.shape[0]),
                                        dtype=torch.float32 if p.split > 1 else torch.bfloat16, device="cuda"))

            def body():
                for w, p, o in zip(mats, pls, outs):
                    tm.skinny_matmul(x[:, :w.shape[1]], w, p, out=o)
            R["matmul_only"][M] = graph_ms(torch, body)
        log(f"matmul only: {R['matmul_only']}")

    with phase(R, "prices"):
        from tandem_core.spec.cut import PriceTable
        ctxs = sorted(int(c) for c in R["verify"])
        widths = list(run.widths)
        table = PriceTable(tuple(widths), tuple(ctxs), tuple(tuple(float(R["verify"][c][w]) for w in widths)
                                                            for c in ctxs),
                           {"model": "qwen3.8-27b", "profile": "bf16", "device": "h200",
                            "meta": {"tool": "tools/bench_gpu.py engine", "repeats": 8,
                                     "gpu": R["device"], "weights": "random bf16 at the 27B shape"}})
        table.save(out / ("bf16.h200.json" if run.widths[-1] == WIDTHS[-1] else f"bf16.h200.w{run.widths[-1]}.json"))
    (out / "engine.json").write_text(json.dumps(R, indent=1, default=str))
    return R


# -- the integrated engine ----------------------------------------------------------------------------------
def random_qwen38_weights(cfg, torch, seed: int = 0):
    """``Qwen38Weights`` at ``cfg``'s shape with random bf16 weights built on the GPU, through ``build_weights``
    (the loader's own construction), scaled as ``random_weights``."""
    from tandem_qwen38.weights import build_weights, expected_tensors

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    shapes = {name: e.shape for name, e in expected_tensors(cfg).items()}

    def get(name: str):
        shape = shapes[name]
        if name.endswith("A_log"):
            return torch.log(torch.rand(shape, device="cuda", generator=g) * 15 + 1)
        if name.endswith("conv1d.weight"):
            return torch.randn(shape, device="cuda", generator=g) * 0.5
        if name == "embed_tokens.weight":
            return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        if len(shape) == 2:
            return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) * (shape[1] ** -0.5)
        return torch.randn(shape, device="cuda", generator=g) * (0.5 if name.endswith("dt_bias") else 0.1)

    return build_weights(get, cfg, "bf16", "cuda", tied=False)


def run_integrated(out: Path, budget_s: float, ctx: int = 4096) -> dict:
    """Decode at ``ctx`` and verify 16 / 64 through the engine (forward, forward_tree, picks, commit_tree,
    settle), beside a bare ``CudaRunner`` over the same fused weights (same matmul plans) at the same context."""
    import torch

    from tandem_qwen38.config import read_config
    from tandem_qwen38.cuda_graphs import CudaRunner, fuse_weights
    from tandem_qwen38.serving import build_engine

    torch.backends.cuda.matmul.allow_tf32 = False
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "context": ctx}
    cfg = read_config(SHAPE)
    gen = torch.Generator().manual_seed(3)

    def rand_ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    with phase(R, "build"):
        t = time.time()
        w = random_qwen38_weights(cfg, torch)
        torch.cuda.synchronize()
        R["weights_GB"] = w.nbytes / 1e9
        log(f"weights {R['weights_GB']:.1f} GB in {time.time() - t:.1f}s")
        t = time.time()
        eng = build_engine(cfg, w, ctx + 1024, 4096, max_tree=64)
        R["engine_build_s"] = time.time() - t
        R["caps"] = {"device": eng.caps.device, "dtype": eng.caps.dtype, "max_tree": eng.caps.max_tree}
        log(f"engine built and captured in {R['engine_build_s']:.1f}s: {R['caps']}")
        ids = rand_ids(ctx)
        t = time.time()
        first = int(eng.picks(eng.forward(ids))[0])
        torch.cuda.synchronize()
        R["prefill_tok_s"] = ctx / (time.time() - t)
        snap = eng.state.clone()

    def events(fn, reps: int) -> tuple[float, float]:
        """Median device ms (events from the call to ``mark()``, which ``fn`` calls once the verb has queued its
        work, before the picks) and host ms (the call through the picks, which wait for the device)."""
        dev_ms, host_ms = [], []
        for i in range(reps + 3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            fn(e1.record)
            host = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            if i >= 3:
                dev_ms.append(e0.elapsed_time(e1))
                host_ms.append(host)
        return statistics.median(dev_ms), statistics.median(host_ms)

    with phase(R, "engine"):
        tok = [first]

        def step(mark):
            lg = eng.forward([tok[-1]])
            mark()
            tok.append(int(eng.picks(lg)[0]))

        eng.state.restore(snap)
        R["engine_decode_ms"], R["engine_decode_host_ms"] = events(step, 30)
        R["engine_verify_ms"], R["engine_round_ms"] = {}, {}
        for W in (16, 64):
            chain = rand_ids(W)
            par = list(range(-1, W - 1))
            eng.state.restore(snap)

            def verify(mark):
                lg = eng.forward_tree(chain, par).logits
                mark()
                eng.picks(lg).tolist()
                eng.discard_pending()

            R["engine_verify_ms"][W] = events(verify, 10)

            def round_(mark):
                eng.picks(eng.forward_tree(chain, par).logits).tolist()
                eng.commit_tree(list(range(W)))
                eng.settle()
                mark()

            eng.state.restore(snap)
            R["engine_round_ms"][W] = events(round_, 8)       # the context grows by W a round (< 800 tokens)
        log(f"engine: decode {R['engine_decode_ms']:.2f} ms (host {R['engine_decode_host_ms']:.2f}), "
            f"verify {R['engine_verify_ms']}, round (verify + picks + commit of the whole chain + settle) "
            f"{R['engine_round_ms']}")

    with phase(R, "runner"):
        n_attn = len(cfg.attention_layers)
        S = torch.zeros_like(eng.state.sections["gdn.S"])
        conv = torch.zeros_like(eng.state.sections["gdn.conv"])
        K = torch.zeros(n_attn, cfg.num_key_value_heads, ctx + 1024 + 64, cfg.head_dim, dtype=torch.bfloat16,
                        device="cuda")
        V = torch.zeros_like(K)
        run = CudaRunner(cfg, fuse_weights(w, cfg), S, conv, K, V, max_context=ctx + 1024 + 64,
                         widths=(1, 2, 4, 8, 16, 24, 32, 48, 64), prefill_chunk=4096)
        run.prefill(ids)
        run.capture()
        keep = (S.clone(), conv.clone(), run.length)
        rt = [first]

        def rstep(mark):
            lg = run.decode(rt[-1])
            mark()
            rt.append(run.picks(lg)[0])

        R["runner_decode_ms"], R["runner_decode_host_ms"] = events(rstep, 30)
        R["runner_verify_ms"] = {}
        for W in (16, 64):
            S.copy_(keep[0])
            conv.copy_(keep[1])
            run.length = keep[2]
            chain = rand_ids(W)
            par = list(range(-1, W - 1))

            def rverify(mark):
                lg = run.verify(chain, par)
                mark()
                run.picks(lg)

            R["runner_verify_ms"][W] = events(rverify, 10)
        log(f"runner: decode {R['runner_decode_ms']:.2f} ms (host {R['runner_decode_host_ms']:.2f}), "
            f"verify {R['runner_verify_ms']}")
        same = [first]
        eng.state.restore(snap)
        for _ in range(16):
            same.append(int(eng.picks(eng.forward([same[-1]]))[0]))
        R["engine_decode_equals_runner"] = same[:17] == rt[:17]
    (out / "integrated.json").write_text(json.dumps(R, indent=1, default=str))
    return R


def integrated_table(R: dict) -> str:
    lines = [f"Integrated engine at {R.get('context')} tokens of context ({R.get('device')}, torch {R.get('torch')}):",
             "", "| what | engine verbs (device ms / host ms) | bare CudaRunner (device ms / host ms) |",
             "|---|---|---|"]
    if "engine_decode_ms" in R and "runner_decode_ms" in R:
        lines.append(f"| decode, ms/token (forward + picks) | {R['engine_decode_ms']:.2f} / "
                     f"{R['engine_decode_host_ms']:.2f} | {R['runner_decode_ms']:.2f} / "
                     f"{R['runner_decode_host_ms']:.2f} |")
    for W in ("16", "64"):
        e = R.get("engine_verify_ms", {}).get(W) or R.get("engine_verify_ms", {}).get(int(W))
        r = R.get("runner_verify_ms", {}).get(W) or R.get("runner_verify_ms", {}).get(int(W))
        if e and r:
            lines.append(f"| verify {W} (forward_tree + picks) | {e[0]:.2f} / {e[1]:.2f} | {r[0]:.2f} / {r[1]:.2f} |")
    for W in ("16", "64"):
        e = R.get("engine_round_ms", {}).get(W) or R.get("engine_round_ms", {}).get(int(W))
        if e:
            lines.append(f"| round {W} (+ commit_tree of all {W} + settle), host ms | {e[1]:.2f} | |")
    lines += ["", f"engine build + graph capture {R.get('engine_build_s', 0):.1f} s; prefill "
              f"{R.get('prefill_tok_s', 0):,.0f} tok/s (chunk 4096, first call, compiles); caps {R.get('caps')}; "
              f"engine decode tokens equal the runner's: {R.get('engine_decode_equals_runner')}"]
    if R.get("errors"):
        lines.append("Phases that failed: " + ", ".join(R["errors"]))
    return "\n".join(lines) + "\n"


# -- the peer: transformers ----------------------------------------------------------------------------------
def run_peer(out: Path, fla: bool, budget_s: float) -> dict:
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    R: dict = {"transformers": transformers.__version__, "fla": fla}
    if fla:
        import fla as _fla  # noqa: F401  (transformers picks it up on its own)
        R["fla_version"] = getattr(_fla, "__version__", "?")
    cfg = dict(SHAPE)
    cfg.pop("model_type")
    conf = Qwen3_5TextConfig(**cfg)
    conf._attn_implementation = "sdpa"
    with phase(R, "build"):
        with torch.device("meta"):
            model = Qwen3_5ForCausalLM(conf)
        model = model.to_empty(device="cuda").to(torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, p.shape[-1] ** -0.5, generator=g)
                elif "A_log" in name:
                    p.copy_(torch.log(torch.rand(p.shape, device="cuda", generator=g) * 15 + 1))
                else:
                    p.normal_(0, 0.1, generator=g)
        # rotary inv_freq is a buffer computed at init on meta: recompute it
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
        for mod in model.modules():
            if isinstance(mod, Qwen3_5TextRotaryEmbedding):
                inv, _ = mod.compute_default_rope_parameters(mod.config)
                mod.inv_freq = inv.to("cuda")
                mod.original_inv_freq = inv.to("cuda").clone()
        model.eval()
        log(f"peer built (fla={fla})")

    def prefill(T: int):
        from transformers import DynamicCache
        cache = DynamicCache(config=conf)
        ids = torch.randint(0, conf.vocab_size, (1, T), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            o = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return T / (time.perf_counter() - t), o.past_key_values, o.logits[:, -1].argmax(-1)

    def decode(cache, tok, steps: int):
        ts = []
        with torch.no_grad():
            for _ in range(steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                o = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
                tok = o.logits[:, -1].argmax(-1)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts[len(ts) // 2:])

    R["prefill"], R["decode"] = {}, {}
    lengths = (2048, 8192, 32768) if fla else (2048,)
    with phase(R, "prefill"):
        prefill(512)                                            # warm (fla compiles and tunes here)
        for T in lengths:
            if time.time() - T0 > budget_s:
                log("peer: time budget reached")
                break
            if fla:                                             # a first run at this length tunes fla's kernels
                prefill(T)
                torch.cuda.empty_cache()
            rate, cache, tok = prefill(T)
            R["prefill"][T] = rate
            log(f"peer prefill {T}: {rate:.0f} tok/s")
            if T in (2048, 32768) or (T == 8192 and not fla):
                R["decode"][T] = decode(cache, tok, 16 if fla else 6)
                log(f"peer decode at {T}: {R['decode'][T]:.1f} ms/token")
            del cache
            torch.cuda.empty_cache()
    with phase(R, "decode4k"):
        if time.time() - T0 < budget_s:
            rate, cache, tok = prefill(4096)
            R["decode"][4096] = decode(cache, tok, 12 if fla else 6)
            log(f"peer decode at 4096: {R['decode'][4096]:.1f} ms/token")
    (out / ("peer_fla.json" if fla else "peer_torch.json")).write_text(json.dumps(R, indent=1, default=str))
    return R


# -- report ----------------------------------------------------------------------------------------------------
def report(out: Path) -> str:
    def load(name):
        p = out / name
        return json.loads(p.read_text()) if p.exists() else {}

    E, P1, P0 = load("engine.json"), load("peer_fla.json"), load("peer_torch.json")
    lines = ["## Measured", ""]
    if E:
        lines += [f"Device: {E.get('device')}, torch {E.get('torch')}, triton {E.get('triton')}.", "",
                  f"- copy bandwidth {E.get('copy_TBps', 0):.2f} TB/s (read + write); weights "
                  f"{E.get('weights_GB', 0):.1f} GB; floor {E.get('floor_ms', 0):.2f} ms/token (every weight once), "
                  f"{E.get('floor_read_ms', 0):.2f} ms (the bytes a decode step reads: all but the embedding)",
                  ""]
        lines += ["| decode | graph ms/token | step ms/token (with the pick) | goal |", "|---|---|---|---|"]
        for ctx, goal in (("4096", "<= 13.4"), ("32768", "<= 15")):
            d = E.get("decode", {}).get(ctx)
            if d:
                lines.append(f"| {ctx} | {d['graph_ms']:.2f} | {d['step_ms']:.2f} | {goal} |")
        lines += ["", "Verify cost (ms, one graph replay, chain of N nodes):", ""]
        ver = E.get("verify", {})
        if ver:
            widths = list(next(iter(ver.values())).keys())
            lines.append("| context | " + " | ".join(widths) + " |")
            lines.append("|---" * (len(widths) + 1) + "|")
            for ctx, row in ver.items():
                dec = E.get("decode", {}).get(ctx, {}).get("graph_ms")
                lines.append(f"| {ctx} | " + " | ".join(f"{row[w]:.2f}" for w in widths) + " |")
                if dec:
                    lines.append(f"| {ctx} / decode | " + " | ".join(f"{row[w] / dec:.3f}" for w in widths) + " |")
        lines += ["", "| prefill tokens | tok/s (ours) | goal |", "|---|---|---|"]
        for T, goal in (("2048", ""), ("8192", ">= 11,000"), ("32768", ">= 10,000")):
            if T in E.get("prefill", {}):
                lines.append(f"| {T} | {E['prefill'][T]:,.0f} | {goal} |")
        if "matmul_only" in E:
            lines += ["", "Weight matmuls alone (graph, ms): " + ", ".join(
                f"{M} rows {v:.2f}" for M, v in E["matmul_only"].items())]
        if E.get("plans"):
            lines += ["", "Matmul plans chosen in the run (per shape, lowest t(1) + t(64)/2, each timed as one graph "
                      "over every layer's matrix of the shape):", "",
                      "| weight N x K | layout | BN | BK | split | stages | us at 1 row | GB/s at 1 row | us at 64 rows |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for shp, v in E["plans"].items():
                pl = v["plan"]
                lines.append(f"| {shp} | {pl.get('layout')} | {pl['BN']} | {pl['BK']} | {pl['split']} | "
                             f"{pl['stages']} | {v['us_1']:.1f} | {v['GBps_1']:,.0f} | {v['us_64']:.1f} |")
        if E.get("tree_ms"):
            lines += ["", "Gated DeltaNet tree kernel over the 48 GDN layers (ms at 64 nodes, "
                      "at 1 node) by warps per program: " + ", ".join(
                          f"{w}: {v[0]:.3f} / {v[1]:.3f}" for w, v in E["tree_ms"].items()) +
                      f"; the runner used {E.get('tree_warps')}"]
        refused = [f"{shp} {c[0]['layout']} {c[0]['BN']}/{c[0]['BK']}/{c[0]['split']}"
                   for shp, v in E.get("plans", {}).items() for c in v["candidates"] if c[1] == "not row-invariant"]
        if E.get("plans"):
            lines += ["", "Plans refused as not row-invariant on the device: " + (", ".join(refused) or "none")]
        if E.get("chunk_scan_ms"):
            lines += ["", "Chunked gated delta rule at 4096 tokens (one layer, ms) by value columns per program: " +
                      ", ".join(f"{k}: {v:.3f}" for k, v in E["chunk_scan_ms"].items())]
        lines += ["", f"Exactness on the GPU: {E.get('exact')}", f"Greedy speculative vs plain: {E.get('spec')}"]
        if E.get("errors"):
            lines += ["", "Phases that failed: " + ", ".join(E["errors"])]
    for name, P in (("transformers + flash-linear-attention", P1), ("transformers (torch fallback)", P0)):
        if not P:
            lines += ["", f"{name}: not measured."]
            continue
        lines += ["", f"### {name} ({P.get('transformers')})", "", "| what | peer | ours | ours / peer speed |",
                  "|---|---|---|---|"]
        for T, v in P.get("prefill", {}).items():
            ours = E.get("prefill", {}).get(T)
            lines.append(f"| prefill {T} tok/s | {v:,.0f} | {ours:,.0f} | {ours / v:.2f}x |" if ours else
                         f"| prefill {T} tok/s | {v:,.0f} | - | - |")
        for T, v in P.get("decode", {}).items():
            ours = E.get("decode", {}).get(T, {}).get("step_ms") or E.get("decode", {}).get("4096", {}).get("step_ms")
            lines.append(f"| decode at {T} ms/token | {v:.1f} | {ours:.2f} | {v / ours:.2f}x |" if ours else
                         f"| decode at {T} ms/token | {v:.1f} | - | - |")
        if P.get("errors"):
            lines.append(f"\nPeer phases that failed: {', '.join(P['errors'])}")
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["engine", "integrated", "peer", "report"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fla", action="store_true", help="the peer with flash-linear-attention importable")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which long phases are skipped")
    ap.add_argument("--no-tune", action="store_true", help="keep the heuristic matmul plans")
    ap.add_argument("--max-tree", type=int, default=128, help="the widest verify the engine captures")
    ap.add_argument("--skip-prefill", action="store_true", help="leave out the prefill phase")
    ap.add_argument("--prefill-chunk", type=int, default=8192,
                    help="rows a prefill forward runs at a time (the CUDA serving default, CUDA_PREFILL_CHUNK)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.part == "engine":
        R = run_engine(out, a.budget, not a.no_tune, a.max_tree, not a.skip_prefill, a.prefill_chunk)
        print(report(out))
        if R.get("errors"):
            for k, v in R["errors"].items():
                print(f"==== {k}\n{v}")
    elif a.part == "integrated":
        R = run_integrated(out, a.budget)
        print(integrated_table(R))
        for k, v in R.get("errors", {}).items():
            print(f"==== {k}\n{v}")
    elif a.part == "peer":
        R = run_peer(out, a.fla, a.budget)
        print(json.dumps({k: v for k, v in R.items() if k != "errors"}, default=str))
        for k, v in R.get("errors", {}).items():
            print(f"==== {k}\n{v}")
    else:
        print(report(out))


if __name__ == "__main__":
    main()
