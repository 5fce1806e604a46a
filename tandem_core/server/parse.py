"""What a model writes, read as typed events: the names the server, a plugin's format and a test use.

The parsers live in ``tandem_core.server.parsing`` (one concern a module): ``OutputParser``
splits the reasoning block off and hands the rest to the model's tool-call format
(``tandem_core.server.toolformat``), whose parser turns content and calls into ``Content``,
``ToolCallBegin``, ``ToolCallArgs`` (the arguments as JSON text, streamed) and ``ToolCallEnd``
events, a call it cannot read into ``Malformed`` and its raw text. ``Collected`` folds events
into a whole answer; ``parse_complete`` reads a whole output at once.
"""

from tandem_core.server.parsing.collect import Collected, Parsed, ToolCall
from tandem_core.server.parsing.events import (
    Content, Event, Malformed, Reasoning, ToolCallArgs, ToolCallBegin, ToolCallEnd,
)
from tandem_core.server.parsing.output import OutputParser, parse_complete, think_open_at_end
from tandem_core.server.parsing.reasoning import THINK_TAGS

__all__ = [
    "THINK_TAGS", "Collected", "Content", "Event", "Malformed", "OutputParser", "Parsed", "Reasoning",
    "ToolCall", "ToolCallArgs", "ToolCallBegin", "ToolCallEnd", "parse_complete", "think_open_at_end",
]
