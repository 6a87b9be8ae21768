"""LLaVA (llava-1.5, `LlavaForConditionalGeneration`): one tile per image at the tower's size.

Every image is processed by the checkpoint's image processor to one tower-sized square, becomes one tile, and
takes the same number of placeholder tokens: the tower's patches plus its CLS-like tokens, less the CLS token
the "default" select strategy drops (`spec.image_token_count`). The projector is `LlavaMultiModalProjector`;
there is no post-processing. Everything is the `Family` defaults.
"""
from __future__ import annotations

from .base import Family


class Llava(Family):
    name = "llava"
    model_type = "llava"
    architectures = ("LlavaForConditionalGeneration",)
    model_class = "LlavaForConditionalGeneration"


LLAVA = Llava()
