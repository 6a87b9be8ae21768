"""Every config.json field that changes the math is implemented exactly or refused at load, never ignored.

`check_fields(top)` runs where the checkpoint is read (`spec.CheckpointSpec.load`), on the parsed transformers
config: its top config, its `text_config` and its `vision_config` (one scope each). Each field the transformers
config classes of the served families define (`tests/test_checkpoint_fields.py` walks them all) is in exactly one
of a scope's tables:
- `HARMLESS`: no effect on the tokens served (metadata, training-only settings, the storage dtype: the engine
  computes in its own dtype);
- `IMPLEMENTED`: read and applied by the engine (the place is named), or run by transformers' own module;
- `CHECKED`: implemented only for some values; any other value is refused naming the field, its value and what
  is supported.
Fields other families use to change the math (soft caps, ...) are refused when a served config carries them
(`FOREIGN`), and a field of the installed transformers' config class that no table names (a newer transformers)
is refused unless it has the class's default value. `quantization_config` is the quantization module's
(`quant.config`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable



class Unservable(ValueError):
    """A checkpoint config the engine would serve inexactly; `spec.CheckpointSpec.load` raises it as its
    `CheckpointError` (this module and `quant` import nothing of the package's, so `spec` can import them)."""

# metadata and training-only settings, in every scope
COMMON_HARMLESS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "problem_type", "is_encoder_decoder", "output_attentions", "output_hidden_states", "return_dict",
    "transformers_version", "use_cache", "initializer_range", "initializer_factor", "attention_dropout",
    "model_type", "bos_token_id", "pad_token_id", "tokenizer_class", "num_labels", "finetuning_task",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "is_decoder",
    "_attn_implementation_autoset", "use_return_dict", "output_scores", "torchscript", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "base_model_tp_plan", "base_model_pp_plan",
})

Check = tuple[Callable[[Any], bool], str]  # (value accepted?, what is supported)

TEXT_HARMLESS = COMMON_HARMLESS | {
    "pretraining_tp",  # transformers 5's Llama no longer reads it: one matmul per projection, as the engine
    "output_router_logits", "router_aux_loss_coef",  # MoE training losses: no effect on the tokens
}
TEXT_IMPLEMENTED = {
    "vocab_size": "spec.TextSpec", "hidden_size": "spec.TextSpec", "intermediate_size": "spec.TextSpec",
    "num_hidden_layers": "spec.TextSpec", "num_attention_heads": "spec.TextSpec",
    "num_key_value_heads": "spec.TextSpec (GQA)", "head_dim": "spec.TextSpec", "rms_norm_eps": "RMSNorm",
    "max_position_embeddings": "the context length", "eos_token_id": "spec.eos_ids",
    "rope_parameters": "spec._rope (default, linear, llama3; M-RoPE sections)", "rope_scaling": "spec._rope",
    "rope_theta": "spec._rope", "tie_word_embeddings": "weights._lm_head",
    "attention_bias": "q/k/v/o biases as the checkpoint holds them", "mlp_bias": "MLP biases as held",
    "sliding_window": "spec._layer_windows", "use_sliding_window": "spec._layer_windows (Qwen2's sliding_window)",
    "max_window_layers": "spec._layer_windows (Qwen2: through layer_types)",
    "quantization_config": "quant.config (a plain text model's config)",
    # Qwen3-VL-MoE's sparse layers (engine/model: router softmax, top-k renormalised, experts grouped by expert)
    "num_experts": "spec._moe", "num_local_experts": "spec._moe (transformers' name behind num_experts)",
    "num_experts_per_tok": "spec._moe", "moe_intermediate_size": "spec._moe",
    "decoder_sparse_step": "spec._moe (Qwen3.5-MoE: every layer sparse whatever it says, as transformers)",
    "mlp_only_layers": "spec._moe (Qwen3.5-MoE: every layer sparse whatever it says, as transformers)",
    "shared_expert_intermediate_size": "spec._moe (Qwen3.5-MoE's shared expert, engine/model/model.SharedExpert)",
    # Qwen3.5's Gated DeltaNet layers (engine/model/deltanet.py through spec._hybrid)
    "linear_conv_kernel_dim": "spec._hybrid (the conv window)", "linear_key_head_dim": "spec._hybrid",
    "linear_value_head_dim": "spec._hybrid", "linear_num_key_heads": "spec._hybrid",
    "linear_num_value_heads": "spec._hybrid",
}
TEXT_CHECKED: dict[str, Check] = {
    "hidden_act": (lambda v: v in (None, "silu"), "'silu'"),
    "layer_types": (lambda v: v is None or set(v) <= {"full_attention", "sliding_attention", "linear_attention"},
                    "'full_attention', 'sliding_attention' and (hybrid models: spec._hybrid) 'linear_attention' "
                    "layers"),
}

TOP_HARMLESS = COMMON_HARMLESS | {
    "image_seq_length",  # the processor's count; the engine's is the family layout's (checked against it)
    "vision_start_token_id", "vision_end_token_id",  # prompt text the processor writes; no math
}
TOP_IMPLEMENTED = {
    "text_config": "this table's text scope", "vision_config": "this table's vision scope",
    "image_token_index": "spec.image_token_id", "image_token_id": "spec.image_token_id",
    "video_token_id": "spec.TextSpec.video_token_id", "tie_word_embeddings": "weights._lm_head",
    "vision_feature_layer": "vision.encoder (one layer or several concatenated)",
    "image_grid_pinpoints": "families.llava_next.AnyResLayout",
    "multimodal_projector_bias": "transformers' LlavaMultiModalProjector", "projector_hidden_act":
        "transformers' LlavaMultiModalProjector",
    "quantization_config": "quant.config",
}
TOP_CHECKED: dict[str, Check] = {
    "vision_feature_select_strategy": (lambda v: v in (None, "default", "full"), "'default' or 'full'"),
}

# CLIP / SigLIP towers run as transformers' own modules (AutoModel from vision_config): every field they define is
# theirs; the Qwen2-VL / Qwen2.5-VL tower is ours (vision/qwen_tower.py), field by field
VISION_HARMLESS = COMMON_HARMLESS | {"projection_dim", "vision_use_head"}  # CLIP's projection, SigLIP's pooling
VISION_IMPLEMENTED = {
    "hidden_size": "the tower", "intermediate_size": "the tower", "num_hidden_layers": "the tower",
    "num_attention_heads": "the tower", "num_channels": "the tower", "image_size": "spec.VisionSpec",
    "patch_size": "the tower", "layer_norm_eps": "the tower", "hidden_act": "the tower (transformers' ACT2FN)",
    "depth": "qwen_tower", "embed_dim": "qwen_tower", "in_channels": "qwen_tower", "in_chans": "qwen_tower",
    "mlp_ratio": "qwen_tower", "num_heads": "qwen_tower", "spatial_merge_size": "qwen_tower",
    "temporal_patch_size": "qwen_tower", "out_hidden_size": "qwen_tower", "window_size": "qwen_tower",
    "fullatt_block_indexes": "qwen_tower", "tokens_per_second": "engine.model.mrope (video time positions)",
    # Qwen3-VL's tower (vision/qwen_tower.py, kind qwen3_vl): DeepStack mergers, learned position table
    "deepstack_visual_indexes": "the Qwen3-VL tower", "num_position_embeddings": "the Qwen3-VL tower",
}
VISION_CHECKED: dict[str, Check] = {
    "rope_parameters": (lambda v: (v or {}).get("rope_type", "axial") in ("axial", "default"),
                        "rope_type 'axial' (the Qwen towers' 2-D rope; it reads rope_theta)"),
}

# fields with which other families change the math; a served family's config that carries them is refused
# (field -> the values that leave the math as the served families compute it)
FOREIGN: dict[str, tuple] = {
    "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,), "logits_scaling": (None, 1, 1.0),
    "logit_scale": (None, 1, 1.0), "embedding_multiplier": (None, 1, 1.0), "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,), "query_pre_attn_scalar": (None,), "qk_layernorm": (None, False),
    "use_qk_norm": (None, False), "partial_rotary_factor": (None, 1, 1.0), "rope_interleaved": (None, False),
    "no_rope_layers": (None,), "attention_chunk_size": (None,), "use_bidirectional_attention": (None, False),
}

SCOPES: dict[str, tuple[frozenset, dict, dict]] = {
    "text": (TEXT_HARMLESS, TEXT_IMPLEMENTED, TEXT_CHECKED),
    "top": (TOP_HARMLESS, TOP_IMPLEMENTED, TOP_CHECKED),
    "vision": (VISION_HARMLESS, VISION_IMPLEMENTED, VISION_CHECKED),
}


def classified(scope: str) -> set[str]:
    harmless, implemented, checked = SCOPES[scope]
    return set(harmless) | set(implemented) | set(checked)


def check_fields(top: Any) -> None:
    """Refuse (`Unservable`) a config field the engine would otherwise ignore (see the module docstring)."""
    text = getattr(top, "text_config", None)
    vision = getattr(top, "vision_config", None)
    _check_scope("text" if text is None else "top", top, "config.json")
    if text is not None:
        _check_scope("text", text, "config.json text_config")
    if vision is not None:
        _check_scope("vision", vision, "config.json vision_config")


def _check_scope(scope: str, cfg: Any, where: str) -> None:
    _, _, checked = SCOPES[scope]
    for name, (ok, supported) in checked.items():
        value = getattr(cfg, name, None)
        if not ok(value):
            raise Unservable(f"{where}: {name} = {value!r} is not supported; supported: {supported}")
    for name, neutral in FOREIGN.items():
        value = getattr(cfg, name, None)
        if value not in neutral:
            raise Unservable(f"{where}: {name} = {value!r} changes the math and is not implemented for "
                             f"model_type {getattr(cfg, 'model_type', None)!r}, so the checkpoint is "
                             "refused")
    known = classified(scope)
    for f in _class_fields(type(cfg)):
        if f.name in known or f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        value = getattr(cfg, f.name, default)
        if value != default:
            raise Unservable(f"{where}: {f.name} = {value!r} is a field this engine does not know "
                             f"(transformers' {type(cfg).__name__} defines it, default {default!r}); "
                             "it may change the math, so the checkpoint is refused")


def _class_fields(cls: type) -> tuple:
    return dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
