"""M-RoPE (Qwen2-VL, Qwen2.5-VL): rotary positions in three axes (time, height, width) for image and video tokens.

A prompt's positions (transformers' `Qwen2VLModel.get_rope_index`, for one sequence): text tokens count up by one
on all three axes; an image or video of grid (t, h, w) patches takes t*h*w / merge^2 placeholder tokens whose
positions are `start + (time, row, column)` over the merged grid (t, h / merge, w / merge), time scaled by
`tokens_per_second * seconds per temporal patch` for a Qwen2.5-VL video (and truncated to an integer), after which
text continues at `start + max(h, w) / merge`. Qwen3-VL (`video_frames`) writes a timestamp before each temporal
patch of a video, so its get_rope_index splits a video's grid (t, h, w) into t grids (1, h, w), each placed like an
image where its own run of placeholders starts. So a prompt's largest position can be below its length: `delta` =
largest + 1 - length, and every token after the prompt (decode steps) is at its cache position + delta on every
axis, where M-RoPE equals the ordinary 1-D rotary embedding (`rope_positions`). A prompt without images has
delta 0 and needs nothing here.

The rotary tables: `mrope_section` [s_t, s_h, s_w] (summing to head_dim / 2) says which frequencies take which
axis, in blocks or interleaved (`frequency_axes`; `mrope_interleaved`, Qwen3-VL): `tables` picks, for each
frequency, the cos / sin row of that axis's position from the model's 1-D tables
(the same values transformers computes: position x inv_freq, then cos / sin), in both halves of the head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...errors import InvalidArgument

Grid = tuple[int, int, int]  # (t, h, w) in patches
MAX_SECONDS = 3600.0  # a video's seconds per temporal patch


@dataclass(frozen=True)
class MRopeSpec:
    """The family's M-RoPE rule, as data (`families.PositionRule` has these fields)."""

    section: tuple[int, ...]  # [3] frequencies per axis (time, height, width)
    image_token_id: int
    video_token_id: int
    merge: int  # spatial merge size (2x2 patches -> one token)
    tokens_per_second: Optional[float] = None  # Qwen2.5-VL: video time positions per second
    max_position: int = 1 << 30  # positions must stay inside the rotary tables (the context length)
    interleaved: bool = False  # frequencies T, H, W, T, H, W, ... (Qwen3-VL) instead of blocks
    video_frames: bool = False  # a video's temporal patches are runs of their own, each a (1, h, w) grid (Qwen3-VL)


@dataclass
class MRopePrompt:
    """A prompt's 3-D positions and the offset of every later token."""

    positions: torch.Tensor  # [3, P] int64
    delta: int  # decode positions = cache position + delta


def _vision_positions(start: int, grid: Grid, merge: int, interval: Optional[torch.Tensor]) -> torch.Tensor:
    """[3, t * h/m * w/m] positions of one image / video starting at `start` (transformers' order: time, rows,
    columns)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    time = torch.arange(t)
    if interval is not None:
        time = (time * interval).long()
    tt, hh, ww = torch.meshgrid(time + start, torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def prompt_positions(input_ids: Sequence[int], grids: Sequence[Grid], spec: MRopeSpec,
                     seconds: Optional[Sequence[float]] = None) -> MRopePrompt:
    """The prompt's M-RoPE positions: `grids` are its images' and videos' in prompt order; `seconds` each one's
    seconds per temporal patch (read for videos, Qwen2.5-VL; None: 1). Raises InvalidArgument when the placeholders
    do not match the grids."""
    ids = np.asarray(list(input_ids), dtype=np.int64)
    kinds = np.where(ids == spec.image_token_id, 1, np.where(ids == spec.video_token_id, 2, 0))  # [P]
    starts = np.flatnonzero(kinds)  # placeholder positions: a text run ends at the next one
    parts, pos, i, g = [], 0, 0, 0
    frames_left = 0  # Qwen3-VL: temporal patches of the current video still to place (each its own run)
    n = len(ids)
    while i < n:
        if kinds[i] == 0:
            k = np.searchsorted(starts, i)
            j = int(starts[k]) if k < len(starts) else n
            parts.append(torch.arange(j - i).expand(3, -1) + pos)
            pos, i = pos + j - i, j
            continue
        if g >= len(grids):
            raise InvalidArgument(f"input_ids hold more image / video placeholders than the {len(grids)} images' "
                                  "grids (image_sizes) account for")
        grid, kind = tuple(int(x) for x in grids[g]), int(kinds[i])
        if kind == 2 and spec.video_frames:  # get_rope_index's split: t grids (1, h, w), one per run
            frames_left = frames_left or grid[0]
            grid = (1, grid[1], grid[2])
        count = grid[0] * grid[1] * grid[2] // (spec.merge * spec.merge)
        if count <= 0 or i + count > n or not bool((kinds[i:i + count] == kind).all()):
            raise InvalidArgument(f"image {g} of grid {list(grid)} needs {count} adjacent placeholders at position "
                                  f"{i} of input_ids")
        interval = None
        if kind == 2 and spec.tokens_per_second is not None and not spec.video_frames:
            sec = float(seconds[g]) if seconds is not None and g < len(seconds) else 1.0
            if not 0.0 <= sec <= MAX_SECONDS:
                raise InvalidArgument(f"media_seconds of video {g} is {sec}; 0 to {MAX_SECONDS} is allowed")
            interval = spec.tokens_per_second * torch.tensor(sec, dtype=torch.float32)
        parts.append(_vision_positions(pos, grid, spec.merge, interval))
        pos += max(grid[1], grid[2]) // spec.merge
        i += count
        frames_left = max(0, frames_left - 1)
        if not frames_left:
            g += 1
    if g != len(grids) or frames_left:
        raise InvalidArgument(f"{len(grids)} image grids but placeholders for {g} images in input_ids"
                              + (f" and {frames_left} temporal patches of video {g} missing" if frames_left else ""))
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    top = int(positions.max()) if n else 0
    if top >= spec.max_position:
        raise InvalidArgument(f"the prompt's rotary positions reach {top}; the checkpoint's tables end at "
                              f"{spec.max_position - 1} (media_seconds / grids too large)")
    delta = top + 1 - n if n else 0
    return MRopePrompt(positions, delta)


def frequency_axes(section: Sequence[int], interleaved: bool = False) -> torch.Tensor:
    """[hd / 2] the axis (0 time, 1 height, 2 width) of each rotary frequency. Blocks (Qwen2-VL): the first s_t
    frequencies take time, the next s_h height, the last s_w width. Interleaved (Qwen3-VL's
    `apply_interleaved_mrope`): frequency i takes height where i % 3 == 1 and i < 3 s_h, width where i % 3 == 2
    and i < 3 s_w, time elsewhere."""
    if not interleaved:
        return torch.cat([torch.full((s,), k % 3, dtype=torch.long) for k, s in enumerate(section)])
    i = torch.arange(sum(section))
    axis = torch.zeros_like(i)
    axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return axis


def tables(cos: torch.Tensor, sin_rot: torch.Tensor, positions: torch.Tensor,
           section: Sequence[int], interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_rot [max_pos, hd] (the model's 1-D tables), positions [3, rows, q_len] -> the M-RoPE rows
    [rows, q_len, 1, hd] for `attention.attend_torch`."""
    hd = cos.shape[-1]
    axis = frequency_axes(section, interleaved)  # [hd / 2]
    axis = torch.cat([axis, axis]).to(cos.device)  # [hd]: both halves of the head
    cols = torch.arange(hd, device=cos.device)
    out = []
    for table in (cos, sin_rot):
        per_axis = table[positions]  # [3, rows, q_len, hd]
        out.append(per_axis[axis, ..., cols].permute(1, 2, 0)[:, :, None])  # [rows, q_len, 1, hd]
    return out[0], out[1]


class PromptRope:
    """A checkpoint's M-RoPE: a request's input_ids and image sizes -> its `MRopePrompt` (None when the prompt has no
    image placeholders: text-only positions are the cache positions, delta 0, as transformers has them)."""

    def __init__(self, spec: MRopeSpec, grid_of):
        self.spec, self.grid_of = spec, grid_of  # grid_of((height, width)) -> (t, h, w): the family's layout

    @classmethod
    def from_rules(cls, rules) -> Optional["PromptRope"]:
        """From the family's `families.TextRules` (its `position` rule and the layout's `grid_of`); None without
        M-RoPE."""
        rule = rules.position
        if rule is None:
            return None
        return cls(MRopeSpec(tuple(rule.section), rule.image_token_id, rule.video_token_id, rule.merge,
                             rule.tokens_per_second, rule.max_position, rule.interleaved,
                             getattr(rule, "video_frames", False)), rules.grid_of)

    def __call__(self, input_ids: Sequence[int], image_sizes, grids=None, seconds=None) -> Optional[MRopePrompt]:
        """`grids` (t, h, w) per image / video when sent (`media_grids`), else from `image_sizes`; `seconds`: each
        medium's seconds per temporal patch (videos')."""
        s = self.spec
        if not any(t in (s.image_token_id, s.video_token_id) for t in input_ids):
            if image_sizes is not None and len(image_sizes):
                raise InvalidArgument(f"image_sizes has {len(image_sizes)} rows but input_ids hold no image "
                                      "placeholders")
            return None
        if grids is None:
            if image_sizes is None:
                raise InvalidArgument("input 'image_sizes' ([images, 2] height, width) is required: this "
                                      "checkpoint's image token positions (M-RoPE) depend on each image's size")
            grids = [self.grid_of((int(h), int(w))) for h, w in image_sizes]
        return prompt_positions(input_ids, grids, s, seconds)

