"""The vision tower + projector: one graph on tiles (`encoder.EncoderGraph`), three backends (`backends.py`: torch,
onnxruntime, TensorRT), cross-request batching of tiles, the model family's packing of each image's tiles
(`families/`) and an embedding cache keyed by image content (`service.py`, `cache.py`), the ONNX exporter
(`export.py`) and the TensorRT builder (`trt.py`); `python -m triton_vlm.vision` is their command line."""
from .encoder import EncoderGraph, VisionEncoder, VisionSettings, check_pixel_values, parse_bits

__all__ = ["EncoderGraph", "VisionEncoder", "VisionSettings", "check_pixel_values", "parse_bits"]
