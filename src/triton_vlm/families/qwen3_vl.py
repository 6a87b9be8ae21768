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
added after decoder layers 0 .. levels - 1 at the media positions).

Videos (`Qwen3VLVideoProcessor`, `Qwen3VLProcessor`), all known from the container's header (`video_plan`):
- sampling: int(frames / rate x fps) frames, clamped to [min_frames, max_frames] and to the file's frames, at
  `linspace(0, frames - 1, n).round()` (not floored to whole temporal patches: a last odd frame is repeated);
- size: the video `smart_resize` of (n, H, W): the area of all n frames together (t_bar x h x w) between the video
  processor's `size.shortest_edge` and `size.longest_edge` (optionally `cap_pixels_per_frame`), sides multiples of
  32; one video fewer than 2 sampled frames is refused as transformers refuses it;
- prompt (`video_text`): the `<|video_pad|>` of `<|vision_start|><|video_pad|><|vision_end|>` becomes, for each
  temporal patch, `<{t:.1f} seconds>` (the mean time of its frames, frame index / rate) then
  `<|vision_start|>` + its h*w/4 `<|video_pad|>` + `<|vision_end|>`;
- positions (`PositionRule.video_frames`): `get_rope_index` splits a video of grid (t, h, w) into t grids
  (1, h, w), each placed like an image at the text position where its run starts (the timestamps, not absolute
  time positions, say when a frame is);
- the tower takes the video's patches as Qwen2.5-VL's (`[t*h*w, 3 * 2 * 16 * 16]`, attention inside each temporal
  patch, the position table tiled over t).

MoE: the same with sparse layers (the engine reads `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
`decoder_sparse_step`, `mlp_only_layers` from the text config: `spec.TextSpec`; the experts' fused tensors in either
layout transformers loads). LoRA is served on the attention projections and the dense layers' MLP; an adapter on
the experts is refused at load by name.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..spec import CheckpointSpec
from .base import Size, TextRules, VideoPlan
from .qwen2_vl import VIDEO_PAD, VISION_END, VISION_START, Qwen2VL

# `Qwen3VLVideoProcessor`'s class defaults (a checkpoint's `video_preprocessor_config.json` overrides them)
VIDEO_DEFAULTS = {"fps": 2.0, "min_frames": 4, "max_frames": 768, "min_pixels": 128 * 32 * 32,
                  "max_pixels": 32 * 32 * 768, "patch": 16, "temporal": 2, "merge": 2, "mean": (0.5, 0.5, 0.5),
                  "std": (0.5, 0.5, 0.5), "cap_pixels_per_frame": False, "max_video_tokens": 768}


def sample_indices(total: int, fps: float, cfg: Any) -> list[int]:
    """`Qwen3VLVideoProcessor.sample_frames` with the container's rate: the indices of the frames kept."""
    import numpy as np  # noqa: PLC0415

    n = int(total / fps * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def frame_size(cfg: Any, n: int, size: Size) -> Size:
    """(height, width) the n kept frames are resized to (`Qwen3VLVideoProcessor.resize`); ValueError as transformers
    raises it (fewer frames than a temporal patch, an aspect ratio past 200:1)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize  # noqa: PLC0415

    factor, max_pixels = cfg.patch * cfg.merge, cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        per = max(min(cfg.max_video_tokens * factor * factor, cfg.max_pixels // n), int(cfg.min_pixels * 1.05))
        max_pixels = per * n
    return smart_resize(n, int(size[0]), int(size[1]), temporal_factor=cfg.temporal, factor=factor,
                        min_pixels=cfg.min_pixels, max_pixels=max_pixels)


def timestamps(keep: list[int], fps: float, temporal: int) -> tuple[float, ...]:
    """`Qwen3VLProcessor._calculate_timestamps`: each temporal patch's mean time of its first and last frame."""
    idx = keep + keep[-1:] * (-len(keep) % temporal)
    secs = [i / fps for i in idx]
    return tuple((secs[i] + secs[i + temporal - 1]) / 2 for i in range(0, len(secs), temporal))


def video_plan(cfg: Any, size: Size, total: int, fps: float) -> VideoPlan:
    keep = sample_indices(total, fps, cfg)
    if not keep:
        raise ValueError(f"{total} frames at {fps:g} fps give no sample")
    h, w = frame_size(cfg, len(keep), size)
    grid = (math.ceil(len(keep) / cfg.temporal), h // cfg.patch, w // cfg.patch)
    rows = grid[0] * grid[1] * grid[2]
    return VideoPlan(tuple(keep), (h, w), grid, rows // (cfg.merge * cfg.merge),
                     rows * 3 * cfg.temporal * cfg.patch * cfg.patch * 4, timestamps(keep, fps, cfg.temporal))


class Qwen3VL(Qwen2VL):
    name = "qwen3_vl"
    model_type = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    model_class = "Qwen3VLForConditionalGeneration"
    text_model_types = ("qwen3_vl_text",)
    weight_renames = ()  # the hub's files hold the transformers-5 names
    video_defaults = VIDEO_DEFAULTS

    def video_plan(self, cfg: Any, size: Size, frames: int, fps: float) -> VideoPlan:
        return video_plan(cfg, size, frames, fps)

    def video_text(self, plan: VideoPlan) -> str:
        per = plan.tokens // plan.grid[0]
        return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * per}{VISION_END}" for t in plan.timestamps)

    def text_rules(self, spec: CheckpointSpec) -> TextRules:
        levels = len(getattr(spec.hf_config.vision_config, "deepstack_visual_indexes", None) or ())
        rules = super().text_rules(spec)
        position = rules.position and dataclasses.replace(rules.position, video_frames=True)
        return dataclasses.replace(rules, deepstack_levels=levels, position=position)


QWEN3_VL = Qwen3VL()


class Qwen3VLMoe(Qwen3VL):
    name = "qwen3_vl_moe"
    model_type = "qwen3_vl_moe"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    model_class = "Qwen3VLMoeForConditionalGeneration"
    text_model_types = ("qwen3_vl_moe_text",)


QWEN3_VL_MOE = Qwen3VLMoe()
