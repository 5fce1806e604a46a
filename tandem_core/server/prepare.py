"""A request body -> a ``Job``: fields checked, prompt rendered and tokenised, limits and grammar set.

Everything that can refuse a request happens here, before it queues, so a
refusal is a 400 (never an error in the middle of a stream). Runs off the event
loop (rendering, tokenising and compiling a grammar take time).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tandem_core.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldError, check
from tandem_core.server.grammar import GrammarConstraint, GrammarError, Grammars, available
from tandem_core.server.messages import check_messages
from tandem_core.server.parse import THINK_TAGS, think_open_at_end
from tandem_core.server.template import TemplateError, render_chat
from tandem_core.server.toolformat import tool_format
from tandem_core.serving import Served
from tandem_core.spec.loop import DecodeRequest
from tandem_core.spec.sampler import SamplingParams, random_seed

__all__ = ["Job", "ParseSpec", "ModelNotServed", "prepare_chat", "prepare_completion"]

class ModelNotServed(LookupError):
    """The request names a model this server does not serve (404)."""


@dataclass(frozen=True)
class ParseSpec:
    """How the answer's text is read (``tandem_core.server.parse.OutputParser``'s arguments)."""

    tool_format: str
    reasoning: bool
    think_in_prompt: bool
    tools: list[dict[str, Any]] | None
    forced: bool = False    # a grammar forces the calls: a call's markup never becomes content
    think_tags: tuple[str, str] = THINK_TAGS


@dataclass
class Job:
    """One admitted-to-be request, ready to run on any engine."""

    rid: str
    endpoint: str                     # "chat" or "completions"
    model: str
    created: int
    t_arrival: float                  # perf_counter at arrival
    ts: float                         # unix time at arrival
    decode: DecodeRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    parse: ParseSpec | None           # None: the text is all content (completions)
    constraint: GrammarConstraint | None
    parallel_tool_calls: bool
    capped_from: int | None           # the asked max_tokens, when capped to fit the context


def _model(body: Mapping[str, Any], served: Served) -> str:
    name = body.get("model")
    if name is not None and name != served.model_id:
        raise ModelNotServed(f"model: {name!r} is not served here; this server serves {served.model_id!r}")
    return served.model_id


def _max_tokens(asked: int | None, prompt_len: int, max_context: int, field: str) -> tuple[int, int | None]:
    room = max_context - prompt_len
    if room < 1:
        raise FieldError(field, f"the prompt has {prompt_len} tokens and the context holds {max_context}; "
                                f"nothing is left to generate")
    if asked is None:
        return room, None
    if asked > room:
        return room, asked
    return asked, None


def _sampling(body: Mapping[str, Any], served: Served, top_logprobs: int | None) -> SamplingParams:
    vocab = served.tokenizer.vocab_size
    bias: dict[int, float] = {}
    for k, v in (body.get("logit_bias") or {}).items():
        tid = int(k)
        if not 0 <= tid < vocab:
            raise FieldError("logit_bias", f"token id {tid} is outside the vocabulary (0..{vocab - 1})")
        bias[tid] = float(v)
    top_k = body.get("top_k")
    seed = body.get("seed")
    temperature = body.get("temperature")
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        min_p=float(body.get("min_p") or 0.0),
        seed=random_seed() if seed is None else int(seed),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
        logit_bias=bias,
        top_logprobs=top_logprobs,
    )


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _stream_options(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options") or {}
    if opts and not body.get("stream"):
        raise FieldError("stream_options", "only allowed with stream: true")
    return bool(opts.get("include_usage"))


def _stop_ids(served: Served) -> frozenset[int]:
    return frozenset(served.stop_ids) | frozenset(served.tokenizer.eos_token_ids)


def prepare_chat(body: Mapping[str, Any], served: Served, max_context: int, grammars: Grammars) -> Job:
    t0, ts = time.perf_counter(), time.time()
    check(body, CHAT_FIELDS)
    model = _model(body, served)
    if "messages" not in body:
        raise FieldError("messages", "is required")
    check_messages(body["messages"])
    tools = body.get("tools") or None
    choice = body.get("tool_choice", "auto" if tools else "none")
    forced: list[dict[str, Any]] | None = None
    if choice == "required" or isinstance(choice, Mapping):
        if not tools:
            raise FieldError("tool_choice", "asks for a tool call but tools is empty")
        if isinstance(choice, Mapping):
            name = choice["function"]["name"]
            forced = [t for t in tools if t["function"]["name"] == name]
            if not forced:
                raise FieldError("tool_choice", f"names {name!r}, which is not in tools")
        else:
            forced = list(tools)
    active_tools = None if choice == "none" else tools
    kwargs = dict(body.get("chat_template_kwargs") or {})
    thinking = served.reasoning and kwargs.get("enable_thinking", True) is not False
    prompt = _render(served, body["messages"], active_tools, kwargs)
    ids = served.tokenizer.encode(prompt)
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    max_new, capped = _max_tokens(asked, len(ids), max_context, "messages")
    logprobs = bool(body.get("logprobs"))
    if body.get("top_logprobs") is not None and not logprobs:
        raise FieldError("top_logprobs", "needs logprobs: true")
    top = (body.get("top_logprobs") or 0) if logprobs else None
    parallel = body.get("parallel_tool_calls", True) is not False
    in_think = thinking and think_open_at_end(prompt, served.think_tags)  # the template opened the block
    think = "none" if not thinking else ("open" if in_think else "maybe")
    constraint = _constraint(body, served, grammars, forced, think, parallel, max_new)
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    return Job(
        rid=rid, endpoint="chat", model=model, created=int(ts), t_arrival=t0, ts=ts,
        decode=DecodeRequest(ids, max_new, _sampling(body, served, top), _stop_ids(served), _stops(body)),
        stream=bool(body.get("stream")), include_usage=_stream_options(body), logprobs=logprobs,
        parse=ParseSpec(served.tool_format if active_tools else "none", thinking, in_think,
                        list(active_tools) if active_tools else None, forced=forced is not None,
                        think_tags=served.think_tags),
        constraint=constraint, parallel_tool_calls=parallel, capped_from=capped,
    )


def _render(served: Served, messages: Sequence[Any], tools: list[dict[str, Any]] | None,
            kwargs: Mapping[str, Any]) -> str:
    """The prompt. A template that never reads ``tool_calls`` gets an assistant's calls written into its
    content in the model's format (the model sees what it called); one that never reads ``tools`` gets
    the tools as the format's own system text. A template failure names the message and its part."""
    form = tool_format(served.tool_format)
    template = served.chat_template or ""
    shift = 0
    calls_as_text = form.render_calls if form is not None and "tool_calls" not in template else None
    if tools and form is not None and "tools" not in template:
        note = form.render_tools(tools)
        first = messages[0] if messages else None
        if isinstance(first, Mapping) and first.get("role") in ("system", "developer"):
            text = "".join(p.get("text", "") for p in first["content"]) if isinstance(first.get("content"), list) \
                else (first.get("content") or "")
            messages = [{**first, "role": "system", "content": f"{text}\n\n{note}" if text else note},
                        *messages[1:]]
        else:
            messages, shift = [{"role": "system", "content": note}, *messages], 1
    try:
        return render_chat(served, messages, tools=tools, template_kwargs=kwargs, calls_as_text=calls_as_text)
    except TemplateError as exc:
        field = re.sub(r"^messages\[(\d+)\]", lambda m: f"messages[{max(0, int(m.group(1)) - shift)}]", exc.field)
        raise FieldError(field, str(exc)) from exc


def _constraint(body: Mapping[str, Any], served: Served, grammars: Grammars, forced: list[dict[str, Any]] | None,
                think: str, parallel: bool, budget: int) -> GrammarConstraint | None:
    rf = body.get("response_format") or {"type": "text"}
    field = None
    if rf["type"] != "text":
        field = "response_format"
        if forced is not None:
            raise FieldError("response_format", "cannot be combined with a tool_choice that forces a tool call")
    elif forced is not None:
        field = "tool_choice"
    if field is None:
        return None
    if not available(served.tokenizer):
        raise FieldError(field, "constrained decoding is not available for this model's tokenizer")
    try:
        if field == "response_format":
            schema = None if rf["type"] == "json_object" else (rf.get("json_schema") or {}).get("schema", {})
            lark = grammars.json_grammar(schema, think, budget)
        else:
            assert forced is not None
            lark = grammars.tool_grammar(forced, served.tool_format, think, parallel, budget)
        return grammars.constraint(lark)
    except GrammarError as exc:
        where = "response_format.json_schema" if field == "response_format" else "tool_choice"
        raise FieldError(where, f"cannot be enforced: {exc}") from exc


def prepare_completion(body: Mapping[str, Any], served: Served, max_context: int) -> Job:
    t0, ts = time.perf_counter(), time.time()
    check(body, COMPLETION_FIELDS)
    model = _model(body, served)
    if "prompt" not in body:
        raise FieldError("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = served.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = [int(t) for t in prompt]
        vocab = served.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    if not ids:
        raise FieldError("prompt", "encodes to no tokens")
    asked = body.get("max_tokens", 16)
    max_new, capped = _max_tokens(asked, len(ids), max_context, "prompt")
    n_top = body.get("logprobs")
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    return Job(
        rid=rid, endpoint="completions", model=model, created=int(ts), t_arrival=t0, ts=ts,
        decode=DecodeRequest(ids, max_new, _sampling(body, served, n_top), _stop_ids(served), _stops(body)),
        stream=bool(body.get("stream")), include_usage=_stream_options(body), logprobs=n_top is not None,
        parse=None, constraint=None, parallel_tool_calls=True, capped_from=capped,
    )
