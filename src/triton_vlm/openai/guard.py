"""`RequestGuard`: the first thing a request meets, a pure ASGI middleware that refuses before reading a body.

- With an API key, a request without `Authorization: Bearer <key>` is answered 401 from its headers, whatever
  its path (/v1/*, and /health and /metrics, which tell the deployment's state and the adapters in use): its
  body is never read (an unauthenticated client cannot make the server take in megabytes).
- A body over `max_bytes` (`--max-request-bytes`, default 32 MiB) is answered 413: at once when its
  `Content-Length` says so, else as soon as the bytes received pass the limit (chunked bodies), before any JSON
  parsing. The app downstream only ever sees a body within the limit.
"""
from __future__ import annotations

import hmac
import json
from typing import Optional

from starlette.exceptions import HTTPException

from .errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def key_error(authorization: str, key: str) -> Optional[APIError]:
    """The 401 for an `Authorization` header that does not carry `Bearer <key>`, or None when it does."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return None
    return APIError(401, "Incorrect API key provided" if token else "Missing bearer token: send "
                    "'Authorization: Bearer <api key>'", code="invalid_api_key")


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is over {max_bytes} bytes, this server's limit "
                    "(--max-request-bytes)", code="request_too_large")


class _TooLarge(HTTPException):
    """Raised by the counting `receive`: FastAPI passes an HTTPException through its body parsing (anything else
    becomes its 400), and `errors.install_handlers` answers it as `too_large`'s 413."""

    def __init__(self, max_bytes: int):
        super().__init__(413, too_large(max_bytes).message)


class RequestGuard:
    def __init__(self, app, *, api_key: Optional[str], max_bytes: int):
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.api_key:
            err = key_error(headers.get("authorization", ""), self.api_key)
            if err is not None:
                return await _reply(send, err, {"www-authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if self.max_bytes and length.isdigit() and int(length) > self.max_bytes:
            return await _reply(send, too_large(self.max_bytes))
        if not self.max_bytes:
            return await self.app(scope, receive, send)
        state = {"received": 0, "started": False}

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def watched_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not state["started"]:
                await _reply(send, too_large(self.max_bytes))


async def _reply(send, err: APIError, extra: Optional[dict] = None) -> None:
    """An OpenAI error body, and `Connection: close`: the unread body is not drained."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
