"""Per-row LoRA in one forward: different adapters (and none) for different rows of the same batch.

`LoraBatch(row_adapters)` groups the forward's rows by adapter (punica's segmented idea, with index lists
instead of sorted segments: the runner's rows stay in request order). For each projection it computes, for
every group whose adapter adapts that (layer, module),

    delta[rows] = (x[rows] @ A^T) @ B^T * scale        # x [rows, q_len, in] -> [rows, q_len, out], fp32

and `Linear` adds it to the base output the way PEFT does (`base(x) + lora_B(lora_A(x)) * scaling`, the sum in
fp32, adapter weights in fp32). Beam search rows of one request all use the request's adapter.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..lora.format import Adapter


class LoraBatch:
    def __init__(self, row_adapters: list[Optional[Adapter]], device: torch.device | str = "cpu"):
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, adapter in enumerate(row_adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        self.rows = len(row_adapters)
        # [(adapter, row indices or None when it covers every row)]
        self.groups = [(a, None if len(idx) == self.rows else torch.tensor(idx, dtype=torch.long, device=device))
                       for a, idx in groups.values()]

    @classmethod
    def build(cls, row_adapters: list[Optional[Adapter]], device) -> Optional["LoraBatch"]:
        """None when no row has an adapter (the base model's forward, no overhead)."""
        if all(a is None for a in row_adapters):
            return None
        return cls(row_adapters, device)

    def delta(self, x: torch.Tensor, layer: int, module: str) -> Optional[torch.Tensor]:
        out: Optional[torch.Tensor] = None
        for adapter, idx in self.groups:
            m = adapter.modules.get((layer, module))
            if m is None:
                continue
            xs = (x if idx is None else x.index_select(0, idx)).to(torch.float32)  # [n, q_len, in]
            d = F.linear(F.linear(xs, m.a), m.b) * m.scale  # [n, q_len, out]
            if idx is None:
                return d
            if out is None:
                out = torch.zeros(x.shape[0], x.shape[1], m.b.shape[0], dtype=torch.float32, device=x.device)
            out.index_copy_(0, idx, d)
        return out
