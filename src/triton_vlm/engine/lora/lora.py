"""Per-row LoRA in one forward: different adapters (and none) for different rows of the same batch.

For each projection the A matrices of every adapter in the batch are stacked (`A_cat` [R, in], R = sum of
their ranks) and so are the B matrices (`B_cat` [out, R]); one forward then takes two GEMMs for all rows:

    h = x @ A_cat^T                      # [rows, q_len, R]
    h = h * mask                         # [rows, 1, R]: row i keeps its adapter's columns, times its scale
    y += h @ B_cat^T                     # [rows, q_len, out], one addmm_ into the base output

(the idea of punica's SGMV / BGMV kernels, as dense GEMMs with a mask on the CPU). Measured on the benchmark
model, 16 requests with 4 adapters of ranks 8 / 16 mixed in every batch (`bench/engine/lora_overhead.py`): 8% faster
than grouping rows by adapter (index_select + two GEMMs + index_copy per adapter) at beam 1, 20% at beam 4,
where the grouped form pays per-group overheads on many small GEMMs (one A GEMM for q/k/v together was tried
too: no measurable gain, so not kept). A GPU deployment should use the punica
SGMV (prefill) / BGMV (decode) kernels instead, which skip the masked-out columns.

On a CPU a decode step of 1-4 rows adds the same deltas in C from these stacks and masks (`cpu_forward.py`).
`Linear` adds the delta to the base output in fp32 and casts back, as PEFT does (`base(x) + lora_B(lora_A(x)) *
scaling` with fp32 adapter weights). The scale is applied between the two GEMMs here, after B in PEFT: the
same value up to float rounding (tests compare generated tokens and scores with PEFT). Rows without an adapter
get a zero mask, so their delta is exactly 0; a batch without any adapter builds nothing (base rows pay nothing).
The stacks of a set of adapters are cached across forwards (`StackCache`, the set in one order whatever the rows'
order): consecutive decode steps of the same requests reuse them. A set of one fp32 adapter (registry adapters,
or wire adapters of an fp32 model) uses its tensors as they are; a set of one fp16 / bf16 adapter needs its
fp32 copies, and a set of several adapters their stacked fp32 copies: the cache charges exactly the bytes of the
tensors it allocated (measured on the tensors built, nothing for a tensor that shares the adapter's memory).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ...lora.format import Adapter


class Stack(NamedTuple):
    a: torch.Tensor  # [R, in]: the A matrices of the set's adapters that adapt this module, stacked
    b: torch.Tensor  # [out, R]: their B matrices, side by side
    layout: tuple  # ((adapter index in the set, rank, scale), ...): which columns belong to whom


@dataclass(eq=False)
class StackSet:
    """The stacks of one set of adapters: (layer, module) -> Stack (None: no adapter of the set adapts it)."""
    adapters: tuple[Adapter, ...]
    stacks: dict = field(default_factory=dict)
    nbytes: int = 0  # bytes of the tensors built for this set (copies only)
    views: dict = field(default_factory=dict)  # derived per-row-map views of the stacks (`cpu_forward`'s tables)


class StackCache:
    """The stacks of the adapter sets of recent batches, built lazily per projection (`build`).

    Consecutive decode steps of the same requests reuse one set's stacks. Bounded by `max_sets` sets and by
    `max_bytes` of built tensors, charged as each stack is built with the bytes it allocated (a stack that is
    the adapter's own fp32 tensors costs nothing): least recently used sets are dropped first, never the one in
    use. `drop(adapter)` forgets every set holding an adapter the device level evicted, so its memory is freed
    with it."""

    def __init__(self, max_sets: int = 8, max_bytes: Optional[int] = None):
        self.max_sets, self.max_bytes = max_sets, max_bytes
        self.used_bytes = 0
        self._sets: "OrderedDict[tuple[int, ...], StackSet]" = OrderedDict()  # least recently used first

    def set_for(self, adapters: tuple[Adapter, ...]) -> StackSet:
        """The StackSet of this set of adapters (no stacks yet when new); it becomes the most recent."""
        key = tuple(id(a) for a in adapters)
        entry = self._sets.get(key)
        if entry is None or any(x is not y for x, y in zip(entry.adapters, adapters)):
            if entry is not None:
                self._forget(key)
            entry = self._sets[key] = StackSet(adapters)
        self._sets.move_to_end(key)
        self._shrink(key)
        return entry

    def build(self, entry: StackSet, layer: int, module: str, device) -> Optional[Stack]:
        """Builds (layer, module)'s stack of `entry`, charging the bytes it allocated."""
        stack = entry.stacks[(layer, module)] = _stack(entry.adapters, layer, module, device)
        cost = 0 if stack is None else _new_bytes(stack, entry.adapters, layer, module)
        entry.nbytes += cost
        key = tuple(id(a) for a in entry.adapters)
        if self._sets.get(key) is entry:  # still cached (a set dropped meanwhile is freed with its batch)
            self.used_bytes += cost
            self._shrink(key)
        return stack

    def _shrink(self, keep) -> None:
        while len(self._sets) > 1 and (len(self._sets) > self.max_sets or
                                       (self.max_bytes is not None and self.used_bytes > self.max_bytes)):
            oldest = next(iter(self._sets))
            self._forget(oldest if oldest != keep else list(self._sets)[1])

    def _forget(self, key) -> None:
        self.used_bytes -= self._sets.pop(key).nbytes

    def drop(self, adapter: Adapter) -> None:
        for key in [k for k, e in self._sets.items() if any(a is adapter for a in e.adapters)]:
            self._forget(key)


def _new_bytes(stack: Stack, adapters: tuple[Adapter, ...], layer: int, module: str) -> int:
    """Bytes of the stack's tensors that do not share memory with the adapters' own tensors."""
    own = {t.untyped_storage().data_ptr() for a in adapters if (layer, module) in a.modules
           for t in (a.modules[(layer, module)].a, a.modules[(layer, module)].b)}
    return sum(t.nbytes for t in (stack.a, stack.b) if t.untyped_storage().data_ptr() not in own)


def _stack(adapters: tuple[Adapter, ...], layer: int, module: str, device) -> Optional[Stack]:
    parts = [(j, adapters[j].modules[(layer, module)]) for j in range(len(adapters))
             if (layer, module) in adapters[j].modules]
    if not parts:
        return None
    f32 = torch.float32  # the adapter math runs in fp32 (PEFT upcasts fp16 / bf16 adapter weights the same way)
    if len(parts) == 1:  # one adapter (a prefill, or a batch of one tenant): its own tensors when fp32
        m = parts[0][1]
        return Stack(m.a.to(device, f32), m.b.to(device, f32), ((parts[0][0], m.rank, m.scale),))
    return Stack(torch.cat([m.a.to(device, f32) for _, m in parts]),
                 torch.cat([m.b.to(device, f32) for _, m in parts], dim=1),
                 tuple((j, m.rank, m.scale) for j, m in parts))


class LoraBatch:
    def __init__(self, row_adapters: list[Optional[Adapter]], stacks: StackCache, device):
        uniq = sorted({id(a): a for a in row_adapters if a is not None}.items())  # one order for one set
        self.adapters = tuple(a for _, a in uniq)
        index = {k: i for i, (k, _) in enumerate(uniq)}
        self.row_key = tuple(-1 if a is None else index[id(a)] for a in row_adapters)  # the row -> adapter map
        # [rows] index of each row's adapter in self.adapters, -1 for none
        self.row_adapter = torch.tensor(self.row_key, device=device)
        self.device = device
        self._cache = stacks
        self._set = stacks.set_for(self.adapters)
        self._masks: dict[tuple, torch.Tensor] = {}  # layout -> [rows, 1, R]; one per layout, not per module

    @classmethod
    def build(cls, row_adapters: list[Optional[Adapter]], stacks: StackCache, device) -> Optional["LoraBatch"]:
        """None when no row has an adapter (the base model's forward, no overhead)."""
        if all(a is None for a in row_adapters):
            return None
        return cls(row_adapters, stacks, device)

    @property
    def views(self) -> dict:
        """A cache for views derived from this set's stacks and a row map (keyed by the caller, with `row_key`);
        it lives and dies with the set's stacks."""
        return self._set.views

    def stack(self, layer: int, module: str) -> Optional[Stack]:
        """(layer, module)'s stack of this batch's adapters, built on first use (None: none adapts it)."""
        stack = self._set.stacks.get((layer, module), _MISSING)
        if stack is _MISSING:
            stack = self._cache.build(self._set, layer, module, self.device)
        return stack

    def mask(self, layout: tuple) -> torch.Tensor:
        """[rows, 1, R]: row i keeps the columns of its own adapter, times that adapter's scale."""
        mask = self._masks.get(layout)
        if mask is None:
            owner = torch.tensor([j for j, r, _ in layout for _ in range(r)], device=self.device)  # [R]
            scale = torch.tensor([s for _, r, s in layout for _ in range(r)], dtype=torch.float32,
                                 device=self.device)  # [R]
            mask = row_mask(self.row_adapter, owner, scale)
            self._masks[layout] = mask
        return mask

    def add(self, x: torch.Tensor, y: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y [rows, q_len, out] (the base projection of x [rows, q_len, in]) plus every row's adapter delta,
        computed in fp32 (as PEFT) and added in place when y is fp32 (`addmm_`: B's GEMM and the sum in one)."""
        stack = self.stack(layer, module)
        if stack is None:  # no adapter of the batch adapts this module
            return y
        return add_masked_delta(x, y, stack.a, stack.b, self.mask(stack.layout))


def row_mask(row_slot: torch.Tensor, owner: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[rows, 1, R]: row i keeps the columns whose owner is its own (row_slot[i], -1: none), times their scale.
    row_slot [rows] int64, owner [R] int64, scale [R] fp32."""
    return ((row_slot[:, None] == owner[None, :]).to(torch.float32) * scale[None, :])[:, None]


def add_masked_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """y [rows, q_len, out] (the base projection of x [rows, q_len, in]) plus the masked stacked deltas: a [R, in],
    b [out, R] fp32, mask [rows, 1, R] (`row_mask`). In fp32 as PEFT; added in place when y is fp32 (`addmm_`: B's
    GEMM and the sum in one), else summed in fp32 and cast back. The one function of both the eager batches
    (`LoraBatch`) and the CUDA graphs' static slots (`graph_slots.GraphLoraBatch`); a column whose mask is 0 (another
    row's adapter, a zero-padded rank) adds exactly 0."""
    h = F.linear(x.to(torch.float32), a).mul_(mask)  # [rows, q_len, R]
    if y.dtype == torch.float32:
        y2 = y.view(-1, y.shape[-1])  # [rows * q_len, out]
        y2.addmm_(h.view(-1, h.shape[-1]), b.t())
        return y
    return (y.to(torch.float32) + F.linear(h, b)).to(y.dtype)  # the sum in fp32, then the model's dtype


_MISSING = object()
