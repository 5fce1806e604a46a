"""Speculation in the server: drafters and a cut for each engine, switched on only when proven lossless.

``build_speculation(served, engines, options, log)`` decides once, at load:

- ``--spec off`` (or no drafter named): plain decoding;
- an engine without tree verbs (``caps.tree`` off): plain decoding, one log line;
- a drafter that does not fit the target (``check_target``): refused by name, plain decoding (``--spec mtp``
  on a checkpoint without an MTP head, say);
- the self-check (``spec.selfcheck``), on a spare engine in the background when the plugin can
  spawn one (the server decodes plainly until it passes), replays a recorded decode as chains and
  trees of every verify width up to ``--max-tree`` and compares every row bit for bit: on a
  difference speculation is off for the process, with one log line naming the layer and row,
  and ``/health`` says so.

Each engine gets its own drafters, built for it (they keep that engine's session history; the MTP
drafter drives that engine's own head, ``TargetInfo.engine``) and its own
``StairCut`` (prices from the model's price file for this profile and device, else learnt
online from its own verify times). ``/metrics`` and the log line carry tokens per round and
acceptance.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem_core.drafter import DrafterMismatch, TargetInfo, build_drafter
from tandem_core.serving import Served
from tandem_core.spec.cut import StairCut
from tandem_core.spec.speculate import SpecStats, Speculation

__all__ = ["ServerSpeculation", "SpecOptions", "build_speculation", "mtp_pays", "parse_spec", "resolve_drafters"]

log = logging.getLogger("tandem.spec")


@dataclass(frozen=True)
class SpecOptions:
    """``drafters``: names registered through ``tandem_drafters`` (empty: off; ``auto``: lookup, the MTP head
    where it pays, and every drafter the model's registry entry ships, see ``resolve_drafters``), merged into one tree each round;
    ``max_tree``: the most drafted nodes one verify carries; ``selfcheck``: run the load-time self-check
    (never skip it in production: it is what makes speculation provably lossless on this engine)."""

    drafters: tuple[str, ...] = ("auto",)
    max_tree: int = 16
    selfcheck: bool = True
    selfcheck_tokens: int = 16


class ServerSpeculation:
    """The decision and, when on, one ``Speculation`` per engine slot."""

    def __init__(self, enabled: bool, reason: str, per_engine: Sequence[Speculation | None],
                 drafters: tuple[str, ...], max_tree: int, selfcheck: dict[str, Any] | None) -> None:
        self.enabled = enabled
        self.reason = reason
        self.per_engine = list(per_engine)
        self.drafters = drafters
        self.max_tree = max_tree
        self.selfcheck = selfcheck
        self.checking: threading.Thread | None = None
        self._lock = threading.Lock()

    def settle(self, enabled: bool, reason: str, selfcheck: dict[str, Any] | None) -> None:
        """The self-check's verdict (from its thread): speculation on or off for the process."""
        with self._lock:
            self.selfcheck = selfcheck
            self.reason = reason
            self.enabled = enabled

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background self-check; True when speculation is on."""
        if self.checking is not None:
            self.checking.join(timeout)
        return self.enabled

    def for_slot(self, index: int) -> Speculation | None:
        with self._lock:
            return self.per_engine[index] if self.enabled else None

    def totals(self) -> SpecStats:
        out = SpecStats()
        for s in self.per_engine:
            if s is not None:
                out.add(s.totals)
        return out

    def health(self) -> dict[str, Any]:
        t = self.totals()
        return {"enabled": self.enabled, "reason": self.reason, "drafters": list(self.drafters),
                "max_tree": self.max_tree, "selfcheck": self.selfcheck,
                "rounds": t.rounds, "tokens_per_round": round(t.tokens_per_round, 3),
                "acceptance": round(t.acceptance, 4),
                "explored": sum(s.cut.explored for s in self.per_engine if s),
                "prices": [("file" if s.cut.table is not None else "online") for s in self.per_engine if s]}

    def metric_lines(self) -> list[str]:
        t = self.totals()
        return [
            "# HELP tandem_spec_enabled 1 when speculation is on for this process.",
            "# TYPE tandem_spec_enabled gauge",
            f"tandem_spec_enabled {int(self.enabled)}",
            "# HELP tandem_spec_rounds_total Speculative rounds (one verify forward each).",
            "# TYPE tandem_spec_rounds_total counter",
            f"tandem_spec_rounds_total {t.rounds}",
            "# HELP tandem_spec_tokens_total Tokens yielded by speculative rounds.",
            "# TYPE tandem_spec_tokens_total counter",
            f"tandem_spec_tokens_total {t.tokens}",
            "# HELP tandem_spec_drafted_total Drafted nodes verified.",
            "# TYPE tandem_spec_drafted_total counter",
            f"tandem_spec_drafted_total {t.drafted}",
            "# HELP tandem_spec_accepted_total Drafted nodes accepted.",
            "# TYPE tandem_spec_accepted_total counter",
            f"tandem_spec_accepted_total {t.accepted}",
            ("# HELP tandem_spec_explore_rounds_total Rounds widened to explore after a run of rounds that kept "
            "no drafted node."),
            "# TYPE tandem_spec_explore_rounds_total counter",
            f"tandem_spec_explore_rounds_total {sum(s.cut.explored for s in self.per_engine if s)}",
            "# HELP tandem_spec_tokens_per_round Tokens per round since start.",
            "# TYPE tandem_spec_tokens_per_round gauge",
            f"tandem_spec_tokens_per_round {t.tokens_per_round:.4f}",
            "# HELP tandem_spec_acceptance Accepted over drafted nodes since start.",
            "# TYPE tandem_spec_acceptance gauge",
            f"tandem_spec_acceptance {t.acceptance:.4f}",
        ]


def parse_spec(spec: str) -> tuple[str, ...]:
    """``--spec``: ``off`` (or ``none``, empty) -> no drafter; ``auto``; else drafter names separated by commas
    (``lookup,block``), each once, in the order given."""
    if spec.strip().lower() in ("off", "none", ""):
        return ()
    out: list[str] = []
    for name in (d.strip() for d in spec.split(",")):
        if name and name not in out:
            out.append(name)
    return tuple(out)


def resolve_drafters(names: Sequence[str], model_id: str, caps: Any = None) -> tuple[str, ...]:
    """``auto`` becomes ``lookup``, then ``mtp`` when the engine's MTP head pays for itself (``mtp_pays``:
    ``caps``, the engine's ``Capabilities``), then every drafter the model's registry entry ships whose files
    are on this machine (``drafters:`` in model.yaml, fetched by ``tandem pull``); other names stay as given."""
    auto = ["lookup", *(("mtp",) if caps is not None and mtp_pays(caps) else ())]
    out: list[str] = []
    for name in names:
        if name != "auto":
            if name not in out:
                out.append(name)
            continue
        for extra in (*auto, *shipped_drafters(model_id)):
            if extra not in out:
                out.append(extra)
    return tuple(out)


def mtp_pays(caps: Any) -> bool:
    """Whether ``--spec auto`` drafts with the engine's MTP head: it has one (``caps.mtp``) and a draft step
    costs a small part of a target step, which holds where the step is a CUDA graph replay (``caps.mtp_graphs``)
    or runs on the CPU. Both read what the head reads (its decoder layer and the shared output head: ~3 GB of
    the 27B's ~54 GB, ~6% of a decode step at the bandwidth floor). An eager head on a GPU does not pay: on
    the H200 its step is launch-bound, 2.3-4.1 ms against a 13.8 ms decode step (``docs/measurements/
    h200-mtp.md``), so a depth-3 round would cost two thirds of the step it tries to save."""
    return int(caps.mtp) > 0 and (bool(caps.mtp_graphs) or str(caps.device).split(":")[0] == "cpu")


def shipped_drafters(model_id: str) -> tuple[str, ...]:
    """The drafters the registry entry of ``model_id`` ships and ``tandem pull`` has verified here."""
    from tandem_core import catalog, pull

    try:
        e = catalog.entry(model_id)
    except catalog.ModelNotFound:
        return ()
    return tuple(n for n in (e.data.get("drafters") or {}) if pull.drafter_path(e.data, n) is not None)


def _off(reason: str, n: int, drafters: tuple[str, ...], max_tree: int,
         selfcheck: dict[str, Any] | None = None) -> ServerSpeculation:
    log.info("speculation off: %s", reason)
    return ServerSpeculation(False, reason, [None] * n, drafters, max_tree, selfcheck)


def build_speculation(served: Served, engines: Sequence[Any], options: SpecOptions,
                      profile: str = "fp32") -> ServerSpeculation:
    """Decide and build. The self-check runs on an engine of its own when the plugin can ``spawn``
    one (in a background thread: the server listens at once and decodes plainly until the check
    passes), else on the first engine before the server listens."""
    n = len(engines)
    names = resolve_drafters(options.drafters, served.model_id, engines[0].caps if engines else None)
    if not names:
        return _off("--spec off", n, names, 0)
    caps = engines[0].caps
    if not caps.tree or caps.max_tree < 2:
        return _off(f"the {served.model_id} engine verifies no trees", n, names, 0)
    # a verify carries the pending token besides the drafted nodes: 1 + max_tree rows
    max_tree = max(1, min(options.max_tree, caps.max_tree - 1))
    fingerprint = served.tokenizer.fingerprint()
    try:
        per_engine_drafters = []
        # each engine lends its own embedding and head (shared weights), and its MTP head, to its drafters
        for engine in engines:
            target = TargetInfo.of_engine(engine, tokenizer=fingerprint, vocab_size=served.tokenizer.vocab_size,
                                          name=served.model_id)
            per_engine_drafters.append([build_drafter(name, target) for name in names])
    except (DrafterMismatch, KeyError, TypeError) as exc:
        return _off(str(exc).strip("'\""), n, names, max_tree)
    device = _device_name(caps.device.split(":")[0])
    per_engine = [Speculation(ds, StairCut.for_model(served.model_id, profile, device, max_tree=max_tree), max_tree)
                  for ds in per_engine_drafters]
    prices = "from file" if per_engine[0].cut.table is not None else "learnt online"
    if not options.selfcheck:
        log.info("speculation on without the self-check: drafters %s, max tree %d, prices %s",
                 ",".join(names), max_tree, prices)
        return ServerSpeculation(True, "on (self-check skipped)", per_engine, names, max_tree, None)
    spec = ServerSpeculation(False, "self-check running", per_engine, names, max_tree, None)

    def check(engine: Any) -> None:
        from tandem_core.spec.selfcheck import run_selfcheck

        result = run_selfcheck(engine, tokens=options.selfcheck_tokens, max_width=max_tree + 1)
        verdict = {"ok": result.ok, "rows": result.rows_checked, "widths": len(result.widths),
                   "seconds": round(result.seconds, 2), "mismatch": result.first_mismatch}
        if result.ok:
            log.info("self-check passed: %d rows bit for bit, verify widths 1..%d, %.2fs; speculation on: "
                     "drafters %s, prices %s", result.rows_checked, max_tree + 1, result.seconds, ",".join(names), prices)
            spec.settle(True, "on", verdict)
        else:
            log.warning("speculation off for this process: the self-check found a verified row that differs "
                        "from decode: %s", result.first_mismatch)
            spec.settle(False, f"self-check failed: {result.first_mismatch}", verdict)

    if served.spawn is not None:
        spare = served.spawn()
        spec.checking = threading.Thread(target=check, args=(spare,), name="tandem-selfcheck", daemon=True)
        spec.checking.start()
        log.info("self-check started on a spare engine: plain decoding until it passes")
    else:
        check(engines[0])   # leaves the engine reset: before the caches attach
    return spec


def _device_name(device: str) -> str:
    """The price files' device name: the GPU's model (``h200``) on CUDA, ``cpu`` otherwise."""
    if device != "cuda":
        return device
    import torch

    name = torch.cuda.get_device_name().lower()
    for known in ("h200", "h100", "a100", "gb10", "l40s", "4090"):
        if known in name:
            return known
    return name.replace(" ", "-")

