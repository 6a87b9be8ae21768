"""An OpenAI-compatible API in front of the triton-vlm server: FastAPI + uvicorn, talking to Triton over gRPC.

`python -m triton_vlm.openai --triton HOST:GRPC_PORT [--model-dir CHECKPOINT] [--port 9000] ...` runs it;
`build_app(FrontendConfig(...))` gives the ASGI application to run in-process (the launcher does).

Modules: `app` (the application and its start-up), `routers/` (one per endpoint: models, chat, completions,
health + metrics), `schemas` (request bodies), `params` (sampling fields -> ensemble inputs), `chat_template`
(messages -> prompt), `media` (image URLs -> bytes), `triton` (the gRPC client), `generate` / `choices` (one
generation's choices, stop strings, log probs), `service` (one body or Server-Sent Events), `responses`
(OpenAI's response shapes), `served` (model ids, adapters, the checkpoint's facts), `structured` (structured
outputs -> the guided-decoding inputs), `tools` / `tool_parsers` (tool_choice -> constraint, answers ->
tool_calls), `metrics`, `errors`.
"""
from .config import FrontendConfig


def build_app(config: FrontendConfig):
    from .app import build_app as _build

    return _build(config)


__all__ = ["FrontendConfig", "build_app"]
