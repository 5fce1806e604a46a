"""What the family benchmarks share (tools/bench_lfm25_gpu.py, tools/bench_flashnext_gpu.py): the run's time
budget, the table's number format, and transformers' decode and prefill timed the same way for every family."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["Budget", "fmt", "hf_decode", "hf_prefill", "sync"]


class Budget:
    """Seconds left of ``total``; ``fits(est)`` says whether a stage of that estimate still fits."""

    def __init__(self, total: float) -> None:
        self.total, self.t0 = float(total), time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def fits(self, est: float) -> bool:
        return self.left() >= est


def fmt(v: Any, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def sync(device: str = "cuda") -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def hf_decode(model: Any, prompt: list[int], steps: int, device: str = "cuda",
              keep_last: bool = False) -> dict[str, Any]:
    """transformers' decode ms/token after ``prompt`` (median of ``steps``, two warm-up steps left out, the pick
    read back each step); with ``keep_last`` also ``_last``, the prompt's last logits on the host."""
    ids = torch.tensor([prompt], device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    last = out.logits[0, -1].float().cpu() if keep_last else None
    tok = out.logits[0, -1].argmax()
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        out = model(tok.view(1, 1), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[0, -1].argmax()
        int(tok)
        times.append(time.perf_counter() - t)
    res: dict[str, Any] = {"hf_decode_ms": statistics.median(times[2:]) * 1e3}
    if keep_last:
        res["_last"] = last
    return res


@torch.no_grad()
def hf_prefill(model: Any, n: int, vocab: int, device: str = "cuda") -> dict[str, Any]:
    """transformers' prefill of an ``n``-token random prompt, one forward (after a 256-token warm-up)."""
    ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(2)).to(device)
    model(ids[:, :256], use_cache=True, logits_to_keep=1)       # warm-up
    sync(device)
    t = time.perf_counter()
    int(model(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
    s = time.perf_counter() - t
    return {"hf_prefill_ms": s * 1e3, "hf_prefill_tok_s": n / s}
