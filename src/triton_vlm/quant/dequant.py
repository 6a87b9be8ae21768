"""FP8 weights dequantized once at load, exactly as `transformers` does with `dequantize=True`.

`QuantizedWeights.split(quant, files)` takes the scale tensors out of a checkpoint's name -> location map (they
are no model tensors; the hub-layout renames have already been applied to them as to every key) and remembers
which weight each belongs to: the scale `X.<scale_suffix>` belongs to `X.weight`. `dequantize(name, w, read)`
returns a quantized weight as float32:
- block-wise fp8 (`Fp8Dequantize`): `w.float() * scale_inv.float()` with each scale spread over its
  `weight_block_size` block ([rows / bm, cols / bn] scales; the weight's shape must be a multiple of the block:
  transformers derives the block from the scale grid, which only then is the checkpoint's);
- compressed-tensors fp8 (`dequantize` of compressed-tensors): `w.to(scale.dtype) * scale` ([out, 1] per
  channel, [1] per tensor) computed in the scale's dtype, then float32.
A float8 tensor without its scale, or a scale without its weight, is refused (`Unservable`): never read as
numbers it is not.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..checkpoint_fields import Unservable
from .config import QuantConfig

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
E4M3 = torch.float8_e4m3fn
# compressed-tensors' optional companions of a weight: zero points (0 for symmetric FP8) are subtracted
ZERO_POINT = "weight_zero_point"


class QuantizedWeights:
    """The scales of a quantized checkpoint and the dequantization of the weights they belong to."""

    def __init__(self, quant: Optional[QuantConfig], scales: dict[str, str], zero_points: dict[str, str]):
        self.quant = quant
        self.scales = scales  # weight name -> its scale's name
        self.zero_points = zero_points  # weight name -> its zero point's name
        self.held: dict = {}  # the scales' and zero points' locations (taken out of the model's tensors)

    @classmethod
    def split(cls, quant: Optional[QuantConfig], files: dict) -> "QuantizedWeights":
        """Move the scales (and zero points) out of `files` (name -> location, changed in place); with `quant`
        None (an unquantized checkpoint) nothing moves and any float8 tensor is refused when read."""
        if quant is None:
            return cls(None, {}, {})
        scales, zeros = {}, {}
        for name in [n for n in files if n.endswith("." + quant.scale_suffix)]:
            weight = name[: -len(quant.scale_suffix)] + "weight"
            if weight not in files:
                raise Unservable(f"scale tensor {name!r} has no weight {weight!r} beside it")
            scales[weight] = name
        for name in [n for n in files if n.endswith("." + ZERO_POINT)]:
            zeros[name[: -len(ZERO_POINT)] + "weight"] = name
        for name in [n for n in files if n.endswith((".input_scale", ".activation_scale", ".weight_shape"))]:
            raise Unservable(f"tensor {name!r}: static activation scales / packed shapes are not supported "
                             f"(quantization_config {quant.method!r} with dynamic activations only)")
        out = cls(quant, scales, zeros)
        out.held = {n: files.pop(n) for n in [*scales.values(), *zeros.values()]}
        return out

    def dequantize(self, name: str, w: torch.Tensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """`name`'s tensor as the model computes with it (float32 for a quantized weight; others as stored)."""
        scale_name = self.scales.get(name)
        if scale_name is None:
            if w.dtype in FP8_DTYPES:
                what = f"no {self.quant.scale_suffix} beside it" if self.quant else "config.json has no " \
                    "quantization_config"
                raise Unservable(f"tensor {name!r} is {w.dtype} but {what}: its scales are unknown")
            return w
        if w.dtype != E4M3:
            raise Unservable(f"tensor {name!r} has a {self.quant.scale_suffix} but is {w.dtype}; supported: "
                             "float8_e4m3fn")
        scale = read(scale_name)
        if self.quant.method == "fp8":
            return block_dequantize(name, w, scale, self.quant.block)
        zero = read(self.zero_points[name]) if name in self.zero_points else None
        return channel_dequantize(name, w, scale, zero)


def block_dequantize(name: str, w: torch.Tensor, scale: torch.Tensor,
                     block: Optional[tuple[int, int]]) -> torch.Tensor:
    """[rows, cols] e4m3 x [rows / bm, cols / bn] scales -> float32 (per tensor: one scale)."""
    rows, cols = w.shape
    s = scale.to(torch.float32)
    if block is None or s.numel() == 1:
        if s.numel() != 1:
            raise Unservable(f"{name}: {tuple(scale.shape)} scales for a per-tensor quantization")
        return w.to(torch.float32) * s.reshape(())
    bm, bn = block
    if rows % bm or cols % bn:
        raise Unservable(f"{name}: shape {(rows, cols)} is not a multiple of weight_block_size {list(block)} "
                         "(transformers would read other blocks than the checkpoint's)")
    if tuple(s.shape) != (rows // bm, cols // bn):
        raise Unservable(f"{name}: weight_scale_inv has shape {tuple(scale.shape)}, expected "
                         f"{(rows // bm, cols // bn)} for shape {(rows, cols)} in {list(block)} blocks")
    q = w.to(torch.float32).reshape(rows // bm, bm, cols // bn, bn)  # [R, bm, C, bn]
    return (q * s[:, None, :, None]).reshape(rows, cols)


def channel_dequantize(name: str, w: torch.Tensor, scale: torch.Tensor,
                       zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """compressed-tensors: [out, in] e4m3 x scale [out, 1] (channel) or [1] / [] (tensor), in the scale's dtype."""
    rows = w.shape[0]
    if scale.numel() == 1:
        s = scale.reshape(1, 1)
    elif scale.numel() == rows:
        s = scale.reshape(rows, 1)
    else:
        raise Unservable(f"{name}: weight_scale has shape {tuple(scale.shape)}; expected [{rows}, 1] (channel) or "
                         "[1] (tensor)")
    x = w.to(s.dtype)
    if zero is not None:
        x = x - zero.to(s.dtype).reshape(s.shape)
    return (x * s).to(torch.float32)
