"""The proxy's relay overhead: answer latency and first-SSE-event latency, direct against via the proxy.

A replay ``tandem serve`` (the test plugin's engine, answers at once) is the backend; ``tandem-dash`` with a
backends file naming it is the proxy. The same request goes to each, interleaved (direct, proxy, direct, ...),
on one keep-alive ``httpx`` client each; the table gives the median and the 90th percentile of

- ``whole``: a non-streamed chat completion, request sent to the last byte of the answer;
- ``first event``: a streamed one, request sent to the first ``data:`` event;
- ``stream``: the streamed one to its ``data: [DONE]``,

and the proxy's overhead (proxy minus direct, medians).

    python tools/bench_proxy.py [--requests 200] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "plugins"), str(ROOT)]

from proxy_helpers import Dash, write_backends
from replay_server import Server, write_model

TEXT = "Hello there! The weather in Paris is sunny today, and tomorrow it will rain."


def _whole(c: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = c.post(url, json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def _stream(c: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        buf = b""
        for part in r.iter_raw():
            if first is None and b"data: " in buf + part:
                first = time.perf_counter() - t0
            buf = (buf + part)[-32:]
    assert first is not None and buf.endswith(b"data: [DONE]\n\n")
    return first, time.perf_counter() - t0


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests of each kind to each endpoint")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        backend = Server(write_model(d / "model", [], default=TEXT), d, "--spec", "off", "--no-cache")
        dash = None
        try:
            backend.wait_ready(60)
            f = write_backends(d / "backends.yaml", [{"name": "replay", "url": backend.url + "/v1",
                                                     "models": ["replay-test"]}])
            dash = Dash(f, d).wait_ready(60)
            body = {"model": "replay-test", "messages": [{"role": "user", "content": "Weather?"}],
                    "max_tokens": args.max_tokens, "temperature": 0}
            urls = {"direct": backend.url + "/v1/chat/completions", "proxy": dash.url + "/v1/chat/completions"}
            res: dict[str, dict[str, list[float]]] = {k: {"whole": [], "first event": [], "stream": []} for k in urls}
            clients = {k: httpx.Client(timeout=60) for k in urls}
            for k, url in urls.items():     # warm: connections, the first chunks' code paths
                for _ in range(5):
                    _whole(clients[k], url, body)
                    _stream(clients[k], url, body)
            for _ in range(args.requests):
                for k, url in urls.items():
                    res[k]["whole"].append(_whole(clients[k], url, body))
                    first, total = _stream(clients[k], url, body)
                    res[k]["first event"].append(first)
                    res[k]["stream"].append(total)
            for c in clients.values():
                c.close()
        finally:
            if dash is not None:
                dash.stop()
            backend.stop()
    print(f"{args.requests} requests of each kind to each endpoint, max_tokens {args.max_tokens}, interleaved")
    print()
    print("| measure | direct median | direct p90 | via proxy median | via proxy p90 | overhead (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in ("whole", "first event", "stream"):
        dm, pm = statistics.median(res["direct"][m]), statistics.median(res["proxy"][m])
        print(f"| {m} | {dm * 1000:.2f} ms | {_q(res['direct'][m], 0.9) * 1000:.2f} ms | {pm * 1000:.2f} ms | "
              f"{_q(res['proxy'][m], 0.9) * 1000:.2f} ms | {(pm - dm) * 1000:+.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
