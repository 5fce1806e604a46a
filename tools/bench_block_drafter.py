"""Benchmark the block drafter: acceptance and speed of --spec lookup / block / lookup,block against plain decode.

Held-out prompts the drafter was never trained on, in three sets:

- code: completion and edit requests over source files that ``tandem train-drafter`` never reads
  (``tandem_drafters.train.held_out_file``);
- agent: agent-style transcripts (a system prompt with tools, a file read through a tool, a request to change
  it), over the same held-out files;
- chat: chat questions in words and topics the training prompts do not use.

For every prompt: plain greedy decode, then each drafter set (drafters reset before each prompt); every
speculative answer must equal the plain one token for token (a mismatch is counted and fails the run). Per set:
acceptance length (tokens a round, the model's own included), drafted and accepted nodes a round, decode tokens a
second and the speedup against plain decode in the same run. Prints a table; ``--md`` writes it (with the
command and the machine) to a markdown file, ``--json`` the numbers.

    python tools/bench_block_drafter.py --model smollm2-135m --drafter ~/.tandem/work/drafter --device cpu \
        --md docs/measurements/block-drafter.md
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

CHAT = (
    "What should I pack for a weekend trip to the mountains in autumn?",
    "Why is the sky blue? Answer in a short paragraph.",
    "Suggest a name for a small bakery and explain why.",
    "How does a refrigerator keep food cold?",
    "Write a limerick about a cat who loves boxes.",
    "What is the difference between weather and climate?",
    "Give me a simple recipe for tomato soup.",
    "How can I become better at remembering names?",
    "Explain how vaccines train the immune system.",
    "Plan a one-day itinerary for a first visit to Lisbon.",
    "What makes a good password?",
    "Describe the water cycle for a ten-year-old.",
)
TOOLS = ('[{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", '
         '"properties": {"path": {"type": "string"}}}}}, {"type": "function", "function": {"name": "write_file", '
         '"parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": '
         '{"type": "string"}}}}}]')
AGENT_ASKS = ("Add a docstring to the first function and show the whole updated snippet.",
              "Fix any style problems and print the corrected code in full.",
              "Rename the first function to something clearer and show the new code.")


def held_out_snippets(n: int, seed: int, chars: int = 1200) -> list[tuple[str, str]]:
    from tandem_drafters.train import held_out_file, source_files

    files = [f for f in source_files() if held_out_file(f)]
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[tuple[str, str]] = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))]
        if not starts:
            continue
        a = rng.choice(starts)
        text = "\n".join(lines[a:a + 30]).strip()
        if len(text) > min(200, chars):
            out.append((f.name, text[:chars]))
        if len(out) >= n:
            break
    return out


def prompt_sets(n: int, seed: int, chars: int = 1200) -> dict[str, list[list[dict[str, str]]]]:
    snippets = held_out_snippets(2 * n, seed, chars)
    code = []
    for k, (_, text) in enumerate(snippets[:n]):
        if k % 2:
            code.append([{"role": "user", "content": f"Complete this Python code:\n\n```python\n"
                                                      f"{chr(10).join(text.splitlines()[:12])}\n```"}])
        else:
            code.append([{"role": "user", "content": f"Add type hints to this code.\n\n```python\n{text}\n```"}])
    agent = []
    for k, (name, text) in enumerate(snippets[n:2 * n] or snippets[:n]):
        agent.append([
            {"role": "system", "content": f"You are a coding agent. Tools: {TOOLS}. Call a tool with JSON."},
            {"role": "user", "content": f"Open {name} and tidy it up."},
            {"role": "assistant", "content": f'{{"name": "read_file", "arguments": {{"path": "{name}"}}}}'},
            {"role": "user", "content": f"Tool result (read_file):\n```python\n{text}\n```\n\n"
                                        f"{AGENT_ASKS[k % len(AGENT_ASKS)]}"},
        ])
    chat = [[{"role": "user", "content": q}] for q in CHAT[:n]]
    return {"code": code, "agent": agent, "chat": chat}


class _NoText:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--drafter", required=True, help="the block drafter folder (config.json + model.safetensors)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6, help="prompts a set (default 6)")
    ap.add_argument("--max-tree", type=int, default=16)
    ap.add_argument("--specs", default="lookup;block;lookup,block", help="drafter sets, ';' between them")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--snippet-chars", type=int, default=1200, help="the most characters of a code snippet")
    ap.add_argument("--md", help="write the table (and the command, the machine) to this markdown file")
    ap.add_argument("--json", help="write the numbers to this file")
    ap.add_argument("--title", default="Block drafter")
    a = ap.parse_args(argv)

    from tandem_core.cli.load import placement
    from tandem_core.drafter import TargetInfo, build_drafter
    from tandem_core.loader import load_served
    from tandem_core.plugins import load_plugins
    from tandem_core.server.speculation import _device_name
    from tandem_core.server.template import render_chat
    from tandem_core.serving import ServeArgs
    from tandem_core.spec.cut import StairCut
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams
    from tandem_core.spec.speculate import SpecDecode, Speculation

    load_plugins()
    device, dtype = placement(a.device, a.dtype)
    served = load_served(a.model, weights=a.weights, args=ServeArgs(model_id="", path=Path("."), device=device,
                                                                    dtype=dtype, max_context=a.max_context))
    eng = served.engine
    target = TargetInfo.of_engine(eng, tokenizer=served.tokenizer.fingerprint(),
                                  vocab_size=served.tokenizer.vocab_size, name=served.model_id)
    specs = [tuple(s.split(",")) for s in a.specs.split(";") if s]
    max_tree = max(1, min(a.max_tree, eng.caps.max_tree - 1))
    per_spec = {}
    for names in specs:
        ds = [build_drafter(n, target, **({"path": a.drafter} if n == "block" else {})) for n in names]
        cut = StairCut.for_model(served.model_id, dtype, _device_name(device.split(":")[0]), max_tree=max_tree)
        per_spec[",".join(names)] = Speculation(ds, cut, max_tree)
    sets = prompt_sets(a.prompts, a.seed, a.snippet_chars)
    stops = frozenset(served.stop_ids)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def one(cls: Any, ids: list[int], **kw: Any) -> tuple[list[int], float, Any]:
        dec = cls(eng, DecodeRequest(ids, a.max_new, SamplingParams(temperature=0.0), stops), _NoText(), **kw)
        t_first = None
        toks: list[int] = []
        for chunk in dec.run():
            toks.extend(chunk.tokens)
            if t_first is None and toks:
                sync()
                t_first = time.perf_counter()
        sync()
        return toks, time.perf_counter() - (t_first or time.perf_counter()), dec

    # warm-up: one prompt through every path
    warm = served.tokenizer.encode(render_chat(served, sets["chat"][0]))
    one(Decode, warm)
    for sp in per_spec.values():
        for d in sp.drafters:
            d.reset()
        one(SpecDecode, warm, speculation=sp)

    results: dict[str, dict[str, Any]] = {}
    mismatches = 0
    for set_name, prompts in sets.items():
        plain_t = plain_n = 0.0
        agg = {k: {"rounds": 0, "tokens": 0, "drafted": 0, "accepted": 0, "t": 0.0, "n": 0, "skipped": 0,
                   "cost_ms": [], "gain_ms": []} for k in per_spec}
        used = 0
        for msgs in prompts:
            ids = served.tokenizer.encode(render_chat(served, msgs))
            if len(ids) + a.max_new + 2 > eng.caps.max_context:
                continue                    # does not fit the engine's context: not measured
            used += 1
            want, t, _ = one(Decode, ids)
            plain_t += t
            plain_n += max(0, len(want) - 1)
            for key, sp in per_spec.items():
                for d in sp.drafters:
                    d.reset()
                got, t, dec = one(SpecDecode, ids, speculation=sp)
                if got != want:
                    mismatches += 1
                g = agg[key]
                g["rounds"] += dec.stats.rounds
                g["tokens"] += dec.stats.tokens
                g["drafted"] += dec.stats.drafted
                g["accepted"] += dec.stats.accepted
                g["t"] += t
                g["n"] += max(0, len(got) - 1)
                g["skipped"] += dec.stats.paused           # rounds the costly drafter sat out (its gate's pauses)
                for gate in dec._gates.values():            # the gate's prices after this request
                    g["cost_ms"].append(gate.cost_ms)
                    g["gain_ms"].append(gate.gain_ms)
        plain_rate = plain_n / plain_t if plain_t else 0.0
        row = {"plain_tok_s": round(plain_rate, 2), "prompts": used}
        for key, g in agg.items():
            r = max(g["rounds"], 1)
            rate = g["n"] / g["t"] if g["t"] else 0.0
            row[key] = {"accept_len": round(g["tokens"] / r, 3), "drafted_per_round": round(g["drafted"] / r, 2),
                        "accepted_per_round": round(g["accepted"] / r, 3), "tok_s": round(rate, 2),
                        "speedup": round(rate / plain_rate, 3) if plain_rate else 0.0,
                        "block_skipped_per_round": round(g["skipped"] / r, 3),
                        "block_ms_per_proposal": round(statistics.fmean(g["cost_ms"]), 2) if g["cost_ms"] else None,
                        "block_saved_ms_per_round": round(statistics.fmean(g["gain_ms"]), 2) if g["gain_ms"]
                        else None}
        results[set_name] = row
        print(f"[{set_name}] done", file=sys.stderr, flush=True)

    lines = [("| set | spec | acceptance length | drafted / round | accepted / round | tok/s | plain tok/s | "
             "speedup | block paused / round | block ms a proposal | block saved ms a round |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(v: Any) -> str:
        return "–" if v is None else f"{v:.2f}"

    for set_name, row in results.items():
        for key in per_spec:
            m = row[key]
            paused = f"{m['block_skipped_per_round']:.2f}" if m["block_ms_per_proposal"] is not None else "–"
            lines.append(f"| {set_name} | {key} | {m['accept_len']:.2f} | {m['drafted_per_round']:.1f} | "
                         f"{m['accepted_per_round']:.2f} | {m['tok_s']:.1f} | {row['plain_tok_s']:.1f} | "
                         f"{m['speedup']:.2f}x | {paused} | {ms(m['block_ms_per_proposal'])} | "
                         f"{ms(m['block_saved_ms_per_round'])} |")
    table = "\n".join(lines)
    print(table)
    print(f"mismatches against plain decode: {mismatches}")
    machine = (torch.cuda.get_device_name() if device.startswith("cuda") else
               (platform.processor() or platform.machine()) + f", {torch.get_num_threads()} threads")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    meta = {"model": served.model_id, "device": device, "dtype": dtype, "machine": machine, "commit": commit,
            "max_new": a.max_new, "max_tree": max_tree, "prompts_per_set": a.prompts,
            "drafter": json.loads((Path(a.drafter) / "config.json").read_text()).get("tandem", {}),
            "command": "python tools/bench_block_drafter.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results, "mismatches": mismatches}, indent=2))
    if a.md:
        md = Path(a.md)
        md.parent.mkdir(parents=True, exist_ok=True)
        head = md.read_text() if md.exists() else "# Block drafter measurements\n"
        section = (f"\n## {a.title}: {served.model_id} on {machine} ({device}, {dtype}), "
                   f"{time.strftime('%Y-%m-%d')}\n\n```\n{meta['command']}\n```\n\ncommit {commit}; "
                   f"{a.prompts} prompts a set, {a.max_new} new tokens, greedy, max tree {max_tree}; drafter: "
                   f"{json.dumps(meta['drafter'])}\n\n{table}\n\nSpeculative answers equal to plain: "
                   f"{'all' if not mismatches else f'NOT ALL ({mismatches} differ)'}.\n")
        md.write_text(head.rstrip("\n") + "\n" + section)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
