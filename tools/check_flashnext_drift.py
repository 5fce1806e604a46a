"""How far bf16 logits of Flash-Next drift on random weights, ours and transformers' alike (a check, not a test).

``tools/bench_flashnext_gpu.py`` compares the prompt's last logits of ``FlashNextCudaRunner`` (bf16) with
transformers' (bf16) over the same tensors at the published shape; a relative L2 far above bf16's rounding can be
a bug or the model's own amplification of rounding (48 layers of random weights, discrete expert and block picks
that a rounding flips). This script tells them apart at the published widths with fewer layers (so an fp32 copy
fits): the same bf16 weights through

- ``cuda``: ``FlashNextCudaRunner`` (bf16, CUDA graphs), ``ref``: the plain-torch runner (bf16, on the device),
- ``hf16``: transformers in bf16, ``hf32``: transformers with the weights widened to fp32 (the reference),

and prints every pair's relative L2 of the last logits and their top-1 agreement over ``--prompts`` prompts, at each ``--contexts`` length (below and above the indexer's budget of 2048, where the block selection starts to
matter). If ``cuda`` and ``ref`` sit as far from ``hf32`` as ``hf16`` does, the gap is bf16's, not a bug.

    python tools/check_flashnext_drift.py --layers 8 --experts 64 --contexts 1024,4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def prompt(cfg: Any, length: int, k: int) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1000 * k + length))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="layers kept of the published 48 (a multiple of 4)")
    p.add_argument("--experts", type=int, default=64, help="routed experts kept of 512")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--prompts", type=int, default=4, help="random prompts a context (their last logits compared)")
    p.add_argument("--shape", default="published", help="published or tiny (tiny --device cpu checks the script)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", help="the weights (bf16, or fp32 to check the mapping itself)")
    p.add_argument("--out", default=None, help="a JSON file for the results")
    a = p.parse_args(argv)
    import bench_flashnext_gpu as bf
    from tandem_flashnext.config import read_config
    from tandem_flashnext.serving import make_runner

    from tandem_core.engine import SequenceEngine

    contexts = [int(c) for c in a.contexts.split(",") if c]
    shape = dict(bf.SHAPES[a.shape], num_hidden_layers=a.layers)
    raw = bf.raw_config(shape, a.experts, 100_000, max(contexts) + 256)
    cfg = read_config(raw)
    dev = a.device
    w = bf.random_weights(cfg, dev, a.dtype)
    runs: dict[str, Any] = {}
    for name, cuda_runner in (("cuda", True), ("ref", False)) if dev.startswith("cuda") else (("ref", False),):
        runner = make_runner(cfg, w, max_context=max(contexts) + 256, prefill_chunk=max(contexts), max_tree=16,
                             cuda_runner=cuda_runner)
        eng = SequenceEngine(runner, name=name)
        runs[name] = {}
        for c in contexts:
            rows = []
            for k in range(a.prompts):
                eng.reset()
                rows.append(eng.forward(prompt(cfg, c, k).tolist())[-1].float().cpu())
            runs[name][c] = torch.stack(rows)
        del eng, runner
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    model = bf.hf_model(raw, cfg, w, "sdpa", dev)
    for name in ("hf16", "hf32"):
        if name == "hf32":
            model = model.float()
        runs[name] = {}
        for c in contexts:
            t = time.perf_counter()
            rows = []
            for k in range(a.prompts):
                with torch.no_grad():
                    out = model(input_ids=prompt(cfg, c, k)[None].to(dev), use_cache=False)
                rows.append(out.logits[0, -1].float().cpu())
            runs[name][c] = torch.stack(rows)
            print(f"[{name} {c}] {time.perf_counter() - t:.1f} s", flush=True)
    names = list(runs)
    out: dict[str, Any] = {"layers": a.layers, "experts": a.experts, "pairs": {}}
    print(f"\nFlash-Next, published widths, {a.layers} layers, {a.experts} experts, bf16 weights; last-logits "
          f"relative L2 (mean and max over {a.prompts} prompts) and top-1 agreement\n")
    print("| context | pair | relative L2 (mean) | relative L2 (max) | top-1 agree |")
    print("|---|---|---|---|---|")
    for c in contexts:
        for i, x in enumerate(names):
            for y in names[i + 1:]:
                A, B = runs[x][c], runs[y][c]
                each = [rel(A[r], B[r]) for r in range(A.shape[0])]
                mean, worst = sum(each) / len(each), max(each)
                agree = float((A.argmax(-1) == B.argmax(-1)).float().mean())
                out["pairs"][f"{c}:{x}-{y}"] = {"mean": mean, "max": worst, "top1": agree}
                print(f"| {c} | {x} - {y} | {mean:.4f} | {worst:.4f} | {agree:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
