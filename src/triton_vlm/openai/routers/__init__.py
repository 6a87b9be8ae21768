"""One router per endpoint, and what they share: the API key check, per-request metrics, and cancellation of a
request whose client went away before its answer started (once a stream has started, Starlette stops the
response when the client disconnects); closing our generators closes the gRPC stream, and Triton cancels the
request."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import APIError, internal
from ..guard import key_error
from ..service import Frontend


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


async def authorize(request: Request) -> None:
    """With --api-key, /v1/* needs `Authorization: Bearer <key>` (401 otherwise, as OpenAI answers). The
    `guard.RequestGuard` middleware checks it first, from the headers alone; this check stays for an app
    mounted without it."""
    key = frontend(request).api_key
    err = key_error(request.headers.get("authorization", ""), key) if key else None
    if err is not None:
        raise err


def request_id(prefix: str, given: str | None) -> str:
    return given or f"{prefix}-{uuid.uuid4().hex}"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def serve(request: Request, endpoint: str, work: Callable[[], Awaitable[object]],
                engine_requests: int = 1) -> Response:
    """Run an endpoint's work: a dict becomes a JSON body, an async iterator an SSE stream. Counts the request in
    the front end's metrics, and its `engine_requests` (one per prompt) against --max-concurrent-requests. Until
    its answer starts, a request is cancelled when its client disconnects (an unstreamed one until its body is
    ready, a streamed one until its first event); then Starlette watches the client of a stream."""
    fe, t0 = frontend(request), time.perf_counter()
    _admit(fe, endpoint, engine_requests)
    fe.engine_requests += engine_requests
    fe.metrics.running += 1
    status, streaming = 200, False
    try:
        try:
            result = await _unless_disconnected(request, work())
        except APIError as e:
            status = e.status
            raise
        except ClientGone:
            status = 499
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            status = 500
            raise internal(e) from None
        if isinstance(result, dict):
            return JSONResponse(result)
        streaming = True
        return StreamingResponse(_counted(fe, endpoint, t0, result, engine_requests), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finally:
        if not streaming:
            _done(fe, endpoint, status, t0, engine_requests)


def _admit(fe: Frontend, endpoint: str, engine_requests: int) -> None:
    """429 when the request's engine requests would pass --max-concurrent-requests (400 when they alone do). The
    event loop's thread only: no race between the check and the count."""
    limit = fe.max_concurrent_requests
    if not limit or fe.engine_requests + engine_requests <= limit:
        return
    if engine_requests > limit:
        fe.metrics.refused(endpoint, 400)
        raise APIError(400, f"the request makes {engine_requests} engine requests (one per prompt), more than this "
                       f"server serves at once (--max-concurrent-requests {limit}); send fewer prompts",
                       param="prompt", code="too_many_prompts")
    fe.metrics.refused(endpoint, 429)
    raise APIError(429, f"the server is serving {fe.engine_requests} engine requests, its limit "
                   f"(--max-concurrent-requests {limit}) leaves no room for {engine_requests} more; retry later",
                   code="too_many_requests")


def _done(fe: Frontend, endpoint: str, status: int, t0: float, engine_requests: int) -> None:
    fe.engine_requests -= engine_requests
    fe.metrics.running -= 1
    fe.metrics.finished(endpoint, status, time.perf_counter() - t0)


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coro):
    """`coro`'s result, or ClientGone (and `coro` cancelled) when the client disconnects first."""
    task, watch = asyncio.ensure_future(coro), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():  # the client went away: cancel the generation (its gRPC stream closes)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def _counted(fe: Frontend, endpoint: str, t0: float, body, engine_requests: int):
    status = 200
    try:
        async for chunk in body:
            yield chunk
    except BaseException:
        status = 499  # the client went away mid-stream
        raise
    finally:
        await body.aclose()
        _done(fe, endpoint, status, t0, engine_requests)
