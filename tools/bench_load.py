"""N concurrent streamed clients against a real ``tandem serve`` with a queue of Q: what admission does under load.

Starts ``tandem serve`` (loopback only, ``--queue Q``) on the default model, then ``--clients`` threads
each send ``--requests`` streamed chat completions (``max_tokens`` ``--tokens``, raw HTTP through
``httpx`` so a 429's ``Retry-After`` and the SSE bytes are seen as they are), all at once. It records
each request's status, its latency (request to the end of the body), the ``Retry-After`` of every
429, whether a 200 ended with ``data: [DONE]`` (one that did not is *lost*), and the server's RSS
(``/proc/<pid>/status``) before and after. Bounded: every client stops after its requests or at
``--deadline`` seconds, whichever comes first. Writes a Markdown table to
``docs/measurements/cpu-load.md``.

    python tools/bench_load.py [--model smollm2-135m] [--weights PATH] [--clients 32] [--queue 8]
                               [--requests 2] [--tokens 24] [--deadline 600] [--threads N] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_session import Server, _model_path, bench_parser, machine_lines, publish  # noqa: E402

QUESTIONS = ["Name three primary colours.", "What is a prime number?", "Say hello in French.",
             "Give me a word that rhymes with cat.", "What is 12 times 12?", "Name a planet."]


@dataclass
class Result:
    client: int
    status: int
    seconds: float
    retry_after: int | None
    done: bool          # a 200 whose stream ended with data: [DONE]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def client(i: int, url: str, model: str, requests: int, tokens: int, deadline: float, out: list[Result],
           lock: threading.Lock) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=max(1.0, deadline - time.monotonic())) as c:
        for k in range(requests):
            if time.monotonic() >= deadline:
                return
            body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[(i + k) % len(QUESTIONS)]}]}
            t0 = time.perf_counter()
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                data = b"".join(r.iter_bytes())
                retry = r.headers.get("retry-after")
            got = Result(i, r.status_code, time.perf_counter() - t0, int(retry) if retry else None,
                         r.status_code == 200 and data.rstrip().endswith(b"data: [DONE]"))
            with lock:
                out.append(got)
            if r.status_code == 429 and got.retry_after:
                time.sleep(min(got.retry_after, max(0.0, deadline - time.monotonic())) * 0.1)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__ or "", "cpu-load.md")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens of each request")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds after which clients stop")
    args = ap.parse_args(argv)
    model, path = _model_path(args.model, args.weights)
    with tempfile.TemporaryDirectory() as home:
        srv = Server(model, path, Path(home), args.threads, "--queue", str(args.queue), "--no-cache",
                     "--spec", "off").ready()
        url = f"http://127.0.0.1:{srv.port}"
        try:
            import httpx

            httpx.post(url + "/v1/chat/completions", timeout=120, json={  # warm: the first request pays once
                "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            rss_before = rss_kib(srv.proc.pid)
            results: list[Result] = []
            lock = threading.Lock()
            deadline = time.monotonic() + args.deadline
            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i, url, model, args.requests, args.tokens, deadline,
                                                             results, lock)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            rss_after = rss_kib(srv.proc.pid)
        finally:
            srv.stop()

    def make(command: str) -> str:
        by: dict[int, list[Result]] = {}
        for r in results:
            by.setdefault(r.status, []).append(r)
        ok = [r.seconds for r in by.get(200, [])]
        retry = sorted(r.retry_after for r in by.get(429, []) if r.retry_after is not None)
        lost = sum(1 for r in by.get(200, []) if not r.done)
        lines = [
            "# Load: concurrent streamed clients against the queue (CPU)",
            "",
            f"{args.clients} clients, each sending {args.requests} streamed chat completions at once (max_tokens "
            f"{args.tokens}, greedy) to `tandem serve --queue {args.queue} --no-cache --spec off` of {model} "
            f"(one engine). A 429 is retried after a tenth of its Retry-After. Lost: a 200 whose stream did not "
            f"end with `data: [DONE]`.",
            "",
            *machine_lines(args.threads, command),
            "",
            "| status | requests | latency p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|",
        ]
        for status, rs in sorted(by.items()):
            xs = [r.seconds for r in rs]
            lines.append(f"| {status} | {len(rs)} | {percentile(xs, .5):.2f} s | {percentile(xs, .9):.2f} s | "
                         f"{percentile(xs, .99):.2f} s | {max(xs):.2f} s |")
        lines += [
            "",
            "| measure | value |",
            "|---|---|",
            f"| requests sent | {len(results)} in {wall:.1f} s |",
            f"| answered 200 | {len(ok)} (mean {statistics.fmean(ok) if ok else float('nan'):.2f} s) |",
            f"| refused 429 | {len(by.get(429, []))} |",
            f"| other statuses | {sum(len(v) for k, v in by.items() if k not in (200, 429))} |",
            f"| Retry-After values (s) | {', '.join(f'{v}x{retry.count(v)}' for v in sorted(set(retry))) or '-'} |",
            f"| requests lost (200 without [DONE]) | {lost} |",
            f"| server RSS before / after | {rss_before / 1024:.1f} MiB / {rss_after / 1024:.1f} MiB "
            f"({(rss_after - rss_before) / 1024:+.1f} MiB) |",
            "",
        ]
        return "\n".join(lines)

    publish("bench_load.py", argv, args.out, make)
    return 0


if __name__ == "__main__":
    sys.exit(main())
