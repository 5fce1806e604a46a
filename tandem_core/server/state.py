"""What the routes share: the model, the engines and their queue, the caches, the books.

``ServerState`` is built once per server. It runs a job in the engine's worker thread
(``launch``), serves a short request in a running generation's side lane (``side``), and
writes each request's log line (counts, times and where the prefill started, never text),
ledger row and metrics (``record``). At start it restores the spilled sessions; at stop it
stops the running generations and spills every engine's session.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem_core.cache.gate import MemoryGateError
from tandem_core.server.admission import Admission, Slot
from tandem_core.server.caches import CacheOptions, ServerCaches, build_caches
from tandem_core.server.conduct import Conduct
from tandem_core.server.generate import Outcome, run_job
from tandem_core.server.grammar import Grammars
from tandem_core.server.ledger import Ledger, UsageRow
from tandem_core.server.metrics import Metrics
from tandem_core.server.prepare import Job
from tandem_core.server.sidelane import SideJob, SideLane
from tandem_core.server.speculation import SpecOptions, build_speculation
from tandem_core.server.stream import Delta
from tandem_core.server.toolformat import tool_format
from tandem_core.serving import Served, host_memory_kinds

__all__ = ["ServerOptions", "ServerState", "ParallelUnavailable"]

log = logging.getLogger("tandem.server")


class ParallelUnavailable(ValueError):
    """``--parallel N`` asked for more engines than the model can build (its ``spawn`` is None)."""


@dataclass(frozen=True)
class ServerOptions:
    parallel: int = 1
    queue: int = 8
    api_key: str | None = None
    max_context: int = 8192
    ledger: Path | None = None          # None: no ledger
    wait_comment_s: float = 10.0        # TANDEM_WAIT_COMMENT_S
    side_lane: bool = True              # TANDEM_SIDE_LANE: short requests served at safe points
    caches: CacheOptions | None = None  # None: no caches (every prefill cold)
    spec: SpecOptions | None = None     # None: plain decoding
    backends: Any = None                # tandem_core.proxy.Backends: relay other models there (None: none)
    conductor: Path | None = None       # --conductor: the profile file (None: no conductor)


def _engines(served: Served, n: int) -> list[Any]:
    if n < 1:
        raise ParallelUnavailable(f"--parallel {n}: at least one engine is needed")
    if n > 1 and served.spawn is None:
        raise ParallelUnavailable(f"--parallel {n}: model {served.model_id} cannot build more than one engine "
                                  f"(its plugin gives no spawn); serve it with --parallel 1")
    engines = [served.engine]
    while len(engines) < n:
        assert served.spawn is not None
        engines.append(served.spawn())
    return engines


class ServerState:
    """Everything the routes share: the model, the engines and their queue, the books."""

    def __init__(self, served: Served, options: ServerOptions) -> None:
        self.served = served
        self.options = options
        tool_format(served.tool_format)  # UnknownToolFormat before anything is built
        engines = _engines(served, options.parallel)
        # before the caches: the self-check leaves the engine reset
        self.spec = build_speculation(served, engines, options.spec or SpecOptions(drafters=()),
                                      profile=served.engine.caps.dtype)
        try:
            self.caches: ServerCaches | None = (build_caches(served, engines, options.caches)
                                                if options.caches is not None else None)
        except BaseException:
            self.spec.wait()    # its background self-check must not outlive a state that never started
            raise
        self.admission = Admission(engines, options.queue)
        gate = self.caches.gate if self.caches is not None else None
        self.lanes = [SideLane(served, options.queue, gate, enabled=options.side_lane and e.caps.resume)
                      for e in engines]
        self.pool = ThreadPoolExecutor(len(engines), thread_name_prefix="tandem-engine")
        cap = served.engine.caps.max_context
        self.max_context = min(options.max_context, cap) if cap > 0 else options.max_context
        self.grammars = Grammars(served.tokenizer, served.stop_ids, served.think_tags)
        self.ledger = Ledger(options.ledger) if options.ledger is not None else None
        self.metrics = Metrics(self._gauges, self._metric_lines)
        self.started = int(time.time())
        self.tokenizer_fingerprint = served.tokenizer.fingerprint()
        self.active: set[threading.Event] = set()
        self.conduct = Conduct(self, options.conductor)     # turn planning and the monitor (server.conduct)

    def _metric_lines(self) -> list[str]:
        lines = self.spec.metric_lines()
        lines += ["# HELP tandem_side_lane_total Short requests served inside a running generation.",
                  "# TYPE tandem_side_lane_total counter",
                  f"tandem_side_lane_total {sum(lane.total for lane in self.lanes)}",
                  "# HELP tandem_side_lane_waiting Short requests waiting for a safe point.",
                  "# TYPE tandem_side_lane_waiting gauge",
                  f"tandem_side_lane_waiting {sum(len(lane) for lane in self.lanes)}"]
        if self.caches is not None:
            lines += self.caches.metric_lines()
        return lines + self.conduct.metric_lines() + self._engine_lines()

    def _engine_lines(self) -> list[str]:
        """Where the engines run, their memory by part and device, and the widths captured as graphs."""
        caps = self.served.engine.caps
        lines = ["# HELP tandem_engine_info The engines' device, dtype and widest verify (value 1).",
                 "# TYPE tandem_engine_info gauge",
                 f'tandem_engine_info{{device="{caps.device}",dtype="{caps.dtype}",max_tree="{caps.max_tree}"}} 1',
                 "# HELP tandem_engine_memory_bytes Memory each engine holds, by part and device.",
                 "# TYPE tandem_engine_memory_bytes gauge"]
        for i, slot in enumerate(self.admission.slots):
            for part in slot.engine.memory_parts():
                lines.append(f'tandem_engine_memory_bytes{{engine="{i}",part="{part.name}",device="{part.device}"}} '
                             f"{part.nbytes}")
        lines += ["# HELP tandem_engine_graph_widths Verify widths captured as CUDA graphs (none: eager).",
                  "# TYPE tandem_engine_graph_widths gauge"]
        lines += [f'tandem_engine_graph_widths{{width="{w}"}} 1' for w in caps.graph_widths]
        lines += ["# HELP tandem_host_memory_bytes This process's host memory: resident anonymous pages, resident "
                  "file-backed pages (mapped libraries and files), and the resident high-water mark.",
                  "# TYPE tandem_host_memory_bytes gauge"]
        lines += [f'tandem_host_memory_bytes{{kind="{k}"}} {v}' for k, v in host_memory_kinds().items()]
        return lines

    def _gauges(self) -> dict[str, float]:
        return {"engines": len(self.admission.slots), "engines_busy": self.admission.busy,
                "queue_waiting": len(self.admission.waiting), "queue_limit": self.admission.limit}

    # -- running a job ---------------------------------------------------------------------------------

    def launch(self, job: Job, slot: Slot, emit: Callable[[Delta], None], queued_s: float
               ) -> tuple[asyncio.Future[Outcome], threading.Event]:
        """Start ``job`` on ``slot``'s engine in its worker thread; the slot comes back when it ends."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        self.active.add(cancel)

        caches = self.caches.engine(slot.index) if self.caches is not None else None
        lane = self.lanes[slot.index]
        lane.open = True            # short requests may now wait for this generation's safe points

        def work() -> Outcome:
            t0 = time.perf_counter()
            try:
                spec = self.spec.for_slot(slot.index)
                with caches.busy if caches is not None else nullcontext():
                    outcome = run_job(slot.engine, job, self.served, emit, cancel, caches, spec=spec,
                                      safe_point=lambda: lane.serve(slot.engine))
                    lane.serve(slot.engine)     # what came during the last step
                self.record(job, outcome, queued_s)
                return outcome
            finally:
                held = time.perf_counter() - t0
                try:
                    loop.call_soon_threadsafe(self._returned, slot, held, cancel)
                except RuntimeError:  # the loop is gone (shutdown)
                    pass

        return loop.run_in_executor(self.pool, work), cancel

    def _returned(self, slot: Slot, held: float, cancel: threading.Event) -> None:
        self.active.discard(cancel)
        self.admission.served(held)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        """On the event loop: close the slot's side lane and give the slot back, unless a short request
        came after the worker's last look (offers run on this loop too): then serve it first."""
        lane = self.lanes[slot.index]
        if len(lane):
            loop = asyncio.get_running_loop()
            caches = self.caches.engine(slot.index) if self.caches is not None else None

            def drain() -> None:
                try:
                    with caches.busy if caches is not None else nullcontext():
                        lane.serve(slot.engine)
                finally:
                    try:
                        loop.call_soon_threadsafe(self._free, slot)
                    except RuntimeError:  # the loop is gone (shutdown)
                        pass

            self.pool.submit(drain)
            return
        lane.open = False
        self.admission.release(slot)

    def side_room(self) -> bool:
        """Whether a running generation's side lane can take a short request now."""
        return any(lane.has_room() for lane in self.lanes)

    def side(self, job: Job, emit: Callable[[Delta], None]) -> tuple[asyncio.Future[Outcome], threading.Event]:
        """A short request served by a running generation at its next safe point (on the event loop, right
        after ``side_room`` said yes: nothing can close a lane in between)."""
        lane = min((lane for lane in self.lanes if lane.has_room()), key=len)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        def done(outcome: Outcome) -> None:
            self.record(job, outcome, side.waited, lane="side")
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(outcome))
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        side = SideJob(job, emit, done)
        taken = lane.offer(side)
        assert taken, "a side lane closed between side_room and side"
        self.active.add(side.cancel)
        fut.add_done_callback(lambda _f: self.active.discard(side.cancel))
        return fut, side.cancel

    def affinity(self, job: Job) -> Callable[[Slot], int] | None:
        """How much of ``job``'s prompt each engine's resident prefix holds (None without caches)."""
        if self.caches is None or len(self.admission.slots) < 2:
            return None
        caches = self.caches
        return lambda slot: caches.engine(slot.index).holds(job.decode.prompt)

    def admit(self, job: Job, slot: Slot) -> None:
        """The memory gate before the request runs: ``MemoryGateError`` for a prompt that can never fit."""
        if self.caches is not None:
            self.caches.engine(slot.index).admit(job.decode.prompt)

    def refused(self, job: Job, exc: MemoryGateError) -> None:
        """The log line and metrics of a request the memory gate refused before it ran."""
        log.info("req=%s endpoint=%s prompt=%d refused=memory_gate need=%d available=%d releasable=%d",
                 job.rid, job.endpoint, len(job.decode.prompt), exc.need.total, exc.available, exc.releasable)
        self.metrics.reject("memory_gate")

    def record(self, job: Job, out: Outcome, queued_s: float, lane: str | None = None) -> None:
        """The request's log line, metrics and ledger row (counts and times, never text)."""
        now = time.perf_counter()
        ttft = None if out.t_first is None else out.t_first - job.t_arrival
        capped = f" capped_max_tokens={job.capped_from}->{job.decode.max_tokens}" if job.capped_from else ""
        pre = out.prefill
        prefill = "-" if pre is None else f"{pre.tier}:{pre.start}/{pre.total}"
        spec = ("" if out.spec is None or not out.spec.rounds else
                f" spec_rounds={out.spec.rounds} tokens_per_round={out.spec.tokens_per_round:.2f}"
                f" acceptance={out.spec.acceptance:.2f}")
        log.info("req=%s endpoint=%s prompt=%d completion=%d finish=%s prefill=%s ttft=%s decode=%s "
                 "queued=%.2fs total=%.2fs%s%s%s%s", job.rid, job.endpoint, out.prompt_tokens,
                 out.completion_tokens, out.finish,
                 prefill, "-" if ttft is None else f"{ttft:.3f}s",
                 "-" if out.decode_rate is None else f"{out.decode_rate:.1f}tok/s", queued_s, now - job.t_arrival,
                 spec, capped, f" lane={lane}" if lane else "", f" error={out.error.split(':')[0]}" if out.error else "")
        if out.status == 507:
            self.metrics.reject("memory_gate")
        self.metrics.request(job.endpoint, out.finish, out.prompt_tokens, out.completion_tokens, ttft,
                             out.decode_rate)
        if pre is not None:
            self.metrics.prefill(pre.tier, pre.start, pre.total)
        if self.ledger is not None and job.endpoint != "conductor":    # a conductor's hidden request: no row
            try:
                self.ledger.write(UsageRow(
                    ts=job.ts, request_id=job.rid, model=job.model, endpoint=job.endpoint,
                    prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    finish_reason=out.finish, ttft_s=ttft, decode_tps=out.decode_rate, queued_s=queued_s,
                    duration_s=now - job.t_arrival, max_tokens=job.decode.max_tokens,
                    capped_from=job.capped_from, stream=job.stream,
                    status=(out.status if out.finish == "error" else 499 if out.finish == "cancelled" else 200)))
            except Exception as exc:  # the ledger never fails a request
                log.error("req=%s ledger write failed: %s", job.rid, exc)

    def start(self) -> None:
        """At start, before the socket listens: the spilled sessions become the engines' own again."""
        if self.caches is not None:
            self.caches.restore()

    def stop(self) -> None:
        """At shutdown: stop the running generations, then spill every engine's session."""
        for ev in list(self.active):
            ev.set()
        if self.caches is not None:
            try:
                self.caches.save_sessions()
            except Exception as exc:  # a failed spill leaves the previous one; the shutdown goes on
                log.error("session spill failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        for ev in list(self.active):
            ev.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.conduct.close()
        if self.ledger is not None:
            self.ledger.close()
        if self.caches is not None:
            self.caches.close()

