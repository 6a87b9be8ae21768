"""LLaVA (llava-1.5, `LlavaForConditionalGeneration`): one tile per image at the tower's size.

Every image is processed by the checkpoint's image processor to one tower-sized square, becomes one tile, and
takes the same number of placeholder tokens: the tower's patches plus its CLS-like tokens, less the CLS token
the "default" select strategy drops (`spec.image_token_count`). The projector is `LlavaMultiModalProjector`;
there is no post-processing. Everything is the `Family` defaults.
"""
from __future__ import annotations

from .base import Family, Renames

# transformers' "llava" conversion mapping, then LlavaModel's (scoped to `model.`) and the legacy duplicate
# `.model.model`: the hub's transformers-4 saves (`language_model.model.*`, `language_model.lm_head.*`,
# `vision_tower.*`, `multi_modal_projector.*`) and transformers-5 saves load by the in-memory names
LLAVA_RENAMES: Renames = (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^language_model\.", "model.language_model."),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
)
INNER_RENAMES: Renames = ((r"^model\.language_model\.model\.(model\.)?", "model.language_model."),)


class Llava(Family):
    name = "llava"
    model_type = "llava"
    architectures = ("LlavaForConditionalGeneration",)
    model_class = "LlavaForConditionalGeneration"
    weight_renames = LLAVA_RENAMES + INNER_RENAMES


LLAVA = Llava()
