"""`gather_all`: `asyncio.gather` that cancels the other awaitables when one fails."""
from __future__ import annotations

import asyncio


async def gather_all(aws) -> list:
    """The results of `aws`, run concurrently; when one fails, the others are cancelled (a generation's gRPC
    stream is closed, so Triton cancels its request) and its error is raised. `asyncio.gather` leaves them
    running."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
