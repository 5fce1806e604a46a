"""Server metrics in the Prometheus text format (``GET /metrics``).

Counters of requests (by endpoint and finish reason), refusals, prompt and
completion tokens, prefills by where they started and the prompt tokens they reused
or forwarded; histograms of time to first token and decode rate; gauges of the queue
and the busy engines (read from admission when rendered); and whatever ``extra``
renders when asked (the caches' tiers and memory gate, ``server.caches``).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Sequence

__all__ = ["Metrics"]

_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None,
                 extra: Callable[[], Sequence[str]] | None = None) -> None:
        self._lock = threading.Lock()
        self.prefills: Counter[str] = Counter()
        self.prefill_tokens: Counter[str] = Counter()
        self._extra = extra or (lambda: ())
        self.requests: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.rate = _Histogram(_RATE_BUCKETS)
        self._gauges = gauges or (lambda: {})

    def request(self, endpoint: str, finish: str, prompt: int, completion: int, ttft: float | None,
                rate: float | None) -> None:
        with self._lock:
            self.requests[(endpoint, finish)] += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            if ttft is not None:
                self.ttft.observe(ttft)
            if rate is not None:
                self.rate.observe(rate)

    def prefill(self, tier: str, start: int, total: int) -> None:
        """A prefill that started at ``start`` of ``total`` tokens, from ``tier`` (``cold``: none reused)."""
        with self._lock:
            self.prefills[tier] += 1
            self.prefill_tokens["reused"] += start
            self.prefill_tokens["forwarded"] += total - start

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def render(self) -> str:
        with self._lock:
            out = ["# HELP tandem_requests_total Requests answered, by endpoint and finish reason.",
                   "# TYPE tandem_requests_total counter"]
            out += [f'tandem_requests_total{{endpoint="{e}",finish_reason="{f}"}} {n}'
                    for (e, f), n in sorted(self.requests.items())]
            out += ["# HELP tandem_rejected_total Requests refused before running, by reason.",
                    "# TYPE tandem_rejected_total counter"]
            out += [f'tandem_rejected_total{{reason="{r}"}} {n}' for r, n in sorted(self.rejected.items())]
            out += ["# HELP tandem_prompt_tokens_total Prompt tokens of answered requests.",
                    "# TYPE tandem_prompt_tokens_total counter", f"tandem_prompt_tokens_total {self.prompt_tokens}",
                    "# HELP tandem_completion_tokens_total Generated tokens of answered requests.",
                    "# TYPE tandem_completion_tokens_total counter",
                    f"tandem_completion_tokens_total {self.completion_tokens}",
                    "# HELP tandem_ttft_seconds Time from arrival to the first generated token.",
                    "# TYPE tandem_ttft_seconds histogram", *self.ttft.lines("tandem_ttft_seconds"),
                    "# HELP tandem_decode_tokens_per_second Decode rate after the first token, per request.",
                    "# TYPE tandem_decode_tokens_per_second histogram",
                    *self.rate.lines("tandem_decode_tokens_per_second"),
                    "# HELP tandem_prefills_total Prefills by where they started (resident, store, disk...).",
                    "# TYPE tandem_prefills_total counter"]
            out += [f'tandem_prefills_total{{start="{t}"}} {n}' for t, n in sorted(self.prefills.items())]
            out += ["# HELP tandem_prefill_tokens_total Prompt tokens reused from a cache or forwarded.",
                    "# TYPE tandem_prefill_tokens_total counter"]
            out += [f'tandem_prefill_tokens_total{{part="{k}"}} {self.prefill_tokens[k]}'
                    for k in ("reused", "forwarded")]
        for name, value in self._gauges().items():
            out += [f"# TYPE tandem_{name} gauge", f"tandem_{name} {value}"]
        out += list(self._extra())
        return "\n".join(out) + "\n"
