"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): native
resolution, 14-px patches, a 2x2 merger, M-RoPE.

Image processing (the checkpoint's `Qwen2VLImageProcessor`, PIL backend; its pixels are used as they are): the image
is resized to `smart_resize(H, W)` (both sides multiples of patch x merge = 28, the area between `min_pixels` and
`max_pixels`, aspect ratios past 200:1 refused), then cut into 14x14 patches, each repeated twice in time
(`temporal_patch_size` 2), in the merger's order. The processor's rows `[patches, 3 * 2 * 14 * 14]` travel between
the ensemble's steps as `pixel_values` `[patches, 3, 28, 14]` (the same bytes: channel, time x row, column), one
"tile" per patch, so the tiles of an image are its grid_h x grid_w patches (`PatchLayout.tiles`), and its
placeholder tokens (`<|image_pad|>`) are that count / merge_size^2 (`PatchLayout.tokens`). An image's grid follows
from its size, so `image_sizes` is all the vision and llm models need (`PatchLayout.grid`).

Prompt: each image is `<|vision_start|><|image_pad|><|vision_end|>` as the checkpoint's processor and chat template
write it; that text in `text_input` is an image marker (paired with `images` in order), and `<image>` and inline
`<img src=...>` map to the same.

Vision graph: the whole tower and merger (`vision/qwen_tower.py`), run on every patch of a batch of images with
attention kept inside each image (and for Qwen2.5-VL inside each window).

Text model: Qwen2 with M-RoPE (`mrope_section`, 3-D positions for image tokens; `engine/model/mrope.py`).

Videos (`Qwen2VLVideoProcessor`): the frames `sample_indices` keeps, each resized to `smart_resize` of the frame size
under the video processor's min / max pixels, in pairs (`temporal_patch_size`): `video_plan` gives that grid and
its tokens from the container's header, before a frame is decoded (`preprocess/videos.py` decodes and patches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import InvalidArgument
from ..spec import CheckpointError, CheckpointSpec, read_json
from .base import Family, PositionRule, Renames, Size, TextRules, VideoPlan

MAX_RATIO = 200  # transformers' smart_resize refuses aspect ratios past this
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
# transformers' "Qwen2VLForConditionalGeneration" conversion mapping (Qwen2.5-VL shares it): the hub's `visual.*`
# and `model.*` (its text model) -> `model.visual.*`, `model.language_model.*`; `lm_head` stays
QWEN_VL_RENAMES: Renames = (
    (r"^visual\.", "model.visual."),
    (r"^model\.(?!(language_model|visual)\.)", "model.language_model."),
)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Size:
    """transformers' `smart_resize` (Qwen2-VL's image processor); an aspect ratio past 200:1 is InvalidArgument."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf  # noqa: PLC0415

    if min(height, width) <= 0 or max(height, width) / min(height, width) > MAX_RATIO:
        ratio = max(height, width) / max(1, min(height, width))
        raise InvalidArgument(f"image of {height}x{width} pixels (height x width) has an aspect ratio of "
                              f"{ratio:g}:1; at most {MAX_RATIO}:1 is allowed (the checkpoint's image processor "
                              "refuses it)")
    return hf(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def sample_indices(total: int, fps: float, cfg: Any) -> list[int]:
    """`Qwen2VLVideoProcessor.sample_frames` with `fps`: the indices of the frames kept (total / fps x cfg.fps
    frames, clamped to [min_frames, max_frames] and to the file's frames, floored to whole temporal patches, taken at
    `arange(0, total, total / n)`); ValueError when that leaves none."""
    import torch  # noqa: PLC0415

    max_frames = math.floor(min(cfg.max_frames, total) / cfg.temporal) * cfg.temporal
    n = total / fps * cfg.fps
    n = min(max(n, cfg.min_frames), max_frames, total)
    n = math.floor(n / cfg.temporal) * cfg.temporal
    if n <= 0:
        raise ValueError(f"{total} frames at {fps:g} fps give no sample of {cfg.temporal} frames")
    return torch.arange(0, total, total / n).int().tolist()


def video_plan(cfg: Any, size: Size, total: int, fps: float) -> VideoPlan:
    """A video's cost from its header: kept frames, resized size, grid (t, h, w) and tokens (`Family.video_plan`)."""
    keep = sample_indices(total, fps, cfg)
    h, w = smart_resize(int(size[0]), int(size[1]), cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels)
    grid = (-(-len(keep) // cfg.temporal), h // cfg.patch, w // cfg.patch)  # a last odd frame is repeated
    rows = grid[0] * grid[1] * grid[2]
    return VideoPlan(tuple(keep), (h, w), grid, rows // (cfg.merge * cfg.merge),
                     rows * 3 * cfg.temporal * cfg.patch * cfg.patch * 4)


@dataclass(frozen=True)
class PatchLayout:
    """Native-resolution patches (Qwen2-VL): an image of (H, W) takes grid (1, h, w) patches and h*w/merge^2
    tokens, where (h, w) = smart_resize(H, W) / patch."""

    patch: int
    temporal: int
    merge: int
    min_pixels: int
    max_pixels: int
    strategy: str = "full"
    whole_images = True  # the tower takes whole images (`vision/qwen_backends.py`), grid from the size

    @property
    def fixed(self) -> bool:
        return False

    @property
    def tile_hw(self) -> Size:
        """One `pixel_values` row: [3, temporal * patch, patch]."""
        return (self.temporal * self.patch, self.patch)

    def grid(self, size: Size) -> tuple[int, int, int]:
        h, w = smart_resize(int(size[0]), int(size[1]), self.patch * self.merge, self.min_pixels, self.max_pixels)
        return (1, h // self.patch, w // self.patch)

    def tiles(self, size: Size) -> int:
        t, h, w = self.grid(size)
        return t * h * w

    def tokens(self, size: Size) -> int:
        return self.tiles(size) // (self.merge * self.merge)

    @property
    def largest_image(self) -> Size:
        """A square image at max_pixels (the most patches smart_resize gives)."""
        side = int(self.max_pixels ** 0.5)
        return (side, side)

    @property
    def max_tokens(self) -> int:
        # smart_resize keeps h*w <= max_pixels, except that a side never goes below one unit f: an image at the
        # largest aspect ratio (200:1) scaled down keeps a side of f and the other up to sqrt(200 * max_pixels)
        f = self.patch * self.merge
        return max(self.tokens(self.largest_image), self.max_pixels // (f * f),
                   math.isqrt(MAX_RATIO * self.max_pixels) // f)

    @property
    def max_tiles(self) -> int:
        return self.max_tokens * self.merge * self.merge

    @property
    def tile(self) -> int:  # the square tile of the fixed-size families; Qwen's rows are `tile_hw`
        return self.patch


class Qwen2VL(Family):
    name = "qwen2_vl"
    model_type = "qwen2_vl"
    architectures = ("Qwen2VLForConditionalGeneration",)
    model_class = "Qwen2VLForConditionalGeneration"
    weight_prefixes = {"tower": ("model.visual.",)}
    image_token = IMAGE_PAD
    image_markers = (VISION_START + IMAGE_PAD + VISION_END,)  # the checkpoint's own format, kept as a marker
    image_start, image_end = VISION_START, VISION_END
    mrope = True
    whole_images = True
    video_token = VIDEO_PAD
    video_markers = (VISION_START + VIDEO_PAD + VISION_END,)
    text_model_types = ("qwen2_vl_text",)
    weight_renames = QWEN_VL_RENAMES

    def layout(self, spec: CheckpointSpec, extra_tokens: Optional[int] = None) -> PatchLayout:
        v = spec.hf_config.vision_config
        proc = read_json(spec.model_dir / "preprocessor_config.json")
        size = proc.get("size") or {}
        lo = proc.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or DEFAULT_MIN_PIXELS
        hi = proc.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or DEFAULT_MAX_PIXELS
        merge = int(proc.get("merge_size") or v.spatial_merge_size)
        layout = PatchLayout(int(v.patch_size), int(v.temporal_patch_size), merge, int(lo), int(hi))
        if merge != int(v.spatial_merge_size) or int(proc.get("patch_size") or v.patch_size) != layout.patch:
            raise CheckpointError(f"{spec.model_dir}: preprocessor_config.json's patch_size / merge_size "
                                  f"({proc.get('patch_size')}, {proc.get('merge_size')}) differ from the vision "
                                  f"tower's ({v.patch_size}, {v.spatial_merge_size})")
        if not 0 < layout.min_pixels <= layout.max_pixels:
            raise CheckpointError(f"{spec.model_dir}: min_pixels {lo} / max_pixels {hi} are not an interval")
        return layout

    def check_processor(self, layout: PatchLayout, image_processor: Any) -> None:
        """The processor's grids for two probe images are the layout's (so the token counts agree)."""
        import numpy as np  # noqa: PLC0415
        from PIL import Image  # noqa: PLC0415

        for width, height in ((100, 60), (60, 300)):
            out = image_processor([Image.new("RGB", (width, height), (128, 64, 32))], return_tensors="np")
            grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
            rows = np.asarray(out["pixel_values"]).shape
            if grid != layout.grid((height, width)) or rows != (layout.tiles((height, width)),
                                                                3 * layout.tile_hw[0] * layout.tile_hw[1]):
                raise CheckpointError(f"the image processor gives grid {grid} (pixel_values {rows}) for a "
                                      f"{height}x{width} image; the checkpoint's config gives "
                                      f"{layout.grid((height, width))}")

    def video_plan(self, cfg: Any, size: Size, frames: int, fps: float) -> VideoPlan:
        return video_plan(cfg, size, frames, fps)

    def projector(self, config: Any):
        raise CheckpointError("qwen2_vl has no separate projector: the merger is part of the vision tower")

    def text_config(self, config: Any) -> Any:
        return config.text_config

    def text_rules(self, spec: CheckpointSpec) -> TextRules:
        """M-RoPE: the token ids, the merge size, (Qwen2.5-VL) the video's tokens per second, the sections."""
        cfg, text = spec.hf_config, spec.text
        if not text.mrope_section:
            return TextRules()
        rule = PositionRule(text.mrope_section, int(cfg.image_token_id), int(cfg.video_token_id),
                            int(cfg.vision_config.spatial_merge_size),
                            getattr(cfg.vision_config, "tokens_per_second", None), text.max_position_embeddings,
                            text.mrope_interleaved)
        return TextRules(position=rule, grid_of=self.layout(spec).grid)


class Qwen25VL(Qwen2VL):
    name = "qwen2_5_vl"
    model_type = "qwen2_5_vl"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    model_class = "Qwen2_5_VLForConditionalGeneration"
    text_model_types = ("qwen2_5_vl_text",)


QWEN2_VL = Qwen2VL()
QWEN2_5_VL = Qwen25VL()
