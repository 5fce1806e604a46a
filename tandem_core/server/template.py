"""Chat prompts, rendered with the model's own Jinja template in a sandbox.

The environment is jinja2's ``ImmutableSandboxedEnvironment`` with what chat
templates expect (as transformers provides it): ``raise_exception``,
``strftime_now``, a ``tojson`` filter that keeps non-ASCII text and takes
``indent``, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``. Messages are
normalised first: text parts joined, ``developer`` read as ``system``, tool-call
arguments given as JSON text parsed into objects (templates iterate them).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

__all__ = ["TemplateError", "render_chat", "normalise_messages"]


class TemplateError(ValueError):
    """The chat template refused the conversation (its own ``raise_exception``) or failed to render."""


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


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what chat templates read."""
    out = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        if msg.get("tool_calls"):
            calls = []
            for c in msg["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                c["function"] = fn
                calls.append(c)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def render_chat(served: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text for ``messages`` under ``served.chat_template``.

    Variables, later ones winning: bos/eos tokens, the plugin's ``served.template_vars``,
    the request's ``template_kwargs`` (``chat_template_kwargs``: ``enable_thinking``...), then
    ``messages``, ``tools`` and ``add_generation_prompt``.
    """
    if not served.chat_template:
        raise TemplateError(f"model {served.model_id} has no chat template")
    tok = served.tokenizer
    variables: dict[str, Any] = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}
    variables.update(served.template_vars)
    variables.update(template_kwargs or {})
    variables.update(messages=normalise_messages(messages), tools=list(tools) if tools else None,
                     add_generation_prompt=add_generation_prompt)
    try:
        return _compile(served.chat_template).render(**variables)
    except TemplateError:
        raise
    except Exception as exc:  # a template error names the template's complaint, never the prompt
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
