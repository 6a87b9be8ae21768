"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower's configuration and its per-batch layout, host-side (numpy).

`TowerConfig` reads the vision config (a transformers config object or its dict); `tower_aux(grids, config)` is
everything the graph (`qwen_tower.QwenTowerGraph`) needs that depends on the images' grids, computed once per
batch, so the graph is static. N = sum(t * h * w) patches over the grids, in the grids' order (the processor's):

- `position_ids` int64 [N, 2]: each patch's (row, column) in its frame, laid out block-major over the merge units
  as the processor orders the patches (transformers' `get_vision_position_ids`);
- attention groups, as an index and its inverse: `attn_index` int64 [G, L]: the patches of each group in order, -1
  padding the shorter groups to L; `attn_slot` int64 [N]: each patch's flat position g * L + l in it. Full
  attention's groups are the frames (an image, or one temporal step of a video: transformers' `cu_seqlens` repeats
  h*w t times), L the longest frame of the batch;
- Qwen3-VL only, `pos_index` int64 [N, 4] and `pos_weight` fp32 [N, 4]: each patch's bilinear taps into the
  learned square position table (transformers' `get_vision_interpolation_indices_and_weights`);
- 2.5-VL only, `window_index` [W, L_w] and `window_slot` [N], the same for the windowed blocks: a group per window
  of `window_size // patch_size // spatial_merge_size` merged tokens squared within a frame, its merge units in
  raster order (transformers' `get_vision_window_index`: windows partial at the right and bottom edges), L_w the
  full window's patch count (fixed per checkpoint).

Attention within groups costs G * L^2 per head instead of N^2 for a dense block-diagonal mask: for 2.5-VL's
windows 64 patches each; for the frames, L is the batch's longest, so batching images of similar sizes wastes
least.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..spec import CheckpointError

QWEN2_VL, QWEN2_5_VL, QWEN3_VL = "qwen2_vl", "qwen2_5_vl", "qwen3_vl"
# the vision config's model_type (transformers' class attribute) -> tower kind; the top-level types are accepted too
MODEL_TYPES = {"qwen2_vl_vision": QWEN2_VL, "qwen2_vl": QWEN2_VL,
               "qwen2_5_vl_vision": QWEN2_5_VL, "qwen2_5_vl": QWEN2_5_VL,
               "qwen3_vl_vision": QWEN3_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe_vision": QWEN3_VL,
               "qwen3_vl_moe": QWEN3_VL, "qwen3_5_vision": QWEN3_VL, "qwen3_5": QWEN3_VL,  # Qwen3.5: Qwen3-VL's
               "qwen3_5_moe_vision": QWEN3_VL, "qwen3_5_moe": QWEN3_VL}
POSITION_IDS, ATTN_INDEX, ATTN_SLOT = "position_ids", "attn_index", "attn_slot"
WINDOW_INDEX, WINDOW_SLOT = "window_index", "window_slot"
POS_INDEX, POS_WEIGHT = "pos_index", "pos_weight"  # Qwen3-VL: the learned position table's bilinear taps
# graph inputs after `patches`, in order; Qwen2-VL (no windowed blocks) takes the first three (`aux_names`),
# Qwen3-VL those three and its position taps
AUX_NAMES = (POSITION_IDS, ATTN_INDEX, ATTN_SLOT, WINDOW_INDEX, WINDOW_SLOT)
PAD = -1  # an index's padding slots


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def is_qwen_vision(vision_config: Any) -> bool:
    """A Qwen2-VL or Qwen2.5-VL vision config (a transformers config object or its dict)."""
    return isinstance(vision_config, TowerConfig) or str(_get(vision_config, "model_type")) in MODEL_TYPES


@dataclass(frozen=True)
class TowerConfig:
    kind: str  # QWEN2_VL, QWEN2_5_VL or QWEN3_VL
    depth: int
    width: int  # the blocks' hidden size
    heads: int
    mlp_hidden: int
    out_hidden: int  # the merger's output size (the language model's hidden size)
    act: str  # the blocks' MLP activation (transformers' ACT2FN name)
    in_channels: int
    patch: int
    temporal_patch: int
    merge: int  # spatial_merge_size
    rope_theta: float
    window_size: int = 0  # pixels (2.5-VL)
    fullatt: tuple[int, ...] = ()  # 2.5-VL: the blocks with full attention; the others are windowed
    pos_embeddings: int = 0  # Qwen3-VL: learned absolute position embeddings (a square grid), interpolated
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose outputs go through their own (DeepStack) mergers

    @classmethod
    def from_config(cls, vc: Any) -> "TowerConfig":
        if isinstance(vc, TowerConfig):
            return vc
        kind = MODEL_TYPES.get(str(_get(vc, "model_type")))
        if kind is None:
            raise CheckpointError(f"vision config model_type {_get(vc, 'model_type')!r} is not a Qwen2-VL, "
                                  f"Qwen2.5-VL or Qwen3-VL tower (one of {sorted(MODEL_TYPES)})")
        rope = _get(vc, "rope_parameters") or {}
        common = dict(kind=kind, depth=int(_get(vc, "depth")), heads=int(_get(vc, "num_heads")),
                      in_channels=int(_get(vc, "in_channels", _get(vc, "in_chans", 3))),
                      patch=int(_get(vc, "patch_size")), temporal_patch=int(_get(vc, "temporal_patch_size")),
                      merge=int(_get(vc, "spatial_merge_size")), rope_theta=float(rope.get("rope_theta", 10000.0)))
        if kind == QWEN3_VL:
            return cls(width=int(_get(vc, "hidden_size")), mlp_hidden=int(_get(vc, "intermediate_size")),
                       out_hidden=int(_get(vc, "out_hidden_size")), act=str(_get(vc, "hidden_act")),
                       pos_embeddings=int(_get(vc, "num_position_embeddings")),
                       deepstack=tuple(int(i) for i in _get(vc, "deepstack_visual_indexes") or ()), **common)
        if kind == QWEN2_VL:
            width = int(_get(vc, "embed_dim"))
            return cls(width=width, mlp_hidden=int(width * _get(vc, "mlp_ratio")),
                       out_hidden=int(_get(vc, "hidden_size")), act=str(_get(vc, "hidden_act", "quick_gelu")),
                       **common)
        cfg = cls(width=int(_get(vc, "hidden_size")), mlp_hidden=int(_get(vc, "intermediate_size")),
                  out_hidden=int(_get(vc, "out_hidden_size")), act=str(_get(vc, "hidden_act", "silu")),
                  window_size=int(_get(vc, "window_size")),
                  fullatt=tuple(int(i) for i in _get(vc, "fullatt_block_indexes")), **common)
        if cfg.window_merged < 1:
            raise CheckpointError(f"vision config window_size {cfg.window_size} is smaller than patch_size * "
                                  f"spatial_merge_size = {cfg.patch * cfg.merge}")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    @property
    def window_merged(self) -> int:
        """A window's side in merged tokens (transformers' `vit_merger_window_size`)."""
        return self.window_size // self.merge // self.patch

    @property
    def window_patches(self) -> int:
        """A full window's patch count (`window_index`'s second axis)."""
        return (self.window_merged * self.merge) ** 2

    @property
    def windowed(self) -> bool:
        return self.kind == QWEN2_5_VL

    def inv_freq(self) -> list[float]:
        """The rotary inverse frequencies, as transformers computes them (fp32)."""
        spatial = self.head_dim // 2
        steps = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        return (1.0 / (self.rope_theta ** steps)).tolist()


    @property
    def side(self) -> int:
        """Qwen3-VL: the learned position grid's side."""
        return math.isqrt(self.pos_embeddings)


def aux_names(vision_config: Any) -> tuple[str, ...]:
    """The graph's inputs after `patches` for this tower, in order."""
    cfg = TowerConfig.from_config(vision_config)
    return AUX_NAMES if cfg.windowed else AUX_NAMES[:3] + ((POS_INDEX, POS_WEIGHT) if cfg.pos_embeddings else ())


# --- host side: the per-batch layout (numpy) ----------------------------------------------------------------
def _check_grid(i: int, grid: Sequence[int], merge: int) -> tuple[int, int, int]:
    if len(grid) != 3:
        raise ValueError(f"grid {i} is {tuple(grid)}: expected (t, h, w) in patches")
    t, h, w = (int(v) for v in grid)
    if t < 1 or h < merge or w < merge or h % merge or w % merge:
        raise ValueError(f"grid {i} is {(t, h, w)}: t must be >= 1 and h, w positive multiples of "
                         f"spatial_merge_size {merge}")
    return t, h, w


def _block_major(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) in the processor's order: merge units in raster order, patches within each."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def _frame_windows(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, int]:
    """Each patch's window within one frame (processor order) and the frame's number of windows."""
    mh, mw = h // merge, w // merge
    per_row = -(-mw // side)
    units = (np.arange(mh)[:, None] // side) * per_row + np.arange(mw)[None, :] // side  # [mh, mw]
    return np.repeat(units.reshape(-1), merge * merge), (-(-mh // side)) * per_row


def groups(ids: np.ndarray, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(index [G, L], slot [N]) for patches labelled with group ids 0..G-1 (every id used): each group's patches
    in their order, PAD after them; L = `length` or the largest group."""
    counts = np.bincount(ids)
    length = int(counts.max()) if length is None else length
    order = np.argsort(ids, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(ids)) - starts[ids[order]]
    index = np.full((len(counts), length), PAD, dtype=np.int64)
    index[ids[order], rank] = order
    slot = np.empty(len(ids), dtype=np.int64)
    slot[order] = ids[order] * length + rank
    return index, slot


def tower_aux(grids: Sequence[Sequence[int]], vision_config: Any) -> dict[str, np.ndarray]:
    """The graph's inputs after `patches` for these grids ((t, h, w) in patches per image or video, in order),
    by name (`aux_names(vision_config)`): see the module docstring."""
    cfg = TowerConfig.from_config(vision_config)
    if len(grids) == 0:
        raise ValueError("tower_aux needs at least one grid")
    positions, frames, windows = [], [], []
    frame, window = 0, 0
    for i, grid in enumerate(grids):
        t, h, w = _check_grid(i, grid, cfg.merge)
        rows, cols = _block_major(h, w, cfg.merge)
        positions.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
        frames.append(np.repeat(np.arange(frame, frame + t), h * w))
        frame += t
        if cfg.windowed:
            ids, count = _frame_windows(h, w, cfg.merge, cfg.window_merged)
            windows.extend(ids + window + k * count for k in range(t))
            window += t * count
    out = {POSITION_IDS: np.concatenate(positions).astype(np.int64)}
    out[ATTN_INDEX], out[ATTN_SLOT] = groups(np.concatenate(frames))
    if cfg.windowed:
        out[WINDOW_INDEX], out[WINDOW_SLOT] = groups(np.concatenate(windows), cfg.window_patches)
    if cfg.pos_embeddings:  # transformers' own taps (`fast_pos_embed_interpolate`: bilinear, align_corners)
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights  # noqa: PLC0415

        index, weight = get_vision_interpolation_indices_and_weights(
            torch.tensor([list(g) for g in grids], dtype=torch.long), cfg.side, mode="bilinear", align_corners=True,
            spatial_merge_size=cfg.merge)
        out[POS_INDEX], out[POS_WEIGHT] = index.numpy().astype(np.int64), weight.numpy().astype(np.float32)
    return out
