"""Qwen3.5 / Qwen3.6 (`Qwen3_5ForConditionalGeneration`): a hybrid text model (Gated DeltaNet linear attention beside
gated full attention) behind Qwen3-VL's vision tower and processors.

Image processing, prompts and the vision graph are Qwen3-VL's (`qwen3_vl.py`): `Qwen2VLImageProcessor` with 16-px
patches and a 2x2 merge, `<|vision_start|><|image_pad|>...<|vision_end|>` per image, the tower of kind qwen3_vl
(learned position embeddings interpolated per image, 2-D rotary) with no DeepStack in the released configs
(`deepstack_visual_indexes` absent: 0 levels). The checkpoint's files hold the transformers-5 names
(`model.visual.*`, `model.language_model.*`, `lm_head`): no renames. Videos as Qwen3-VL's (timestamps per temporal
patch; transformers' Qwen3.5 `get_rope_index` is Qwen3-VL's).

Text model, as data for the engine (`spec.TextSpec`, read from the `qwen3_5_text` config; `spec.HYBRID_TEXT`):
`layer_kinds` from `layer_types` (3 linear : 1 full in the released configs), partial rotary (`rotary_dim` =
head_dim x `partial_rotary_factor`) with interleaved M-RoPE over those frequencies (`text_rules`: the position rule
of Qwen2-VL's family with these sections), zero-centred RMSNorms, the attention's output gate, the linear layers'
sizes (`linear_*`). The engine serves it with `engine/model/hybrid.py` over a `kv.hybrid_cache.HybridCache` (state
slots beside the paged KV), prefix caching off (docs/families.md). LoRA: the full-attention layers' q/k/v/o_proj
(q_proj's doubled output: `lora.format.module_shape`) and every layer's MLP; a linear layer's projections are not
LoRA targets (refused by name).

Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`, text `qwen3_5_moe_text`): the same
hybrid model with a sparse block in every layer (transformers' `Qwen3_5MoeSparseMoeBlock`; the config has no
`decoder_sparse_step` / `mlp_only_layers`: `spec.MOE_TEXT`): the router's softmax (fp32) over `num_experts`, the top
`num_experts_per_tok` renormalised, each token through its experts' SiLU-gated MLPs (`moe_intermediate_size`),
weighted and summed (Qwen3-VL-MoE's `model.Experts`), plus the shared expert (a SiLU-gated MLP of
`shared_expert_intermediate_size`) times sigmoid(`shared_expert_gate`(x)) (`model.SharedExpert`). The hub's files
hold one tensor per expert (`mlp.experts.{e}.gate_proj.weight` ...: transformers' qwen2_moe conversion), stacked at
load (`hybrid_weights._sparse`); fused ones load too. LoRA: the full-attention layers' q/k/v/o_proj only; an
adapter on the experts, the shared expert or its gate is refused at load by name (no layer has a dense MLP).
"""
from __future__ import annotations

from .qwen3_vl import Qwen3VL


class Qwen3_5(Qwen3VL):
    name = "qwen3_5"
    model_type = "qwen3_5"
    architectures = ("Qwen3_5ForConditionalGeneration",)
    model_class = "Qwen3_5ForConditionalGeneration"
    text_model_types = ("qwen3_5_text",)


QWEN3_5 = Qwen3_5()


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    model_type = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    model_class = "Qwen3_5MoeForConditionalGeneration"
    text_model_types = ("qwen3_5_moe_text",)


QWEN3_5_MOE = Qwen3_5Moe()
