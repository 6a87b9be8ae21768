"""Quantized checkpoints: `config.read_quantization` reads `quantization_config` once, with the checkpoint, and
refuses at load any method or scheme the engine does not implement; `dequant.QuantizedWeights` dequantizes the
FP8 weights once at load, as `transformers` does with `dequantize=True` (see each module)."""
from .config import QuantConfig, read_quantization
from .dequant import QuantizedWeights

__all__ = ["QuantConfig", "QuantizedWeights", "read_quantization"]
