"""triton-vlm: a LLaVA-style vision-language model with per-request LoRA adapters, served by Triton.

Everything here is plain Python + torch; only `triton_vlm.triton` knows about Triton.
"""
__version__ = "0.1.0"
