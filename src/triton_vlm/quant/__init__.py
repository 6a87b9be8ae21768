"""Quantized checkpoints: `config.read_quantization` reads `quantization_config` once, with the checkpoint, and
refuses at load any method or scheme the engine does not implement (see `config.py`)."""
from .config import QuantConfig, read_quantization

__all__ = ["QuantConfig", "read_quantization"]
