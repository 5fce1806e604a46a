"""The session monitor: one ``Watch`` per generation, at the core's four safe points.

- **thinking budget**: when the reasoning block has used the class's budget, ``</think>`` goes in
  (hidden) and the answer starts;
- **loop**: a reasoning block whose last ``ngram`` tokens already occurred ``repeats`` times in the
  last ``window`` tokens is closed the same way;
- **empty turn**: an answer that reached its end token with no content and no call goes on (hidden
  text in, the end token not drawn next), once;
- **malformed tool call**: a call's arguments are validated with ``jsonschema`` against the
  request's tool schema; one that fails is repaired (lenient JSON, values coerced to the schema's
  types); one that cannot be repaired is regenerated under the tool grammar;
- **repeated call**: a call identical (name and arguments) to one the answer already made, or to
  the conversation's last ``call_repeats`` calls in a row, is dropped and the answer ends.

Calls are held back until complete when the monitor's tool tasks are on (a call reaches the client
whole). Status lines go out through ``Generation.say``; ``<tandem_memory>`` blocks are cut out of
the content and kept for the notes store. Nothing the monitor adds counts in the usage.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import jsonschema

from tandem_core.server.conduct import Call, Generation, Watch
from tandem_core.server.stream import Delta, ToolDelta

from tandem_conductor.profile import Monitor

__all__ = ["TurnWatch", "Plan", "repeats_at_end", "repair_arguments", "MemoryCutter"]

CLOSE_THINK = "\n</think>\n\n"
MEMORY_OPEN, MEMORY_CLOSE = "<tandem_memory>", "</tandem_memory>"


@dataclass
class Plan:
    """What the router decided for one turn (the watch's orders and the journal's record)."""

    request_id: str = ""
    profile: str = ""
    profile_by: str = ""
    klass: str = ""
    class_by: str = ""
    note_id: str = ""
    session: str = ""
    budget: int | None = None
    status_lines: bool = False
    memory_notes: bool = False
    classifier_ms: float | None = None
    plan_ms: float = 0.0
    history_calls: list[tuple[str, str]] = field(default_factory=list)   # the conversation's calls, in order
    transcript: dict[str, Any] | None = None    # a request with tools: its tool exchange in names and sizes


def repeats_at_end(tokens: list[int], n: int, window: int) -> int:
    """How many times the last ``n`` tokens occur in the last ``window`` tokens (1: once, no loop)."""
    if len(tokens) < n:
        return 0
    tail = tokens[-window:]
    gram = tuple(tail[-n:])
    return sum(1 for i in range(len(tail) - n + 1) if tuple(tail[i:i + n]) == gram)


def _loose_json(text: str) -> Any:
    """JSON the model nearly wrote: trailing commas dropped, unclosed brackets and strings closed."""
    s = text.strip()
    try:
        return json.loads(s)
    except ValueError:
        pass
    s = re.sub(r",\s*([}\]])", r"\1", s)
    stack: list[str] = []
    in_str = esc = False
    for ch in s:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    s += ('"' if in_str else "") + "".join(reversed(stack))
    s = re.sub(r",\s*([}\]])", r"\1", s)
    return json.loads(s)


def _coerce(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` moved toward ``schema``'s types where that is lossless ("3" -> 3, "true" -> True)."""
    t = schema.get("type")
    types = t if isinstance(t, list) else [t]
    if isinstance(value, str):
        if "integer" in types and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
        if "number" in types:
            try:
                return float(value)
            except ValueError:
                pass
        if "boolean" in types and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if ("object" in types or "array" in types) and value.strip()[:1] in "{[":
            try:
                return _coerce(json.loads(value), schema)
            except ValueError:
                pass
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "string" in types and \
            "integer" not in types and "number" not in types:
        return str(value)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        out = {k: _coerce(v, props[k]) if k in props else v for k, v in value.items()}
        if schema.get("additionalProperties") is False:
            out = {k: v for k, v in out.items() if k in props}
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_coerce(v, schema["items"]) for v in value]
    return value


def repair_arguments(arguments: str, schema: dict[str, Any]) -> tuple[str | None, bool]:
    """``(valid arguments JSON or None, whether it had to be repaired)`` for ``schema``."""
    try:
        value = json.loads(arguments)
        if jsonschema.Draft202012Validator(schema).is_valid(value):
            return arguments, False
    except ValueError:
        pass
    try:
        value = _coerce(_loose_json(arguments), schema)
    except ValueError:
        return None, True
    if not isinstance(value, dict) or not jsonschema.Draft202012Validator(schema).is_valid(value):
        return None, True
    return json.dumps(value, ensure_ascii=False), True


def _call_from_raw(raw: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) out of a malformed call's raw text (Hermes JSON or Qwen XML)."""
    body = re.sub(r"</?tool_call>", "", raw).strip()
    m = re.search(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", body, re.S)
    if m:
        params = dict(re.findall(r"<parameter=([^>\s]+)>\s*(.*?)\s*(?:</parameter>|(?=<parameter=)|$)",
                                 m.group(2), re.S))
        return m.group(1), json.dumps(params, ensure_ascii=False)
    start = body.find("{")
    if start < 0:
        return None
    try:
        obj = _loose_json(body[start:])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class MemoryCutter:
    """Cuts ``<tandem_memory>...</tandem_memory>`` out of streamed content; the blocks are kept."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.blocks: list[str] = []
        self._cur = ""

    def feed(self, text: str) -> str:
        self.buf += text
        out = ""
        while self.buf:
            if self.inside:
                i = self.buf.find(MEMORY_CLOSE)
                if i < 0:
                    keep = _partial(self.buf, MEMORY_CLOSE)
                    self._cur += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._cur += self.buf[:i]
                self.blocks.append(self._cur.strip())
                self._cur, self.inside = "", False
                self.buf = self.buf[i + len(MEMORY_CLOSE):].lstrip("\n")
            else:
                i = self.buf.find(MEMORY_OPEN)
                if i < 0:
                    keep = _partial(self.buf, MEMORY_OPEN)
                    out += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self.buf[:i]
                self.inside = True
                self.buf = self.buf[i + len(MEMORY_OPEN):]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.inside else self.buf), ""
        if self.inside and self._cur.strip():
            self.blocks.append(self._cur.strip())
        return out


def _partial(buf: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class TurnWatch(Watch):
    """One generation's monitor (see the module's docstring)."""

    def __init__(self, plan: Plan, monitor: Monitor, host: Any, rate: Callable[[], float | None],
                 done: Callable[["TurnWatch", Generation, Any], None]) -> None:
        self.plan = plan
        self.m = monitor
        self.host = host
        self.rate = rate
        self.done = done
        self.actions: list[str] = []
        self.seen = 0                     # generated tokens already looked at
        self.reasoning: deque[int] = deque(maxlen=max(monitor.window, 16))
        self.reasoning_count = 0
        self.answered = False             # content or a call has begun
        self.closed = False               # the watch closed the reasoning block
        self.continued = False
        self.content_sent = ""
        self.calls_out = 0
        self.sent_calls: list[tuple[str, str]] = []
        self.memory = MemoryCutter() if plan.memory_notes else None
        self.hold_calls = monitor.tool_repair or monitor.repeated_calls
        self.t_prefill = 0.0
        self.prefill_tokens = 0
        self.regenerating = False
        self.regen_resumed = False
        self.constrained = False

    # -- helpers ---------------------------------------------------------------------------------------

    def _status(self, gen: Generation, line: str) -> None:
        if self.plan.status_lines:
            gen.say(Delta(content=f"\u203a {line}\n"))

    def _close_reasoning(self, gen: Generation, why: str) -> None:
        close = getattr(gen.served, "think_tags", ("<think>", "</think>"))[1]   # the model's own closing tag
        self.closed = True
        if not gen.inject(CLOSE_THINK.replace("</think>", close)):
            return                        # the answer's room is spent: it ends at max_tokens anyway
        self.actions.append(why)
        self._status(gen, "thinking budget spent, answering" if why == "budget_closed"
                     else "reasoning went in circles, answering")

    # -- the safe points -------------------------------------------------------------------------------

    def before_prefill(self, gen: Generation) -> None:
        # a grammar (response_format, a forced call) bounds the answer itself: the monitor puts nothing in
        self.constrained = gen.job.constraint is not None
        self.t_prefill = time.perf_counter()
        self.prefill_tokens = max(0, gen.prompt_tokens - gen.cached)
        if self.plan.status_lines:
            if self.plan.class_by == "classifier":
                self._status(gen, f"routed as {self.plan.klass}")
            rate = self.rate()
            left = f", about {self.prefill_tokens / rate:.0f} s left" if rate else ""
            self._status(gen, f"reading {self.prefill_tokens:,} tokens{left}")
        if self.plan.budget == 0:
            self.actions.append("thinking_off")

    def after_block(self, gen: Generation, delta: Delta) -> Delta:
        new = gen.tokens[self.seen:]
        self.seen = len(gen.tokens)
        if delta.content or delta.tool_calls:
            self.answered = True
        elif delta.reasoning and not self.closed and not self.constrained:
            self.reasoning.extend(new)
            self.reasoning_count += len(new)
            budget = self.plan.budget
            if budget is not None and self.reasoning_count >= budget:
                self._close_reasoning(gen, "budget_closed")
            elif self.m.loop and repeats_at_end(list(self.reasoning), self.m.ngram, self.m.window) >= self.m.repeats:
                self._close_reasoning(gen, "loop_closed")
        if self.memory is not None and delta.content:
            delta.content = self.memory.feed(delta.content)
        if self.hold_calls and delta.tool_calls:
            delta.tool_calls = []
        self.content_sent += delta.content
        return delta

    def at_end(self, gen: Generation) -> bool:
        if self.constrained:
            return False
        c = gen.dec.constraint
        if self.regenerating and not self.regen_resumed and c is not None and not c.done():
            self.regen_resumed = True     # the end token came right after the malformed call: write it again
            return gen.go_on("")
        empty = not self.content_sent.strip() and not self.calls_out and not self.answered
        if self.m.empty_turn and empty and not self.continued and not self.regenerating:
            self.continued = True
            if not gen.go_on(self.m.empty_text):
                return False              # no room left: the empty answer stands
            self.closed = True            # what follows is the answer
            self.actions.append("continued_empty")
            self._status(gen, "the answer was empty, going on")
            return True
        return False

    def _schema(self, gen: Generation, name: str) -> dict[str, Any] | None:
        for t in gen.tools or ():
            fn = t.get("function") or {}
            if fn.get("name") == name:
                return fn.get("parameters") or {"type": "object"}
        return None

    def _send(self, gen: Generation, cid: str, name: str, arguments: str) -> Delta | None:
        try:
            sig = (name, json.dumps(json.loads(arguments), sort_keys=True))
        except ValueError:
            sig = (name, arguments)
        if self.m.repeated_calls:
            earlier = self.plan.history_calls
            streak = 0
            for prev in reversed(earlier):
                if prev != sig:
                    break
                streak += 1
            if sig in self.sent_calls or streak >= self.m.call_repeats:
                self.actions.append("repeat_stopped")
                self._status(gen, f"stopped a repeated call of {name}")
                gen.stop()
                return None
        self.sent_calls.append(sig)
        index = self.calls_out
        self.calls_out += 1
        return Delta(tool_calls=[ToolDelta(index, cid, name, arguments)])

    def calls_complete(self, gen: Generation, calls: list[Call]) -> Delta | None:
        if not self.hold_calls:
            return None
        out = Delta()
        for c in calls:
            if gen.stopped:
                break
            args = c.arguments
            schema = self._schema(gen, c.name)
            if self.m.tool_repair and schema is not None:
                fixed, repaired = repair_arguments(args, schema)
                if fixed is None:
                    if self._regenerate(gen, "regenerated_call"):
                        continue
                    fixed = args
                elif repaired:
                    self.actions.append("repaired_call")
                args = fixed
            d = self._send(gen, c.id, c.name, args)
            if d is not None:
                out.tool_calls += d.tool_calls
        return out

    def malformed(self, gen: Generation, raw: str) -> Delta | None:
        if not self.m.tool_repair:
            return Delta(content=raw)
        found = _call_from_raw(raw)
        if found is not None:
            name, args = found
            schema = self._schema(gen, name)
            if schema is not None:
                fixed, _ = repair_arguments(args, schema)
                if fixed is not None:
                    self.actions.append("repaired_call")
                    return self._send(gen, f"call_{gen.job.rid[-12:]}{self.calls_out}", name, fixed)
        if self._regenerate(gen, "regenerated_call"):
            return None
        return Delta(content=raw)

    def _regenerate(self, gen: Generation, action: str) -> bool:
        if not (self.m.regenerate and gen.tools) or self.regenerating or self.constrained:
            return False
        grammars = self.host.grammars
        left = gen.job.decode.max_tokens - len(gen.tokens)
        try:
            lark = grammars.tool_grammar(gen.tools, gen.served.tool_format, "none", False, max(left, 8))
            gen.constrain(grammars.constraint(lark))
        except Exception:
            return False
        self.regenerating = True
        self.actions.append(action)
        self._status(gen, "a tool call was malformed, writing it again")
        return True

    def flush(self, gen: Generation) -> Delta | None:
        if self.memory is None:
            return None
        rest = self.memory.flush()
        self.content_sent += rest
        return Delta(content=rest) if rest else None

    def finished(self, gen: Generation, outcome: Any) -> None:
        self.done(self, gen, outcome)
