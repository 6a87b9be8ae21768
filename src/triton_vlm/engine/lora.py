"""Per-row LoRA in one forward: different adapters (and none) for different rows of the same batch.

For each projection the A matrices of every adapter in the batch are stacked (`A_cat` [R, in], R = sum of
their ranks) and so are the B matrices (`B_cat` [out, R]); one forward then takes two GEMMs for all rows:

    h = x @ A_cat^T                      # [rows, q_len, R]
    h = h * mask                         # [rows, 1, R]: row i keeps its adapter's columns, times its scale
    delta = h @ B_cat^T                  # [rows, q_len, out]

(the idea of punica's SGMV / BGMV kernels, as dense GEMMs with a mask on the CPU). Measured on the benchmark
model, 16 requests with 4 adapters of ranks 8 / 16 mixed in every batch (`bench/lora_overhead.py`): 8% faster
than grouping rows by adapter (index_select + two GEMMs + index_copy per adapter) at beam 1, 20% at beam 4,
where the grouped form pays per-group overheads on many small GEMMs. A GPU deployment should use the punica
SGMV (prefill) / BGMV (decode) kernels instead, which skip the masked-out columns.

`Linear` adds the delta to the base output in fp32 and casts back, as PEFT does (`base(x) + lora_B(lora_A(x)) *
scaling` with fp32 adapter weights). The scale is applied between the two GEMMs here, after B in PEFT: the
same value up to float rounding (tests compare generated tokens and scores with PEFT). Rows without an adapter
get a zero mask, so their delta is exactly 0; a batch without any adapter builds nothing (base rows pay nothing).
The stacks of a set of adapters are cached across forwards (`StackCache`): consecutive decode steps of the
same requests reuse them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from ..lora.format import Adapter


class StackCache:
    """The stacks of the adapter sets of recent batches: set -> {(layer, module): (A_cat [R, in], B_cat [out, R],
    owner [R], scale [R])}, built lazily, at most `max_sets` sets (least recently used dropped).

    Consecutive decode steps of the same requests reuse one set's stacks. `drop(adapter)` forgets every set
    holding an adapter the device level evicted, so its memory is freed with it."""

    def __init__(self, max_sets: int = 4):
        self.max_sets = max_sets
        self._sets: "OrderedDict[tuple[int, ...], tuple[tuple[Adapter, ...], dict]]" = OrderedDict()

    def get(self, adapters: tuple[Adapter, ...], layer: int, module: str, device):
        key = tuple(id(a) for a in adapters)
        entry = self._sets.get(key)
        if entry is None or any(x is not y for x, y in zip(entry[0], adapters)):
            entry = (adapters, {})
            self._sets[key] = entry
            while len(self._sets) > self.max_sets:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        stacks = entry[1]
        if (layer, module) not in stacks:
            stacks[(layer, module)] = _stack(adapters, layer, module, device)
        return stacks[(layer, module)]

    def drop(self, adapter: Adapter) -> None:
        for key in [k for k, (adapters, _) in self._sets.items() if any(a is adapter for a in adapters)]:
            del self._sets[key]


def _stack(adapters: tuple[Adapter, ...], layer: int, module: str, device):
    parts = [(j, adapters[j].modules[(layer, module)]) for j in range(len(adapters))
             if (layer, module) in adapters[j].modules]
    if not parts:
        return None
    return (torch.cat([m.a for _, m in parts]).to(device),  # [R, in]
            torch.cat([m.b for _, m in parts], dim=1).to(device),  # [out, R]
            torch.tensor([j for j, m in parts for _ in range(m.rank)], device=device),  # [R]
            torch.tensor([m.scale for _, m in parts for _ in range(m.rank)], device=device))  # [R]


class LoraBatch:
    def __init__(self, row_adapters: list[Optional[Adapter]], stacks: StackCache, device):
        uniq: list[Adapter] = []
        for a in row_adapters:
            if a is not None and all(a is not u for u in uniq):
                uniq.append(a)
        self.adapters = tuple(uniq)
        # [rows] index of each row's adapter in self.adapters, -1 for none
        self.row_adapter = torch.tensor([-1 if a is None else next(i for i, u in enumerate(uniq) if u is a)
                                         for a in row_adapters], device=device)
        self.stacks, self.device = stacks, device
        self._masks: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, row_adapters: list[Optional[Adapter]], stacks: StackCache, device) -> Optional["LoraBatch"]:
        """None when no row has an adapter (the base model's forward, no overhead)."""
        if all(a is None for a in row_adapters):
            return None
        return cls(row_adapters, stacks, device)

    def delta(self, x: torch.Tensor, layer: int, module: str) -> Optional[torch.Tensor]:
        """x [rows, q_len, in] -> fp32 delta [rows, q_len, out], or None when no row adapts this module."""
        stack = self.stacks.get(self.adapters, layer, module, self.device)
        if stack is None:
            return None
        a_cat, b_cat, owner, scale = stack
        mask = self._masks.get(id(owner))
        if mask is None:  # [rows, 1, R]: the row's own adapter's columns, scaled
            mask = ((self.row_adapter[:, None] == owner[None, :]).to(torch.float32) * scale[None, :])[:, None]
            self._masks[id(owner)] = mask
        h = F.linear(x.to(torch.float32), a_cat) * mask  # [rows, q_len, R]
        return F.linear(h, b_cat)  # [rows, q_len, out]
