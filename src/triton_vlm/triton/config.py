"""Model parameters from `config.pbtxt` (`parameters { key: ... value: { string_value: ... } }`)."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("triton_vlm")


def model_parameters(args: dict) -> dict[str, str]:
    cfg = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}


def model_config(args: dict) -> dict[str, Any]:
    return json.loads(args["model_config"])


def resolve_model_path(value: str) -> Path:
    """`model_path` parameter: a checkpoint dir; empty = $TRITON_VLM_MODEL, else the built-in demo model."""
    value = value or os.environ.get("TRITON_VLM_MODEL", "")
    if value:
        path = Path(value).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"model_path {path} is not a Hugging Face checkpoint directory (no config.json)")
        return path
    from ..demo import ensure_demo_model  # noqa: PLC0415

    return ensure_demo_model()


class _TritonLogHandler(logging.Handler):
    """Python logging -> Triton's own log (the stub's stderr does not reach the server log)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            import triton_python_backend_utils as pb_utils  # noqa: PLC0415

            msg = "triton_vlm: " + self.format(record)
            L = pb_utils.Logger
            if record.levelno >= logging.ERROR:
                L.log_error(msg)
            elif record.levelno >= logging.WARNING:
                L.log_warn(msg)
            else:
                L.log_info(msg)
        except Exception:  # noqa: BLE001 - outside the stub, or the logger is gone at shutdown
            sys.stderr.write(self.format(record) + "\n")


def setup_logging() -> None:
    if not log.handlers:
        log.addHandler(_TritonLogHandler())
        log.setLevel(logging.INFO)
        log.propagate = False


def parse_int(params: dict[str, str], key: str, default: int) -> int:
    v = params.get(key, "")
    return int(v) if v.strip() else default



_DTYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_BF16": "bfloat16"}


def output_dtype(args: dict, name: str) -> str:
    """The torch dtype name ("float32", "float16", "bfloat16") of output `name` as config.pbtxt declares it."""
    for out in model_config(args).get("output", []):
        if out.get("name") == name:
            kind = out.get("data_type", "TYPE_FP32")
            if kind not in _DTYPES:
                raise ValueError(f"output {name} must be TYPE_FP32, TYPE_FP16 or TYPE_BF16, got {kind}")
            return _DTYPES[kind]
    raise ValueError(f"config.pbtxt declares no output {name!r}")
