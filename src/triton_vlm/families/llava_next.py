"""LLaVA-NeXT (llava-v1.6, `LlavaNextForConditionalGeneration`): "anyres" tiles, exactly as transformers does it.

Image processing (the checkpoint's `LlavaNextImageProcessor`, whose pixels are used as they are): the best
resolution among `image_grid_pinpoints` (`select_best_resolution`: the most effective pixels, then the least
waste), the image resized into it keeping its aspect ratio and padded, cut into tower-sized tiles, after the
whole image resized to one tile (the base tile, first). `AnyResLayout.tiles` is that count
(`image_size_to_num_patches`).

Tokens per image (`LlavaNextProcessor._get_number_of_features`, `AnyResLayout.tokens`): the base tile's
features, plus the tiles' features laid out as one grid of (rows x tile patches) by (columns x tile patches),
unpadded to the image's aspect ratio (`_get_unpadded_features`), plus one row separator per remaining row.

Vision graph: the tower and projector run on every tile (one batch of tiles for all images); `AnyResPacker`
then does `LlavaNextModel.pack_image_features` for one image: base tile first, the grid permuted to rows,
`unpad_image`, the learned `image_newline` vector appended to every row. The packing runs in torch after the
tower + projector (also after the ONNX / TensorRT graph): it is indexing whose output shape depends on each
image's size (data-dependent slicing that an exported graph and a TensorRT profile handle badly), it costs
microseconds, and keeping it out lets one encoder call take the tiles of images of every size and grid.

Valid combinations, as in transformers (anything else fails there in `pack_image_features`): a tower with a CLS
token and the "default" strategy (CLIP), or a tower without one and "full" (SigLIP): each tile must give
exactly (tile / patch)^2 features.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..spec import CheckpointError, CheckpointSpec
from .base import Family, ImageLayout, Packer, Size, _vision, check_tile, probe
from .llava import INNER_RENAMES, LLAVA_RENAMES

log = logging.getLogger("triton_vlm")


def select_best_resolution(size: Size, pinpoints: tuple[Size, ...]) -> Size:
    """transformers' `image_processing_utils.select_best_resolution`: (height, width) of the pinpoint that keeps
    the most of the image's pixels when it is scaled into it, the least wasted area on a tie."""
    original_height, original_width = size
    best_fit, max_effective, min_wasted = None, 0, float("inf")
    for height, width in pinpoints:
        scale = min(width / original_width, height / original_height)
        down_w, down_h = int(original_width * scale), int(original_height * scale)
        effective = min(down_w * down_h, original_width * original_height)
        wasted = width * height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            best_fit, max_effective, min_wasted = (height, width), effective, wasted
    return best_fit


def unpadded_grid(size: Size, grid_h: int, grid_w: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the part of a (grid_h x grid_w) feature grid that holds the image of `size`
    (H, W), as transformers' `unpad_image` (and the processor's `_get_unpadded_features`) slice it."""
    original_height, original_width = size
    if original_width / original_height > grid_w / grid_h:
        new_height = int(round(original_height * (grid_w / original_width), 7))
        pad = (grid_h - new_height) // 2
        return pad, grid_h - pad, 0, grid_w
    new_width = int(round(original_width * (grid_h / original_height), 7))
    pad = (grid_w - new_width) // 2
    return 0, grid_h, pad, grid_w - pad


@dataclass(frozen=True)
class AnyResLayout(ImageLayout):
    pinpoints: tuple[Size, ...] = ()  # candidate resolutions (height, width), multiples of the tile

    @property
    def fixed(self) -> bool:
        return False

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.tile // self.patch

    def grid(self, size: Size) -> tuple[int, int]:
        """(rows, columns) of tiles the image of `size` is cut into (the base tile not counted)."""
        height, width = select_best_resolution(size, self.pinpoints)
        return height // self.tile, width // self.tile

    def tiles(self, size: Size) -> int:
        rows, cols = self.grid(size)
        return rows * cols + 1

    def tokens(self, size: Size) -> int:
        rows, cols = self.grid(size)
        top, bottom, left, right = unpadded_grid(size, rows * self.side, cols * self.side)
        grid_rows, grid_cols = bottom - top, right - left
        return self.tile_tokens + grid_rows * grid_cols + grid_rows  # base tile, unpadded grid, row separators

    @property
    def max_tokens(self) -> int:
        return self.tokens(self.largest_image)

    @property
    def largest_image(self) -> Size:
        """The pinpoint with the most tokens: an image of its exact size fills its grid with nothing unpadded,
        and no image can take more tokens than the full grid of the pinpoint it is fitted to."""
        return max(self.pinpoints, key=lambda p: (self.tokens(p), self.tiles(p)))


class AnyResPacker(Packer):
    """`LlavaNextModel.pack_image_features` for one image: [tiles, side^2, hidden] -> [tokens(size), hidden]."""

    def __init__(self, layout: AnyResLayout, newline: torch.Tensor):
        super().__init__()
        self.layout = layout
        self.register_buffer("newline", newline.detach().float().clone(), persistent=False)  # [hidden]

    def forward(self, feats: torch.Tensor, size: Size) -> torch.Tensor:
        newline = self.newline.to(feats.device, feats.dtype)
        if feats.shape[0] == 1:
            return torch.cat((feats[0], newline[None]), dim=0)
        base, tiles = feats[0], feats[1:]  # [side^2, hidden], [rows * cols, side^2, hidden]
        rows, cols = self.layout.grid(size)
        side = self.layout.side
        x = tiles.reshape(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3)  # [hidden, rows, side, cols, side]
        x = x.flatten(1, 2).flatten(2, 3)  # [hidden, rows * side, cols * side]
        top, bottom, left, right = unpadded_grid(size, x.shape[1], x.shape[2])
        x = x[:, top:bottom, left:right]  # [hidden, H', W']
        x = torch.cat((x, newline[:, None, None].expand(*x.shape[:-1], 1)), dim=-1)  # [hidden, H', W' + 1]
        x = x.flatten(1, 2).transpose(0, 1)  # [H' * (W' + 1), hidden]
        return torch.cat((base, x), dim=0)  # [tokens, hidden]


class LlavaNext(Family):
    name = "llava_next"
    model_type = "llava_next"
    architectures = ("LlavaNextForConditionalGeneration",)
    model_class = "LlavaNextForConditionalGeneration"
    weight_prefixes = {**Family.weight_prefixes, "newline": ("model.image_newline",)}
    weight_renames = LLAVA_RENAMES + ((r"^image_newline$", "model.image_newline"),) + INNER_RENAMES

    def layout(self, spec: CheckpointSpec, extra_tokens: Optional[int] = None) -> AnyResLayout:
        v = _vision(spec)
        # the model's features decide: a processor config that counts other CLS tokens than the tower has would
        # make transformers fail at the merge, so the tower's own count is used when it is known
        extra = v.known_extra_tokens(None if v.extra_tokens is not None else extra_tokens)
        if extra_tokens is not None and int(extra_tokens) != extra:
            log.warning("llava_next: processor num_additional_image_tokens %s differs from the %s tower's %d "
                        "extra tokens; counting the tower's", extra_tokens, v.model_type, extra)
        points = getattr(spec.hf_config, "image_grid_pinpoints", None) or []
        layout = AnyResLayout(v.image_size, v.patch_size, extra, v.select_strategy,
                              tuple((int(h), int(w)) for h, w in points))
        if not layout.pinpoints:
            raise CheckpointError(f"{spec.model_dir}: llava_next needs image_grid_pinpoints in config.json")
        odd = [p for p in layout.pinpoints if p[0] % layout.tile or p[1] % layout.tile or min(p) <= 0]
        if odd:
            raise CheckpointError(f"image_grid_pinpoints {odd} are not positive multiples of the tower's image "
                                  f"size {layout.tile}")
        if layout.tile_tokens != layout.side ** 2:
            raise CheckpointError(
                f"llava_next lays each tile's features out as a {layout.side}x{layout.side} grid, but the "
                f"{v.model_type} tower's {extra} extra token(s) with vision_feature_select_strategy "
                f"{v.select_strategy!r} leave {layout.tile_tokens} features per tile (transformers' "
                "LlavaNextModel fails on this too); use 'default' with a CLS tower, 'full' without one")
        return layout

    def check_processor(self, layout: AnyResLayout, image_processor: Any) -> None:
        points = getattr(image_processor, "image_grid_pinpoints", None)
        if points is None or [tuple(p) for p in points] != list(layout.pinpoints):
            raise CheckpointError(f"the image processor's image_grid_pinpoints {points} differ from config.json's "
                                  f"{[list(p) for p in layout.pinpoints]}")
        for width, height in ((48, 20), (20, 48)):
            pv = probe(image_processor, (width, height))
            if pv.ndim != 5 or pv.shape[2] != 3:
                raise CheckpointError(f"image processor {type(image_processor).__name__} returned pixel_values of "
                                      f"shape {pv.shape}; expected [n, tiles, 3, H, W] (LLaVA-NeXT tiles)")
            check_tile(tuple(int(x) for x in pv.shape[-2:]), layout.tile)
            if pv.shape[1] != layout.tiles((height, width)):
                raise CheckpointError(f"the image processor cut a {height}x{width} image into {pv.shape[1]} tiles; "
                                      f"image_grid_pinpoints give {layout.tiles((height, width))}")

    def projector(self, config: Any):
        from transformers.models.llava_next.modeling_llava_next import (  # noqa: PLC0415
            LlavaNextMultiModalProjector,
        )

        return LlavaNextMultiModalProjector(config)

    def packer(self, spec: CheckpointSpec, weights: Any = None) -> AnyResPacker:
        if weights is None:
            raise CheckpointError("llava_next's packer reads image_newline: pass the checkpoint's TensorSource")
        key = next((k for k in self.weight_prefixes["newline"] if k in weights), None)
        if key is None:
            raise CheckpointError(f"{spec.model_dir}: no image_newline tensor (looked for "
                                  f"{list(self.weight_prefixes['newline'])})")
        newline = weights.get(key)
        if tuple(newline.shape) != (spec.text.hidden_size,):
            raise CheckpointError(f"image_newline has shape {tuple(newline.shape)}; expected "
                                  f"({spec.text.hidden_size},)")
        return AnyResPacker(self.layout(spec), newline)


LLAVA_NEXT = LlavaNext()

