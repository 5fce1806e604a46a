"""Speculative decoding of the default model on this CPU: plain decode against lookup speculation.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched with ``tandem_core.pull`` when
absent) first has its verify cost measured (a decode step and a verify of ``w`` rows, at two
context lengths), then decodes three prompt sets greedily, each prompt four ways, interleaved
prompt by prompt (so the machine's load hits them alike):

- ``plain``: the plain loop (``Decode``), one forward a token;
- ``lookup, online prices``: ``SpecDecode`` with the lookup drafter and a StairCut that learns the
  verify prices online from its own measured verify times (no price file: the production setting
  on a machine without one);
- ``lookup, measured prices``: the same with a price table made from this run's verify
  measurements (what a price file for this machine would hold);
- ``lookup, forced drafting``: a synthetic price curve on which a verified row costs a tenth of a
  decode step (as on a GPU), so the cut drafts whatever the drafter offers: what drafting costs on
  this CPU when the cut does not hold it back.

The sets: ``agent`` (an agent session: each turn is the previous turn's messages, the model's
answer and a tool result that shows a file again), ``copying`` (single prompts whose answer copies or
continues text in the prompt) and ``chat`` (plain questions). Each speculative mode keeps one drafter
and one cut for the whole set (their session history, learnt prices and calibration carry over, as in
a server). Every speculative answer is checked against the plain one, token for token.

Decode speed is tokens after the first over the time after the first (the prefill is not timed).
The tables are printed and written to ``docs/measurements/cpu-speculation.md`` with the command
that made them.

    python tools/bench_spec_cpu.py [--tokens 48] [--threads 1] [--max-tree 16] [--sets agent,copying,chat]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PLAIN, ONLINE, MEASURED, FORCED = "plain", "lookup, online prices", "lookup, measured prices", "lookup, forced drafting"
MODES = (PLAIN, ONLINE, MEASURED, FORCED)
CONTEXTS = (64, 1024)                        # where the verify cost is measured
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)          # and at which widths (max tree + 1 is added)

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
    ('Copy this JSON exactly: {"name": "Alice", "age": 30, "city": "Paris", "tags": ["a", "b", "c"], '
    '"address": {"street": "1 Main St", "zip": "75001"}}'),
    ("Complete this Python code:\n\ndef f0(x):\n    return x + 0\n\ndef f1(x):\n    return x + 1\n\n"
    "def f2(x):\n    return x + 2\n"),
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


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import _cpu_name, _model_path  # noqa: E402  (the same machine and model as the decode benchmark)


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
    mismatches: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.timed_tokens / self.seconds if self.seconds else float("nan")

    def per_round(self, n: int) -> float:
        return n / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class VerifyCost:
    """Median ms of a decode step and of a verify of each width, at each context."""

    decode: dict[int, float]                     # context -> ms
    verify: dict[int, dict[int, float]]          # context -> width -> ms

    def marginal(self, context: int) -> float:
        """The median cost of one more verified row, in decode steps."""
        d = self.decode[context]
        return statistics.median((ms - d) / (w - 1) / d for w, ms in self.verify[context].items() if w > 1)

    def table(self) -> Any:
        from tandem_core.spec.cut import PriceTable

        widths = sorted(self.verify[CONTEXTS[0]])
        return PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "smollm2-135m",
                                     "profile": "fp32", "device": "cpu", "contexts": list(CONTEXTS),
                                     "widths": widths, "ms": [[self.verify[c][w] for w in widths] for c in CONTEXTS],
                                     "meta": {"tool": "bench_spec_cpu (measured in this run)"}})


def measure_verify(engine: Any, served: Any, widths: list[int], repeats: int) -> VerifyCost:
    """A decode step and a verify (a chain) of each width on top of each of ``CONTEXTS`` cached tokens."""
    decode: dict[int, float] = {}
    verify: dict[int, dict[int, float]] = {}
    text = served.tokenizer.encode(FILE)

    def once(context: int, rows: list[int], verify: bool) -> float:
        engine.rollback_to(context)
        t0 = time.perf_counter()
        if verify:
            engine.forward_block(rows)
        else:
            engine.forward(rows)
        return (time.perf_counter() - t0) * 1e3

    for context in CONTEXTS:
        ids = (text * (context // max(len(text), 1) + 2))[:context + max(widths) + 1]
        engine.reset()
        engine.forward(ids[:context])
        nxt = ids[context:]
        decode[context] = statistics.median(once(context, nxt[:1], False) for _ in range(repeats))
        verify[context] = {w: statistics.median(once(context, nxt[:w], True) for _ in range(repeats))
                           for w in widths}
        engine.discard_pending()
    engine.reset()
    return VerifyCost(decode, verify)


def _speculation(engine: Any, tokenizer: Any, max_tree: int, prices: Any) -> Any:
    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.spec.cut import StairCut
    from tandem_core.spec.speculate import Speculation

    target = TargetInfo.of(engine.caps, tokenizer=tokenizer.fingerprint(), vocab_size=tokenizer.vocab_size,
                           name="smollm2-135m")
    return Speculation([build_drafter("lookup", target)], StairCut(prices, max_tree=max_tree), max_tree)


def _forced(max_tree: int) -> Any:
    from tandem_core.spec.cut import PriceTable

    w = max_tree + 1
    return PriceTable.from_dict({"format": "tandem-prices", "version": 1, "model": "smollm2-135m", "profile": "fp32",
                                 "device": "cpu", "contexts": [0, 1 << 20], "widths": [1, w],
                                 "ms": [[1.0, 1.0 + 0.1 * (w - 1)]] * 2,
                                 "meta": {"tool": "bench_spec_cpu (synthetic: forced drafting)"}})


def _run(engine: Any, ids: list[int], tokens: int, stops: frozenset[int], spec: Any) -> tuple[list[int], Any]:
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams
    from tandem_core.spec.speculate import SpecDecode

    req = DecodeRequest(ids, tokens, SamplingParams(temperature=0.0), stops)
    dec = Decode(engine, req, _NullDetok()) if spec is None else SpecDecode(engine, req, _NullDetok(),
                                                                            speculation=spec)
    return [t for chunk in dec.run() for t in chunk.tokens], dec


def _account(t: Tally, out: list[int], dec: Any, want: list[int] | None, index: int) -> None:
    t.prompts += 1
    t.tokens += len(out)
    if dec.t_first is not None and dec.t_last is not None and len(out) > 1:
        t.timed_tokens += len(out) - 1
        t.seconds += dec.t_last - dec.t_first
    from tandem_core.spec.speculate import SpecDecode

    if isinstance(dec, SpecDecode):
        stats = dec.stats
        t.rounds += stats.rounds
        t.drafted += stats.drafted
        t.accepted += stats.accepted
    if want is not None and out != want:
        t.mismatches.append(index)


def run_set(name: str, served: Any, engine: Any, tokens: int, max_tree: int, cost: VerifyCost
            ) -> tuple[dict[str, Tally], Any, int]:
    """Decode one prompt set four ways, prompt by prompt; returns the tallies, the online cut and the
    median prompt length."""
    from tandem_core.server.template import render_chat

    tok = served.tokenizer
    stops = frozenset(served.stop_ids)
    specs = {ONLINE: _speculation(engine, tok, max_tree, None),
             MEASURED: _speculation(engine, tok, max_tree, cost.table()),
             FORCED: _speculation(engine, tok, max_tree, _forced(max_tree))}
    tallies = {m: Tally() for m in MODES}
    convo: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    prompts = {"agent": AGENT_ASKS, "copying": COPYING, "chat": CHAT}[name]
    lengths = []
    for i, text in enumerate(prompts):
        if name == "agent":
            convo.append({"role": "user", "content": text})
            ids = tok.encode(render_chat(served, convo))
        else:
            ids = tok.encode(render_chat(served, [{"role": "user", "content": text}]))
        lengths.append(len(ids))
        want, dec = _run(engine, ids, tokens, stops, None)
        _account(tallies[PLAIN], want, dec, None, i)
        for mode, spec in specs.items():
            out, dec = _run(engine, ids, tokens, stops, spec)
            _account(tallies[mode], out, dec, want, i)
        print(f"  {name} {i + 1}/{len(prompts)}: {len(ids)} prompt tokens; "
              + ", ".join(f"{m} {tallies[m].rate:.1f}" for m in MODES) + " tok/s", file=sys.stderr, flush=True)
        if name == "agent":
            convo.append({"role": "assistant", "content": tok.decode([t for t in want if t not in stops])})
            convo.append({"role": "tool", "content": f"$ cat timeparse/core.py  (after step {i + 1})\n{FILE}"})
    return tallies, specs[ONLINE].cut, int(statistics.median(lengths))


def report(args: argparse.Namespace, cmd: str, path: Path, results: dict[str, dict[str, Tally]],
           cuts: dict[str, tuple[Any, int]], cost: VerifyCost, load: tuple[float, float]) -> str:
    cores = os.cpu_count() or 1
    same = not any(t.mismatches for r in results.values() for t in r.values())
    lines = [
        "# Speculative decoding on the CPU: the default model, plain against lookup speculation",
        "",
        f"Command: `{cmd}`",
        "",
        (f"- CPU: {_cpu_name()}, {cores} logical cores, torch {torch.__version__}, {args.threads} torch "
        f"thread(s); load average (1 min) {load[0]:.1f} before and {load[1]:.1f} after the runs"),
        (f"- model: {path.name} (`smollm2-135m`, tandem-llama, dense fp32); greedy, at most {args.tokens} "
        f"tokens an answer; at most {args.max_tree} drafted nodes a verify (besides the pending token)"),
        ("- decode speed: tokens after each answer's first over the time after it (prefill not timed), "
        "summed over the set; the four modes run prompt by prompt, interleaved"),
        f"- every speculative answer equals the plain answer token for token: **{'yes' if same else 'NO'}**",
    ]
    if max(load) >= cores / 2 and cores > 1:
        lines.append(f"- other processes shared the {cores} cores during the runs (the load average above): "
                     f"the times are noisy; the interleaving spreads the noise over the modes alike")
    lines += [
        "",
        ("| set | mode | prompts | tokens | decode tok/s | vs plain | rounds | tokens/round | drafted/round "
        "| accepted/round | acceptance |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, tallies in results.items():
        base = tallies[PLAIN].rate
        for mode in MODES:
            t = tallies[mode]
            if mode == PLAIN:
                lines.append(f"| {name} | {mode} | {t.prompts} | {t.tokens} | {t.rate:.2f} | 1.00x | {t.tokens} | "
                             f"1.00 | | | |")
                continue
            acc = t.accepted / t.drafted if t.drafted else 0.0
            lines.append(f"| {name} | {mode} | {t.prompts} | {t.tokens} | {t.rate:.2f} | **{t.rate / base:.2f}x** | "
                         f"{t.rounds} | {t.per_round(t.tokens):.2f} | {t.per_round(t.drafted):.2f} | "
                         f"{t.per_round(t.accepted):.2f} | {acc:.2f} |")
    lines += [
        "",
        f"## What a verify costs here (median of {args.repeats} runs)",
        "",
        "| rows verified | " + " | ".join(f"ms at {c} tokens | decode steps" for c in CONTEXTS) + " |",
        "|---:|" + "---:|---:|" * len(CONTEXTS),
        "| decode step | " + " | ".join(f"{cost.decode[c]:.1f} | 1.00" for c in CONTEXTS) + " |",
    ]
    for w in sorted(cost.verify[CONTEXTS[0]]):
        lines.append(f"| {w} | " + " | ".join(f"{cost.verify[c][w]:.1f} | {cost.verify[c][w] / cost.decode[c]:.2f}"
                                              for c in CONTEXTS) + " |")
    shown = [w for w in WIDTHS if 1 < w <= args.max_tree + 1]
    table = cost.table()
    lines += [
        "",
        ("The online cut's prices at the end of each set, relative to one row, at the set's median prompt "
         "length, against the measured ones (the table above, interpolated); it verified the widths listed "
         "itself, the others it interpolated or extrapolated:"),
        "",
        "| set | context | prices | " + " | ".join(f"{w} rows" for w in shown) + " | widths it verified |",
        "|---|---:|---|" + "---:|" * len(shown) + "---|",
    ]
    steeper = []
    for name, (cut, ctx) in cuts.items():
        learnt, want = cut.curve(ctx, args.max_tree + 1), table.curve(ctx, args.max_tree + 1)
        lines.append(f"| {name} | {ctx} | learnt online | "
                     + " | ".join(f"{learnt[w - 1] / learnt[0]:.2f}" for w in shown)
                     + f" | {', '.join(str(w) for w in cut.online.widths)} |")
        lines.append(f"| {name} | {ctx} | measured | " + " | ".join(f"{want[w - 1] / want[0]:.2f}" for w in shown)
                     + " | |")
        if learnt[3] / learnt[0] > 1.25 * want[3] / want[0]:          # 4 rows priced 25 % over the measured
            steeper.append(name)
    lines += ["", *_reading(results, cost, steeper)]
    return "\n".join(lines)


def _reading(results: dict[str, dict[str, Tally]], cost: VerifyCost, steeper: list[str]) -> list[str]:
    """The conclusions, written from the numbers above."""
    marg = statistics.median(cost.marginal(c) for c in CONTEXTS)
    out = [
        "## Reading the numbers",
        "",
        (f"- A verified row costs about **{marg:.2f} of a decode step** here (the median marginal row of the "
        f"table above). Row invariance makes every row its own gemv (`linear_rows`: the decode step's "
        f"one-row call), so a verify reads every weight once a row (from the CPU's cache after the first "
        f"row; the output head in 8 MiB blocks for that reason). A round that verifies the pending token "
        f"and `d` drafted nodes costs about `1 + {marg:.2f} d` steps and yields `1 + a` tokens (`a` "
        f"accepted): it beats plain decoding only when more than about {marg:.0%} of the drafted nodes are "
        f"accepted."),
    ]
    for name, t in results.items():
        base = t[PLAIN].rate
        parts = []
        for mode in (ONLINE, MEASURED, FORCED):
            m = t[mode]
            acc = m.accepted / m.drafted if m.drafted else 0.0
            parts.append(f"{mode.split(', ')[1]} {m.rate / base:.2f}x ({m.per_round(m.drafted):.2f} drafted a "
                         f"round, {acc:.0%} accepted)")
        best = max((ONLINE, MEASURED, FORCED), key=lambda mode: t[mode].rate)
        out.append(f"- **{name}**: " + "; ".join(parts) + f". Fastest: {best}"
                   + (", faster than plain." if t[best].rate > base else ", still slower than plain."))
    steep = (f"steeper than the measured one on {', '.join(steeper)} (the table above), so there it drafted less "
             f"than the measured prices let it; a width it stops trying is measured again only when an exploring "
             f"round (one after every 16 rounds in a row that kept nothing) picks it"
             if steeper else "close to the measured one on every set")
    out += [
        ("- The cut drafts what pays on its prices: a node goes in when its calibrated chance of acceptance "
        "buys more than its row costs. Online, it learns the verify cost from its own verifies and verifies "
        "wide only when the drafter is confident, so the wider widths rest on few samples on a busy machine; "
        f"here its curve came out {steep}. Forced drafting shows what restraint saves or costs."),
        ("- A round that drafts nothing still costs a little more than a plain step (the drafter's proposal, "
        "the cut, the walk and a one-node verify instead of a decode step): most of the loss where a cut "
        "drafts almost nothing."),
        ("- Every speculative answer equals the plain answer token for token, whichever way the cut went: "
        "speculation changes the speed, never the text."),
        ("- On a GPU the picture flips: a verify's rows share one read of the weights (the Qwen3.8-27B price "
        "file for the H200, `tandem_core/shipped/prices/qwen3.8-27b/bf16.h200.json`, prices 16 rows at about 1.1x one "
        "row), so the cut drafts wide trees and accepted tokens come nearly free."),
        "",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="the most tokens an answer")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-tree", type=int, default=16, help="drafted nodes a verify may carry")
    ap.add_argument("--sets", default="agent,copying,chat", help="prompt sets: agent, copying, chat")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each verify width (the median)")
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
    width = args.max_tree + 1                  # the pending token and the drafted nodes
    served = serve(ServeArgs("smollm2-135m", path, max_context=4096, options={"max_tree": width}),
                   ServeContext())
    engine = served.engine
    load_before = os.getloadavg()[0]
    cost = measure_verify(engine, served, sorted({*(w for w in WIDTHS if w < width), width}), args.repeats)
    results: dict[str, dict[str, Tally]] = {}
    cuts: dict[str, tuple[Any, int]] = {}
    for name in sets:
        results[name], cut, ctx = run_set(name, served, engine, args.tokens, args.max_tree, cost)
        cuts[name] = (cut, ctx)
    load_after = os.getloadavg()[0]
    cmd = "python tools/bench_spec_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(args, cmd.strip(), path, results, cuts, cost, (load_before, load_after))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)
    same = not any(t.mismatches for r in results.values() for t in r.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
