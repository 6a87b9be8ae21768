"""One layer's attention core over the paged KV cache: rotary embeddings, the new tokens' K/V written to the
cache, grouped-query attention over each row's own slots. The projections around it are `model.py`'s.

Two implementations of the same computation:
- `attend_torch`: torch ops, any device, any q_len (prefill chunks and decode steps). The keys a row reads
  are gathered from its slots (`AttentionBatch.read_slots`; column j is position j) and attended with
  `scaled_dot_product_attention` under the batch's mask.
- `cpu_decode.DecodeStep.attend`: one C call per layer for a decode step (q_len 1) on a CPU in fp32, reading
  the keys in place (`cpu_decode.Kernel.decode` is the same for one layer, in `decode_torch`'s arguments).
  `Attention.kernel_for` decides per forward; the kernel's results are checked against `decode_torch` at
  first use.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..cpu import cpu_decode
from ..kv.kv_cache import AttentionBatch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` (rotate_half(x) = [-x_2, x_1]) in 4 ops instead of 7, bit for
    bit: rotate_half(x) is roll(x, half) with its first half negated, and that sign moves exactly onto sin
    (`sin_rot` = [-sin_1, sin_2])."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_rot


def attend_torch(qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, write_slots: torch.Tensor,
                 read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                 heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [rows, q_len, (heads + 2 kv_heads) * hd]; cos, sin_rot [rows, q_len, 1, hd] (each token's own rows of
    the tables); write_slots [rows * q_len]; read_slots [rows, T]; mask [rows, 1, q_len, T]; kc, vc [slots,
    kv_heads, hd] (the new K/V are written) -> [rows, q_len, heads * hd]."""
    rows, q_len, _ = qkv.shape
    hd = cos.shape[-1]
    qkv = qkv.view(rows, q_len, heads + 2 * kv_heads, hd)
    qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin_rot)  # [rows, q_len, heads + kv_heads, hd]
    q = qk[:, :, :heads].transpose(1, 2)  # [rows, heads, q_len, hd]
    k = qk[:, :, heads:]  # [rows, q_len, kv_heads, hd]
    v = qkv[:, :, heads + kv_heads:]  # [rows, q_len, kv_heads, hd]
    kc.index_copy_(0, write_slots, k.reshape(-1, kv_heads, hd))
    vc.index_copy_(0, write_slots, v.reshape(-1, kv_heads, hd))
    flat = read_slots.reshape(-1)  # index_select: ~1.5x faster than advanced indexing on CPU
    T = read_slots.shape[1]
    keys = kc.index_select(0, flat).view(rows, T, kv_heads, hd).transpose(1, 2)
    values = vc.index_select(0, flat).view(rows, T, kv_heads, hd).transpose(1, 2)
    # keys / values: [rows, kv_heads, T, head_dim]
    # grouped-query attention without materialising repeated K/V (the repeat was 40% of a beam step)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                         enable_gqa=heads != kv_heads)  # [rows, heads, q_len, hd]
    return out.transpose(1, 2).reshape(rows, q_len, heads * hd)


def decode_torch(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor,
                 write_slots: torch.Tensor, read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """`attend_torch` for a decode step in the kernel's arguments (`cpu_decode.Kernel.decode`): qkv [rows,
    width], positions [rows], the full tables cos, sin_rot [max_pos, hd], mask [rows, T] -> [rows, heads * hd]."""
    rows = qkv.shape[0]
    out = attend_torch(qkv[:, None], cos[positions][:, None, None], sin_rot[positions][:, None, None],
                       write_slots, read_slots, mask[:, None, None], kc, vc, heads, kv_heads)
    return out.view(rows, -1)


class Attention:
    """A model's attention core: the rotary tables and the choice of implementation."""

    def __init__(self, cos: torch.Tensor, sin_rot: torch.Tensor, heads: int, kv_heads: int):
        self.cos, self.sin_rot = cos, sin_rot  # [max_pos, head_dim] each
        self.heads, self.kv_heads = heads, kv_heads

    def kernel_for(self, q_len: int) -> Optional[cpu_decode.Kernel]:
        """The C decode kernel when it applies to a forward of `q_len` new tokens per row (a decode step, fp32
        on a CPU, this machine has it), else None."""
        if q_len != 1 or self.cos.device.type != "cpu" or self.cos.dtype != torch.float32:
            return None
        return cpu_decode.kernel(decode_torch)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_rot rows of each token [rows, q_len, 1, hd], for `attend_torch`."""
        return self.cos[positions][:, :, None], self.sin_rot[positions][:, :, None]
