"""Offline builder for tiny Qwen3.5 checkpoints (random weights), laid out as the hub's are.

`build_qwen3_5(out_dir, shards=2)` saves what `transformers` saves for `Qwen3_5ForConditionalGeneration` (the hub's
Qwen3.5 files hold the transformers-5 names: `model.language_model.*`, `model.visual.*`, `lm_head`), cut into
`shards` safetensors files with their index:
- `config.json`: a hybrid text model, `layer_types` 3 `linear_attention` (Gated DeltaNet: 2 key heads, 4 value
  heads, a conv window of 4) to 1 `full_attention` (gated, QK-norm, head_dim 32 with partial rotary 0.25: 8 rotary
  values, interleaved M-RoPE sections [2, 1, 1]); Qwen3-VL's vision tower (16-px patches, temporal 2, 2x2 merge,
  learned positions on a 4x4 grid, no DeepStack);
- the Qwen tokenizer and chat template of `qwen_checkpoint.py`, `preprocessor_config.json` of
  `Qwen2VLImageProcessor` (`qwen3_checkpoint.image_processor_config`: 4 to 64 placeholder tokens per image) and
  `video_preprocessor_config.json` of `Qwen3VLVideoProcessor` (Qwen3-VL's: the processor writes each temporal
  patch's timestamp);
- `generation_config.json` with the eos ids.
`experts=4` builds Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`): every layer sparse (its config has no dense
layers), `top_k` of `experts` routed experts of width 32 per token plus a shared expert of width 48 with its sigmoid
gate; transformers' `save_pretrained` writes the experts one tensor per expert, as the hub's files hold them.
Weights are seeded and scaled so that every piece moves the tokens (the linear layers' decay and gates, the
attention gate, the zero-centred norms); nothing touches the network.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig

from .qwen3_checkpoint import MERGE, PATCH, TEMPORAL, image_processor_config, video_processor_config
from .qwen_checkpoint import IMAGE_PAD, QWEN_VL_SPECIALS, VIDEO_PAD, VISION_END, VISION_START, qwen_tokenizer


def _config(tok, *, hidden: int, layers: int, max_pos: int, experts: int = 0, top_k: int = 2):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig  # noqa: PLC0415

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25})
    if experts:
        del text["intermediate_size"]
        text |= dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48)
    vision = dict(depth=2, hidden_size=32, out_hidden_size=hidden, num_heads=2, intermediate_size=64,
                  patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3,
                  hidden_act="gelu_pytorch_tanh", num_position_embeddings=16)
    return (Qwen3_5MoeConfig if experts else Qwen3_5Config)(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)


def build_qwen3_5_model(*, seed: int = 0, hidden: int = 64, layers: int = 4, max_position_embeddings: int = 1024,
                        experts: int = 0, top_k: int = 2):
    """(model, tokenizer) of a random Qwen3.5 (see the module doc); `experts` > 0: Qwen3.5-MoE."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration  # noqa: PLC0415

    tok = qwen_tokenizer()
    torch.manual_seed(seed)
    cls = Qwen3_5MoeForConditionalGeneration if experts else Qwen3_5ForConditionalGeneration
    model = cls(_config(tok, hidden=hidden, layers=layers, max_pos=max_position_embeddings, experts=experts,
                        top_k=top_k)).eval()
    with torch.no_grad():  # a livelier model than the init: the tests must see every piece
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith("norm.weight") and "language_model" in name:  # zero-centred: 1 + w
                p.uniform_(-0.5, 0.5)
            elif "visual" in name and (p.dim() >= 2 or "pos_embed" in name):
                p.normal_(0.0, (0.3 if "merger" in name else 0.1) if "pos_embed" not in name else 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "in_proj_qkv.weight")):
                p.normal_(0.0, 0.25)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "in_proj_z.weight", "conv1d.weight")):
                p.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":  # spread logits: near-ties would make fp ulps decide tokens
                p.normal_(0.0, 0.4)
            elif ".mlp.experts." in name or ".shared_expert." in name:  # distinct experts, a shared one that counts
                p.normal_(0.0, 0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # a flat router; gates that vary
                p.normal_(0.0, 0.05 if name.endswith("mlp.gate.weight") else 0.3)
    return model, tok


def build_qwen3_5(out_dir: str | Path, shards: int = 2, **kw) -> Path:
    """Build and save a hub-layout checkpoint directory (see the module doc); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = build_qwen3_5_model(**kw)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=16)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=max(1, size // shards + 1))  # the hub's sharded layout + index
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor_config(), indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(), indent=2))
    return out
