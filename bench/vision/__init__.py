"""Benchmarks of the multimodal front half: encoder (torch vs onnxruntime, batching, the embedding cache),
next_tiling (LLaVA-NeXT tiles), qwen_vl (Qwen2-VL native resolution), cache_trust (content-bound cache keys).
Each is `python -m bench.vision.<module>`."""
