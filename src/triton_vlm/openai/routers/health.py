"""GET /health (200 when Triton and its models are ready, else 503) and GET /metrics (Triton's metrics plus the
front end's own, Prometheus text). With an API key both need it (`guard.RequestGuard`); neither names an internal
address (Triton's URL is the operator's business, not the client's)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import frontend

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ready = await frontend(request).client.ready()
    return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    m = frontend(request).metrics
    text = await m.scrape_triton() + m.text()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
