"""triton-vlm: a LLaVA-style vision-language model served by Triton (per-request LoRA is the next step).

Everything here is plain Python + torch; only `triton_vlm.triton` knows about Triton.
"""
__version__ = "0.1.0"
