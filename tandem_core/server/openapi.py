"""``GET /openapi.json``: the server's own OpenAPI 3.1 document, generated from the field table.

Each request body's properties are exactly the rows of ``fields.CHAT_FIELDS`` /
``fields.COMPLETION_FIELDS`` (a refused row appears with ``"not": {}``, so the document
says it is refused), each with the row's policy and note as its description and the
value schema below (``VALUES``: what the row's validator takes). Unknown fields are
refused (``additionalProperties: false``). ``tests/test_server_fuzz.py`` checks that every
row has a value schema and runs schemathesis against this document.
"""

from __future__ import annotations

from typing import Any

from tandem_core.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED, Field

__all__ = ["VALUES", "openapi", "body_schema"]

_NUM = {"type": ["number", "null"]}
_STOP = {"anyOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
                   {"type": "null"}]}
_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
         "required": ["type", "text"]}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}, {"type": "null"}]}
_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": _CONTENT, "name": {"type": "string"}, "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": _CALL}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}

VALUES: dict[str, dict[str, Any]] = {
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "model": {"type": ["string", "null"]},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
    "n": {"enum": [1, None]},
    "best_of": {"enum": [1, None]},
    "temperature": {**_NUM, "minimum": 0, "maximum": 2},
    "top_p": {**_NUM, "minimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "seed": {"type": ["integer", "null"]},
    "stop": _STOP,
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number", "minimum": -100,
                                                                       "maximum": 100}},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {
        "include_usage": {"type": ["boolean", "null"]}, "include_obfuscation": {}}, "additionalProperties": False},
    "user": {},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "response_format": {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                             "schema": {"type": "object"},
                                                             "strict": {"type": "boolean"}}}}},
        {"type": "null"}]},
    "tools": {"type": ["array", "null"], "items": _TOOL},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "chat_template_kwargs": {"type": ["object", "null"]},
    "modalities": {"anyOf": [{"const": ["text"]}, {"type": "null"}]},
    "metadata": {},
    "store": {},
    "service_tier": {},
    "safety_identifier": {},
    "prompt_cache_key": {},
    "prompt_cache_retention": {},
    "reasoning_effort": {},
    "verbosity": {},
    "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}}]},
    "echo": {"enum": [False, None]},
    "suffix": {},
}
# rows nested in another row's object (stream_options.*) are described inside it
_NESTED_IN = {"stream_options.include_usage": "stream_options", "stream_options.include_obfuscation": "stream_options"}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _row_schema(f: Field) -> dict[str, Any]:
    described = {"description": f"{f.policy}: {f.note}"}
    if f.policy == REFUSED:
        return {"not": {}, **described}
    return {**VALUES[f.name], **described}


def body_schema(fields: tuple[Field, ...], required: str) -> dict[str, Any]:
    """The request body of one endpoint: its table's rows, nothing else."""
    props = {f.name: _row_schema(f) for f in fields if f.name not in _NESTED_IN}
    return {"type": "object", "required": [required], "properties": props, "additionalProperties": False}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "an OpenAI-shaped error",
                     "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


def _post(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": body}}}, "responses": {
        "200": {"description": "the answer, whole (JSON) or streamed (text/event-stream)", "content": {
            "application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}},
        **_errors(400, 401, 404, 429, 499, 500, 507)}}}


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": summary, "content": {media: {"schema": {"type": "object"} if "json" in media
                                                          else {"type": "string"}}}}, **_errors(401)}}}


def openapi(model_id: str) -> dict[str, Any]:
    """The document for a server of ``model_id``."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "TandemLLM", "version": "1", "description": f"serving {model_id}"},
        "paths": {
            "/v1/chat/completions": _post("a chat completion", body_schema(CHAT_FIELDS, "messages")),
            "/v1/completions": _post("a text completion", body_schema(COMPLETION_FIELDS, "prompt")),
            "/v1/models": _get("the served model"),
            "/health": _get("the model, its engines, caches and speculation"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
        },
    }
