"""`build_app(config)`: the FastAPI application (run it with uvicorn; `python -m triton_vlm.openai` does).

At start-up (lifespan) it waits for Triton, reads the llm model's parameters (`model_path`, `lora_dir`,
`context_length`) for what the command line left out, and loads the served model (tokenizer, chat template).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from ..params import DEFAULT_MAX_VIDEOS
from ..preprocess.images import DEFAULT_MAX_IMAGES
from .config import FrontendConfig
from .errors import install_handlers
from .guard import RequestGuard
from .media import MediaPolicy
from .metrics import FrontendMetrics
from .served import ServedModel
from .service import Frontend
from .triton import LLM, PREPROCESS, TritonClient

log = logging.getLogger("triton_vlm.openai")


async def _server_parameters(client: TritonClient, timeout_s: float) -> dict[str, str]:
    """The llm model's parameters once Triton answers (waiting up to `timeout_s`), or {} when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await client.ready((LLM,)):
            try:
                return await client.model_parameters(LLM)
            except Exception as e:  # noqa: BLE001
                log.warning("cannot read the llm model's config: %s", e)
                return {}
        if time.monotonic() > deadline:
            return {}
        await asyncio.sleep(0.5)


async def _media_limits(client: TritonClient) -> tuple[int, int]:
    """The preprocess model's `max_images` and `max_videos` (per request), or their defaults where the server does
    not say: the front end counts both before it fetches anything."""
    try:
        params = await client.model_parameters(PREPROCESS)
    except Exception as e:  # noqa: BLE001
        log.warning("cannot read the preprocess model's max_images / max_videos: %s", e)
        return DEFAULT_MAX_IMAGES, DEFAULT_MAX_VIDEOS
    return (int(params.get("max_images") or DEFAULT_MAX_IMAGES),
            int(params.get("max_videos") or DEFAULT_MAX_VIDEOS))


async def start_frontend(config: FrontendConfig) -> Frontend:
    client = TritonClient(config.triton, route=config.route, channels=config.grpc_channels,
                          timeout_s=config.request_timeout_s, api_key=config.api_key)
    params = await _server_parameters(client, config.startup_timeout_s)
    model_dir = config.model_dir or (Path(params["model_path"]) if params.get("model_path") else None)
    if model_dir is None or not Path(model_dir).is_dir():
        await client.close()
        raise SystemExit(f"triton-vlm openai: no checkpoint folder: pass --model-dir (the server at {config.triton} "
                         f"{'reported ' + repr(params.get('model_path')) if params else 'did not answer'})")
    lora_dir = config.lora_dir or (Path(params["lora_dir"]) if params.get("lora_dir") else None)
    context = int(params.get("context_length") or 0)
    served = await asyncio.to_thread(ServedModel, Path(model_dir), served_name=config.served_model_name,
                                     lora_dir=lora_dir, chat_template=config.chat_template, context_length=context)
    client.context_length = served.context_length
    max_images, max_videos = await _media_limits(client)
    media = MediaPolicy(tuple(config.allowed_image_domains), config.max_image_bytes, config.image_fetch_timeout_s,
                        max_images=max_images, max_videos=max_videos, ports=tuple(config.image_ports),
                        allow_private=config.allow_private_image_hosts)
    log.info("serving %s (%s) from Triton at %s, route %s, adapters %s, chat template %s", served.base_id,
             served.model_dir, config.triton, config.route, served.adapters.names() or "none",
             served.chat.origin if served.chat else "none")
    return Frontend(client, served, media, FrontendMetrics(config.metrics_url()), api_key=config.api_key,
                    max_concurrent_requests=config.max_concurrent_requests, tool_call_parser=config.tool_call_parser)


def build_app(config: FrontendConfig):
    """The ASGI application for `config` (the front end starts when the server's lifespan starts)."""
    from fastapi import FastAPI

    from .routers import chat, completions, health, models

    @asynccontextmanager
    async def lifespan(app):
        app.state.frontend = await start_frontend(config)
        try:
            yield
        finally:
            await app.state.frontend.client.close()

    app = FastAPI(title="triton-vlm OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_bytes=config.max_request_bytes)
    for module in (models, chat, completions, health):
        app.include_router(module.router)
    return app
