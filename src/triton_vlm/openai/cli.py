"""`python -m triton_vlm.openai`: the OpenAI-compatible front end against a running triton-vlm server."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from ..server.auth import ENV_HOST, LOOPBACK, exposure_error
from .config import FrontendConfig
from .guard import DEFAULT_MAX_REQUEST_BYTES
from .media import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S
from .tool_parsers import PARSERS
from .triton import ROUTES


def _count(text: str) -> int:
    """A count >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 (no limit) or more")
    return value


def _ports(text: str) -> tuple[int, ...]:
    """Comma-separated TCP ports (argparse type)."""
    ports = tuple(_count(x.strip()) for x in text.split(",") if x.strip())
    if not ports or not all(1 <= p <= 65535 for p in ports):
        raise argparse.ArgumentTypeError(f"{text!r}: give ports in [1, 65535], comma-separated")
    return ports


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m triton_vlm.openai", description=__doc__)
    p.add_argument("--triton", default="localhost:8001", help="Triton's gRPC endpoint, host:port")
    p.add_argument("--model-dir", type=Path, help="the checkpoint folder (tokenizer, chat template); default: the "
                   "server's own model_path, when this machine can read it")
    p.add_argument("--served-model-name", help="the base model's id (default: the checkpoint folder's name)")
    p.add_argument("--lora-dir", type=Path, help="adapter registry listed by /v1/models (default: the server's)")
    p.add_argument("--host", default=os.environ.get(ENV_HOST) or LOOPBACK,
                   help=f"the address to listen on (default {LOOPBACK}: this machine only; also ${ENV_HOST}); "
                        "another one needs --api-key or --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --host other than loopback without an API key: anyone who reaches it is served")
    p.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)))
    p.add_argument("--api-key", default=os.environ.get("TRITON_VLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (also $TRITON_VLM_API_KEY, as the launcher); "
                        "sent to Triton too, which the launcher starts with the same key")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file (or JSON with 'chat_template')")
    p.add_argument("--allowed-image-domains", default="",
                   help="comma-separated hosts whose http(s) image URLs are fetched ('*.example.org' for "
                        "subdomains); none by default: only data: URLs")
    p.add_argument("--image-ports", type=_ports, default=(80, 443),
                   help="comma-separated ports http(s) image URLs may use")
    p.add_argument("--allow-private-image-hosts", action="store_true",
                   help="also fetch images from loopback, private and link-local addresses (never metadata ones)")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per fetched image")
    p.add_argument("--triton-metrics-url", help="Triton's metrics (default http://HOST:GRPC_PORT+1/metrics)")
    p.add_argument("--route", choices=ROUTES, default="pipeline",
                   help="pipeline: preprocess -> vision -> llm from here (cancellable mid-generation); "
                        "ensemble: one call to the ensemble")
    p.add_argument("--grpc-channels", type=int, default=2, help="HTTP/2 connections to Triton")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-concurrent-requests", type=_count, default=1024,
                   help="engine requests (one per prompt) served at once, streams included; more are refused "
                        "with 429 (0: no limit)")
    p.add_argument("--max-request-bytes", type=_count, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body; a larger one gets 413 before it is read (0: no limit)")
    p.add_argument("--tool-call-parser", choices=PARSERS,
                   help="the model's tool-call format, read back as tool_calls for tool_choice 'auto' (vLLM's "
                        "names; without it 'auto' is refused: 'required' and named functions need no parser)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for Triton at start")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        triton=args.triton, model_dir=args.model_dir, served_model_name=args.served_model_name,
        lora_dir=args.lora_dir, api_key=args.api_key or None, chat_template=args.chat_template,
        allowed_image_domains=tuple(d.strip() for d in args.allowed_image_domains.split(",") if d.strip()),
        image_ports=args.image_ports,
        allow_private_image_hosts=args.allow_private_image_hosts, max_image_bytes=args.max_image_bytes,
        image_fetch_timeout_s=args.image_fetch_timeout,
        triton_metrics_url=args.triton_metrics_url, route=args.route, grpc_channels=args.grpc_channels,
        request_timeout_s=args.request_timeout, startup_timeout_s=args.startup_timeout,
        max_concurrent_requests=args.max_concurrent_requests, max_request_bytes=args.max_request_bytes,
        tool_call_parser=args.tool_call_parser)


def main(argv: Optional[Sequence[str]] = None) -> None:
    import uvicorn

    from .app import build_app

    p = parser()
    args = p.parse_args(argv)
    refused = exposure_error(args.host, args.api_key, args.insecure)
    if refused:
        p.error(refused)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app = build_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                loop="auto", http="auto", timeout_graceful_shutdown=5)
