"""Error bodies in OpenAI's shape, ``{"error": {message, type, param, code}}``, on every route and method."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem_core.server.prepare import Job

__all__ = ["error", "openai_errors", "memory_error", "prompt_field", "json_response"]

log = logging.getLogger("tandem.server")


def error(status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict[str, str] | None = None) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def openai_errors(app: Any) -> None:
    """Every error on every route and method in OpenAI's shape: ``{"error": {message, type, param, code}}``
    (FastAPI's own 404/405/422 say ``{"detail": ...}``, an unhandled exception plain text)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

    async def http_error(request: Request, exc: HTTPException) -> Any:
        what = {404: f"no route {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, what, code=codes.get(exc.status_code),
                      headers=dict(exc.headers) if exc.headers else None)

    async def validation_error(request: Request, exc: RequestValidationError) -> Any:
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error(422, f"{where or 'request'}: {first.get('msg', 'invalid')}", param=where)

    async def internal_error(request: Request, exc: Exception) -> Any:
        log.error("%s %s failed: %s", request.method, request.url.path, type(exc).__name__)
        return error(500, "the server failed on this request (see its log)", kind="server_error")

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def prompt_field(job: Job) -> str:
    return "messages" if job.endpoint == "chat" else "prompt"


def memory_error(job: Job, message: str) -> Any:
    """507: the prompt does not fit under the memory gate (the message: what it needs, what there is)."""
    return error(507, message, param=prompt_field(job), kind="server_error", code="memory_gate")


def json_response(body: Any) -> Any:
    return Response(json.dumps(body, default=str), media_type="application/json")
