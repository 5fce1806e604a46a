"""What the conductor costs and keeps: an agent session on a plain server and on one with ``--conductor``.

The session of ``bench_session.py`` (a system prompt, a task, then turns of the model's answer + a tool
result), with a second user message at turn ``--ask-at``, sent as streamed greedy chat completions through
the ``openai`` client to two servers with the caches on: a plain one and one with a conductor profile of
three classes (the classifier: the served model under a choice grammar). For each turn it records the
prompt's tokens, where the prefill started (the log line), the client's time to first token, and from the
conductor's journal the class, how it was chosen, the classifier's and the planning's milliseconds. Writes a
Markdown table to ``docs/measurements/cpu-conductor-session.md``.

    python tools/bench_conductor.py [--model smollm2-135m] [--weights PATH] [--turns 8] [--answer 16]
                                    [--ask-at 5] [--threads N] [--out PATH]
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_session import SYSTEM, TASK, Server, _model_path, bench_parser, machine_lines, publish, tool_result  # noqa: E402

PROFILE = """\
journal: journal.jsonl
profiles:
  coding:
    classes:
      question:
        description: a question about the code, answered in words
        effort: Answer directly.
      edit:
        description: a change to source files
        effort: Make the smallest change that does it, then run the tests.
        rules: [Read a file before you edit it.]
      plan:
        description: a larger task that needs a plan first
        effort: Write a short plan, then carry it out.
"""
FOLLOW_UP = "Also add a regression test for '1h30m'."


@dataclass
class Turn:
    rid: str
    prompt: int
    start: int
    tier: str
    ttft: float
    answer: str


def run(server: Server, model: str, turns: int, answer: int, ask_at: int) -> list[Turn]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", timeout=900,
                           max_retries=0)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    out: list[Turn] = []
    for turn in range(turns):
        t0 = time.perf_counter()
        ttft, parts, rid = None, [], ""
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, temperature=0,
                                                    max_tokens=answer):
            rid = chunk.id
            for c in chunk.choices:
                if c.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(c.delta.content)
        m = re.search(r"prefill=(\w+):(\d+)/(\d+)", server.line(rid))
        if m is None:
            raise RuntimeError(f"turn {turn + 1}: no prefill in the log line")
        out.append(Turn(rid, int(m.group(3)), int(m.group(2)), m.group(1),
                        ttft if ttft is not None else float("nan"), "".join(parts)))
        print(f"  turn {turn + 1}: prompt {out[-1].prompt}, prefill from {out[-1].tier} {out[-1].start}, "
              f"ttft {out[-1].ttft:.2f}s", file=sys.stderr, flush=True)
        messages = messages + [{"role": "assistant", "content": out[-1].answer}]
        if turn + 2 == ask_at:
            messages.append({"role": "user", "content": FOLLOW_UP})
        else:
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": tool_result(turn)})
    return out


def report(model: str, path: Path, plain: list[Turn], conducted: list[Turn], journal: dict[str, dict],
           threads: int, answer: int, ask_at: int, command: str) -> str:
    lines = [
        "# An agent session on the CPU: a plain server and one with the conductor",
        "",
        f"Model: `{model}` (`{path.name}`), served by `tandem serve` on this machine's CPU, fp32, caches on, "
        f"speculation off. Turn 1 is the task, turn {ask_at} a second user message, every other turn the "
        f"model's answer (greedy, at most {answer} tokens) + a tool result of about a hundred tokens. The "
        f"conductor's profile has three classes and the model itself as the classifier.",
        "",
        *machine_lines(threads, command),
        "- The times depend on what else ran on the CPU (the load average above).",
        "",
        "*Start*: where the prefill started (`prefill=TIER:START/TOTAL`). The conductor's prompt is larger by "
        "its hidden notes. The classifier's time is inside the conductor's time to first token (it runs "
        "before the turn is prepared); a tool-result turn does not ask it.",
        "",
        "| turn | kind | prompt plain | start plain | TTFT plain (s) | prompt conductor | start conductor "
        "| TTFT conductor (s) | class | chosen by | classifier (ms) | planning (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for i, (a, b) in enumerate(zip(plain, conducted)):
        j = journal.get(b.rid, {})
        kind = "user" if i == 0 or i + 1 == ask_at else "tool result"
        cms = j.get("classifier_ms")
        lines.append(f"| {i + 1} | {kind} | {a.prompt} | {a.tier} {a.start} | {a.ttft:.2f} | {b.prompt} | "
                     f"{b.tier} {b.start} | {b.ttft:.2f} | {j.get('class', '?')} | {j.get('class_by', '?')} | "
                     f"{'-' if cms is None else f'{cms:.0f}'} | {j.get('plan_ms', float('nan')):.1f} |")
    fa = sum(t.prompt - t.start for t in plain)
    fb = sum(t.prompt - t.start for t in conducted)
    lines += ["", f"Prompt tokens forwarded over the session: {fa} plain, {fb} with the conductor (the notes "
                  f"are replayed at the same place, so later turns still resume where the last one ended).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "cpu-conductor-session.md")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--answer", type=int, default=16, help="tokens each answer may have")
    ap.add_argument("--ask-at", type=int, default=5, help="the turn that is a second user message")
    args = ap.parse_args(argv)
    model, path = _model_path(args.model, args.weights)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        root = Path(tmp)
        (root / "profile.yaml").write_text(PROFILE)
        print("plain:", file=sys.stderr, flush=True)
        server = Server(model, path, root / "plain", args.threads, "--spec", "off",
                        "--cache-dir", str(root / "c1")).ready()
        try:
            plain = run(server, model, args.turns, args.answer, args.ask_at)
        finally:
            server.stop()
        print("conductor:", file=sys.stderr, flush=True)
        server = Server(model, path, root / "cond", args.threads, "--spec", "off", "--cache-dir", str(root / "c2"),
                        "--conductor", str(root / "profile.yaml")).ready()
        try:
            conducted = run(server, "TandemLLM", args.turns, args.answer, args.ask_at)
        finally:
            server.stop()
        journal = {ln["request_id"]: ln for ln in map(json.loads, (root / "journal.jsonl").read_text().splitlines())
                   if "request_id" in ln}
    publish("bench_conductor.py", argv, args.out,
            lambda command: report(model, path, plain, conducted, journal, args.threads, args.answer,
                                   args.ask_at, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
