"""OpenAI response bodies: streamed chunks (server-sent events) and whole responses.

``ChatChunks`` writes ``chat.completion.chunk`` objects for one request;
``ChatAnswer`` gathers the same deltas into a ``chat.completion``. Both take
``Delta``s, so the streamed and the whole answer cannot disagree. The completion
(``text_completion``) bodies are written the same way by ``TextChunks``/``TextAnswer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Delta", "ToolDelta", "TokenLogprob", "Usage", "sse", "sse_comment", "SSE_DONE",
           "ChatChunks", "ChatAnswer", "TextChunks", "TextAnswer"]

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_comment(text: str) -> bytes:
    """An SSE comment line (clients ignore it; it keeps the stream alive and says why it waits)."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: tuple[tuple[str, float, list[int]], ...]

    def chat(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": self.bytes,
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in self.top]}


@dataclass(frozen=True)
class ToolDelta:
    """One piece of a tool call: its header (``id``/``name``) when it begins, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def chat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


@dataclass
class Delta:
    """What one decode step adds to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls or self.logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


class ChatChunks:
    """``chat.completion.chunk`` objects for one streamed answer."""

    def __init__(self, rid: str, model: str, created: int, *, include_usage: bool, logprobs: bool) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.include_usage = include_usage
        self.logprobs = logprobs

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def first(self) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta(self, d: Delta) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if d.content:
            body["content"] = d.content
        if d.reasoning:
            body["reasoning_content"] = d.reasoning
            body["reasoning"] = d.reasoning
        if d.tool_calls:
            body["tool_calls"] = [t.chat() for t in d.tool_calls]
        lp = {"content": [t.chat() for t in d.logprobs]} if self.logprobs and d.logprobs else None
        return self._chunk([{"index": 0, "delta": body, "logprobs": lp, "finish_reason": None}])

    def finish(self, reason: str) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def usage(self, usage: Usage) -> dict[str, Any]:
        out = self._chunk([])
        out["usage"] = usage.body()
        return out


class ChatAnswer:
    """A whole ``chat.completion``, gathered from the deltas."""

    def __init__(self, rid: str, model: str, created: int, *, logprobs: bool) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.logprobs = logprobs
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.token_logprobs: list[dict[str, Any]] = []

    def add(self, d: Delta) -> None:
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        for t in d.tool_calls:
            call = self.calls.setdefault(t.index, {"id": None, "type": "function",
                                                   "function": {"name": None, "arguments": ""}})
            if t.id is not None:
                call["id"] = t.id
            if t.name is not None:
                call["function"]["name"] = t.name
            call["function"]["arguments"] += t.arguments
        self.token_logprobs.extend(t.chat() for t in d.logprobs)

    def body(self, finish: str, usage: Usage) -> dict[str, Any]:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
            msg["reasoning"] = reasoning
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                             "logprobs": {"content": self.token_logprobs} if self.logprobs else None}],
                "usage": usage.body()}


def _text_logprobs(items: list[TokenLogprob], offset0: int) -> dict[str, Any]:
    offsets, pos = [], offset0
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{tok: lp for tok, lp, _ in t.top} for t in items], "text_offset": offsets}


class TextChunks:
    """``text_completion`` objects for one streamed completion."""

    def __init__(self, rid: str, model: str, created: int, *, include_usage: bool, logprobs: bool) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.offset = 0

    def _chunk(self, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.rid, "object": "text_completion", "created": self.created,
                               "model": self.model, "system_fingerprint": None,
                               "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return out

    def delta(self, d: Delta) -> dict[str, Any]:
        lp = _text_logprobs(d.logprobs, self.offset) if self.logprobs else None
        self.offset += len(d.content)
        return self._chunk(d.content, lp, None)

    def finish(self, reason: str) -> dict[str, Any]:
        return self._chunk("", None, reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        out = self._chunk("", None, None)
        out["choices"] = []
        out["usage"] = usage.body()
        return out


class TextAnswer:
    def __init__(self, rid: str, model: str, created: int, *, logprobs: bool) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.logprobs = logprobs
        self.text: list[str] = []
        self.items: list[TokenLogprob] = []

    def add(self, d: Delta) -> None:
        self.text.append(d.content)
        self.items.extend(d.logprobs)

    def body(self, finish: str, usage: Usage) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "text": "".join(self.text), "finish_reason": finish,
                             "logprobs": _text_logprobs(self.items, 0) if self.logprobs else None}],
                "usage": usage.body()}
