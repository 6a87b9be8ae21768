"""Per-row LoRA in one forward: different adapters (and none) for different rows of the same batch.

For each projection the A matrices of every adapter in the batch are stacked (`A_cat` [R, in], R = sum of
their ranks) and so are the B matrices (`B_cat` [out, R]); one forward then takes two GEMMs for all rows:

    h = x @ A_cat^T                      # [rows, q_len, R]
    h = h * mask                         # [rows, 1, R]: row i keeps its adapter's columns, times its scale
    y += h @ B_cat^T                     # [rows, q_len, out], one addmm_ into the base output

(the idea of punica's SGMV / BGMV kernels, as dense GEMMs with a mask on the CPU). Measured on the benchmark
model, 16 requests with 4 adapters of ranks 8 / 16 mixed in every batch (`bench/lora_overhead.py`): 8% faster
than grouping rows by adapter (index_select + two GEMMs + index_copy per adapter) at beam 1, 20% at beam 4,
where the grouped form pays per-group overheads on many small GEMMs (one A GEMM for q/k/v together was tried
too: no measurable gain, so not kept). A GPU deployment should use the punica
SGMV (prefill) / BGMV (decode) kernels instead, which skip the masked-out columns.

`Linear` adds the delta to the base output in fp32 and casts back, as PEFT does (`base(x) + lora_B(lora_A(x)) *
scaling` with fp32 adapter weights). The scale is applied between the two GEMMs here, after B in PEFT: the
same value up to float rounding (tests compare generated tokens and scores with PEFT). Rows without an adapter
get a zero mask, so their delta is exactly 0; a batch without any adapter builds nothing (base rows pay nothing).
The stacks of a set of adapters are cached across forwards (`StackCache`, the set in one order whatever the rows'
order): consecutive decode steps of the same requests reuse them, and a set of one adapter uses its tensors as
they are.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..lora.format import Adapter


class Stack(NamedTuple):
    a: torch.Tensor  # [R, in]: the A matrices of the set's adapters that adapt this module, stacked
    b: torch.Tensor  # [out, R]: their B matrices, side by side
    layout: tuple  # ((adapter index in the set, rank, scale), ...): which columns belong to whom


class StackCache:
    """The stacks of the adapter sets of recent batches: set -> {(layer, module): Stack or None}, built lazily.

    Consecutive decode steps of the same requests reuse one set's stacks. Bounded by `max_sets` sets and by
    `max_bytes` of stacked copies (a set of several adapters costs about the sum of their sizes once built; a
    set of one adapter uses its tensors and costs nothing): least recently used sets are dropped first, never the
    one just asked for. `drop(adapter)` forgets every set holding an adapter the device level evicted, so its
    memory is freed with it."""

    def __init__(self, max_sets: int = 8, max_bytes: Optional[int] = None):
        self.max_sets, self.max_bytes = max_sets, max_bytes
        self.used_bytes = 0
        # key -> (adapters, {(layer, module): Stack or None}, bytes of copies)
        self._sets: "OrderedDict[tuple[int, ...], tuple[tuple[Adapter, ...], dict, int]]" = OrderedDict()

    def set_for(self, adapters: tuple[Adapter, ...]) -> dict:
        """The (layer, module) -> Stack dict of this set of adapters (empty when new)."""
        key = tuple(id(a) for a in adapters)
        entry = self._sets.get(key)
        if entry is None or any(x is not y for x, y in zip(entry[0], adapters)):
            if entry is not None:
                self._forget(key)
            cost = sum(a.nbytes for a in adapters) if len(adapters) > 1 else 0
            entry = (adapters, {}, cost)
            self._sets[key] = entry
            self.used_bytes += cost
        self._sets.move_to_end(key)
        while len(self._sets) > 1 and (len(self._sets) > self.max_sets or
                                       (self.max_bytes is not None and self.used_bytes > self.max_bytes)):
            self._forget(next(iter(self._sets)))
        return entry[1]

    def _forget(self, key) -> None:
        self.used_bytes -= self._sets.pop(key)[2]

    def drop(self, adapter: Adapter) -> None:
        for key in [k for k, (adapters, _, _) in self._sets.items() if any(a is adapter for a in adapters)]:
            self._forget(key)


def _stack(adapters: tuple[Adapter, ...], layer: int, module: str, device) -> Optional[Stack]:
    parts = [(j, adapters[j].modules[(layer, module)]) for j in range(len(adapters))
             if (layer, module) in adapters[j].modules]
    if not parts:
        return None
    f32 = torch.float32  # the adapter math runs in fp32 (PEFT upcasts fp16 / bf16 adapter weights the same way)
    if len(parts) == 1:  # one adapter (a prefill, or a batch of one tenant): its own fp32 tensors, no copy
        m = parts[0][1]
        return Stack(m.a.to(device, f32), m.b.to(device, f32), ((parts[0][0], m.rank, m.scale),))
    return Stack(torch.cat([m.a for _, m in parts]).to(device, f32),
                 torch.cat([m.b for _, m in parts], dim=1).to(device, f32),
                 tuple((j, m.rank, m.scale) for j, m in parts))


class LoraBatch:
    def __init__(self, row_adapters: list[Optional[Adapter]], stacks: StackCache, device):
        uniq = sorted({id(a): a for a in row_adapters if a is not None}.items())  # one order for one set
        self.adapters = tuple(a for _, a in uniq)
        index = {k: i for i, (k, _) in enumerate(uniq)}
        # [rows] index of each row's adapter in self.adapters, -1 for none
        self.row_adapter = torch.tensor([-1 if a is None else index[id(a)] for a in row_adapters], device=device)
        self.device = device
        self._stacks = stacks.set_for(self.adapters)
        self._masks: dict[tuple, torch.Tensor] = {}  # layout -> [rows, 1, R]; one per layout, not per module

    @classmethod
    def build(cls, row_adapters: list[Optional[Adapter]], stacks: StackCache, device) -> Optional["LoraBatch"]:
        """None when no row has an adapter (the base model's forward, no overhead)."""
        if all(a is None for a in row_adapters):
            return None
        return cls(row_adapters, stacks, device)

    def _mask(self, layout: tuple) -> torch.Tensor:
        """[rows, 1, R]: row i keeps the columns of its own adapter, times that adapter's scale."""
        mask = self._masks.get(layout)
        if mask is None:
            owner = torch.tensor([j for j, r, _ in layout for _ in range(r)], device=self.device)  # [R]
            scale = torch.tensor([s for _, r, s in layout for _ in range(r)], device=self.device)  # [R]
            mask = ((self.row_adapter[:, None] == owner[None, :]).to(torch.float32) * scale[None, :])[:, None]
            self._masks[layout] = mask
        return mask

    def add(self, x: torch.Tensor, y: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y [rows, q_len, out] (the base projection of x [rows, q_len, in]) plus every row's adapter delta,
        computed in fp32 (as PEFT) and added in place when y is fp32 (`addmm_`: B's GEMM and the sum in one)."""
        key = (layer, module)
        stack = self._stacks.get(key, _MISSING)
        if stack is _MISSING:
            stack = self._stacks[key] = _stack(self.adapters, layer, module, self.device)
        if stack is None:  # no adapter of the batch adapts this module
            return y
        h = F.linear(x.to(torch.float32), stack.a).mul_(self._mask(stack.layout))  # [rows, q_len, R]
        if y.dtype == torch.float32:
            y2 = y.view(-1, y.shape[-1])  # [rows * q_len, out]
            y2.addmm_(h.view(-1, h.shape[-1]), stack.b.t())
            return y
        return (y.to(torch.float32) + F.linear(h, stack.b)).to(y.dtype)  # the sum in fp32, then the model's dtype


_MISSING = object()
