"""Errors of the OpenAI front end, in OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is the one error type of this package; everything raised while serving a request becomes one at the
boundary (`install_handlers`): request validation -> 400 (never FastAPI's 422), Triton's gRPC status codes ->
`from_triton`, anything unexpected -> 500 (our bug, logged with its traceback).

Triton's statuses map as vLLM's and OpenAI's front ends answer them:

| Triton | HTTP | when |
|---|---|---|
| INVALID_ARGUMENT | 400 | the project's INVALID_ARG messages, passed through unchanged |
| UNAVAILABLE, queue full | 429 | the engine's request queue refused the request |
| UNAVAILABLE, other / unreachable | 503 | Triton down, restarting, a model not ready or shutting down |
| NOT_FOUND | 503 | the server does not serve a model this front end needs |
| DEADLINE_EXCEEDED | 504 | `--request-timeout` passed |
| anything else | 500 | |
"""
from __future__ import annotations

import logging
import re
import traceback
from typing import Any, Optional

log = logging.getLogger("triton_vlm.openai")

# Triton prefixes errors of a composing model with the ensemble's name; the project's message follows it.
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
# UNAVAILABLE messages that mean "full, retry later": the engine's queue (engine.py), Triton's queue policy
_QUEUE_FULL = ("queue is full", "exceeds maximum queue size", "out of device memory")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          429: "rate_limit_error", 499: "invalid_request_error", 500: "internal_error", 503: "service_unavailable",
          504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    return bad_request(f"{param} is not supported by this server{': ' + what if what else ''}", param=param,
                       code="unsupported_parameter")


def strip_triton_prefix(message: str) -> str:
    return _ENSEMBLE_PREFIX.sub("", message, count=1)


def from_triton(code: str, message: str) -> APIError:
    """A Triton error (gRPC status name such as "INVALID_ARGUMENT" and its message) as an APIError."""
    message = strip_triton_prefix(message)
    if code == "INVALID_ARGUMENT":
        return APIError(400, message)
    if code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        if code == "RESOURCE_EXHAUSTED" or any(m in message.lower() for m in _QUEUE_FULL):
            return APIError(429, message, code="queue_full")
        return APIError(503, message, code="server_unavailable")
    if code == "NOT_FOUND":
        return APIError(503, f"the Triton server does not serve what this front end needs: {message}",
                        code="server_unavailable")
    if code == "DEADLINE_EXCEEDED":
        return APIError(504, message, code="timeout")
    if code == "CANCELLED":
        return APIError(499, message, code="cancelled")
    return APIError(500, message or f"Triton error {code}", code="internal_error")


def internal(exc: BaseException) -> APIError:
    """An exception we did not expect: our bug. Logged with its traceback; the client gets one line."""
    log.error("internal error: %s", "".join(traceback.format_exception(exc)))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """pydantic's errors -> one message naming each bad field, and the first field as `param`."""
    parts, param = [], None
    for e in errors[:8]:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        msg = e.get("msg", "invalid value")
        if e.get("type") == "extra_forbidden":
            msg = "unrecognized request argument"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts), param


def install_handlers(app) -> None:
    """OpenAI-shaped JSON for every error, 400 for validation errors."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def reply(err: APIError, headers: Optional[dict] = None) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api(_request, exc: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return reply(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return reply(bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        return reply(APIError(status, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _other(_request, exc: Exception):
        return reply(internal(exc))
