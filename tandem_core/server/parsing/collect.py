"""Events folded into what a non-streamed answer holds: content, reasoning and complete calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tandem_core.server.parsing.events import (
    Content, Event, Malformed, Reasoning, ToolCallArgs, ToolCallBegin, ToolCallEnd,
)

__all__ = ["Collected", "Parsed", "ToolCall"]


@dataclass(frozen=True)
class ToolCall:
    """A complete call, as ``Collected`` gathers it."""

    index: int
    id: str
    name: str
    arguments: str  # a JSON object

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class Collected:
    """Events folded into what a non-streamed answer holds."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    _open: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)

    def add(self, events: Sequence[Event]) -> Collected:
        for ev in events:
            if isinstance(ev, Content):
                self.content += ev.text
            elif isinstance(ev, Reasoning):
                self.reasoning += ev.text
            elif isinstance(ev, ToolCallBegin):
                self._open[ev.index] = (ev.id, ev.name, [])
            elif isinstance(ev, ToolCallArgs):
                self._open[ev.index][2].append(ev.delta)
            elif isinstance(ev, ToolCallEnd):
                cid, name, deltas = self._open.pop(ev.index)
                if "".join(deltas) != ev.arguments:
                    raise AssertionError(f"tool call {ev.index}: deltas do not add up to its arguments")
                self.tool_calls.append(ToolCall(ev.index, cid, name, ev.arguments))
            elif isinstance(ev, Malformed):
                self.malformed.append(ev.reason)
                self._open.clear()  # a begun call that turned out malformed is void
        return self


class Parsed(NamedTuple):
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
