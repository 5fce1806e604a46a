"""The checks of a chat request's ``messages``: what the OpenAI API refuses is refused here, naming the element.

``check_messages(messages)`` raises ``FieldError`` with the dotted path of the first element at
fault (``messages[2].tool_calls[0].function.arguments``); it runs before the chat template, so
the template only ever sees messages of the shapes OpenAI clients send:

- a message is an object with a ``role`` of system, developer, user, assistant or tool;
- ``content`` is a string or a list of text parts (``{"type": "text", "text": "..."}``; another
  type, a part that is not an object, or a text part without a string ``text`` is refused);
  it may be null or absent only on an assistant message;
- an assistant's ``tool_calls`` is a list of ``{"id", "type": "function", "function": {"name",
  "arguments"}}`` with string ``id`` and ``name`` and ``arguments`` a JSON-object string (or an
  object);
- a ``tool`` message has a string ``tool_call_id``; ``name`` is a string where given.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tandem_core.server.body import loads_bounded
from tandem_core.server.fields import FieldError

__all__ = ["ROLES", "check_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(content: Any, where: str, nullable: bool) -> None:
    if content is None:
        if not nullable:
            raise FieldError(where, "is required (a string or a list of text parts)")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise FieldError(where, "must be a string, a list of text parts, or null")
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise FieldError(at, 'must be a content part object, e.g. {"type": "text", "text": "..."}')
        kind = part.get("type")
        if kind != "text":
            raise FieldError(f"{at}.type", f"{kind!r} parts are not served (text only)")
        if not isinstance(part.get("text"), str):
            raise FieldError(f"{at}.text", "is required (a string) in a text part")


def _tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise FieldError(where, "must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise FieldError(at, 'must be an object {"id", "type": "function", "function": {"name", "arguments"}}')
        if not isinstance(call.get("id"), str):
            raise FieldError(f"{at}.id", "is required (a string)")
        if call.get("type", "function") != "function":
            raise FieldError(f"{at}.type", "must be \"function\"")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise FieldError(f"{at}.function", "must be an object with name and arguments")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{at}.function.name", "is required (a string)")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = loads_bounded(args, [f"{at}.function.arguments"]) if args.strip() else {}
            except FieldError:
                raise
            except ValueError:
                raise FieldError(f"{at}.function.arguments", "must be a JSON object (as text)") from None
            if not isinstance(parsed, dict):
                raise FieldError(f"{at}.function.arguments", "must be a JSON object (as text)")
        elif not isinstance(args, Mapping):
            raise FieldError(f"{at}.function.arguments", "is required (a JSON object as text)")


def check_messages(messages: Sequence[Any]) -> None:
    """Refuse (``FieldError``) the first message element the OpenAI API would refuse."""
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise FieldError(at, "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"{at}.role", f"must be one of {', '.join(ROLES)}")
        _content(m.get("content"), f"{at}.content", nullable=role == "assistant")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise FieldError(f"{at}.name", "must be a string")
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise FieldError(f"{at}.tool_calls", "only an assistant message has tool calls")
            _tool_calls(m["tool_calls"], f"{at}.tool_calls")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise FieldError(f"{at}.tool_call_id", "is required (a string) in a tool message")
