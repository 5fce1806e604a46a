"""Benchmark the Flash-Next CUDA runner at the published Flash-Next shape (experts cut to fit), against transformers.

Random bf16 weights built in GPU memory (no checkpoint on disk), batch 1, in one process:

- ours (``FlashNextCudaRunner``, CUDA graphs, through the core's ``SequenceEngine``): decode ms/token at ``--context``
  tokens of context (the greedy pick read back every step, as serving does), the verify curve (a chain of each
  width in ``--widths`` on that state, over one decode step), prefill tokens/s of a ``--prefill``-token prompt;
- the floors: decode against the weights a token reads once at ``--bandwidth`` TB/s (every dense weight, the
  head, ``top_k`` experts a layer, the PLE projections; the embedding and PLE rows are a few rows), prefill
  against ``--tflops``;
- transformers 5.24.0 (``Qwen4ExpForCausalLM``, its own forward, no graphs or compile, attention ``--hf-attn``)
  over the same tensors (the model built on the meta device and handed ours, the PLE table copied to the device:
  transformers keeps it there): decode ms/token at the same context and prefill tokens/s.

The published shape (``plugins/flashnext/tandem_flashnext/shipped/models/flashnext/model.yaml``): hidden 2560, 48
layers (36 Gated DeltaNet, 12 QSA), 24/2 heads of 256, linear 16/48 heads of 128, 512 experts of 640 (top 10) and a
shared one, 4 hyper-connection streams (low rank 320), PLE on layer 2 (2560 features, 16 hashed heads), the indexer 4
heads of 128 with a budget of 2048 in blocks of 4, vocabulary 248320. Two cuts, both named in the output:

- ``--experts`` (default 224 of 512): 512 experts are 241.6 GB in bf16, more than the H200's 139 GiB; a decode
  step reads ``top_k`` = 10 experts a layer whatever their count, so the cut changes what a step reads by nothing
  but the router's rows;
- ``--ngram-base`` (default 100,000 for the published 20,000,000): the PLE table's rows (16 primes from the base); a
  step gathers 16 rows a token whatever the table's size, and transformers needs the table on the device.

``--budget`` seconds bound the run: a stage whose estimate does not fit in what is left is skipped (named in the
table); the JSON and the markdown table are written under ``--out`` whatever happens. ``--shape tiny --device
cpu`` runs the whole script at a tiny shape on the CPU (the reference runner there), to check the script itself.

Goal (issue 15): decode <= 3.0 ms/token at 4K context.

    python tools/bench_flashnext_gpu.py --out /tmp/flashnext --budget 300
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import Budget, fmt, hf_decode, hf_prefill, sync

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "plugins" / "flashnext", ROOT / "plugins" / "qwen38_27b", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PUBLISHED = dict(
    vocab_size=248320, hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=640,
    shared_expert_intermediate_size=640, num_experts=512, num_experts_per_tok=10, hc_count=4, hc_lowrank=320,
    ple_layer_ids=[2], ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, indexer_n_heads=4,
    indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, attention_every=4, mrope=[11, 11, 10],
    rope_theta=10_000_000.0, eos=248044)
TINY = dict(PUBLISHED, vocab_size=320, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=24, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2, hc_count=3, hc_lowrank=16,
            ple_embed_dim=48, indexer_n_heads=2, indexer_head_dim=16, indexer_budget=16, mrope=[2, 1, 1], eos=317)
SHAPES = {"published": PUBLISHED, "tiny": TINY}
GOALS = {"decode_ms": 3.0}


def raw_config(shape: dict[str, Any], experts: int, ngram_base: int, max_positions: int) -> dict[str, Any]:
    """A ``qwen4_exp_text`` config.json at ``shape`` with ``experts`` routed experts and the PLE base cut."""
    s = dict(shape)
    every, mrope, theta, eos = s.pop("attention_every"), s.pop("mrope"), s.pop("rope_theta"), s.pop("eos")
    n = s["num_hidden_layers"]
    return dict(s, model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"],
                num_experts=min(int(experts), s["num_experts"]), ngram_vocab_size_base=int(ngram_base),
                layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
                max_position_embeddings=max(262144, max_positions), rms_norm_eps=1e-6, split_ngram_parts=1,
                seed=1234, indexer_kv_heads=1, eos_token_id=eos, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                                 "mrope_section": mrope, "mrope_interleaved": True})


def random_weights(cfg: Any, device: str, dtype: str, seed: int = 0) -> Any:
    """``FlashNextWeights`` in ``dtype`` on ``device``, built tensor by tensor (nothing else holds them, so the
    runner's expert stacking frees each original): matrices ``N(0, 1/fan_in)``, zero-centred norms small, the
    decay and gates as a trained model's; the PLE table random on the host."""
    from tandem_flashnext.layout import expected_tensors
    from tandem_flashnext.ngram import RowTable, ngram_hashes
    from tandem_flashnext.weights import build_weights

    act = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {k: e.shape for k, e in expected_tensors(cfg).items()}
    hashes = ngram_hashes(cfg)

    def get(name: str) -> torch.Tensor:
        shape = tuple(shapes[name])
        if name.endswith("A_log"):
            return torch.log(torch.rand(shape, device=device, generator=gen) * 15 + 1)
        if name.endswith("dt_bias"):
            return torch.randn(shape, device=device, generator=gen) * 0.1
        if len(shape) >= 2 and not name.endswith("conv1d.weight"):
            return torch.randn(shape, device=device, dtype=act, generator=gen) * shape[-1] ** -0.5
        if name.endswith("conv1d.weight"):
            return torch.randn(shape, device=device, generator=gen) * 0.3
        if name.endswith("linear_attn.norm.weight"):
            return torch.ones(shape, device=device)
        return torch.randn(shape, device=device, generator=gen) * 0.05          # zero-centred norms

    def tables(layer: int) -> Any:
        m = cfg.ple_slot(layer)
        rows = hashes[m].rows
        g = torch.Generator().manual_seed(seed + layer)
        return RowTable([(torch.randn(rows, cfg.ngram_head_dim, generator=g) * 0.5).to(act)])

    return build_weights(get, cfg, dtype, device, tables=tables, tied=False)


def hf_model(raw: dict[str, Any], cfg: Any, w: Any, attn: str, device: str) -> Any:
    """transformers' ``Qwen4ExpForCausalLM`` over our tensors (projections, experts and embedding shared; the small
    vectors and the PLE table copied), built on the meta device."""
    from tandem_flashnext.cuda_runner import _fused
    from tandem_flashnext.weights import GDNWeights
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    hf_cfg = Qwen4ExpTextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    hf_cfg._attn_implementation = attn
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(hf_cfg)
    act = w.act_dtype
    fw = _fused(cfg, w)                         # the stacked experts (transformers' own layout: [E, 2I, H], [E, H, I])
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed, "lm_head.weight": w.head.weight}

    def hyper(p: str, hc: Any) -> None:
        sd[p + "hc_norm.weight"] = hc.norm.to(act)
        sd[p + "input_mix_weight_down.weight"] = hc.down.weight
        sd[p + "input_mix_weight_up.weight"] = hc.up.weight
        if hc.inject is not None:
            sd[p + "block_inject_weight.weight"] = hc.inject.weight

    hyper("model.hyper_connection_mixer.", w.final_hc)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        hyper(p + "attn_hyper_connection.", lw.attn_hc)
        hyper(p + "mlp_hyper_connection.", lw.mlp_hc)
        m = lw.mixer
        if isinstance(m, GDNWeights):
            a = p + "linear_attn."
            for name, lin in (("in_proj_qkv", m.in_qkv), ("in_proj_z", m.in_z), ("in_proj_b", m.in_b),
                              ("in_proj_a", m.in_a), ("out_proj", m.out)):
                sd[a + name + ".weight"] = lin.weight
            sd[a + "conv1d.weight"] = m.conv.to(act)[:, None, :]
            sd[a + "A_log"], sd[a + "dt_bias"], sd[a + "norm.weight"] = m.A_log.to(act), m.dt_bias.to(act), \
                m.norm.to(act)
        else:
            a = p + "self_attn."
            for name, lin in (("q_proj", m.q), ("k_proj", m.k), ("v_proj", m.v), ("o_proj", m.o),
                              ("indexer.index_qk_proj", m.index_qk)):
                sd[a + name + ".weight"] = lin.weight
            sd[a + "q_norm.weight"], sd[a + "k_norm.weight"] = m.q_norm.to(act), m.k_norm.to(act)
            sd[a + "indexer.q_layernorm.weight"] = m.index_q_norm.to(act)
            sd[a + "indexer.k_layernorm.weight"] = m.index_k_norm.to(act)
        q = p + "mlp."
        sd[q + "gate.weight"] = lw.moe.router.weight
        sd[q + "experts.gate_up_proj"], sd[q + "experts.down_proj"] = fw.gate_up[i], fw.down[i]
        sh = lw.moe.shared
        sd[q + "shared_expert.gate_proj.weight"], sd[q + "shared_expert.up_proj.weight"] = sh.gate.weight, sh.up.weight
        sd[q + "shared_expert.down_proj.weight"] = sh.down.weight
        sd[q + "shared_expert_gate.weight"] = lw.moe.shared_gate.weight
        if lw.ple is not None:
            e = p + "ple."
            pl = lw.ple
            sd[e + "key_proj.weight"], sd[e + "value_proj.weight"] = pl.key.weight, pl.value.weight
            for name in ("norm_key", "norm_query", "norm_conv"):
                sd[e + name + ".weight"] = getattr(pl, name).to(act)
            sd[e + "conv1d.weight"] = pl.conv.to(act)[:, None, :]
            sd[e + "ple_embedding.ngram_embedding.weight"] = torch.cat(list(pl.table.parts)).to(device)
            h = pl.hash
            sd[e + "ple_embedding.layer_multipliers"] = torch.tensor(h.multipliers, dtype=torch.long, device=device)
            sd[e + "ple_embedding.ngram_heads_vocab_sizes"] = torch.tensor(h.sizes, dtype=torch.long, device=device)
            sd[e + "ple_embedding.ngram_heads_offsets"] = torch.tensor(h.offsets, dtype=torch.long, device=device)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or missing:
        raise RuntimeError(f"bench: the transformers model's keys differ: missing {missing[:8]}, unexpected "
                           f"{unexpected[:8]}")
    rot = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rot)(hf_cfg)                        # its buffers were on meta
    return model.eval()


def ours_decode(eng: Any, prompt: list[int], steps: int, widths: list[int], repeats: int) -> dict[str, Any]:
    eng.reset()
    last = eng.forward(prompt)[-1].float().cpu()
    tok = int(last.argmax())
    base = eng.state.clone()
    for _ in range(3):                                          # warm-up
        eng.forward([tok])
    eng.state.restore(base)
    times: list[float] = []
    tokens: list[int] = []
    first = tok
    for _ in range(steps):
        t = time.perf_counter()
        tok = int(eng.forward([tok])[0].argmax())                # the pick read back: one sync a step
        times.append(time.perf_counter() - t)
        tokens.append(tok)
    eng.state.restore(base)
    d = statistics.median(times) * 1e3
    curve: dict[str, float] = {}
    for W in widths:
        chain = ([first, *tokens] + [3] * W)[:W]
        vt: list[float] = []
        for i in range(repeats + 2):
            t = time.perf_counter()
            out = eng.forward_tree(chain, list(range(-1, W - 1)))
            int(out.logits[0].argmax())
            if i >= 2:
                vt.append(time.perf_counter() - t)
            eng.discard_pending()
        curve[str(W)] = statistics.median(vt) * 1e3
    return {"decode_ms": d, "decode_mean_ms": statistics.fmean(times) * 1e3, "verify_ms": curve,
            "verify_over_decode": {k: v / d for k, v in curve.items()}, "_last": last}


def ours_prefill(eng: Any, n: int, vocab: int, device: str) -> dict[str, Any]:
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    eng.reset()
    eng.forward(ids[: min(n, 512)])                             # warm-up: the prefill kernels built
    sync(device)
    eng.reset()
    t = time.perf_counter()
    int(eng.forward(ids)[-1].argmax())
    s = time.perf_counter() - t
    eng.reset()
    return {"prefill_ms": s * 1e3, "prefill_tok_s": n / s}


def floors(cfg: Any, w: Any, context: int, bandwidth_tbs: float, tflops: float) -> dict[str, Any]:
    """What a decode step reads once (bytes) and a prefill row multiplies (FLOPs)."""
    from tandem_flashnext.weights import GDNWeights

    el = 2 if w.dtype == "bf16" else 4
    dense = 0
    for lin in w.linears():
        dense += lin.shape[0] * lin.shape[1]
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    experts_all = cfg.num_hidden_layers * cfg.num_experts * per_expert
    active_experts = cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    read = dense - experts_all + active_experts                         # every dense weight once, top_k experts
    kv = len(cfg.attention_layers) * min(context, cfg.indexer_budget + cfg.indexer_compress_ratio) * \
        2 * cfg.num_key_value_heads * cfg.head_dim * el                 # the selected tokens' K and V
    gdn = sum(1 for lw in w.layers if isinstance(lw.mixer, GDNWeights))
    state = gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 * 2
    flops = 2 * (read - cfg.vocab_size * cfg.hidden_size)               # a prefill row skips the head
    return {"read_params": read, "weight_gb": read * el / 1e9, "kv_gb_at_context": kv / 1e9,
            "state_gb": state / 1e9, "decode_floor_ms": read * el / (bandwidth_tbs * 1e12) * 1e3,
            "decode_floor_all_ms": (read * el + kv + state) / (bandwidth_tbs * 1e12) * 1e3,
            "prefill_floor_tok_s": tflops * 1e12 / flops}


def run(a: argparse.Namespace, budget: Budget, log: Callable[[str], None]) -> dict[str, Any]:
    from tandem_flashnext.config import read_config
    from tandem_flashnext.serving import make_runner

    from tandem_core.engine import SequenceEngine

    dev, dtype = a.device, "bf16" if a.device.startswith("cuda") else "fp32"
    row: dict[str, Any] = {"shape": a.shape, "experts": f"{a.experts} of 512", "ngram_base": a.ngram_base,
                           "skipped": []}
    raw = raw_config(SHAPES[a.shape], a.experts, a.ngram_base, a.prefill + 256)
    row["experts"] = f"{raw['num_experts']} of {SHAPES[a.shape]['num_experts']}"
    cfg = read_config(raw)
    t = time.perf_counter()
    w = random_weights(cfg, dev, dtype)
    sync(dev)
    row["weights_s"] = time.perf_counter() - t
    row |= floors(cfg, w, a.context, a.bandwidth, a.tflops)
    log(f"{a.shape}: {row['experts']} experts, {row['read_params'] / 1e9:.2f} B parameters read a token, weights "
        f"built in {row['weights_s']:.1f} s, PLE table {w.table_bytes / 2**30:.2f} GiB on the host")
    t = time.perf_counter()
    max_tree = max(a.widths)
    runner = make_runner(cfg, w, max_context=max(a.prefill, a.context) + 64, prefill_chunk=a.prefill_chunk,
                         max_tree=max_tree, cuda_runner=True)
    eng = SequenceEngine(runner, name="qwen4_exp")
    sync(dev)
    row["runner"], row["capture_s"] = type(runner).__name__, time.perf_counter() - t
    row["memory"] = [p._asdict() for p in eng.memory_parts()]
    log(f"{a.shape}: {row['runner']} built (graphs captured) in {row['capture_s']:.1f} s")
    vocab = cfg.vocab_size
    prompt = torch.randint(3, vocab, (a.context,), generator=torch.Generator().manual_seed(1)).tolist()
    ours_last = None
    if budget.fits(30):
        row |= ours_decode(eng, prompt, a.steps, a.widths, a.repeats)
        ours_last = row.pop("_last")
        log(f"{a.shape}: decode {row['decode_ms']:.3f} ms/token at {a.context} (weight floor "
            f"{row['decode_floor_ms']:.3f}); verify over decode "
            + ", ".join(f"{k}: {v:.2f}" for k, v in row["verify_over_decode"].items()))
    else:
        row["skipped"].append("ours decode/verify (budget)")
    if budget.fits(a.prefill / 500 + 10):
        row |= ours_prefill(eng, a.prefill, vocab, dev)
        log(f"{a.shape}: prefill {a.prefill} {row['prefill_tok_s']:.0f} tok/s")
    else:
        row["skipped"].append("ours prefill (budget)")
    del eng, runner
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    if a.no_hf:
        row["skipped"].append("transformers (--no-hf)")
    elif budget.fits(60):
        try:
            model = hf_model(raw, cfg, w, a.hf_attn, dev)
            hf = hf_decode(model, prompt, a.hf_steps, dev, keep_last=True)
            theirs = hf.pop("_last")
            row |= hf
            if ours_last is not None:           # the same tensors: the prompt's last logits agree within bf16
                row["last_logits_rel_l2"] = float((ours_last - theirs).norm() / theirs.norm())
            log(f"{a.shape}: transformers decode {row['hf_decode_ms']:.1f} ms/token; the prompt's last logits "
                f"against ours: relative L2 {row.get('last_logits_rel_l2', float('nan')):.4f}")
            if budget.fits(40):
                row |= hf_prefill(model, a.prefill, vocab, dev)
                log(f"{a.shape}: transformers prefill {row['hf_prefill_tok_s']:.0f} tok/s")
            else:
                row["skipped"].append("transformers prefill (budget)")
            del model
        except Exception as e:                                   # the peer failing is reported, not fatal
            row["hf_error"] = f"{type(e).__name__}: {e}"[:400]
            log(f"{a.shape}: transformers failed: {row['hf_error']}")
    else:
        row["skipped"].append("transformers (budget)")
    met = {}
    if "decode_ms" in row:
        met["decode"] = row["decode_ms"] <= GOALS["decode_ms"]
    row["goals"], row["goals_met"] = GOALS, met
    return row


def table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (f"| shape | experts | decode ms/token @{a.context} | weight floor ms | floor / decode | prefill tok/s "
            f"@{a.prefill} | compute floor tok/s | transformers decode ms | ours faster (decode) | transformers "
            f"prefill tok/s | ours faster (prefill) | goals | skipped |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        d, hd = r.get("decode_ms"), r.get("hf_decode_ms")
        p, hp = r.get("prefill_tok_s"), r.get("hf_prefill_tok_s")
        fl = r.get("decode_floor_ms")
        goals = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in r.get("goals_met", {}).items()) or "–"
        skipped = "; ".join(r.get("skipped", [])) + (f"; transformers: {r['hf_error']}" if "hf_error" in r else "")
        lines.append(
            f"| {r['shape']} | {r.get('experts', '–')} | {fmt(d, '.3f')} | {fmt(fl, '.3f')} | "
            f"{fmt(fl / d if d and fl else None)} | {fmt(p, ',.0f')} | {fmt(r.get('prefill_floor_tok_s'), ',.0f')} | "
            f"{fmt(hd, '.1f')} | {fmt(hd / d if d and hd else None, '.1f')}x | {fmt(hp, ',.0f')} | "
            f"{fmt(p / hp if p and hp else None, '.1f')}x | {goals} | {skipped or '–'} |")
    curve = [r for r in rows if "verify_ms" in r]
    if curve:
        widths = list(curve[0]["verify_ms"])
        lines += ["", "Verify curve (a chain of W nodes, ms, and over one decode step):", "",
                  "| shape | " + " | ".join(f"W={k}" for k in widths) + " |", "|" + "---|" * (len(widths) + 1)]
        for r in curve:
            lines.append(f"| {r['shape']} | " + " | ".join(
                f"{r['verify_ms'][k]:.3f} ({r['verify_over_decode'][k]:.2f}x)" for k in widths) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for flashnext.json and flashnext.md")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (default 300)")
    ap.add_argument("--shape", default="published", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", help="cuda (bf16, the CUDA runner) or cpu (fp32: checks the script)")
    ap.add_argument("--experts", type=int, default=224, help="routed experts of the published 512 (default 224)")
    ap.add_argument("--ngram-base", type=int, default=100_000, help="the PLE table's prime base (published 2e7)")
    ap.add_argument("--context", type=int, default=4096, help="decode context (default 4096)")
    ap.add_argument("--prefill", type=int, default=8192, help="prefill prompt tokens (default 8192)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="tokens a prefill chunk (default 8192)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--widths", default="1,2,4,8,16,24,32,48,64", help="verify widths of the curve")
    ap.add_argument("--repeats", type=int, default=10, help="verifies timed a width (default 10)")
    ap.add_argument("--hf-steps", type=int, default=8, help="transformers decode steps timed (default 8)")
    ap.add_argument("--hf-attn", default="sdpa", help="transformers' attention implementation (default sdpa)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--bandwidth", type=float, default=4.2, help="HBM TB/s for the decode floor (default 4.2)")
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s for the prefill floor (H200)")
    a = ap.parse_args(argv)
    a.widths = [int(x) for x in a.widths.split(",") if x]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []

    def log(line: str) -> None:
        print(f"[{a.budget - budget.left():6.1f}s] {line}", flush=True)

    machine = "no CUDA device"
    try:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("bench_flashnext_gpu: no CUDA device")
        import transformers

        name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.processor() or "cpu"
        machine = (f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, Python "
                   f"{platform.python_version()}")
        try:
            rows.append(run(a, budget, log))
        except Exception as e:
            errors.append(f"{a.shape}: {type(e).__name__}: {e}")
            traceback.print_exc()
            rows.append({"shape": a.shape, "skipped": [f"error: {type(e).__name__}: {e}"[:300]]})
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        md = table(rows, a)
        print(md)
        cmd = "python tools/bench_flashnext_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
        (out / "flashnext.json").write_text(json.dumps({"machine": machine, "command": cmd, "args": vars(a),
                                                        "rows": rows, "errors": errors}, indent=1, default=str))
        (out / "flashnext.md").write_text(
            f"# Flash-Next on CUDA: FlashNextCudaRunner against transformers\n\nCommand: `{cmd}`\n\nMachine: "
            f"{machine}\n\nRandom weights (bf16 on CUDA), batch 1, the published shape with the routed experts cut "
            f"to {a.experts} of 512 and the PLE table's prime base cut to {a.ngram_base:,} (a step reads top-k "
            f"experts and 16 table rows a token whatever their counts); decode: median of {a.steps} steps with the "
            f"pick read back; verify: chains of each width, median of {a.repeats}; prefill: one run after a "
            f"warm-up. Floors: the weights a token reads at {a.bandwidth} TB/s, prefill FLOPs at {a.tflops} "
            f"TFLOP/s.\n\n{md}\n"
            + ("\nErrors:\n\n" + "\n".join(f"- {e}" for e in errors) + "\n" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
