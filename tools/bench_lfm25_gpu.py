"""Benchmark the LFM2 CUDA runner at the LFM2.5-24B-A2B shape and an LFM2-8B-A1B-like one, against transformers.

Random bf16 weights built in GPU memory (no checkpoint on disk), batch 1. Per shape, in one process:

- ours (``LfmCudaRunner``, CUDA graphs, through the core's ``SequenceEngine``): decode ms/token at ``--context``
  tokens of context (the greedy pick read back every step, as serving does), a verify of a ``--verify``-node
  chain on that state over one decode step, prefill tokens/s of a ``--prefill``-token prompt in one chunk;
- the floors: decode against the active weights read once a token at ``--bandwidth`` TB/s (the head, every dense
  weight, ``top_k`` experts a MoE layer; the K/V read is listed beside it), prefill against ``--tflops``;
- transformers 5.24.0 (its own forward, no graphs or compile, attention ``--hf-attn``, its default expert
  kernel) on the same tensors (the model built on the meta device and handed ours): decode ms/token at the same
  context (``--hf-steps`` steps) and prefill tokens/s at ``--prefill``.

``--budget`` seconds bound the run: a stage whose estimate does not fit in what is left is skipped (named in the
table); the JSON and the markdown table are written under ``--out`` whatever happens.

Goals (issue 13): 24B-A2B decode <= 2.5 ms/token at 4K, verify 16 <= 2.5x decode, prefill >= 20,000 tok/s at 8K;
8B-A1B-like decode <= 2.0 ms/token.

    python tools/bench_lfm25_gpu.py --out /tmp/lfm25 --budget 240
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import Budget, fmt, hf_decode, hf_prefill, sync

# the published shapes (registry/models/lfm2.5-24b-a2b/model.yaml; LFM2-8B-A1B's card for the second)
SHAPES: dict[str, dict[str, Any]] = {
    "24b-a2b": dict(hidden_size=2048, num_hidden_layers=40, attention=10, num_dense_layers=2, intermediate_size=7168,
                    num_experts=64, num_experts_per_tok=4, moe_intermediate_size=1536, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=65536),
    "8b-a1b": dict(hidden_size=2048, num_hidden_layers=24, attention=6, num_dense_layers=2, intermediate_size=7168,
                   num_experts=32, num_experts_per_tok=4, moe_intermediate_size=1792, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=65536),
}
GOALS = {"24b-a2b": {"decode_ms": 2.5, "verify_over_decode": 2.5, "prefill_tok_s": 20000.0},
         "8b-a1b": {"decode_ms": 2.0}}


def layer_types(n: int, attention: int) -> list[str]:
    """``attention`` attention layers spread evenly over ``n`` (the last of every group), the rest conv."""
    at = {round((j + 1) * n / attention) - 1 for j in range(attention)}
    return ["full_attention" if i in at else "conv" for i in range(n)]


def raw_config(shape: dict[str, Any], max_positions: int) -> dict[str, Any]:
    s = dict(shape)
    n_attn = s.pop("attention")
    return dict(s, model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"],
                layer_types=layer_types(s["num_hidden_layers"], n_attn), conv_L_cache=3, use_expert_bias=True,
                norm_topk_prob=True, routed_scaling_factor=1.0, norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=max(128000, max_positions), eos_token_id=7, bos_token_id=1, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def random_weights(cfg: Any, seed: int = 0, device: str = "cuda") -> Any:
    """``Lfm2Weights`` in bf16 on the GPU: matrices ``N(0, 1/fan_in)``, norms one, the expert bias small."""
    from tandem_lfm25.weights import build_weights, expected_tensors

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {k: e.shape for k, e in expected_tensors(cfg).items()}

    def get(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) >= 2:
            return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * shape[-1] ** -0.5
        if name.endswith("expert_bias"):
            return torch.randn(shape, device=device, generator=gen) * 0.02
        return torch.ones(shape, device=device)

    return build_weights(get, cfg, "bf16", device, tied=True)


def hf_model(raw: dict[str, Any], cfg: Any, w: Any, attn: str, device: str = "cuda") -> Any:
    """transformers' ``Lfm2MoeForCausalLM`` over our tensors (experts, projections and embedding shared; the small
    vectors copied to bf16), built on the meta device."""
    from tandem_lfm25.weights import AttentionWeights, ConvWeights, MLPWeights
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    hf_cfg = Lfm2MoeConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    hf_cfg._attn_implementation = attn
    with torch.device("meta"):
        model = Lfm2MoeForCausalLM(hf_cfg)
    bf = torch.bfloat16
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed, "lm_head.weight": w.embed,
                                   "model.embedding_norm.weight": w.norm.to(bf)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd[p + "operator_norm.weight"] = lw.operator_norm.to(bf)
        sd[p + "ffn_norm.weight"] = lw.ffn_norm.to(bf)
        m, f = lw.mixer, lw.ffn
        if isinstance(m, ConvWeights):
            sd[p + "conv.in_proj.weight"] = m.in_proj.weight
            sd[p + "conv.out_proj.weight"] = m.out_proj.weight
            sd[p + "conv.conv.weight"] = m.conv.to(bf).reshape(cfg.hidden_size, 1, cfg.conv_L_cache)
        else:
            assert isinstance(m, AttentionWeights)
            a = p + "self_attn."
            for name, lin in (("q_proj", m.q), ("k_proj", m.k), ("v_proj", m.v), ("out_proj", m.o)):
                sd[a + name + ".weight"] = lin.weight
            sd[a + "q_layernorm.weight"] = m.q_norm.to(bf)
            sd[a + "k_layernorm.weight"] = m.k_norm.to(bf)
        q = p + "feed_forward."
        if isinstance(f, MLPWeights):
            sd[q + "w1.weight"], sd[q + "w3.weight"], sd[q + "w2.weight"] = f.w1.weight, f.w3.weight, f.w2.weight
        else:
            sd[q + "gate.weight"] = f.router.weight
            sd[q + "expert_bias"] = f.expert_bias
            sd[q + "experts.gate_up_proj"] = f.gate_up_all
            sd[q + "experts.down_proj"] = f.down_all
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"bench: the transformers model's keys differ: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    rot = model.model.pos_emb
    with torch.device(device):
        model.model.pos_emb = type(rot)(hf_cfg)                            # its buffers were on meta
    return model.eval()


def ours_decode(eng: Any, prompt: list[int], steps: int, verify: int, repeats: int) -> dict[str, Any]:
    eng.reset()
    logits = eng.forward(prompt)
    tok = int(logits[-1].argmax())
    base = eng.state.clone()
    for _ in range(3):                                          # warm-up
        tok2 = int(eng.forward([tok])[0].argmax())
    eng.state.restore(base)
    del tok2
    times: list[float] = []
    tokens: list[int] = []
    t_first = tok
    for _ in range(steps):
        t = time.perf_counter()
        tok = int(eng.forward([tok])[0].argmax())                # the pick read back: one sync a step
        times.append(time.perf_counter() - t)
        tokens.append(tok)
    eng.state.restore(base)
    chain = [t_first, *tokens][:verify]
    chain += [3] * (verify - len(chain))
    parents = list(range(-1, verify - 1))
    vt: list[float] = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        out = eng.forward_tree(chain, parents)
        int(out.logits[0].argmax())
        if i >= 2:
            vt.append(time.perf_counter() - t)
        eng.discard_pending()
    d, v = statistics.median(times) * 1e3, statistics.median(vt) * 1e3
    return {"decode_ms": d, "decode_mean_ms": statistics.fmean(times) * 1e3, "verify_ms": v,
            "verify_over_decode": v / d}


def ours_prefill(eng: Any, n: int, vocab: int, repeats: int) -> dict[str, Any]:
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    eng.reset()
    eng.forward(ids[: min(n, 1024)])                            # warm-up: the prefill kernels built
    sync()
    ts = []
    for _ in range(repeats):
        eng.reset()
        sync()
        t = time.perf_counter()
        int(eng.forward(ids)[-1].argmax())
        ts.append(time.perf_counter() - t)
    s = min(ts)
    eng.reset()
    return {"prefill_ms": s * 1e3, "prefill_tok_s": n / s}


def floors(cfg: Any, w: Any, context: int, bandwidth_tbs: float, tflops: float) -> dict[str, Any]:
    active = w.active_parameter_count(cfg.num_experts_per_tok)
    weight_bytes = 2 * active                                     # bf16; the tied head reads the embedding whole
    kv_bytes = len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * context
    per_token_flops = 2 * (active - cfg.vocab_size * cfg.hidden_size)     # a prefill row skips the head
    return {"active_params": active, "weight_gb": weight_bytes / 1e9, "kv_gb_at_context": kv_bytes / 1e9,
            "decode_floor_ms": weight_bytes / (bandwidth_tbs * 1e12) * 1e3,
            "prefill_floor_tok_s": tflops * 1e12 / per_token_flops}


def run_shape(name: str, a: argparse.Namespace, budget: Budget, log: Callable[[str], None]) -> dict[str, Any]:
    from tandem_lfm25.config import read_config
    from tandem_lfm25.cuda_runner import LfmCudaRunner, unsupported

    from tandem_core.engine import SequenceEngine

    row: dict[str, Any] = {"shape": name, "skipped": []}
    big = name == "24b-a2b"
    if not budget.fits(60 if big else 35):
        row["skipped"].append("everything (budget)")
        return row
    raw = raw_config(SHAPES[name], a.prefill + 256)
    cfg = read_config(raw)
    t = time.perf_counter()
    w = random_weights(cfg)
    sync()
    row["weights_s"] = time.perf_counter() - t
    why = unsupported(cfg, w)
    if why is not None:
        raise RuntimeError(f"bench: LfmCudaRunner cannot run the {name} weights: {why}")
    row |= floors(cfg, w, a.context, a.bandwidth, a.tflops)
    log(f"{name}: {row['active_params'] / 1e9:.2f} B active parameters, weights built in {row['weights_s']:.1f} s")
    t = time.perf_counter()
    eng = SequenceEngine(LfmCudaRunner(cfg, w, max_context=max(a.prefill, a.context) + 64, max_tree=a.verify,
                                       prefill_chunk=max(a.prefill, a.context)), name=cfg.model_type)
    sync()
    row["capture_s"] = time.perf_counter() - t
    vocab = cfg.vocab_size
    prompt = torch.randint(3, vocab, (a.context,), generator=torch.Generator().manual_seed(1)).tolist()
    if budget.fits(15):
        row |= ours_decode(eng, prompt, a.steps, a.verify, a.repeats)
        log(f"{name}: decode {row['decode_ms']:.3f} ms/token at {a.context} (floor {row['decode_floor_ms']:.3f}), "
            f"verify {a.verify} {row['verify_ms']:.3f} ms")
    else:
        row["skipped"].append("ours decode/verify (budget)")
    if budget.fits(15):
        row |= ours_prefill(eng, a.prefill, vocab, 2)
        log(f"{name}: prefill {a.prefill} {row['prefill_tok_s']:.0f} tok/s")
    else:
        row["skipped"].append("ours prefill (budget)")
    del eng
    torch.cuda.empty_cache()
    if a.no_hf:
        row["skipped"].append("transformers (--no-hf)")
    elif budget.fits(45 if big else 25):
        try:
            model = hf_model(raw, cfg, w, a.hf_attn)
            row |= hf_decode(model, prompt, a.hf_steps, "cuda")
            log(f"{name}: transformers decode {row['hf_decode_ms']:.1f} ms/token")
            if budget.fits(25 if big else 15):
                row |= hf_prefill(model, a.prefill, vocab, "cuda")
                log(f"{name}: transformers prefill {row['hf_prefill_tok_s']:.0f} tok/s")
            else:
                row["skipped"].append("transformers prefill (budget)")
            del model
        except Exception as e:                                   # the peer failing is reported, not fatal
            row["hf_error"] = f"{type(e).__name__}: {e}"[:400]
            log(f"{name}: transformers failed: {row['hf_error']}")
    else:
        row["skipped"].append("transformers (budget)")
    del w
    torch.cuda.empty_cache()
    goals = GOALS.get(name, {})
    met = {}
    if "decode_ms" in row:
        met["decode"] = row["decode_ms"] <= goals.get("decode_ms", float("inf"))
        if "verify_over_decode" in goals:
            met["verify"] = row["verify_over_decode"] <= goals["verify_over_decode"]
    if "prefill_tok_s" in row and "prefill_tok_s" in goals:
        met["prefill"] = row["prefill_tok_s"] >= goals["prefill_tok_s"]
    row["goals"], row["goals_met"] = goals, met
    return row


def table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (f"| shape | decode ms/token @{a.context} | weight floor ms | floor / decode | verify-{a.verify} ms | "
            f"verify / decode | prefill tok/s @{a.prefill} | compute floor tok/s | transformers decode ms | "
            f"ours faster (decode) | transformers prefill tok/s | ours faster (prefill) | goals | skipped |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        d, hd = r.get("decode_ms"), r.get("hf_decode_ms")
        p, hp = r.get("prefill_tok_s"), r.get("hf_prefill_tok_s")
        fl = r.get("decode_floor_ms")
        goals = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in r.get("goals_met", {}).items()) or "–"
        skipped = "; ".join(r.get("skipped", [])) + (f"; transformers: {r['hf_error']}" if "hf_error" in r else "")
        lines.append(
            f"| {r['shape']} | {fmt(d, '.3f')} | {fmt(fl, '.3f')} | {fmt(fl / d if d and fl else None)} | "
            f"{fmt(r.get('verify_ms'), '.3f')} | {fmt(r.get('verify_over_decode'))} | {fmt(p, ',.0f')} | "
            f"{fmt(r.get('prefill_floor_tok_s'), ',.0f')} | {fmt(hd, '.1f')} | {fmt(hd / d if d and hd else None, '.1f')}x | "
            f"{fmt(hp, ',.0f')} | {fmt(p / hp if p and hp else None, '.1f')}x | {goals} | {skipped or '–'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for lfm25.json and lfm25.md")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (default 240)")
    ap.add_argument("--shapes", default="24b-a2b,8b-a1b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--context", type=int, default=4096, help="decode context (default 4096)")
    ap.add_argument("--prefill", type=int, default=8192, help="prefill prompt tokens (default 8192)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--verify", type=int, default=16, help="nodes of the verified chain (default 16)")
    ap.add_argument("--repeats", type=int, default=10, help="verifies timed (default 10)")
    ap.add_argument("--hf-steps", type=int, default=8, help="transformers decode steps timed (default 8)")
    ap.add_argument("--hf-attn", default="sdpa", help="transformers' attention implementation (default sdpa)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--bandwidth", type=float, default=4.2, help="HBM TB/s for the decode floor (default 4.2)")
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s for the prefill floor (H200)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []

    def log(line: str) -> None:
        print(f"[{a.budget - budget.left():6.1f}s] {line}", flush=True)

    machine = "no CUDA device"
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("bench_lfm25_gpu: no CUDA device")
        import transformers

        machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers "
                   f"{transformers.__version__}, Python {platform.python_version()}")
        for name in [s for s in re.split(r"[,\s]+", a.shapes) if s]:
            if name not in SHAPES:
                raise ValueError(f"bench: unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
            try:
                rows.append(run_shape(name, a, budget, log))
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                traceback.print_exc()
                rows.append({"shape": name, "skipped": [f"error: {type(e).__name__}: {e}"[:300]]})
                torch.cuda.empty_cache()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        md = table(rows, a)
        print(md)
        cmd = "python tools/bench_lfm25_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
        (out / "lfm25.json").write_text(json.dumps({"machine": machine, "command": cmd, "args": vars(a),
                                                    "rows": rows, "errors": errors}, indent=1, default=str))
        (out / "lfm25.md").write_text(
            f"# LFM2 on CUDA: LfmCudaRunner against transformers\n\nCommand: `{cmd}`\n\nMachine: {machine}\n\n"
            f"Random bf16 weights, batch 1; decode: median of {a.steps} steps with the pick read back; verify: a "
            f"{a.verify}-node chain, median of {a.repeats}; prefill: best of 2, one chunk. Floors: active weights "
            f"at {a.bandwidth} TB/s, prefill FLOPs at {a.tflops} TFLOP/s.\n\n{md}\n"
            + ("\nErrors:\n\n" + "\n".join(f"- {e}" for e in errors) + "\n" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
