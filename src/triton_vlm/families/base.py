"""The interface every model family implements, and the image layout of the fixed-size families.

A family is what `transformers` calls one `*ForConditionalGeneration` class (LLaVA, LLaVA-NeXT, ...). It says
everything that family does differently, and the stages ask it instead of branching on model names:

- **recognise its checkpoint**: `matches(config.json)` by `architectures`, then `model_type`;
- **image processing and tokens per image**: `layout(spec)` -> an `ImageLayout` (how an image of (H, W)
  pixels becomes tower tiles and placeholder tokens), `check_processor(layout, processor)` (the checkpoint's own
  image processor produces what the layout says; its pixels are used as they are);
- **vision graph**: the tower comes from the checkpoint's `vision_config` (`AutoModel`), `projector(config)` is
  the family's projector, `packer(spec, weights)` the post-processing from the tiles' projected features to
  the features of one image (LLaVA-NeXT: grid, unpad, row separators; LLaVA: none), and `weight_prefixes` where
  their tensors live in the checkpoint;
- **text model**: `text_config(config)`, `text_model_types` (the nested text configs it serves); the text models
  themselves (Llama, Mistral, Qwen2) are shared by the families: `spec.TextSpec` and `engine/`. What the engine
  does differently for a family arrives as data, `text_rules(spec)` -> `TextRules` (its M-RoPE `PositionRule`,
  DeepStack levels), never by the family's name;
- **checkpoint layout**: `weight_renames`, transformers' conversion-mapping rules from the layouts its checkpoints
  are saved in to the transformers-5 names (`weight_source.TensorSource` asks `families.family_for_config`);
- **videos** (families with a `video_token`): `video_plan(cfg, size, frames, fps)` -> a `VideoPlan`, the frames
  sampling keeps, their resized size, the patch grid and the tokens, computed from the container's header before
  any frame is decoded, so preprocess bounds a request's media cost before paying it; `video_defaults` (the video
  processor class's defaults under the checkpoint's `video_preprocessor_config.json`) and `video_text(plan)` (what
  the processor writes for the video's placeholder: Qwen3-VL's timestamps between the temporal patches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ..spec import CheckpointError, CheckpointSpec, image_token_count

Size = tuple[int, int]  # (height, width) in pixels
Renames = tuple[tuple[str, str], ...]  # (pattern, replacement) applied in turn to each checkpoint key
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")  # the text configs a LLaVA-style family nests


@dataclass(frozen=True)
class PositionRule:
    """M-RoPE (transformers' `get_rope_index`), as data for the engine (`engine/model/mrope.py`): which ids take
    3-D positions, the merge of the grids, how the rotary frequencies split between the axes."""

    section: tuple[int, ...]  # [3] frequencies per axis (time, height, width), summing to head_dim / 2
    image_token_id: int
    video_token_id: int
    merge: int  # spatial merge size (2x2 patches -> one token)
    tokens_per_second: Optional[float] = None  # Qwen2.5-VL: video time positions per second
    max_position: int = 1 << 30  # positions must stay inside the rotary tables (the context length)
    interleaved: bool = False  # frequencies assigned T, H, W, T, H, W... (Qwen3-VL) instead of in blocks
    # each temporal patch of a video is a run of placeholders of its own (text timestamps between them), placed
    # like an image of grid (1, h, w) (Qwen3-VL: `get_rope_index` splits `video_grid_thw` by its t)
    video_frames: bool = False


@dataclass(frozen=True)
class TextRules:
    """What the engine does differently for a family's text model, as data."""

    position: Optional[PositionRule] = None  # M-RoPE; None: 1-D positions
    grid_of: Any = None  # (height, width) -> (t, h, w) patches of an image (the family's layout), with M-RoPE
    deepstack_levels: int = 0  # extra features per media token added after the first decoder layers


@dataclass(frozen=True)
class ImageLayout:
    """One tile per image at the tower's size, the same tokens for every image (llava-1.5)."""

    tile: int  # tiles are tile x tile pixels (the tower's image_size)
    patch: int
    extra_tokens: int  # CLS-like tokens the tower outputs per tile besides the patches
    strategy: str  # "default": the first token of each tile is dropped; "full": every token is kept

    @property
    def fixed(self) -> bool:
        """Every image takes one tile and `tile_tokens` tokens, whatever its size."""
        return True

    whole_images = False  # the tower takes tiles of one size (True: whole images at their own size, Qwen2-VL)

    @property
    def tile_tokens(self) -> int:
        """Features of one tile after the select strategy (`spec.image_token_count`)."""
        return image_token_count((self.tile, self.tile), self.patch, self.extra_tokens, self.strategy)

    @property
    def tile_hw(self) -> Size:
        """(H, W) of one `pixel_values` tile."""
        return (self.tile, self.tile)

    def tiles(self, size: Size) -> int:
        return 1

    def tokens(self, size: Size) -> int:
        return self.tile_tokens

    @property
    def max_tokens(self) -> int:
        """The most placeholder tokens one image can take."""
        return self.tile_tokens

    @property
    def largest_image(self) -> Size:
        """An image size that takes `max_tokens` tokens (and the most tiles)."""
        return (self.tile, self.tile)

    @property
    def max_tiles(self) -> int:
        return self.tiles(self.largest_image)


@dataclass(frozen=True)
class VideoPlan:
    """What one video costs, known from its container's header (frame count, rate, frame size) before decoding."""

    keep: tuple[int, ...]  # indices of the frames sampling keeps, ascending
    size: Size  # (height, width) each kept frame is resized to
    grid: tuple[int, int, int]  # (t, h, w) patches
    tokens: int  # placeholder tokens
    pixel_bytes: int  # bytes of the video's pixel_values (float32 rows)
    timestamps: tuple[float, ...] = ()  # seconds of each temporal patch, written before it (Qwen3-VL); () none

    @property
    def frame_bytes(self) -> int:
        """Bytes of the kept frames once resized (RGB, uint8), held until they are patched."""
        return len(self.keep) * self.size[0] * self.size[1] * 3


class Packer(nn.Module):
    """Features of one image's tiles [tiles, t, hidden] -> the image's features [T, hidden] (LLaVA: its one tile)."""

    def forward(self, feats: torch.Tensor, size: Size) -> torch.Tensor:
        return feats.reshape(-1, feats.shape[-1])  # [tiles * t, hidden]


class Family:
    """One model family. Subclasses set the class attributes and override what differs."""

    name: str = ""
    model_type: str = ""  # config.json model_type
    architectures: tuple[str, ...] = ()  # config.json architectures served
    model_class: str = ""  # the transformers class holding the weights (the `hf` baseline loads it)
    image_token: Optional[str] = None  # the placeholder token (None: the processor's / tokenizer's `image_token`)
    image_markers: tuple[str, ...] = ()  # prompt text that stands for an image besides `<image>` (its own format)
    image_start: str = ""  # text the checkpoint's processor writes around each image's placeholders
    image_end: str = ""
    mrope = False  # 3-D rotary positions for image tokens (Qwen2-VL's M-RoPE)
    whole_images = False  # the tower takes whole images at their own size (`layout(spec).whole_images`)
    video_token: Optional[str] = None  # the placeholder of video frames (None: the family takes no videos)
    video_markers: tuple[str, ...] = ()  # prompt text that stands for a video besides `<video>`
    text_model_types: tuple[str, ...] = TEXT_MODEL_TYPES  # the nested text config's model_type
    weight_renames: Renames = ()  # saved layouts -> transformers-5 names (transformers' conversion mapping)
    # where the vision tensors live, by their transformers-5 names (`weight_source.TensorSource` maps every saved
    # layout, the hub's `vision_tower.vision_model.` and `multi_modal_projector.` included, to these)
    weight_prefixes: dict[str, tuple[str, ...]] = {
        "tower": ("model.vision_tower.",),
        "projector": ("model.multi_modal_projector.",),
    }

    def matches(self, config: dict) -> bool:
        archs = config.get("architectures") or []
        return config.get("model_type") == self.model_type or any(a in self.architectures for a in archs)

    def describe(self) -> str:
        return f"{self.name} (model_type {self.model_type!r}: {', '.join(self.architectures)})"

    # --- checkpoint ---------------------------------------------------------------------------------------
    def text_config(self, config: Any) -> Any:
        return getattr(config, "text_config", None) or config

    def check_text(self, spec: CheckpointSpec) -> None:
        """Refuse a nested text model this family does not serve."""
        text = self.text_config(spec.hf_config)
        if text is not spec.hf_config and getattr(text, "model_type", None) not in self.text_model_types:
            raise CheckpointError(f"{spec.model_dir}: {self.name} with a {getattr(text, 'model_type', None)!r} "
                                  f"text model is not supported; supported: {self.text_model_types}")

    def text_rules(self, spec: CheckpointSpec) -> TextRules:
        """What the engine does differently for this family's text model (default: nothing)."""
        return TextRules()

    # --- image processing and tokens ------------------------------------------------------------------------
    def layout(self, spec: CheckpointSpec, extra_tokens: Optional[int] = None) -> ImageLayout:
        """The checkpoint's image layout; `extra_tokens` (the processor config's `num_additional_image_tokens`)
        wins over the tower type's CLS count."""
        v = _vision(spec)
        return ImageLayout(v.image_size, v.patch_size, v.known_extra_tokens(extra_tokens), v.select_strategy)

    def check_processor(self, layout: ImageLayout, image_processor: Any) -> None:
        """Refuse an image processor whose output is not what `layout` says (probed on two dummy images)."""
        shapes = set()
        for size in ((48, 20), (20, 48)):
            pv = probe(image_processor, size)
            if pv.ndim != 4 or pv.shape[1] != 3:
                raise CheckpointError(f"image processor {type(image_processor).__name__} returned pixel_values of "
                                      f"shape {pv.shape}; expected [n, 3, H, W] (a tiling processor needs a "
                                      "tiling family such as llava_next)")
            shapes.add(tuple(int(x) for x in pv.shape[-2:]))
        if len(shapes) != 1:
            raise CheckpointError(f"image processor output size depends on the input image ({sorted(shapes)}); "
                                  "a fixed size is required (e.g. center crop or a fixed height/width)")
        check_tile(shapes.pop(), layout.tile)

    video_defaults: dict[str, Any] = {}  # the video processor class's defaults (`preprocess.videos.VideoConfig`)

    def video_text(self, plan: VideoPlan) -> Optional[str]:
        """The text the checkpoint's processor writes in place of one video's placeholder token (its `video_token`),
        or None: the placeholder `plan.tokens` times."""
        return None

    def video_plan(self, cfg: Any, size: Size, frames: int, fps: float) -> VideoPlan:
        """The cost of a video of `frames` frames of `size` (height, width) at `fps`, under the checkpoint's video
        processor settings `cfg` (`preprocess.videos.VideoConfig`); ValueError when sampling keeps nothing."""
        raise CheckpointError(f"the {self.name} family takes no videos")

    # --- vision graph ---------------------------------------------------------------------------------------
    def projector(self, config: Any) -> nn.Module:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector  # noqa: PLC0415

        return LlavaMultiModalProjector(config)

    def packer(self, spec: CheckpointSpec, weights: Any = None) -> Packer:
        """`weights`: the checkpoint's `weight_source.TensorSource` (the vision stage opens it)."""
        return Packer()

    def hashed_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """Tensor prefixes whose content decides the image features (the embedding cache's namespace)."""
        return tuple(self.weight_prefixes.values())


def _vision(spec: CheckpointSpec):
    if spec.vision is None:
        raise CheckpointError(f"{spec.model_dir}: no vision_config (expected a vision-language checkpoint)")
    return spec.vision


def probe(image_processor: Any, size: tuple[int, int]) -> np.ndarray:
    """pixel_values of one dummy RGB image of PIL size (width, height)."""
    from PIL import Image  # noqa: PLC0415

    out = image_processor([Image.new("RGB", size, (128, 64, 32))], return_tensors="np")
    return np.asarray(out["pixel_values"])


def check_tile(hw: tuple[int, int], tile: int) -> None:
    if hw != (tile, tile):
        raise CheckpointError(f"the image processor produces {hw[0]}x{hw[1]} images but the vision tower expects "
                              f"{tile}x{tile}")
