"""Speculative decoding of the default model on this CPU: plain decode against lookup speculation.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched with ``tandem_core.pull`` when
absent) decodes three prompt sets greedily, each prompt three ways, interleaved prompt by prompt
(so the machine's load hits them alike):

- ``plain``: the plain loop (``Decode``), one forward a token;
- ``lookup, online prices``: ``SpecDecode`` with the lookup drafter and a StairCut that learns the
  verify prices online from its own measured verify times (no price file: the production setting
  on a machine without one);
- ``lookup, forced drafting``: the same with a synthetic price curve on which a verified row costs a
  tenth of a decode step (as on a GPU), so the cut drafts whatever the drafter offers: what drafting
  costs on this CPU when the cut does not hold it back.

The sets: ``agent`` (an agent session: each turn is the previous turn's messages, the model's answer
and a tool result that shows a file again with small changes), ``copying`` (single prompts whose
answer copies or continues text in the prompt) and ``chat`` (plain questions). Each speculative mode
keeps one drafter and one cut for the whole set (their session history and learnt prices carry over,
as in a server). Every speculative answer is checked against the plain one, token for token.

Decode speed is tokens after the first over the time after the first (the prefill is not timed).
Also measured: one verify of ``w`` rows (``forward_block``) against a decode step, and the price
curve the online cut learnt. The tables are printed and written to
``docs/measurements/cpu-speculation.md`` with the command that made them.

    python tools/bench_spec_cpu.py [--tokens 48] [--threads 1] [--max-tree 16] [--sets agent,copying,chat]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "lookup, online prices", "lookup, forced drafting")

SYSTEM = ("You are a coding agent working in a Python repository. You can read files and edit them. When "
          "you change a file, print the whole new file in a code block.")
FILE = '''def parse_duration(text):
    """Seconds in a duration such as '1h30m' or '45s'."""
    total = 0
    number = ""
    for ch in text:
        if ch.isdigit():
            number += ch
        elif ch == "h":
            total += int(number) * 3600
            number = ""
        elif ch == "m":
            total += int(number) * 60
            number = ""
        elif ch == "s":
            total += int(number)
            number = ""
    return total
'''
AGENT_ASKS = [
    "Read timeparse/core.py.",
    "Add a docstring line saying that an empty string gives 0, and print the whole file.",
    "Rename `number` to `digits` everywhere and print the whole file.",
    "Print the file again, unchanged.",
    "Make 'd' mean days (86400 seconds) and print the whole file.",
    "Print the whole file once more.",
]
COPYING = [
    "Repeat after me: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    'Copy this JSON exactly: {"name": "Alice", "age": 30, "city": "Paris", "tags": ["a", "b", "c"], '
    '"address": {"street": "1 Main St", "zip": "75001"}}',
    "Complete this Python code:\n\ndef f0(x):\n    return x + 0\n\ndef f1(x):\n    return x + 1\n\n"
    "def f2(x):\n    return x + 2\n",
    f"Here is a file:\n\n{FILE}\nPrint it again, unchanged, in a code block.",
    "Continue the list: Monday: gym. Tuesday: swim. Wednesday: gym. Thursday: swim. Friday: gym.",
    "Write the HTML for a table with three rows; each row has the cells 'a', 'b' and 'c'.",
]
CHAT = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "Give me a tip for learning to cook.",
    "Explain what a CPU does in two sentences.",
    "What should I pack for a weekend hike?",
    "Suggest three names for a bakery.",
    "What is the difference between a list and a tuple in Python?",
    "Describe autumn in a few sentences.",
]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _model_path(home: Path | None) -> Path:
    from tandem_core import catalog
    from tandem_core.pull import pull

    return pull(catalog.entry("smollm2-135m").data, home=home)


class _NullDetok:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class Tally:
    """One (set, mode): tokens, decode seconds after each prompt's first token, and speculation counts."""

    prompts: int = 0
    tokens: int = 0
    timed_tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_ms: float = 0.0
    mismatches: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.timed_tokens / self.seconds if self.seconds else float("nan")


def _speculation(engine: Any, tokenizer: Any, max_tree: int, forced: bool) -> Any:
    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.spec.cut import PriceTable, StairCut
    from tandem_core.spec.speculate import Speculation

    table = None
    if forced:
        w = max_tree + 1
        table = PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "smollm2-135m",
                                      "profile": "fp32", "device": "cpu", "contexts": [0, 1 << 20],
                                      "widths": [1, w], "ms": [[1.0, 1.0 + 0.1 * (w - 1)]] * 2,
                                      "meta": {"tool": "bench_spec_cpu (synthetic: forced drafting)"}})
    target = TargetInfo.of(engine.caps, tokenizer=tokenizer.fingerprint(), vocab_size=tokenizer.vocab_size,
                           name="smollm2-135m")
    return Speculation([build_drafter("lookup", target)], StairCut(table, max_tree=max_tree), max_tree)


def _run(engine: Any, ids: list[int], tokens: int, stops: frozenset[int], spec: Any) -> tuple[list[int], Any, Any]:
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams
    from tandem_core.spec.speculate import SpecDecode

    req = DecodeRequest(ids, tokens, SamplingParams(temperature=0.0), stops)
    dec = Decode(engine, req, _NullDetok()) if spec is None else SpecDecode(engine, req, _NullDetok(),
                                                                            speculation=spec)
    out = [t for chunk in dec.run() for t in chunk.tokens]
    return out, dec, (dec.stats if spec is not None else None)


def _account(t: Tally, out: list[int], dec: Any, stats: Any, want: list[int] | None, index: int) -> None:
    t.prompts += 1
    t.tokens += len(out)
    if dec.t_first is not None and dec.t_last is not None and len(out) > 1:
        t.timed_tokens += len(out) - 1
        t.seconds += dec.t_last - dec.t_first
    if stats is not None:
        t.rounds += stats.rounds
        t.drafted += stats.drafted
        t.accepted += stats.accepted
        t.verify_ms += stats.verify_ms
    if want is not None and out != want:
        t.mismatches.append(index)


def run_set(name: str, served: Any, engine: Any, tokens: int, max_tree: int) -> tuple[dict[str, Tally], Any]:
    """Decode one prompt set three ways, prompt by prompt; returns the tallies and the online cut."""
    from tandem_core.server.template import render_chat

    tok = served.tokenizer
    stops = frozenset(served.stop_ids)
    specs = {MODES[1]: _speculation(engine, tok, max_tree, False), MODES[2]: _speculation(engine, tok, max_tree, True)}
    tallies = {m: Tally() for m in MODES}
    convo: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    prompts = {"agent": AGENT_ASKS, "copying": COPYING, "chat": CHAT}[name]
    for i, text in enumerate(prompts):
        if name == "agent":
            convo.append({"role": "user", "content": text})
            ids = tok.encode(render_chat(served, convo))
        else:
            ids = tok.encode(render_chat(served, [{"role": "user", "content": text}]))
        want, dec, _ = _run(engine, ids, tokens, stops, None)
        _account(tallies[MODES[0]], want, dec, None, None, i)
        for mode, spec in specs.items():
            out, dec, stats = _run(engine, ids, tokens, stops, spec)
            _account(tallies[mode], out, dec, stats, want, i)
        print(f"  {name} {i + 1}/{len(prompts)}: {len(ids)} prompt tokens, "
              + ", ".join(f"{m} {tallies[m].rate:.1f} tok/s" for m in MODES), file=sys.stderr, flush=True)
        if name == "agent":
            answer = tok.decode([t for t in want if t not in stops])
            convo.append({"role": "assistant", "content": answer})
            convo.append({"role": "tool", "content": f"$ cat timeparse/core.py  (after step {i + 1})\n{FILE}"})
    return tallies, specs[MODES[1]].cut


def verify_prices(engine: Any, served: Any, context: int, widths: list[int], repeats: int) -> tuple[float, dict[int, float]]:
    """Median ms of a decode step and of a verify of each width (a chain) at ``context`` cached tokens."""
    ids = (served.tokenizer.encode(FILE) * (context // 100 + 2))[:context]
    engine.reset()
    engine.forward(ids)

    def once(fn: Any) -> float:
        engine.rollback_to(context)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    decode = statistics.median(once(lambda: engine.forward([ids[0]])) for _ in range(repeats))
    out = {}
    for w in widths:
        out[w] = statistics.median(once(lambda: engine.forward_block(ids[1:w + 1])) for _ in range(repeats))
    engine.discard_pending()
    return decode, out


def report(args: argparse.Namespace, cmd: str, path: Path, results: dict[str, dict[str, Tally]], cut: Any,
           decode_ms: float, prices: dict[int, float], context: int, load: tuple[float, float]) -> str:
    cores = os.cpu_count() or 1
    lines = [
        "# Speculative decoding on the CPU: the default model, plain against lookup speculation",
        "",
        f"Command: `{cmd}`",
        "",
        f"- CPU: {_cpu_name()}, {cores} logical cores, torch {torch.__version__}, {args.threads} torch "
        f"thread(s); load average (1 min) {load[0]:.1f} before and {load[1]:.1f} after the runs",
        f"- model: {path.name} (`smollm2-135m`, tandem-llama, dense fp32); greedy, at most {args.tokens} "
        f"tokens an answer; `--max-tree {args.max_tree}` (drafted nodes a verify carries besides the "
        f"pending token)",
        "- decode speed: tokens after each answer's first over the time after it (prefill not timed), "
        "summed over the set; the three modes run prompt by prompt, interleaved",
        "- every speculative answer equals the plain answer token for token: "
        + ("**yes**" if not any(t.mismatches for r in results.values() for t in r.values()) else "**NO**"),
        "",
        "| set | mode | prompts | tokens | decode tok/s | vs plain | rounds | tokens/round | drafted/round "
        "| accepted/round | acceptance |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, tallies in results.items():
        base = tallies[MODES[0]].rate
        for mode in MODES:
            t = tallies[mode]
            if mode == MODES[0]:
                lines.append(f"| {name} | {mode} | {t.prompts} | {t.tokens} | {t.rate:.2f} | 1.00x | "
                             f"{t.tokens} | 1.00 | | | |")
                continue
            r = max(t.rounds, 1)
            acc = t.accepted / t.drafted if t.drafted else 0.0
            lines.append(f"| {name} | {mode} | {t.prompts} | {t.tokens} | {t.rate:.2f} | **{t.rate / base:.2f}x** | "
                         f"{t.rounds} | {t.tokens / r:.2f} | {t.drafted / r:.2f} | {t.accepted / r:.2f} | "
                         f"{acc:.2f} |")
    lines += [
        "",
        f"## What a verify costs here (at {context} cached tokens, median of {args.repeats} runs)",
        "",
        "| rows verified | ms | decode steps | marginal row (decode steps) |",
        "|---:|---:|---:|---:|",
        f"| decode step | {decode_ms:.1f} | 1.00 | |",
    ]
    for w, ms in prices.items():
        marg = "" if w == 1 else f"{(ms - decode_ms) / (w - 1) / decode_ms:.2f}"
        lines.append(f"| {w} | {ms:.1f} | {ms / decode_ms:.2f} | {marg} |")
    curve = cut.curve(context, args.max_tree + 1)
    learnt = ", ".join(f"{w}: {curve[w - 1] / curve[0]:.2f}" for w in (1, 2, 3, 4, 6, 8, 12, 16) if w <= len(curve))
    lines += [
        "",
        f"The online cut of the last set learnt, relative to one row at {context} tokens (widths it never "
        f"tried are extrapolated): {learnt}; it measured widths {list(cut.online.widths)}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="the most tokens an answer")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-tree", type=int, default=16, help="drafted nodes a verify may carry")
    ap.add_argument("--sets", default="agent,copying,chat", help="prompt sets: agent, copying, chat")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each verify width (the median)")
    ap.add_argument("--home", type=Path, default=None, help="TANDEM_HOME for the model file (default: the setting)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "measurements" / "cpu-speculation.md")
    args = ap.parse_args(argv)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    for s in sets:
        if s not in ("agent", "copying", "chat"):
            ap.error(f"--sets: unknown set {s!r} (agent, copying, chat)")
    torch.set_num_threads(args.threads)

    from tandem_llama.serving import serve

    from tandem_core.plugins import load_plugins
    from tandem_core.serving import ServeArgs, ServeContext

    load_plugins()
    path = _model_path(args.home)
    served = serve(ServeArgs("smollm2-135m", path, max_context=4096, options={"max_tree": args.max_tree + 1}),
                   ServeContext())
    engine = served.engine
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, Tally]] = {}
    cut = None
    for name in sets:
        results[name], cut = run_set(name, served, engine, args.tokens, args.max_tree)
    context = 512
    decode_ms, prices = verify_prices(engine, served, context, [1, 2, 3, 4, 6, 8, 12, 16], args.repeats)
    load_after = os.getloadavg()[0]
    cmd = "python tools/bench_spec_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(args, cmd.strip(), path, results, cut, decode_ms, prices, context, (load_before, load_after))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)
    same = not any(t.mismatches for r in results.values() for t in r.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
