"""Qwen3-VL (`Qwen3VLForConditionalGeneration`) and Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`): Qwen2-VL's
native resolution with 16-px patches, DeepStack, a Qwen3 text model and interleaved M-RoPE.

Image processing and prompts are Qwen2-VL's (`qwen2_vl.py`): the checkpoint's `Qwen2VLImageProcessor` (patch 16,
merge 2: sides multiples of 32), `<|vision_start|><|image_pad|><|vision_end|>` per image, `<|image_pad|>` x
grid_h * grid_w / 4. The checkpoint's files are saved under the transformers-5 names (`model.visual.*`,
`model.language_model.*`, `lm_head`): no renames.

Vision graph (`vision/qwen_tower.py`, kind qwen3_vl): patch embedding with a bias, learned absolute position
embeddings bilinearly interpolated to each image's grid (transformers' taps), LayerNorm blocks with a
`gelu_pytorch_tanh` MLP, 2-D rotary, attention inside each frame; the main merger and one DeepStack merger per
`deepstack_visual_indexes` entry. Each media token's features are its embedding then one feature per level
(`[tokens, hidden * (1 + levels)]`): what the embedding cache holds and the prefix cache hashes.

Text model, as data for the engine (`text_rules`): Qwen3 (QK-norm: the checkpoint's `q_norm` / `k_norm`; `head_dim`
from the config), M-RoPE with `mrope_interleaved` (`PositionRule.interleaved`), DeepStack levels (the features
added after decoder layers 0 .. levels - 1 at the media positions). Videos (timestamps between temporal patches)
are not taken yet: the family has no video token.

MoE: the same with sparse layers (the engine reads `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
`decoder_sparse_step`, `mlp_only_layers` from the text config: `spec.TextSpec`; the experts' fused tensors in either
layout transformers loads). LoRA is served on the attention projections and the dense layers' MLP; an adapter on
the experts is refused at load by name.
"""
from __future__ import annotations

import dataclasses

from ..spec import CheckpointSpec
from .base import TextRules
from .qwen2_vl import Qwen2VL


class Qwen3VL(Qwen2VL):
    name = "qwen3_vl"
    model_type = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    model_class = "Qwen3VLForConditionalGeneration"
    text_model_types = ("qwen3_vl_text",)
    weight_renames = ()  # the hub's files hold the transformers-5 names
    video_token = None  # timestamps between temporal patches: not yet
    video_markers = ()

    def text_rules(self, spec: CheckpointSpec) -> TextRules:
        levels = len(getattr(spec.hf_config.vision_config, "deepstack_visual_indexes", None) or ())
        return dataclasses.replace(super().text_rules(spec), deepstack_levels=levels)


QWEN3_VL = Qwen3VL()


class Qwen3VLMoe(Qwen3VL):
    name = "qwen3_vl_moe"
    model_type = "qwen3_vl_moe"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    model_class = "Qwen3VLMoeForConditionalGeneration"
    text_model_types = ("qwen3_vl_moe_text",)


QWEN3_VL_MOE = Qwen3VLMoe()
