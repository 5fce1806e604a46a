"""Chat prompts, rendered with the model's own Jinja template in a sandbox.

The environment is jinja2's ``ImmutableSandboxedEnvironment`` with what chat
templates expect (as transformers provides it): ``raise_exception``,
``strftime_now``, a ``tojson`` filter that keeps non-ASCII text and takes
``indent``, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``. Messages are
normalised first (``normalise_messages``): content always a string, ``developer`` read as
``system``, tool-call arguments given as JSON text parsed into objects (templates iterate
them). A template that fails on a message is named by the message and its part, never by
the Python exception (``TemplateError.field``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

from tandem_core.server.body import loads_bounded

__all__ = ["TemplateError", "render_chat", "normalise_messages"]

log = logging.getLogger("tandem.server")


class TemplateError(ValueError):
    """The chat template refused the conversation (its own ``raise_exception``) or failed to render;
    ``field`` names where (``messages``, or the message and its part)."""

    def __init__(self, message: str, *, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    from markupsafe import Markup

    return Markup(json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _text(content: Any) -> str:
    """A message's content as the one string templates concatenate: None -> "", text parts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else str(content)


def normalise_messages(messages: Sequence[Mapping[str, Any]],
                       calls_as_text: Callable[[list[dict[str, Any]]], str] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages (as checked by the server) -> what every chat template can read.

    - ``developer`` is read as ``system``;
    - ``content`` is always a string: null (an assistant's tool-call turn, an empty assistant turn)
      becomes ``""``, a list of text parts (any role, ``tool`` included) is joined, so a template
      that concatenates ``'...' + message['content']`` never meets None or a list;
    - tool-call ``arguments`` sent back as JSON text are parsed into objects (templates iterate them
      or ``tojson`` them); text that is not a JSON object stays text;
    - with ``calls_as_text`` (for a template that never reads ``tool_calls``), an assistant's calls are
      also written into its content in the model's own format, so the model sees what it called.
    """
    out = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        msg["content"] = _text(msg.get("content"))
        if msg.get("tool_calls"):
            calls = []
            for c in msg["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = loads_bounded(args, []) if args.strip() else {}
                    except ValueError:   # FieldError is one: the server refused it before rendering
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                c["function"] = fn
                calls.append(c)
            msg["tool_calls"] = calls
            if calls_as_text is not None:
                msg["content"] += calls_as_text(calls)
        out.append(msg)
    return out


def render_chat(served: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None,
                calls_as_text: Callable[[list[dict[str, Any]]], str] | None = None) -> str:
    """The prompt text for ``messages`` under ``served.chat_template``.

    Variables, later ones winning: bos/eos tokens, the plugin's ``served.template_vars``,
    the request's ``template_kwargs`` (``chat_template_kwargs``: ``enable_thinking``...), then
    ``messages`` (``normalise_messages``), ``tools`` and ``add_generation_prompt``.

    ``TemplateError`` when the template refuses (its ``raise_exception``: its own words, ``field``
    ``messages``) or fails on a message: then ``field`` names the first message it cannot render and
    the part of it (``messages[3].tool_calls``), and the message says no Python exception.
    """
    if not served.chat_template:
        raise TemplateError(f"model {served.model_id} has no chat template")
    tok = served.tokenizer
    base: dict[str, Any] = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}
    base.update(served.template_vars)
    base.update(template_kwargs or {})
    base.update(tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt)
    template = _compile(served.chat_template)

    def render(msgs: Sequence[Mapping[str, Any]]) -> str:
        return template.render(**base, messages=normalise_messages(msgs, calls_as_text))

    try:
        return render(messages)
    except TemplateError:
        raise
    except Exception as exc:  # a template error names the message and its part, never the exception
        field = _culprit(render, messages)
        log.warning("chat template failed at %s: %s", field, type(exc).__name__)
        raise TemplateError("the model's chat template cannot render this message", field=field) from None


def _culprit(render: Callable[[Sequence[Mapping[str, Any]]], str], messages: Sequence[Mapping[str, Any]]) -> str:
    """Where a failed render failed: the first message whose prefix fails, and which of its parts (the
    message rendered without its tool calls, its name, its content) lets it pass. Runs only on failure."""
    def fails(msgs: Sequence[Mapping[str, Any]]) -> bool:
        try:
            render(msgs)
            return False
        except Exception:
            return True

    for i in range(len(messages)):
        if not fails(messages[: i + 1]):
            continue
        m = dict(messages[i])
        for part in ("tool_calls", "name", "tool_call_id"):
            if part in m and not fails([*messages[:i], {k: v for k, v in m.items() if k != part}]):
                return f"messages[{i}].{part}"
        if not fails([*messages[:i], {**m, "content": "x"}]):
            return f"messages[{i}].content"
        return f"messages[{i}].role" if not fails([*messages[:i], {**m, "role": "user"}]) else f"messages[{i}]"
    return "messages"
