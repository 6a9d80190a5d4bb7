"""Errors as each API dialect writes them (OpenAI's {"error": {"message", "type", "param", "code"}} unless
the path belongs to another dialect: `dialect_for`); what ruvllm's typed errors mean to an HTTP client is
said here alone (`api_error`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ruvllm.errors import (AdapterError, AdapterNotFoundError, AdapterPathError, EngineDeadError, EngineShutdownError,
                           ReplicaLostError, RequestError, RuvllmError)
from ruvllm.learning.errors import CompletionNotFoundError, UpdateNotServedError
from ruvllm.tools.format import ToolError

log = logging.getLogger(__name__)

# any other status: "invalid_request_error"
_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


# (type, status, code, param when the error names none): the first that matches; subclasses first
_MEANINGS: tuple[tuple[type, int, str, str | None], ...] = (
    (EngineShutdownError, 503, "shutting_down", None),
    (ReplicaLostError, 503, "replica_failed", None),  # the others serve on: a retry is answered
    (EngineDeadError, 500, "engine_failed", None),
    (AdapterNotFoundError, 404, "model_not_found", "model"),  # e.g. unloaded between the check and the start
    (CompletionNotFoundError, 404, "not_found", "id"),
    (UpdateNotServedError, 503, "learning_capacity", None),
    (RequestError, 400, "invalid_value", None),
    (AdapterPathError, 403, "path_not_allowed", "lora_path"),
    (AdapterError, 400, "invalid_adapter", "lora_path"),
    (ToolError, 400, "invalid_value", None),
)


def api_error(exc: BaseException) -> APIError:
    """What an error means to the HTTP client; a 500 without a code for one ruvllm did not raise on purpose."""
    if isinstance(exc, APIError):
        return exc
    for kind, status, code, param in _MEANINGS:
        if isinstance(exc, kind):
            return APIError(status, str(exc), getattr(exc, "param", None) or param, code)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


# Anthropic's error types by status (any other 4xx: invalid_request_error; 5xx: api_error)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None, code: str | None = None
                         ) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def ollama_error_body(status: int, message: str, param: str | None = None, code: str | None = None
                      ) -> dict[str, Any]:
    return {"error": message}


@dataclass(frozen=True)
class Dialect:
    """How one API dialect writes an error: as a response body, and as the last frame of a stream
    whose status line is long gone; and the media type of its streams."""

    body: Callable[[int, str, str | None, str | None], dict[str, Any]]
    stream_end: Callable[[dict[str, Any]], list[str]]
    stream_media_type: str = "text/event-stream"


def _sse(body: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(body, ensure_ascii=True)}\n\n"


OPENAI = Dialect(error_body, lambda body: [_sse(body), "data: [DONE]\n\n"])
ANTHROPIC = Dialect(anthropic_error_body, lambda body: [_sse(body, "error")])
OLLAMA = Dialect(ollama_error_body, lambda body: [json.dumps(body, ensure_ascii=True) + "\n"], "application/x-ndjson")
# (path prefix, dialect): the first that matches; every other path speaks OpenAI's
_DIALECTS: tuple[tuple[str, Dialect], ...] = (("/v1/messages", ANTHROPIC), ("/api/", OLLAMA))


def dialect_for(path: str) -> Dialect:
    return next((d for prefix, d in _DIALECTS if path.startswith(prefix)), OPENAI)


class _ErrorJSON(JSONResponse):
    """ASCII-escaped JSON: an error may quote the client's own text, and that text can hold what
    UTF-8 cannot encode (a lone surrogate); escaped, it can always be sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error in the shape of the dialect that `path` belongs to."""
    body = dialect_for(path).body(status, message, param, code)
    return _ErrorJSON(body, status_code=status, headers=headers)


def _param_name(loc: tuple[Any, ...]) -> str | None:
    """The request field at fault: `stop`, `messages.0.role`; pydantic's union-branch labels
    (`str`, `list[int]`, `function-after[...]`) are dropped from the path."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    path = [str(parts[0])]
    for p in parts[1:]:
        if isinstance(p, int):
            path.append(str(p))
        elif isinstance(p, str) and p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict"):
            path.append(p)
    return ".".join(path)


class UnexpectedErrorMiddleware:
    """An exception no handler took becomes its 500 here, and goes no further: Starlette's
    ServerErrorMiddleware would answer it but re-raise it to uvicorn, which then closes (resets) the
    keep-alive connection (issue 33, item 21). Only a response already started is cut short: closing
    the connection is then the one way to tell the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            await answer(exc, scope.get("path", ""))(scope, receive, send)


def answer(exc: BaseException, path: str = "") -> JSONResponse:
    err = api_error(exc)
    return error_response(err.status, err.message, err.param, err.code, err.headers, path)


def install_error_handlers(app: Any) -> None:
    async def _typed(request: Request, exc: Exception) -> JSONResponse:
        return answer(exc, request.url.path)

    # Exception: what the middlewares outside UnexpectedErrorMiddleware raise (Starlette's last resort)
    for kind in (APIError, RuvllmError, ToolError, Exception):
        app.add_exception_handler(kind, _typed)
    app.add_middleware(UnexpectedErrorMiddleware)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        param = _param_name(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)
