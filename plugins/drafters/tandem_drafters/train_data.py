"""The data stage of ``tandem train-drafter`` (``tandem_drafters.train`` documents both stages): prompts built
offline from source files and chat topics, and the target's own greedy answers to them, in resumable shards
under ``OUT/data``."""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch



__all__ = ["CHAT_TEMPLATES", "CHAT_TOPICS", "DataOptions", "EDITS", "auto_batch", "batched_of", "done_indices",
           "generate", "held_out_file", "make_request", "source_files"]


# -- prompts --------------------------------------------------------------------------------------------------

EDITS = (
    "Add type hints to this code.", "Add a docstring to every function in this code.",
    "Rename the variables in this code to clearer names.", "Rewrite this code to be easier to read.",
    "Add error handling to this code.", "Write unit tests for this code with pytest.",
    "Make this code shorter without changing what it does.", "Convert this code to use pathlib where it can.",
)
CHAT_TEMPLATES = (
    "Write a short story about {}.", "Explain {} to a beginner.", "Give me three tips for {}.",
    "What are the pros and cons of {}?", "Write a poem about {}.", "Summarize the history of {}.",
    "How do I get started with {}?", "Write an email to a friend about {}.", "List five facts about {}.",
    "Describe {} in simple words.",
)
CHAT_TOPICS = (
    "gardening", "the ocean", "learning a language", "cooking pasta", "running a marathon", "the moon",
    "saving money", "photography", "climate", "volcanoes", "chess", "coffee", "birds", "public speaking",
    "the internet", "bicycles", "jazz", "sleep", "time management", "ancient Rome", "electric cars",
    "mountains", "friendship", "painting", "recycling", "trains", "the solar system", "baking bread",
    "meditation", "football", "libraries", "rain", "robots", "the desert", "music theory", "camping",
)


def source_files(roots: Sequence[Path | str] | None = None, limit: int = 20000) -> list[Path]:
    """Python source files under ``roots`` (default: the standard library and the installed packages), sorted,
    files under 100 bytes or over 200 kB skipped, at most ``limit``."""
    if roots is None:
        paths = sysconfig.get_paths()
        roots = [paths["stdlib"], paths["purelib"]]
    out: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(str(root)):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(".py"):
                    p = Path(dirpath) / f
                    try:
                        if 100 < p.stat().st_size < 200_000:
                            out.append(p)
                    except OSError:
                        continue
                if len(out) >= limit:
                    return out
    return out


def held_out_file(path: Path | str) -> bool:
    """True for the one source file in 16 that training never reads (the benchmark's code prompts)."""
    name = "/".join(Path(path).parts[-3:])
    return hashlib.sha1(name.encode()).digest()[0] % 16 == 0


def _snippet(rng: random.Random, files: Sequence[Path], max_chars: int) -> str | None:
    for _ in range(8):
        p = files[rng.randrange(len(files))]
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        a = rng.choice(starts)
        text = "\n".join(lines[a:a + rng.randrange(10, 40)]).strip("\n")
        if len(text) >= 80:
            return text[:max_chars]
    return None


def make_request(i: int, files: Sequence[Path], seed: int = 0, max_chars: int = 1200) -> tuple[str, str] | None:
    """Sample ``i``'s ``(kind, user message)``: completion, explanation, edit (of a snippet of a training source
    file) or chat; the same for the same ``i`` and ``seed``; None when no snippet could be read."""
    rng = random.Random(seed * 1_000_003 + i)
    k = i % 10
    if k >= 8 or not files:
        return "chat", rng.choice(CHAT_TEMPLATES).format(rng.choice(CHAT_TOPICS))
    code = _snippet(rng, files, max_chars)
    if code is None:
        return None
    if k < 4:
        cut = code.splitlines()
        head = "\n".join(cut[: max(2, len(cut) // 2)])
        return "completion", f"Complete this Python code:\n\n```python\n{head}\n```"
    if k < 6:
        return "explanation", f"Explain what this Python code does:\n\n```python\n{code}\n```"
    return "edit", f"{rng.choice(EDITS)}\n\n```python\n{code}\n```"


# -- data -----------------------------------------------------------------------------------------------------


@dataclass
class DataOptions:
    model: str | None
    weights: str | None
    out: Path
    samples: int = 256
    max_new: int = 256
    max_prompt: int = 768
    layers: tuple[int, ...] = ()
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    workers: int = 1
    sources: tuple[str, ...] = ()
    time_budget: float = 0.0        # seconds; 0: none
    shard_every: int = 32
    batch: int = 1                  # prompts answered a forward (>1: the runner's batched generator)


class _NoText:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _load(model: str | None, weights: str | None, device: str, dtype: str, max_context: int) -> Any:
    from tandem_core.loader import load_served
    from tandem_core.serving import ServeArgs

    return load_served(model, weights=weights, args=ServeArgs(model_id="", path=Path("."), device=device,
                                                             dtype=dtype, max_context=max_context))


def done_indices(data: Path) -> set[int]:
    out: set[int] = set()
    for f in sorted(data.glob("*.pt")):
        out.update(int(s["i"]) for s in torch.load(f, weights_only=False))
    return out


def _gen_worker(spec: dict[str, Any], served: Any = None) -> int:
    """One worker: sample indices ``w, w + n, ...`` not yet in the shards; returns how many it wrote (``served``:
    the model already loaded, for the one worker run in the calling process)."""
    from tandem_core.server.template import render_chat
    from tandem_core.spec.loop import Decode, DecodeRequest
    from tandem_core.spec.sampler import SamplingParams

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    o = DataOptions(**spec["options"])
    o.out = Path(o.out)
    data = o.out / "data"
    if served is None:
        served = _load(o.model, o.weights, o.device, o.dtype, o.max_prompt + o.max_new + 8)
    eng = served.engine
    layers = tuple(o.layers)
    eng.tap(layers)
    files = [Path(p) for p in spec["files"]]
    done = set(spec["done"])
    w, n = int(spec["worker"]), int(spec["of"])
    deadline = time.monotonic() + o.time_budget if o.time_budget > 0 else math.inf
    pending: list[dict[str, Any]] = []
    shard = 0
    wrote = 0

    def flush() -> None:
        nonlocal shard, pending
        if not pending:
            return
        while (data / f"w{w:02d}-{os.getpid()}-{shard:05d}.pt").exists():
            shard += 1
        path = data / f"w{w:02d}-{os.getpid()}-{shard:05d}.pt"
        torch.save(pending, str(path) + ".part")
        os.replace(str(path) + ".part", path)
        shard += 1
        pending = []

    bar = _bar(len([i for i in range(w, o.samples, n) if i not in done]), f"data w{w}", spec.get("bar", True))
    if o.batch > 1:
        gen = batched_of(eng)
        if gen is None:
            raise ValueError(f"{served.model_id}: its engine has no batched generator (use --batch 1)")
        todo = iter([i for i in range(w, o.samples, n) if i not in done])
        while time.monotonic() <= deadline:
            group: list[tuple[int, str, list[int]]] = []
            for i in todo:
                req = make_request(i, files, o.seed)
                bar.update(1)
                if req is None:
                    continue
                ids = served.tokenizer.encode(render_chat(served, [{"role": "user", "content": req[1]}]))
                if 2 <= len(ids) <= o.max_prompt:
                    group.append((i, req[0], ids))
                if len(group) >= o.batch:
                    break
            if not group:
                break
            answers = gen.generate([g[2] for g in group], o.max_new, sorted(served.stop_ids))
            for (i, kind, ids), ans in zip(group, answers):
                if len(ans) >= 2:
                    pending.append({"i": i, "kind": kind, "tokens": torch.tensor([*ids, *ans], dtype=torch.int32),
                                    "prompt_len": len(ids)})
                    wrote += 1
            if len(pending) >= o.shard_every:
                flush()
        flush()
        bar.close()
        return wrote
    for i in range(w, o.samples, n):
        if i in done:
            continue
        if time.monotonic() > deadline:
            break
        req = make_request(i, files, o.seed)
        bar.update(1)
        if req is None:
            continue
        kind, text = req
        ids = served.tokenizer.encode(render_chat(served, [{"role": "user", "content": text}]))
        if len(ids) > o.max_prompt or len(ids) < 2:
            continue
        dec = Decode(eng, DecodeRequest(ids, o.max_new, SamplingParams(temperature=0.0),
                                        frozenset(served.stop_ids)), _NoText())
        for _ in dec.run():
            pass
        seq = [*ids, *dec.generated]
        if len(dec.generated) < 2:
            continue
        eng.reset()
        with torch.inference_mode():
            eng.forward(seq)
            feats = torch.cat([eng.hidden_at(li) for li in layers], dim=-1).to("cpu", torch.bfloat16)
        pending.append({"i": i, "kind": kind, "tokens": torch.tensor(seq, dtype=torch.int32),
                        "prompt_len": len(ids), "feats": feats.clone()})
        wrote += 1
        if len(pending) >= o.shard_every:
            flush()
    flush()
    bar.close()
    return wrote


def batched_of(engine: Any) -> Any:
    """The engine's batched generator (``generate(prompts, max_new, stop_ids)`` and ``hidden(seqs, layers)``:
    ``tandem_llama.batched.BatchedLlama`` for the Llama runner), or None when its runner has none."""
    make = getattr(getattr(engine, "runner", None), "batched", None)
    return make() if callable(make) else None


def auto_batch(engine: Any, device: str) -> int:
    """``--batch 0``: 256 prompts a forward on CUDA, 8 on the CPU, 1 when the runner has no batched generator."""
    if getattr(getattr(engine, "runner", None), "batched", None) is None:
        return 1
    return 256 if device.startswith("cuda") else 8


def _bar(total: int, what: str, enabled: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=what, file=sys.stderr, mininterval=1.0, disable=not enabled, leave=False)


def generate(o: DataOptions, log: Any = None, served: Any = None) -> dict[str, Any]:
    """Stage 1: write the shards up to ``o.samples`` samples (continuing what is there)."""
    data = o.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    files = [f for f in source_files([Path(s) for s in o.sources] or None) if not held_out_file(f)]
    done = done_indices(data)
    t0 = time.monotonic()
    opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in o.__dict__.items()}
    opts["out"] = str(o.out)
    specs = [{"options": opts, "files": [str(f) for f in files], "done": sorted(done), "worker": w,
              "of": max(1, o.workers), "threads": 0 if o.workers <= 1 else max(1, (os.cpu_count() or 2) // o.workers),
              "bar": sys.stderr.isatty()} for w in range(max(1, o.workers))]
    if o.workers <= 1:
        wrote = _gen_worker(specs[0], served)
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(o.workers) as pool:
            wrote = sum(pool.map(_gen_worker, specs))
    have = done_indices(data)
    rec = {"stage": "data", "samples": len(have), "new": wrote, "seconds": round(time.monotonic() - t0, 1),
           "files": len(files), "workers": o.workers, "batch": o.batch}
    if log is not None:
        log(rec)
    return rec
