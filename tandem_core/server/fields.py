"""The field policy: every OpenAI request field, honoured, accepted with no effect, or refused.

``CHAT_FIELDS`` (``POST /v1/chat/completions``) and ``COMPLETION_FIELDS``
(``POST /v1/completions``) are the one table; ``docs/server.md`` carries it and
a test checks that the two agree. ``check(body, table)`` refuses, with a
``FieldError`` naming the field, any field the table refuses, any value a field
does not take, and any field the table does not know.

Each row has an ``example`` (a value the server takes) and, where some values
are refused, a ``refused`` example: the tests send both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Field", "FieldError", "HONOURED", "IGNORED", "REFUSED", "CHAT_FIELDS", "COMPLETION_FIELDS",
           "check", "table"]

HONOURED = "honoured"
IGNORED = "accepted, no effect"
REFUSED = "refused"

_NO = object()  # a row without a refused example


class FieldError(ValueError):
    """A request field the server refuses: ``field`` names it (dotted, with indices)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


Validator = Callable[[Any], "str | None"]  # value -> why it is refused, or None


@dataclass(frozen=True)
class Field:
    name: str                 # dotted for nested fields (stream_options.include_usage)
    policy: str               # HONOURED, IGNORED or REFUSED
    note: str                 # what the server does with it (the docs' table)
    example: Any = None       # a value the server takes (None for a refused row: any value is refused)
    refused: Any = _NO        # a value the server refuses, for a row that takes others
    validate: Validator | None = None
    requires: Mapping[str, Any] | None = None  # other fields a request with this one needs


    @property
    def has_refused_example(self) -> bool:
        return self.refused is not _NO


# -- value checks ---------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(lo: float, hi: float, *, nullable: bool = True) -> Validator:
    def v(x: Any) -> str | None:
        if x is None and nullable:
            return None
        if not _is_num(x) or not lo <= x <= hi:
            return f"must be a number in [{lo}, {hi}]"
        return None
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Validator:
    def v(x: Any) -> str | None:
        if x is None:
            return None
        if not _is_int(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
            if lo is None:
                return "must be an integer"
            return f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        return None
    v.integer = True  # type: ignore[attr-defined]  (check() takes 8.0 for 8 here, as JSON Schema's integer does)
    return v


def _bool(x: Any) -> str | None:
    return None if x is None or isinstance(x, bool) else "must be true or false"


def _any(_: Any) -> str | None:
    return None


def _str(x: Any) -> str | None:
    return None if x is None or isinstance(x, str) else "must be a string"


def _dict(x: Any) -> str | None:
    return None if x is None or isinstance(x, dict) else "must be an object"


def _messages(x: Any) -> str | None:
    if not isinstance(x, list) or not x:
        return "must be a non-empty list of messages"
    return None


def _stop(x: Any) -> str | None:
    if x is None:
        return None
    if x == "" or isinstance(x, list) and "" in x:
        return "must not hold an empty string"
    if isinstance(x, str):
        return None
    if isinstance(x, list) and len(x) <= 16 and all(isinstance(s, str) for s in x):
        return None
    return "must be a string or a list of at most 16 strings"


def _n(x: Any) -> str | None:
    return None if x is None or x == 1 else "only n=1 is served (one choice per request)"


def _modalities(x: Any) -> str | None:
    return None if x is None or x == ["text"] else "only [\"text\"] is served"


def _logit_bias(x: Any) -> str | None:
    if x is None:
        return None
    if not isinstance(x, dict):
        return "must be an object of token id -> bias"
    for k, b in x.items():
        try:
            int(k)
        except (TypeError, ValueError):
            return f"key {k!r} is not a token id"
        if not _is_num(b) or not -100 <= b <= 100:
            return f"bias for {k} must be a number in [-100, 100]"
    return None


def _response_format(x: Any) -> str | None:
    if x is None:
        return None
    if not isinstance(x, dict) or x.get("type") not in ("text", "json_object", "json_schema"):
        return "type must be text, json_object or json_schema"
    if x["type"] == "json_schema":
        js = x.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            return "json_schema.schema must be an object"
    return None


def _tools(x: Any) -> str | None:
    if x is None:
        return None
    if not isinstance(x, list):
        return "must be a list of tools"
    for i, t in enumerate(x):
        if not isinstance(t, dict) or t.get("type") != "function":
            return f"[{i}]: only tools of type function are served"
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return f"[{i}].function.name is required"
    return None


def _tool_choice(x: Any) -> str | None:
    if x is None or x in ("none", "auto", "required"):
        return None
    if isinstance(x, dict) and x.get("type") == "function" and isinstance(x.get("function"), dict) \
            and isinstance(x["function"].get("name"), str):
        return None
    return "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def _stream_options(x: Any) -> str | None:
    return None if x is None or isinstance(x, dict) else "must be an object"


def _top_logprobs(x: Any) -> str | None:
    return _int(0, 20)(x)


def _false(x: Any) -> str | None:
    return None if x in (None, False) else "only false is served"


def _prompt(x: Any) -> str | None:
    if isinstance(x, str) and x:
        return None
    if isinstance(x, list) and x and all(_is_int(t) for t in x):
        return None
    if isinstance(x, list) and len(x) == 1 and (isinstance(x[0], str) or
                                                 (isinstance(x[0], list) and all(_is_int(t) for t in x[0]))):
        return None
    return "must be a non-empty string or a list of token ids (one prompt per request)"


def _completion_logprobs(x: Any) -> str | None:
    return _int(0, 20)(x)


# -- the table -------------------------------------------------------------------------------------------

_SAMPLING = [
    Field("temperature", HONOURED, "0 is greedy; default 1", 0.7, 5, _num(0, 2)),
    Field("top_p", HONOURED, "nucleus filter before the seeded draw", 0.9, 1.5, _num(0, 1)),
    Field("top_k", HONOURED, "extension (vLLM's): keep the k most likely; 0 or -1 is off", 40, -5,
          _int(-1)),
    Field("min_p", HONOURED, "extension (vLLM's): drop tokens under min_p times the top probability", 0.05, 2,
          _num(0, 1)),
    Field("seed", HONOURED, "keys the sampling noise by (seed, position); no seed draws one per request",
          1234, "x", _int()),
    Field("stop", HONOURED, "up to 16 strings; the stop string is never sent", ["\n\n"], 3, _stop),
    Field("presence_penalty", HONOURED, "OpenAI's definition, over the generated tokens", 0.5, 3, _num(-2, 2)),
    Field("frequency_penalty", HONOURED, "OpenAI's definition, over the generated tokens", 0.5, 3, _num(-2, 2)),
    Field("logit_bias", HONOURED, "token id -> bias added to the logits", {"0": -100}, {"x": 1}, _logit_bias),
    Field("stream", HONOURED, "server-sent events, ending with data: [DONE]", False, "yes", _bool),
    Field("stream_options", HONOURED, "an object (with stream: true); its keys are the rows below", {}, 3,
          _stream_options, {"stream": True}),
    Field("stream_options.include_usage", HONOURED, "a last chunk with usage and no choices", True, "yes", _bool,
          {"stream": True}),
    Field("user", IGNORED, "a client label; not logged, not stored", "someone", validate=_any),
]

CHAT_FIELDS: tuple[Field, ...] = (
    Field("messages", HONOURED, "rendered with the model's own chat template",
          [{"role": "user", "content": "hi"}], [], _messages),
    Field("model", HONOURED, "must name the served model (or be left out)", None, "no-such-model", _str),
    Field("max_tokens", HONOURED, "capped to what fits the context (said in the log line), never refused "
                                  "for being large", 8, 0, _int(1)),
    Field("max_completion_tokens", HONOURED, "same as max_tokens; wins when both are set", 8, 0, _int(1)),
    Field("n", HONOURED, "1 only; n > 1 is refused", 1, 2, _n),
    *_SAMPLING,
    Field("logprobs", HONOURED, "logprobs of the model's distribution for each sent token", True, "yes", _bool),
    Field("top_logprobs", HONOURED, "0-20 alternatives per token (with logprobs)", 2, 21, _top_logprobs,
          {"logprobs": True}),
    Field("response_format", HONOURED, "json_object and json_schema by constrained decoding (llguidance)",
          {"type": "json_object"}, {"type": "xml"}, _response_format),
    Field("tools", HONOURED, "function tools, rendered by the chat template",
          [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
          [{"type": "code"}], _tools),
    Field("tool_choice", HONOURED, "none, auto, required, or a named function (required and named are "
                                   "enforced by a grammar)", "auto", "sometimes", _tool_choice),
    Field("parallel_tool_calls", HONOURED, "false ends the answer after the first tool call", True, "no", _bool),
    Field("chat_template_kwargs", HONOURED, "extension: variables for the chat template, e.g. enable_thinking",
          {"enable_thinking": False}, [1], _dict),
    Field("modalities", IGNORED, "[\"text\"] only; any other modality is refused", ["text"], ["audio"],
          _modalities),
    Field("metadata", IGNORED, "not stored", {"k": "v"}, validate=_any),
    Field("store", IGNORED, "nothing is stored beyond the usage ledger", False, validate=_any),
    Field("service_tier", IGNORED, "there is one tier", "auto", validate=_any),
    Field("safety_identifier", IGNORED, "not logged, not stored", "abc", validate=_any),
    Field("prompt_cache_key", IGNORED, "prefix caching needs no key", "k", validate=_any),
    Field("prompt_cache_retention", IGNORED, "the caches keep what memory allows", "in_memory", validate=_any),
    Field("reasoning_effort", IGNORED, "thinking is switched by chat_template_kwargs.enable_thinking",
          "low", validate=_any),
    Field("verbosity", IGNORED, "the model writes as long as it writes", "low", validate=_any),
    Field("stream_options.include_obfuscation", IGNORED, "no obfuscation field is sent", False, validate=_any,
          requires={"stream": True}),
    Field("audio", REFUSED, "no audio output"),
    Field("prediction", REFUSED, "no predicted outputs (speculation needs no hint)"),
    Field("web_search_options", REFUSED, "no web search"),
    Field("functions", REFUSED, "deprecated: use tools"),
    Field("function_call", REFUSED, "deprecated: use tool_choice"),
)

COMPLETION_FIELDS: tuple[Field, ...] = (
    Field("prompt", HONOURED, "text (special tokens added as the tokenizer does) or a list of token ids",
          "Hello", [], _prompt),
    Field("model", HONOURED, "must name the served model (or be left out)", None, "no-such-model", _str),
    Field("max_tokens", HONOURED, "default 16; capped to what fits the context", 8, 0, _int(1)),
    Field("n", HONOURED, "1 only; n > 1 is refused", 1, 2, _n),
    Field("best_of", HONOURED, "1 only; more is refused", 1, 2, _n),
    *_SAMPLING,
    Field("logprobs", HONOURED, "0-20: logprobs of each sent token and that many alternatives", 2, 21,
          _completion_logprobs),
    Field("echo", HONOURED, "false only; true is refused", False, True, _false),
    Field("suffix", REFUSED, "no fill-in-the-middle"),
)


def table(endpoint: str) -> tuple[Field, ...]:
    return {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}[endpoint]


def check(body: Any, fields: tuple[Field, ...]) -> None:
    """Refuse (``FieldError``) what the table refuses, a value a field does not take, or an unknown field."""
    if not isinstance(body, Mapping):
        raise FieldError("body", "must be a JSON object")
    rows = {f.name: f for f in fields}
    _check_level(body, rows, "")


def _check_level(obj: Mapping[str, Any], rows: Mapping[str, Field], prefix: str) -> None:
    for key, value in obj.items():
        name = prefix + key
        row = rows.get(name)
        if row is None:
            known = sorted(n for n in rows if n.startswith(prefix) and "." not in n[len(prefix):])
            where = name if key else (prefix.rstrip(".") or "body")
            what = "unknown field" if key else "a field with an empty name"
            raise FieldError(where, f"{what} (this server knows: {', '.join(known)})")
        if row.policy == REFUSED:
            raise FieldError(name, f"not supported by this server ({row.note})")
        if (getattr(row.validate, "integer", False) and isinstance(value, float) and value.is_integer()
                and isinstance(obj, dict)):
            obj[key] = value = int(value)   # an integral number is an integer (JSON Schema, /openapi.json)
        if row.validate is not None:
            why = row.validate(value)
            if why:
                raise FieldError(name, why)
        if isinstance(value, Mapping) and any(n.startswith(name + ".") for n in rows):
            _check_level(value, rows, name + ".")
