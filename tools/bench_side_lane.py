"""Short requests while a long generation runs, against a real ``tandem serve``: the side lane on and off.

An agent's long turn streams (greedy, ``--long`` tokens, its end token held off with ``logit_bias`` so it
runs its full length); after its first token, ``--shorts`` short requests (a title of at most 16 tokens, the
kind a client sends beside the turn) go out ``--gap`` seconds apart (each at its time, answered or not the
ones before), through the official ``openai`` client. The same run is made on a server with the side lane
on (the default) and on one with ``TANDEM_SIDE_LANE=0``; before the long turn each short request is also
timed on the idle server. For each
short request it records the client's latency (request to the whole answer); for the long turn its decode
rate and total time. It checks that every answer is the same in both runs and on the idle server (the long
turn's text is its text, untouched by what ran at its safe points), and writes a Markdown table to
``docs/measurements/cpu-side-lane.md``.

    python tools/bench_side_lane.py [--model smollm2-135m] [--weights PATH] [--long 400] [--shorts 5]
                                    [--gap 1] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_session import SYSTEM, TASK, Server, _model_path, bench_parser, machine_lines, publish  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["fixing parse_duration for inputs like 1h30m", "adding a --verbose flag to the CLI",
          "a flaky test in tests/test_units.py", "renaming helpers.py to util.py", "updating the README",
          "the timeout in the HTTP client", "a typo in an error message", "caching the parsed config"]


def title_request(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a title of at most five words for a conversation about "
                                        f"{TOPICS[i % len(TOPICS)]}. Answer with the title only."}]


@dataclass
class Run:
    idle: list[float] = field(default_factory=list)        # each short request's latency on the idle server
    busy: list[float] = field(default_factory=list)        # ... while the long turn ran
    shorts: list[str] = field(default_factory=list)
    idle_shorts: list[str] = field(default_factory=list)
    long_text: str = ""
    long_tokens: int = 0
    long_first: float = 0.0                                # seconds to its first token
    long_total: float = 0.0
    long_ended_at: float = 0.0
    short_done_at: list[float] = field(default_factory=list)
    side_lane_total: int = 0

    @property
    def long_rate(self) -> float:
        return (self.long_tokens - 1) / max(1e-9, self.long_total - self.long_first)


def one_run(server: Server, model: str, long_tokens: int, shorts: int, gap: float, stops: dict) -> Run:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", timeout=900,
                           max_retries=0)
    run = Run()

    def short(i: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=title_request(i), max_tokens=16, temperature=0)
        return r.choices[0].message.content or "", time.perf_counter() - t0

    for i in range(shorts):
        text, dt = short(i)
        run.idle.append(dt)
        run.idle_shorts.append(text)
    started = threading.Event()

    def long_turn() -> None:
        t0 = time.perf_counter()
        parts = []
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}],
            max_tokens=long_tokens, temperature=0, logit_bias=stops, stream=True,
            stream_options={"include_usage": True})
        for ev in stream:
            if ev.usage is not None:
                run.long_tokens = ev.usage.completion_tokens
            if ev.choices and ev.choices[0].delta.content:
                if not parts:
                    run.long_first = time.perf_counter() - t0
                    started.set()
                parts.append(ev.choices[0].delta.content)
        run.long_total = time.perf_counter() - t0
        run.long_ended_at = time.perf_counter()
        run.long_text = "".join(parts)
        started.set()

    th = threading.Thread(target=long_turn, daemon=True)
    th.start()
    started.wait(600)
    run.busy, run.shorts, run.short_done_at = [0.0] * shorts, [""] * shorts, [0.0] * shorts

    def timed(i: int) -> None:
        run.shorts[i], run.busy[i] = short(i)
        run.short_done_at[i] = time.perf_counter()

    clients = []
    for i in range(shorts):          # each sent at its time, whether or not the ones before were answered
        time.sleep(gap)
        clients.append(threading.Thread(target=timed, args=(i,), daemon=True))
        clients[-1].start()
    for c in clients:
        c.join(900)
    th.join(900)
    metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).text
    for line in metrics.splitlines():
        if line.startswith("tandem_side_lane_total "):
            run.side_lane_total = int(float(line.split()[1]))
    return run


def report(model: str, path: Path, on: Run, off: Run, args: argparse.Namespace, command: str) -> str:
    import statistics

    same = (on.shorts == off.shorts == on.idle_shorts == off.idle_shorts and on.long_text == off.long_text)
    during = sum(t < on.long_ended_at for t in on.short_done_at)
    lines = [
        "# Short requests during a long generation on the CPU: the side lane on and off",
        "",
        f"Model: `{model}` (`{path.name}`), served by `tandem serve` on this machine's CPU, fp32, caches on, "
        f"no speculation. A long agent turn (greedy, {args.long} tokens, its end token held off) streams; after "
        f"its first token {args.shorts} short requests (a title, at most 16 tokens, not streamed) go out "
        f"{args.gap} s apart, each at its time. The same run on a server with the side lane on (the default) and "
        f"on one with `TANDEM_SIDE_LANE=0`; each short request also ran on the idle server first.",
        "",
        *machine_lines(args.threads, command),
        f"- Every answer is {'the same' if same else 'NOT the same'} in both runs and on the idle server; the "
        f"long turn's text is identical with and without the side lane.",
        f"- With the lane on, {during} of {args.shorts} short requests were answered while the long turn ran "
        f"(`tandem_side_lane_total` {on.side_lane_total}; with it off {off.side_lane_total}).",
        "- Latency is the client's, from sending the request to the whole answer.",
        "",
        "| short request | idle server (s) | during the long turn, lane on (s) | lane off (s) | off / on |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, (idle, a, b) in enumerate(zip(on.idle, on.busy, off.busy)):
        lines.append(f"| {i + 1} | {idle:.2f} | {a:.2f} | {b:.2f} | {b / a:.1f}x |")
    lines += [
        f"| median | {statistics.median(on.idle):.2f} | {statistics.median(on.busy):.2f} | "
        f"{statistics.median(off.busy):.2f} | {statistics.median(off.busy) / statistics.median(on.busy):.1f}x |",
        "",
        "| long turn | tokens | first token (s) | total (s) | decode (tok/s) |",
        "|---|---:|---:|---:|---:|",
        f"| lane on | {on.long_tokens} | {on.long_first:.2f} | {on.long_total:.2f} | {on.long_rate:.1f} |",
        f"| lane off | {off.long_tokens} | {off.long_first:.2f} | {off.long_total:.2f} | {off.long_rate:.1f} |",
        "",
        f"With the lane off a short request waits for the long turn to end; with it on it is served at the "
        f"turn's next safe point, and the long turn pays the short requests' own work (their prefill and "
        f"decode on the same engine) plus parking its state: {on.long_total - off.long_total:+.2f} s over "
        f"{args.shorts} short requests.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "cpu-side-lane.md")
    ap.add_argument("--long", type=int, default=400, help="tokens of the long turn")
    ap.add_argument("--shorts", type=int, default=5)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between two short requests")
    args = ap.parse_args(argv)
    model, path = _model_path(args.model, args.weights)
    from tandem_core.loader import load_served

    stops = {str(i): -100 for i in load_served(model, weights=str(path)).stop_ids}   # the long turn runs its length
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for name, lane in (("on", "1"), ("off", "0")):
            print(f"side lane {name}:", file=sys.stderr, flush=True)
            os.environ["TANDEM_SIDE_LANE"] = lane
            server = Server(model, path, Path(tmp) / name, args.threads, "--spec", "off").ready()
            try:
                runs[name] = one_run(server, model, args.long, args.shorts, args.gap, stops)
            finally:
                server.stop()
    publish("bench_side_lane.py", argv, args.out,
            lambda command: report(model, path, runs["on"], runs["off"], args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
