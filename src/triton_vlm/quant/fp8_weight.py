"""An FP8 weight kept as its e4m3 bytes and fp32 scales (issue 38, CPU: a quarter of fp32's bytes in memory).

`Fp8Weight(q, scale, block)`: q [N, K] float8_e4m3fn, scale fp32 [ceil(N / bm), ceil(K / bn)] with block =
(bm, bn): block-wise FP8's `weight_block_size`; a compressed-tensors per-channel scale is block (1, K), a
per-tensor one (N, K). `dequantize()` gives the fp32 matrix `dequant.py` gives at load (bitwise: the same
`float(q) * s`), `cat` stacks the projections the engine fuses (q/k/v, gate/up) when each one's rows are whole
row blocks. Only fp32 scales are kept so: compressed-tensors computes in the scale's dtype, which for bf16 scales
is not `float(q) * s` in fp32 (`dequant.channel_dequantize`), and such weights are dequantized at load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Weight:
    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [ceil(N / bm), ceil(K / bn)] fp32
    block: tuple[int, int]  # (bm, bn)
    # on a GPU (`quant/fp8_gpu.py`, chosen at load): (its weight-scale layout, the products' output dtype)
    gpu: Optional[tuple[str, torch.dtype]] = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @classmethod
    def of(cls, q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]) -> Optional["Fp8Weight"]:
        """The weight as kept, or None where it must be dequantized at load (not fp32 scales, other grids)."""
        if q.dtype != E4M3 or q.dim() != 2 or scale.dtype != torch.float32:
            return None
        n, k = q.shape
        if scale.numel() == 1:
            block = (n, k)
        elif block is None and scale.numel() == n:
            block = (1, k)
        elif block is None:
            return None
        grid = (-(-n // block[0]), -(-k // block[1]))
        if scale.numel() != grid[0] * grid[1]:
            return None
        return cls(q, scale.reshape(grid).contiguous(), (int(block[0]), int(block[1])))

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32: float(q) * s, each scale over its block."""
        n, k = self.q.shape
        bm, bn = self.block
        s = self.scale.repeat_interleave(bm, 0)[:n].repeat_interleave(bn, 1)[:, :k]  # [N, K]
        return self.q.to(torch.float32) * s

    @staticmethod
    def cat(parts: Sequence["Fp8Weight"]) -> Optional["Fp8Weight"]:
        """The parts stacked along N, or None where their scales do not stack (other blocks, partial blocks)."""
        first = parts[0]
        if any(p.block != first.block or p.q.shape[1] != first.q.shape[1] or p.q.shape[0] % first.block[0]
               for p in parts):
            return None
        return first if len(parts) == 1 else Fp8Weight(torch.cat([p.q for p in parts]),
                                                       torch.cat([p.scale for p in parts]), first.block, first.gpu)

    def to_gpu(self, device: torch.device, layout: str, dtype: torch.dtype) -> "Fp8Weight":
        """The weight on `device`, its products by `quant/fp8_gpu.py` in `dtype` with the chosen scale layout."""
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.block, (layout, dtype))
