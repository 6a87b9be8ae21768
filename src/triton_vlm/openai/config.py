"""The front end's settings (one dataclass, filled by the command line or by the launcher)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .guard import DEFAULT_MAX_REQUEST_BYTES
from .fetch import DEFAULT_PORTS
from .media import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class FrontendConfig:
    triton: str = "localhost:8001"  # Triton's gRPC endpoint, host:port
    model_dir: Optional[Path] = None  # the checkpoint (tokenizer, chat template); default: the server's model_path
    served_model_name: Optional[str] = None  # default: the checkpoint folder's name
    lora_dir: Optional[Path] = None  # the adapter registry; default: the server's llm lora_dir
    api_key: Optional[str] = None  # require `Authorization: Bearer <key>` on /v1/*
    chat_template: Optional[Path] = None
    allowed_image_domains: tuple[str, ...] = ()
    max_image_bytes: int = DEFAULT_MAX_BYTES
    image_fetch_timeout_s: float = DEFAULT_TIMEOUT_S
    image_ports: tuple[int, ...] = DEFAULT_PORTS  # ports of http(s) image URLs
    allow_private_image_hosts: bool = False  # fetch images from loopback / private / link-local addresses too
    triton_metrics_url: Optional[str] = None  # default: http://<triton host>:<gRPC port + 1>/metrics
    route: str = "pipeline"  # "pipeline" (cancellable, default) or "ensemble" (see triton.py)
    grpc_channels: int = 2
    request_timeout_s: float = 600.0
    # engine requests (one per prompt) served at once (streams until their last event); beyond it 429 at once
    # (0: no limit). It bounds what waits for preprocess and the vision encoder, whose Triton queues have no bound
    max_concurrent_requests: int = 1024
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is refused (413) before it is read whole
    startup_timeout_s: float = 120.0  # how long to wait for Triton at start
    tool_call_parser: Optional[str] = None  # the model's tool-call format for tool_choice "auto" (tool_parsers.py)

    def metrics_url(self) -> str:
        if self.triton_metrics_url:
            return self.triton_metrics_url
        host, _, port = self.triton.rpartition(":")
        return f"http://{host or 'localhost'}:{int(port) + 1}/metrics"
