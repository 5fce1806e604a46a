"""The conductor's interface in the core: the hook-facing types and the four safe points.

With ``tandem serve --conductor PATH`` the server builds the conductor a plugin registered
through ``tandem_conductors`` (the profile file's ``conductor:`` key names it; with one
registered, that one) as ``Class(path, host)``. The core knows only this interface:

- **turn planning**: ``await conductor.plan(endpoint, body, headers)`` before a request is
  prepared (before it queues) returns a ``Turn``: the body to prepare (its note appended, its
  status lines stripped, its output capped), the model name the answer carries, and the
  ``Watch`` that follows the generation (None: not watched). It may raise ``FieldError``
  (400) or ``ModelNotServed`` (404). ``host.ask`` runs a hidden request on the engine (the
  classifier): its prompt and answer never reach a client and never count in a client's usage.
- **the monitor's safe points**, called in the engine's worker thread with a ``Generation``:
  ``before_prefill``; ``after_block`` after every committed block (it returns the delta the
  client sees: **output rewriting**); ``at_end`` at the end token (True: the turn goes on);
  ``calls_complete`` / ``malformed`` when the answer's tool calls are complete (or one could not
  be read); ``finished`` with the outcome.

What a watch adds to the sequence (``Generation.inject``) is hidden: never emitted, never in
the usage (``Generation.hidden`` is subtracted from the completion tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from tandem_core.server.body import read_body
from tandem_core.server.fields import FieldError
from tandem_core.server.stream import Delta

# light at import (no torch): ``tandem serve`` checks a profile file through this module before anything loads
if TYPE_CHECKING:
    import torch

    from tandem_core.server.state import ServerState
    from tandem_core.server.generate import Outcome
    from tandem_core.server.prepare import Job

log = logging.getLogger("tandem.server")

__all__ = ["ConductorError", "Turn", "Watch", "Generation", "Call", "Conductor", "ConductorHost", "Conduct",
           "read_profile_file", "conductor_class", "check_profile", "run_hidden"]


class ConductorError(ValueError):
    """A profile file the conductor refuses (the message names the file, the key and the line)."""


@dataclass
class Call:
    """A complete tool call of the answer: ``arguments`` is its JSON text."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class Turn:
    body: dict[str, Any]
    model: str
    watch: "Watch | None" = None


class Watch:
    """A generation's monitor; every method runs at a safe point in the engine's worker thread."""

    def before_prefill(self, gen: "Generation") -> None:
        """Before the prefill (``gen.cached``: the prompt tokens the caches already hold)."""

    def after_block(self, gen: "Generation", delta: Delta) -> Delta:
        """After every committed block: the delta the client sees (held back, rewritten or as it is)."""
        return delta

    def at_end(self, gen: "Generation") -> bool:
        """At the end token: True to go on (``gen.inject`` what makes it go on)."""
        return False

    def calls_complete(self, gen: "Generation", calls: list[Call]) -> Delta | None:
        """Calls the parser read completely (in this block); a delta to emit (None: nothing)."""
        return None

    def malformed(self, gen: "Generation", raw: str) -> Delta | None:
        """A call the parser could not read (``raw``: its text); a delta to emit instead (None: nothing)."""
        return Delta(content=raw)

    def flush(self, gen: "Generation") -> Delta | None:
        """At the very end: anything still held back."""
        return None

    def finished(self, gen: "Generation", outcome: "Outcome") -> None:
        """After the generation (counts and times; never raises into the request)."""


class _BanOnce:
    """A constraint that forbids ``banned`` for the next token, then gives the old constraint back."""

    def __init__(self, dec: Any, banned: Sequence[int]) -> None:
        self.dec, self.inner, self.banned = dec, dec.constraint, list(banned)

    def allowed(self, vocab: int) -> "torch.Tensor":
        import torch

        base = self.inner.allowed(vocab) if self.inner is not None else None
        mask = torch.ones(vocab, dtype=torch.bool) if base is None else base.clone()
        mask[[b for b in self.banned if 0 <= b < vocab]] = False
        return mask

    def advance(self, token: int) -> None:
        self.dec.constraint = self.inner
        if self.inner is not None:
            self.inner.advance(token)

    def done(self) -> bool:
        return False


class Generation:
    """What a watch may read and do at a safe point: the prompt, the tokens so far, hidden text in."""

    def __init__(self, job: "Job", dec: Any, served: Any, emit: Callable[[Delta], None], parser: Any,
                 cached: int) -> None:
        self.job, self.dec, self.served, self._emit, self.parser = job, dec, served, emit, parser
        self.cached = cached             # prompt tokens the caches hold before the prefill
        self.hidden = 0                  # tokens the watch put in (never counted in the usage)
        self.stopped = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.decode.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.dec.generated

    @property
    def tokenizer(self) -> Any:
        return self.served.tokenizer

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.job.parse.tools if self.job.parse is not None else None

    def say(self, delta: Delta) -> None:
        """Send ``delta`` to the client now (a status line); it is not a generated token."""
        if not delta.empty():
            self._emit(delta)

    def inject(self, text: str) -> int:
        """Put ``text`` into the sequence as hidden tokens (the parser reads it; the client never sees it); the
        tokens put in (0: no room left before ``max_tokens``)."""
        ids = self.served.tokenizer.encode(text)
        if len(self.dec.generated) + len(ids) >= self.dec.req.max_tokens:
            return 0                     # no room left in the answer (nor, so, in the context)
        self.dec.inject(ids)
        self.hidden += len(ids)
        if self.parser is not None:
            self.parser.feed(text)       # the parser's state follows (a closed reasoning block); nothing goes out
        return len(ids)

    def go_on(self, text: str) -> bool:
        """At the end token: drop it, put ``text`` in (hidden) and draw on, never the end token next. False
        (nothing done) when the answer has no room left for it."""
        dec = self.dec
        ended = bool(dec.generated) and dec.generated[-1] in dec.req.stop_ids
        need = len(self.served.tokenizer.encode(text)) if text else 0
        if len(dec.generated) - ended + need + 1 >= dec.req.max_tokens:
            return False
        if ended:
            dec.generated.pop()
        dec.finish = None
        if text:
            self.inject(text)
        dec.constraint = _BanOnce(dec, sorted(dec.req.stop_ids))
        return True

    def constrain(self, constraint: Any) -> None:
        """From the next token on, the output follows ``constraint`` (``Grammars.constraint(lark)``)."""
        self.dec.constraint = constraint

    def stop(self) -> None:
        """End the answer after this block."""
        self.stopped = True
        self.dec.finish = "stop"


class Conductor(Protocol):
    """Built as ``Class(path, host)``; ``Class.check(path)`` refuses a bad profile file before the model loads."""

    model_name: str

    @classmethod
    def check(cls, path: Path) -> None: ...

    async def plan(self, endpoint: str, body: dict[str, Any], headers: Mapping[str, str]) -> Turn: ...

    def metric_lines(self) -> list[str]: ...

    def health(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ConductorHost:
    """What a conductor gets from the server: the model, its grammars, and hidden requests on the engine."""

    def __init__(self, state: "ServerState") -> None:
        self._state = state
        self.served = state.served
        self.grammars = state.grammars
        self.max_context = state.max_context

    async def ask(self, messages: list[dict[str, Any]], choices: Sequence[str], *, max_tokens: int = 16) -> str:
        """The served model's answer to ``messages`` under a grammar that admits only ``choices`` (thinking
        off, greedy). Hidden: no client sees it, and it counts in no client's usage. Raises ``QueueFull`` or
        ``MemoryGateError`` when it cannot run."""
        from tandem_core.server.prepare import prepare_chat

        state = self._state
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

        def build() -> "Job":
            job = prepare_chat(body, state.served, state.max_context, state.grammars)
            job.endpoint, job.parse, job.stream = "conductor", None, False
            job.constraint = state.grammars.constraint(lark)
            return job

        job = await asyncio.to_thread(build)
        text: list[str] = []
        out = await run_hidden(state, job, lambda d: text.append(d.content))
        if out.finish == "error":
            raise RuntimeError(out.error or "the hidden request failed")
        return "".join(text)


    async def write(self, messages: list[dict[str, Any]], *, max_tokens: int = 128) -> str | None:
        """The served model's free answer to ``messages`` (thinking off, greedy), only on an idle engine: None
        when an engine is busy or a request waits. A request that comes meanwhile stops it at the next step
        (it never waits for this). Hidden like ``ask``."""
        from tandem_core.server.prepare import prepare_chat

        state = self._state
        if not state.admission.free or state.admission.waiting:
            return None
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}

        def build() -> "Job":
            job = prepare_chat(body, state.served, state.max_context, state.grammars)
            job.endpoint, job.parse, job.stream = "conductor", None, False
            return job

        job = await asyncio.to_thread(build)
        if not state.admission.free or state.admission.waiting:
            return None
        cancel = threading.Event()

        async def yield_to_requests() -> None:
            while not cancel.is_set():
                if state.admission.waiting:
                    cancel.set()
                await asyncio.sleep(0.01)

        watcher = asyncio.get_running_loop().create_task(yield_to_requests())
        text: list[str] = []
        try:
            out = await run_hidden(state, job, lambda d: text.append(d.content), cancel)
        finally:
            cancel.set()
            await watcher
        return "".join(text) if out.finish in ("stop", "length") else None


async def run_hidden(state: "ServerState", job: "Job", emit: Callable[[Delta], None],
                     cancel: threading.Event | None = None) -> "Outcome":
    """Run ``job`` on an engine without touching its session: inside a running generation (its side lane) when
    every engine is busy, else on a free engine with its sequence parked and given back byte for byte."""
    from tandem_core.server.generate import run_job
    from tandem_core.server.sidelane import SideJob, SideLane, is_short

    cancel = cancel if cancel is not None else threading.Event()
    if is_short(job) and not state.admission.free and state.side_room():
        fut, _ = state.side(job, emit)
        return await fut
    ticket = state.admission.enter()
    try:
        slot = await ticket.slot
        await asyncio.to_thread(state.admit, job, slot)
    except BaseException:
        state.admission.leave(ticket)
        raise
    caches = state.caches.engine(slot.index) if state.caches is not None else None
    result: list["Outcome"] = []

    def work() -> None:
        if caches is None or not slot.engine.caps.resume:
            result.append(run_job(slot.engine, job, state.served, emit, cancel))
            return
        lane = SideLane(state.served, 1, state.caches.gate if state.caches is not None else None)
        lane.open = True
        lane.offer(SideJob(job, emit, result.append, cancel))
        with caches.busy:
            lane.serve(slot.engine)

    try:
        await asyncio.get_running_loop().run_in_executor(state.pool, work)
    finally:
        state.admission.release(slot)
    state.record(job, result[0], 0.0, lane="conductor")
    return result[0]


def read_profile_file(path: Path) -> Any:
    """The YAML of a profile file, with line numbers kept (``tandem_conductor`` reads them)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConductorError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader), text
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConductorError(f"{path}:{where} is not YAML: {getattr(exc, 'problem', exc)}") from None


def conductor_class(path: Path) -> Any:
    """The conductor class the profile file names (``conductor: NAME``), or the only one registered."""
    from tandem_core.plugins import import_string, registries

    node, _ = read_profile_file(path)
    name = None
    if node is not None and hasattr(node, "value") and isinstance(node.value, list):
        for key, value in node.value:
            if getattr(key, "value", None) == "conductor":
                name = value.value
    found = registries().conductors
    if not found:
        raise ConductorError(f"{path}: no conductor is installed (pip install tandem-conductor)")
    if name is None:
        if len(found) > 1:
            raise ConductorError(f"{path}: conductor: several are installed ({', '.join(sorted(found))}); "
                                 f"name one")
        name = next(iter(found))
    if name not in found:
        raise ConductorError(f"{path}: conductor: {name!r} is not installed (installed: "
                             f"{', '.join(sorted(found))})")
    return import_string(found[name])


def check_profile(path: Path) -> None:
    """Refuse a profile file before anything loads (``ConductorError`` naming the file, the key, the line)."""
    conductor_class(path).check(Path(path))


class Conduct:
    """The server's side of it: no conductor (requests pass as they came) or the one ``path`` configures."""

    def __init__(self, state: "ServerState", path: Path | None) -> None:
        self.conductor: Conductor | None = None
        self.served_id = self.model_name = state.served.model_id
        if path is not None:
            try:
                cls = conductor_class(path)
                self.conductor = cls(Path(path), ConductorHost(state))
            except BaseException:   # the state never starts: its background self-check and cache lock end here
                state.spec.wait()
                if state.caches is not None:
                    state.caches.close()
                raise
            self.model_name = self.conductor.model_name

    async def prepare(self, headers: Mapping[str, str], endpoint: str, raw: bytes,
                      prepare: Callable[[Any], "Job"]) -> "Job":
        """The request's ``Job``: planned by the conductor (when there is one), then prepared."""
        if self.conductor is None:
            return await asyncio.to_thread(lambda: prepare(read_body(raw)))
        from tandem_core.server.prepare import ModelNotServed

        body = await asyncio.to_thread(read_body, raw)
        if not isinstance(body, dict):
            return await asyncio.to_thread(prepare, body)     # not an object: prepare refuses it, naming it
        try:
            turn = await self.conductor.plan(endpoint, body, headers)
        except (FieldError, ModelNotServed):
            raise
        except Exception as exc:  # a conductor's failure is never a 5xx: the request as it came, unplanned
            log.error("conductor: planning failed: %s", type(exc).__name__)
            plain = dict(body)
            if plain.get("model") in (None, self.model_name):
                plain["model"] = self.served_id
            turn = Turn(plain, self.model_name)
        job = await asyncio.to_thread(prepare, turn.body)
        job.model = turn.model
        job.watch = turn.watch
        return job

    def metric_lines(self) -> list[str]:
        return self.conductor.metric_lines() if self.conductor is not None else []

    def health(self) -> dict[str, Any]:
        return self.conductor.health() if self.conductor is not None else {"enabled": False}

    def close(self) -> None:
        if self.conductor is not None:
            self.conductor.close()

