"""`quantization_config`, read once where the checkpoint is read (`spec.CheckpointSpec.load`).

A checkpoint whose weights are quantized in a way the engine does not read exactly is refused at load
(`checkpoint_fields.Unservable`, raised as `spec.CheckpointError`, naming the field, its value and what is
supported): serving it with its scales ignored answers silently wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..checkpoint_fields import Unservable

SUPPORTED_METHODS: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuantConfig:
    """A quantization the engine reads exactly (none yet)."""

    method: str


def _raw(top: Any) -> Optional[dict]:
    """The checkpoint's quantization_config (top config, else its text config), as a dict; None when absent."""
    for cfg in (top, getattr(top, "text_config", None)):
        q = getattr(cfg, "quantization_config", None) if cfg is not None else None
        if q is not None:
            return q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else dict(vars(q)))
    return None


def read_quantization(top: Any) -> Optional[QuantConfig]:
    """The checkpoint's quantization (None for unquantized weights); `Unservable` for one not served."""
    raw = _raw(top)
    if raw is None:
        return None
    method = raw.get("quant_method")
    raise Unservable(f"config.json quantization_config.quant_method = {method!r} is not supported; supported: "
                          f"{list(SUPPORTED_METHODS) or 'none (unquantized checkpoints only)'}")
