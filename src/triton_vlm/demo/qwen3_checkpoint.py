"""Offline builder for tiny Qwen3-VL checkpoints (random weights), laid out as the hub's are.

`build_qwen3_vl(out_dir, shards=2)` saves what `transformers` saves for `Qwen3VLForConditionalGeneration` (the
hub's Qwen3-VL files hold the same transformers-5 names: `model.language_model.*`, `model.visual.*`, `lm_head`),
cut into `shards` safetensors files with their index:
- `config.json`: a Qwen3 text model with QK-norm and a `head_dim` other than hidden / heads, interleaved M-RoPE
  (`mrope_interleaved`, `mrope_section`); a vision tower with 16-px patches, temporal patches of 2, a 2x2 merger,
  learned position embeddings (a 4x4 grid, interpolated to every image), `gelu_pytorch_tanh` and DeepStack
  mergers after the blocks of `deepstack_visual_indexes`;
- the Qwen tokenizer and chat template of `qwen_checkpoint.py` (the same special tokens and prompt format);
- `preprocessor_config.json` of `Qwen2VLImageProcessor` with Qwen3-VL's patch 16 and mean / std 0.5, small
  `min_pixels` / `max_pixels` (4 to 64 placeholder tokens per image);
- `video_preprocessor_config.json` of `Qwen3VLVideoProcessor` (2 fps, 4 to 16 frames, all kept frames together
  between 8 and 192 units of 32x32 pixels: at most 96 placeholder tokens per video);
- `generation_config.json` with the eos ids.
`experts=4` builds Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`: layers 0 and 2 sparse, 2 of 4 experts per
token, layer 1 dense through `mlp_only_layers`). Weights are seeded and scaled so that every piece (QK-norm, the
position table, DeepStack, the M-RoPE axes, the experts' renormalisation) moves
the tokens; nothing touches the network.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from transformers import GenerationConfig

from .qwen_checkpoint import IMAGE_PAD, QWEN_VL_SPECIALS, VIDEO_PAD, VISION_END, VISION_START, qwen_tokenizer

PATCH, TEMPORAL, MERGE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64  # 4 .. 64 placeholder tokens per image
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 32 * 32 * 8, 32 * 32 * 192  # of all the kept frames together


def _config(tok, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
            max_pos: int, vision_hidden: int, vision_layers: int, vision_heads: int, deepstack: list[int],
            positions: int, mrope_section: list[int], experts: int = 0, top_k: int = 2,
            moe_intermediate: Optional[int] = None, dense_layers: tuple[int, ...] = (1,)):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig  # noqa: PLC0415

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                max_position_embeddings=max_pos, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": mrope_section,
                                 "mrope_interleaved": True})
    vision = dict(depth=vision_layers, hidden_size=vision_hidden, out_hidden_size=hidden, num_heads=vision_heads,
                  intermediate_size=2 * vision_hidden, patch_size=PATCH, temporal_patch_size=TEMPORAL,
                  spatial_merge_size=MERGE, in_channels=3, hidden_act="gelu_pytorch_tanh",
                  num_position_embeddings=positions, deepstack_visual_indexes=deepstack)
    if experts:  # layer 1 dense (mlp_only_layers), the others sparse: 2 of `experts` per token
        text |= dict(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=moe_intermediate or 3 * hidden // 4,  # != H, H / 2
                     decoder_sparse_step=1, mlp_only_layers=list(dense_layers))
    return (Qwen3VLMoeConfig if experts else Qwen3VLConfig)(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                         video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                         vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)


def build_qwen3_vl_model(*, seed: int = 0, text_hidden: int = 64, layers: int = 3, heads: int = 4,
                         kv_heads: int = 2, head_dim: int = 24, intermediate: int = 128,
                         max_position_embeddings: int = 1024, vision_hidden: int = 32, vision_layers: int = 3,
                         vision_heads: int = 2, deepstack: Optional[list[int]] = None, positions: int = 16,
                         mrope_section: Optional[list[int]] = None, experts: int = 0, top_k: int = 2,
                         moe_intermediate: Optional[int] = None, dense_layers: tuple[int, ...] = (1,)):
    """(model, tokenizer) of a random Qwen3-VL (see the module doc); `experts` > 0: Qwen3-VL-MoE (`top_k` experts
    per token of `moe_intermediate` each, `dense_layers` with the plain MLP)."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration  # noqa: PLC0415

    tok = qwen_tokenizer()
    half = head_dim // 2
    section = mrope_section or [half - 2 * (half // 3), half // 3, half // 3]
    config = _config(tok, hidden=text_hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     intermediate=intermediate, max_pos=max_position_embeddings, vision_hidden=vision_hidden,
                     vision_layers=vision_layers, vision_heads=vision_heads,
                     deepstack=[0, 1] if deepstack is None else deepstack, positions=positions, mrope_section=section,
                     experts=experts, top_k=top_k, moe_intermediate=moe_intermediate, dense_layers=dense_layers)
    torch.manual_seed(seed)
    model = (Qwen3VLMoeForConditionalGeneration if experts else Qwen3VLForConditionalGeneration)(config).eval()
    with torch.no_grad():  # a livelier model than the init: the tests must see every piece
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif "visual" in name and (p.dim() >= 2 or "pos_embed" in name):
                p.normal_(0.0, 0.1 if "pos_embed" not in name else 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: positions (M-RoPE) matter
                p.normal_(0.0, 0.25)
            elif name == "lm_head.weight":  # spread logits: near-ties would make fp ulps decide tokens
                p.normal_(0.0, 0.4)
            elif ".experts." in name or name.endswith("mlp.gate.weight"):  # distinct experts, a decisive router
                p.normal_(0.0, 0.05 if "gate.weight" in name else 0.2)  # flat router: renormalising matters
    return model, tok


def image_processor_config() -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL, "merge_size": MERGE, "processor_class": "Qwen3VLProcessor"}


def video_processor_config() -> dict:
    return {"video_processor_type": "Qwen3VLVideoProcessor", "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_sample_frames": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4, "max_frames": 16,
            "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}, "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL, "merge_size": MERGE, "cap_pixels_per_frame": False,
            "processor_class": "Qwen3VLProcessor"}


def build_qwen3_vl(out_dir: str | Path, shards: int = 2, **kw) -> Path:
    """Build and save a hub-layout checkpoint directory (see the module doc); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = build_qwen3_vl_model(**kw)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=16)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=max(1, size // shards + 1))  # the hub's sharded layout + index
    if kw.get("experts"):
        _hub_experts(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor_config(), indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(), indent=2))
    return out


def _hub_experts(out: Path) -> None:
    """The fused experts as the hub's Qwen3-VL-MoE files hold them: gate_up [E, hidden, 2 I], down [E, I, hidden]
    (transformers' `save_pretrained` writes its in-memory [E, 2 I, hidden]; its loader transposes either back)."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    for shard in sorted(out.glob("model*.safetensors")):
        tensors = load_file(str(shard))
        if any(".mlp.experts." in k for k in tensors):
            tensors = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}
            save_file(tensors, str(shard), metadata={"format": "pt"})
