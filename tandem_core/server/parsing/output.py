"""One generation's text -> typed events: the reasoning block, then the model's tool-call format.

``OutputParser(tool_format, reasoning, think_in_prompt, tools)`` reads the decoded text in
pieces of any size (``feed``) and returns typed events; ``finish`` resolves whatever was held
back when the output ends. The events for one output are the same whatever the pieces are
(split anywhere, or fed whole): every decision depends on the text only, and text that merely
looks like the start of a tag (``<``, ``<tool``, ``</thi``) is held back until decided, then
emitted once. Structure read::

    [<think>] reasoning </think>  content  <call> ... </call>  content ...

The reasoning block is ``ReasoningSplitter``'s (``reasoning.py``); content and calls are the
format's parser (``ToolFormat.parser``, looked up by name through the registry;
``tandem_core.server.toolformat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem_core.server.parsing.collect import Collected, Parsed
from tandem_core.server.parsing.events import Event
from tandem_core.server.parsing.reasoning import THINK_TAGS, ReasoningSplitter
from tandem_core.server.parsing.text import NoCalls
from tandem_core.server.parsing.values import tool_schemas
from tandem_core.server.toolformat import CallParser, UnknownToolFormat
from tandem_core.server.toolformat import tool_format as tool_format_of

__all__ = ["OutputParser", "parse_complete", "think_open_at_end"]


class OutputParser:
    """Events for one generation's text, fed in pieces.

    tool_format     a registered format's name, or ``"none"`` (the model writes no calls)
    reasoning       the model writes a reasoning block (``think_tags``)
    think_in_prompt the prompt ends inside an open reasoning block (see ``think_open_at_end``)
    tools           the request's tools (OpenAI form) or None: names a call may use, schemas that type
                    arguments a format writes as text
    id_prefix       call ids are ``call_<id_prefix>_<index>``; random when None
    keep_malformed  a malformed call's raw text becomes Content (False: it is dropped, for a call a grammar
                    forced: its markup never reaches content, even when the budget cut it short)
    think_tags      the reasoning block's opening and closing tags
    """

    def __init__(self, tool_format: str, reasoning: bool, think_in_prompt: bool,
                 tools: Sequence[Mapping[str, Any]] | None = None, *, id_prefix: str | None = None,
                 keep_malformed: bool = True, think_tags: tuple[str, str] = THINK_TAGS) -> None:
        try:
            form = tool_format_of(tool_format)
        except UnknownToolFormat as exc:
            raise ValueError(str(exc)) from None
        tool_schemas(tools)  # a tool without a function name is refused whatever the format
        calls: CallParser = (NoCalls() if form is None else
                             form.parser(tools, id_prefix=id_prefix, keep_malformed=keep_malformed))
        self.tool_format = tool_format
        self._splitter = ReasoningSplitter(calls, reasoning=reasoning, think_in_prompt=think_in_prompt,
                                           tags=think_tags)

    def feed(self, text: str) -> list[Event]:
        """Events decided by ``text`` (and what was held before it)."""
        return self._splitter.feed(text)

    def finish(self) -> list[Event]:
        """Events for what was held back; the output has ended."""
        return self._splitter.finish()


def parse_complete(text: str, tool_format: str, reasoning: bool, think_in_prompt: bool,
                   tools: Sequence[Mapping[str, Any]] | None = None, *, id_prefix: str | None = None,
                   on_malformed: Callable[[str], None] | None = None,
                   think_tags: tuple[str, str] = THINK_TAGS) -> Parsed:
    """A whole output at once: (content, reasoning, tool_calls).

    ``on_malformed(reason)`` is called once per malformed call (its raw text is in the content)."""
    parser = OutputParser(tool_format, reasoning, think_in_prompt, tools, id_prefix=id_prefix,
                          think_tags=think_tags)
    got = Collected().add(parser.feed(text)).add(parser.finish())
    if on_malformed is not None:
        for reason in got.malformed:
            on_malformed(reason)
    return Parsed(got.content, got.reasoning, got.tool_calls)


def think_open_at_end(prompt: str, tags: tuple[str, str] = THINK_TAGS) -> bool:
    """True when the rendered prompt ends inside an open reasoning block (the template opened it), so the
    output starts in reasoning: the value for ``think_in_prompt``."""
    return prompt.rfind(tags[0]) > prompt.rfind(tags[1])
