"""The conductor: plans each turn (profile, side request, router, note, thinking budget) and watches it.

``Conductor(path, host)`` is what the core builds for ``tandem serve --conductor PATH``
(``tandem_core.server.conduct``). For each chat request ``plan``:

1. checks the model name (the server serves ``config.model_name``, ``TandemLLM``);
2. resolves the profile: the ``X-Tandem-Profile`` header, else the first client rule that matches
   (User-Agent regex and the request's shape), else the default;
3. strips the status lines it sent earlier from the assistant messages;
4. recognises a side request by its shape (opencode's title call): output capped (at most 64
   tokens), thinking off, no classifier, no note, no watch: the server's side lane takes it;
5. replays the notes of earlier user messages (``sessions``) at the same place;
6. routes: a new user message asks the classifier (the served model under a choice grammar over
   the class names, hidden: ``host.ask``); a tool-result turn keeps the session's class (by its
   prefix, else the ``X-Tandem-Session`` header, else the default class), with no classifier call;
7. appends the class's note (effort sentence, rules, packages) to the new user message;
8. sets the thinking budget (``thinking_budget`` in the body, else ``reasoning_effort``, else the
   class's) and hands the generation a ``monitor.TurnWatch``.

Each turn leaves one journal line (``journal``), never text.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Mapping

from tandem_core.server.conduct import ConductorError, ConductorHost, Turn
from tandem_core.server.fields import FieldError
from tandem_core.server.messages import check_messages

from tandem_conductor import profile as profiles
from tandem_conductor.journal import Journal, NotesStore
from tandem_conductor.monitor import MEMORY_CLOSE, MEMORY_OPEN, MemoryCutter, Plan, TurnWatch
from tandem_conductor.sessions import Remembered, Sessions, prefix_keys, strip_status, text_of

__all__ = ["Conductor", "CLASSIFIER_PROMPT"]

log = logging.getLogger("tandem.conductor")

CLASSIFIER_PROMPT = ("You route requests sent to a coding assistant. The classes:\n{classes}\n"
                     "Answer with the name of the class that fits the user's request best.")
CLASSIFIER_CHARS = 2000     # of the user's message the classifier reads (a short request: the side lane)
WRITER_PROMPT = (f"Write the facts from this conversation worth remembering in later sessions, each inside "
                 f"{MEMORY_OPEN}...{MEMORY_CLOSE}. Write nothing else.")
WRITER_CHARS = 6000         # of a quiet session's conversation the writer reads (its end)
MEMORY_SENTENCE = (f"To keep a fact for later sessions, write it inside {MEMORY_OPEN}...{MEMORY_CLOSE}; "
                   f"the user does not see that block.")


def _with_note(message: dict[str, Any], note: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": note}]}
    return {**message, "content": (content or "") + note}


class Conductor:
    def __init__(self, path: Path, host: ConductorHost) -> None:
        self.config = profiles.load(path)
        self.host = host
        self.model_name = self.config.model_name
        self.sessions = Sessions()
        store = self.config.notes_store
        if store is None and any(p.memory_notes or p.writer_quiet_s is not None
                                 for p in self.config.profiles.values()):
            from tandem_core.catalog import home

            store = home() / "conductor" / "notes.sqlite"
        try:
            self.journal = Journal(self.config.journal)
        except OSError as exc:
            raise ConductorError(f"{path}: journal: {self.config.journal} cannot be written ({exc.strerror})") from None
        try:
            self.notes = NotesStore(store) if store is not None else None
        except (OSError, sqlite3.Error) as exc:
            raise ConductorError(f"{path}: notes_store: {store} cannot be opened ({exc})") from None
        self.classifier_calls = 0
        self.side_requests = 0
        self.turns: Counter[tuple[str, str]] = Counter()
        self.actions: Counter[str] = Counter()
        self.memory_notes = 0
        self._rate: float | None = None       # measured prefill tokens/s (moving average)
        self._lock = threading.Lock()
        # the background writer: sessions of profiles with memory_writer, by key -> (last turn, profile, messages)
        self._quiet: OrderedDict[str, tuple[float, str, list[Any]]] = OrderedDict()
        self._writer: asyncio.Task[None] | None = None
        self.writer_runs = 0

    @classmethod
    def check(cls, path: Path) -> None:
        profiles.check(path)

    # -- planning --------------------------------------------------------------------------------------

    def _profile(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[profiles.Profile, str]:
        cfg = self.config
        named = headers.get("x-tandem-profile")
        if named:
            if named not in cfg.profiles:
                raise FieldError("X-Tandem-Profile", f"names {named!r}, which is not a profile here "
                                                     f"(profiles: {', '.join(sorted(cfg.profiles))})")
            return cfg.profiles[named], "header"
        agent = headers.get("user-agent", "")
        for rule in cfg.clients:
            if rule.user_agent is not None and not rule.user_agent.search(agent):
                continue
            if rule.tools is not None and bool(body.get("tools")) != rule.tools:
                continue
            if rule.stream is not None and bool(body.get("stream")) != rule.stream:
                continue
            return cfg.profiles[rule.profile], f"client:{rule.name}"
        return cfg.profiles[cfg.default_profile], "default"

    @staticmethod
    def _side(prof: profiles.Profile, body: Mapping[str, Any], messages: list[Any]) -> profiles.SideShape | None:
        roles = tuple(m.get("role") for m in messages if isinstance(m, dict))
        for shape in prof.side_requests:
            if roles != shape.roles:
                continue
            if shape.tools is not None and bool(body.get("tools")) != shape.tools:
                continue
            if shape.stream is not None and bool(body.get("stream")) != shape.stream:
                continue
            if shape.system_contains is not None:
                system = next((text_of(m.get("content")) for m in messages if m.get("role") == "system"), "")
                if shape.system_contains.lower() not in system.lower():
                    continue
            return shape
        return None

    def _note(self, prof: profiles.Profile, klass: profiles.Klass) -> str:
        parts = [klass.effort] if klass.effort else []
        parts += [f"- {r}" for r in klass.rules]
        parts += [self.config.packages[p] for p in klass.packages]
        if prof.memory_notes:
            parts.append(MEMORY_SENTENCE)
        if not parts:
            return ""
        return "\n\n<tandem_note>\n" + "\n".join(parts) + "\n</tandem_note>"

    async def _classify(self, prof: profiles.Profile, text: str) -> tuple[str, str, float | None]:
        names = list(prof.classes)
        if prof.classifier == "none" or len(names) == 1:
            return prof.default_class, "default", None
        listing = "\n".join(f"- {k.name}: {k.description}" for k in prof.classes.values())
        messages = [{"role": "system", "content": CLASSIFIER_PROMPT.format(classes=listing)},
                    {"role": "user", "content": text[-CLASSIFIER_CHARS:] or "(empty)"}]
        t0 = time.perf_counter()
        with self._lock:
            self.classifier_calls += 1
        try:
            answer = (await self.host.ask(messages, names, max_tokens=16)).strip()
        except Exception as exc:  # busy, over the memory gate: the default class, and the journal says so
            log.warning("conductor: classifier did not run: %s", type(exc).__name__)
            return prof.default_class, "fallback", None
        ms = (time.perf_counter() - t0) * 1e3
        if answer not in prof.classes:
            return prof.default_class, "fallback", ms
        return answer, "classifier", ms

    async def plan(self, endpoint: str, body: dict[str, Any], headers: Mapping[str, str]) -> Turn:
        from tandem_core.server.prepare import ModelNotServed    # (torch: not at import, for check)

        t0 = time.perf_counter()
        body = dict(body)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ModelNotServed(f"model: {model!r} is not served here; this server serves {self.model_name!r}")
        body["model"] = self.host.served.model_id
        messages = body.get("messages")
        if endpoint != "chat" or not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return Turn(body, self.model_name)     # prepare refuses what is malformed, naming the field
        check_messages(messages)            # what the API refuses, refused before the conductor reads it
        prof, prof_by = self._profile(body, headers)
        messages = [{**m, "content": strip_status(m["content"])}
                    if m.get("role") == "assistant" and isinstance(m.get("content"), str) else m for m in messages]
        shape = self._side(prof, body, messages)
        if shape is not None:
            return self._side_turn(body, messages, prof, prof_by, shape, t0)
        keys = prefix_keys(messages)
        new = list(messages)
        for i, key in keys.items():         # earlier notes, replayed where they were
            found = self.sessions.by_key(key)
            if found is not None and found.note and i != len(messages) - 1:
                new[i] = _with_note(new[i], found.note)
        session = headers.get("x-tandem-session") or ""
        last_user = max(keys) if keys else None
        classifier_ms = None
        note_id = ""
        if last_user is None:
            klass, class_by = prof.default_class, "default"
        else:
            remembered = self.sessions.by_key(keys[last_user])
            if last_user == len(messages) - 1:                   # a new user message
                if remembered is not None and remembered.profile == prof.name:
                    klass, class_by = remembered.klass, "session"   # the same turn again (a retry)
                    note = remembered.note
                else:
                    klass, class_by, classifier_ms = await self._classify(prof, text_of(messages[-1].get("content")))
                    note = self._note(prof, prof.classes[klass])
                if note:
                    new[last_user] = _with_note(new[last_user], note)
                note_id = hashlib.sha256(note.encode()).hexdigest()[:12] if note else ""
                self.sessions.remember(keys[last_user], Remembered(prof.name, klass, note, note_id), session)
            else:                                                # a tool result (or an assistant prefill)
                if remembered is None and session:
                    remembered, class_by = self.sessions.by_session(session), "header"
                else:
                    class_by = "session"
                if remembered is not None and remembered.klass in prof.classes:
                    klass, note_id = remembered.klass, remembered.note_id
                else:
                    klass, class_by = prof.default_class, "default"
        budget = self._budget(body, prof, prof.classes[klass])
        if budget == 0:
            _thinking_off(body)
        body["messages"] = new
        history = [(str(fn.get("name", "")), _canon_args(fn.get("arguments"))) for fn in _calls_of(messages)]
        plan = Plan(profile=prof.name, profile_by=prof_by, klass=klass, class_by=class_by, note_id=note_id,
                    session=session[:64], budget=budget, status_lines=prof.status_lines,
                    memory_notes=prof.memory_notes, classifier_ms=classifier_ms,
                    plan_ms=(time.perf_counter() - t0) * 1e3, history_calls=history)
        if body.get("tools"):
            plan.transcript = {
                "messages": len(messages),
                "tool_calls": [[name, len(args)] for name, args in history],
                "tool_results": [len(text_of(m.get("content"))) for m in messages if m.get("role") == "tool"]}
        with self._lock:
            self.turns[(prof.name, klass)] += 1
        if prof.writer_quiet_s is not None and (session or last_user is not None):
            self._touch(session or keys[last_user or 0], prof.name, messages)
        return Turn(body, self.model_name, TurnWatch(plan, prof.monitor, self.host, self.rate, self._finished))

    # -- the background writer -------------------------------------------------------------------------

    def _touch(self, key: str, profile: str, messages: list[Any]) -> None:
        """A turn of a session whose facts the writer keeps: it is quiet again from now."""
        self._quiet[key] = (time.monotonic(), profile, messages)
        self._quiet.move_to_end(key)
        while len(self._quiet) > 256:
            self._quiet.popitem(last=False)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_quiet())

    async def _write_quiet(self) -> None:
        """Every tick: each session quiet for its profile's ``quiet_s`` gets its facts written as notes, on an idle
        engine only (``host.write`` gives up when a request comes); a session that speaks again waits again."""
        quiet = [p.writer_quiet_s for p in self.config.profiles.values() if p.writer_quiet_s is not None]
        tick = min(5.0, max(0.1, min(quiet) / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for key, (t, pname, messages) in list(self._quiet.items()):
                prof = self.config.profiles[pname]
                if prof.writer_quiet_s is None or now - t < prof.writer_quiet_s:
                    continue
                try:
                    await self._write_session(key, t, prof, messages)
                except Exception as exc:  # the writer never stops the server; the log names the failure
                    log.warning("conductor: memory writer failed: %s", type(exc).__name__)
                    self._quiet.pop(key, None)

    async def _write_session(self, key: str, t: float, prof: profiles.Profile, messages: list[Any]) -> None:
        lines = []
        for m in messages:
            for fn in _calls_of([m]):
                lines.append(f"assistant called {fn.get('name')}({fn.get('arguments')})")
            text = text_of(m.get("content"))
            if text:
                lines.append(f"{m.get('role')}: {text}")
        talk = "\n".join(lines)[-WRITER_CHARS:]
        out = await self.host.write([{"role": "system", "content": WRITER_PROMPT}, {"role": "user", "content": talk}],
                                    max_tokens=prof.writer_tokens)
        if out is None:
            return                      # busy: tried again at the next tick
        if self._quiet.get(key, (None,))[0] == t:
            self._quiet.pop(key)
        cut = MemoryCutter()
        cut.feed(out)
        cut.flush()
        if self.notes is not None:
            for block in cut.blocks:
                self.notes.add(key, prof.name, block)
        with self._lock:
            self.writer_runs += 1
            self.memory_notes += len(cut.blocks)
        self.journal.write({"ts": round(time.time(), 3), "profile": prof.name, "session": key[:64],
                            "actions": ["quiet_writer"], "memory_notes": len(cut.blocks)})

    @staticmethod
    def _budget(body: dict[str, Any], prof: profiles.Profile, klass: profiles.Klass) -> int | None:
        asked = body.pop("thinking_budget", None)
        if asked is not None:
            if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
                raise FieldError("thinking_budget", "must be a non-negative integer (reasoning tokens)")
            return asked
        effort = body.get("reasoning_effort")
        if effort is not None:
            if not isinstance(effort, str) or effort not in prof.efforts:
                raise FieldError("reasoning_effort", f"must be one of {', '.join(prof.efforts)}")
            return prof.efforts[effort]
        return klass.thinking_budget

    def _side_turn(self, body: dict[str, Any], messages: list[Any], prof: profiles.Profile, prof_by: str,
                   shape: profiles.SideShape, t0: float) -> Turn:
        capped = False
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):     # anything else: prepare refuses it
                body[key] = min(value, shape.max_tokens)
            if value is not None:
                capped = True
        if not capped:
            body["max_tokens"] = shape.max_tokens
        _thinking_off(body)
        body["messages"] = messages
        with self._lock:
            self.side_requests += 1
        self.journal.write({"ts": round(time.time(), 3), "endpoint": "chat", "profile": prof.name,
                            "profile_by": prof_by, "side": shape.name,
                            "plan_ms": round((time.perf_counter() - t0) * 1e3, 3)})
        return Turn(body, self.model_name)

    # -- after the generation --------------------------------------------------------------------------

    def rate(self) -> float | None:
        return self._rate

    def _finished(self, watch: TurnWatch, gen: Any, outcome: Any) -> None:
        pre = outcome.prefill
        tokens = (pre.total - pre.start) if pre is not None else watch.prefill_tokens
        if outcome.t_first is not None and tokens >= 16:
            dt = outcome.t_first - watch.t_prefill
            if dt > 0:
                r = tokens / dt
                with self._lock:
                    self._rate = r if self._rate is None else 0.7 * self._rate + 0.3 * r
        stored = 0
        if watch.memory is not None and watch.memory.blocks and self.notes is not None:
            for block in watch.memory.blocks:
                self.notes.add(watch.plan.session or None, watch.plan.profile, block)
                stored += 1
        with self._lock:
            self.memory_notes += stored
            self.actions.update(watch.actions)
        p = watch.plan
        self.journal.write({
            "ts": round(time.time(), 3), "request_id": gen.job.rid, "endpoint": "chat", "profile": p.profile,
            "profile_by": p.profile_by, "class": p.klass, "class_by": p.class_by, "note_id": p.note_id,
            "session": p.session or None, "classifier_ms": None if p.classifier_ms is None else round(p.classifier_ms, 3),
            "plan_ms": round(p.plan_ms, 3), "actions": list(watch.actions), "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens, "hidden_tokens": gen.hidden,
            "reasoning_tokens": outcome.reasoning_tokens, "finish": outcome.finish,
            "prefill_start": pre.start if pre is not None else None, "prefill_tokens": tokens,
            "ttft_s": None if outcome.t_first is None else round(outcome.t_first - gen.job.t_arrival, 4),
            "decode_tps": None if outcome.decode_rate is None else round(outcome.decode_rate, 2),
            "memory_notes": stored, "tool_calls": watch.calls_out,
            "transcript": None if p.transcript is None else {**p.transcript,
                                                              "answer_calls": [n for n, _ in watch.sent_calls]},
        })

    # -- the books -------------------------------------------------------------------------------------

    def metric_lines(self) -> list[str]:
        with self._lock:
            lines = ["# HELP tandem_conductor_classifier_calls_total Classifier requests run (hidden).",
                     "# TYPE tandem_conductor_classifier_calls_total counter",
                     f"tandem_conductor_classifier_calls_total {self.classifier_calls}",
                     "# HELP tandem_conductor_side_requests_total Side requests recognised by their shape.",
                     "# TYPE tandem_conductor_side_requests_total counter",
                     f"tandem_conductor_side_requests_total {self.side_requests}",
                     "# HELP tandem_conductor_turns_total Turns planned, by profile and class.",
                     "# TYPE tandem_conductor_turns_total counter"]
            lines += [f'tandem_conductor_turns_total{{profile="{p}",class="{k}"}} {n}'
                      for (p, k), n in sorted(self.turns.items())]
            lines += ["# HELP tandem_conductor_monitor_actions_total What the session monitor did.",
                      "# TYPE tandem_conductor_monitor_actions_total counter"]
            lines += [f'tandem_conductor_monitor_actions_total{{action="{a}"}} {n}'
                      for a, n in sorted(self.actions.items())]
            lines += ["# HELP tandem_conductor_memory_notes_total Memory notes written to the notes store.",
                      "# TYPE tandem_conductor_memory_notes_total counter",
                      f"tandem_conductor_memory_notes_total {self.memory_notes}"]
            return lines

    def health(self) -> dict[str, Any]:
        return {"enabled": True, "model_name": self.model_name, "profiles": sorted(self.config.profiles),
                "default_profile": self.config.default_profile, "sessions": len(self.sessions),
                "classifier_calls": self.classifier_calls, "side_requests": self.side_requests,
                "prefill_rate": self._rate}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        self.journal.close()
        if self.notes is not None:
            self.notes.close()


def _thinking_off(body: dict[str, Any]) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None or isinstance(kwargs, dict):      # anything else: prepare refuses it, naming it
        body["chat_template_kwargs"] = {**(kwargs or {}), "enable_thinking": False}


def _calls_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The ``function`` records of the assistants' calls, in order (what is not one is left to prepare to refuse)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        for c in calls if isinstance(calls, list) else ():
            fn = c.get("function") if isinstance(c, dict) else None
            if isinstance(fn, dict):
                out.append(fn)
    return out


def _canon_args(args: Any) -> str:
    import json

    if isinstance(args, str):
        try:
            return json.dumps(json.loads(args), sort_keys=True)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True)
