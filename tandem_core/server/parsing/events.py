"""The typed events a parser turns a model's text into, and the rule that merges neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = [
    "Content", "Event", "Malformed", "Reasoning", "ToolCallArgs", "ToolCallBegin", "ToolCallEnd", "push",
]


@dataclass(frozen=True)
class Content:
    """Answer text (a delta)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text from the reasoning block (a delta)."""

    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    """Call ``index`` (0, 1, ... in this output) named ``name`` has begun."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """The next piece of call ``index``'s arguments JSON."""

    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``index`` is complete; ``arguments`` (a JSON object) is its deltas joined."""

    index: int
    arguments: str


@dataclass(frozen=True)
class Malformed:
    """A call could not be read; ``reason`` names no model text. Its raw text follows as Content."""

    reason: str


Event = Union[Content, Reasoning, ToolCallBegin, ToolCallArgs, ToolCallEnd, Malformed]


def push(out: list[Event], ev: Event) -> None:
    """Append ``ev``, joined to the last event when both are text of one kind or deltas of one call."""
    last = out[-1] if out else None
    if isinstance(ev, Content) and isinstance(last, Content):
        out[-1] = Content(last.text + ev.text)
    elif isinstance(ev, Reasoning) and isinstance(last, Reasoning):
        out[-1] = Reasoning(last.text + ev.text)
    elif isinstance(ev, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == ev.index:
        out[-1] = ToolCallArgs(ev.index, last.delta + ev.delta)
    else:
        out.append(ev)
