"""Client for the triton-vlm ensemble (LLaVA-style vision-language model on Triton Inference Server)."""
from .client import DEFAULT_TIMEOUT, DEFAULT_URLS, VLMClient
from .errors import VLMClientError
from .request import DEFAULT_MAX_TOKENS, ensure_image_markers, inline_image, load_image
from .response import GenerateResult, StreamPiece

__version__ = "0.1.0"
__all__ = ["VLMClient", "VLMClientError", "GenerateResult", "StreamPiece", "inline_image", "load_image",
           "ensure_image_markers", "DEFAULT_MAX_TOKENS", "DEFAULT_TIMEOUT", "DEFAULT_URLS"]
