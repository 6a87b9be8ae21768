"""LoRA adapters as inputs of the CUDA graphs of decode steps: static, stacked slot buffers (vLLM's design).

A captured graph reads fixed addresses, so the adapters a graphed decode step applies live in buffers allocated
once, at start, and never reallocated: for every (layer, module) the engine may adapt (the seven Llama projections
of every layer),

    a [S * r, in]    fp32: slot s's A in rows s*r .. s*r + rank, zero below its rank
    b [out, S * r]   fp32: slot s's B in the same columns, zero past its rank
    scale [S * r]    fp32: the adapter's scale in its rank's columns, 0 elsewhere (and in an empty slot)

S = `max_loras` (the engine's device adapter slots) or fewer: as many as fit `lora_cache_device_mb` (`slot_count`),
r = `cuda_graph_lora_rank`. A step's rows name their slot in
one more int64 column of the step's input buffer (`cuda_graph.Bucket.lora_slots`, -1: no adapter), and each projection
adds `lora.add_masked_delta(x, y, a, b, row_mask(slots, owner, scale))`: the same function, in the same order of
operations, as the eager batches (`lora.LoraBatch`), over every slot's columns. A column of another slot or past an
adapter's rank has mask 0 (and zero A / B), so it adds exactly 0; a row without an adapter gets y + 0 = y, bit for
bit its value without LoRA. What can differ from the eager path is the blocking of the two GEMMs (R = S * r columns
instead of the batch's own ranks): fp32 rounding in the deltas' last bits (tests: logits within 1e-5, tokens equal).

Loading an adapter into a slot (`assign`, before the step's inputs are copied) writes its tensors into the slot's
rows / columns (`copy_`, upcast to fp32: exact for fp16 / bf16) after zeroing them: stream-ordered with the replays,
and no buffer is ever replaced, so every captured graph stays valid. Slots are reassigned least recently used first,
never to an adapter of the same step; a slot is keyed by the device adapter object (held by a weak reference: an
adapter the device level evicted frees its memory, and its slot is then free). A step whose adapters do not fit
(a rank above r, a module outside the buffers, more distinct adapters than S) runs eager.

Memory: `buffer_bytes` = S * r * sum over layers and modules of (in + out + 1) * 4 bytes, taken from the KV budget
at start (`profile.py`, part `cuda_graphs`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...lora.format import MODULE_IDS, Adapter, module_shape
from .lora import add_masked_delta, row_mask

F32 = torch.float32


def slot_count(spec, max_loras: int, rank: int, budget_bytes: int) -> int:
    """How many static slots of rank `rank` the graphs hold: `max_loras`, fewer where they would not fit the LoRA
    device budget (`lora_cache_device_mb`): a 7B Llama's slot of rank 16 is ~153 MiB in fp32, so the default 256 MiB
    holds one (raise the budget for more). 0 (no LoRA graphs) where not even one fits."""
    one = buffer_bytes(spec, 1, rank)
    return min(max_loras, budget_bytes // one) if one else 0


def buffer_bytes(spec, slots: int, rank: int) -> int:
    """Bytes of the static buffers for `slots` adapters of rank <= `rank` on a model of this `TextSpec`."""
    per_rank = sum(n_in + n_out + 1 for n_in, n_out in (module_shape(spec, m) for m in MODULE_IDS))
    return slots * rank * per_rank * spec.num_layers * F32.itemsize


@dataclass(eq=False)
class SlotBuffers:
    a: torch.Tensor  # [S * r, in]
    b: torch.Tensor  # [out, S * r]
    scale: torch.Tensor  # [S * r]


class GraphAdapters:
    """The static slot buffers (module doc) of one model, and which adapter each slot holds."""

    def __init__(self, spec, slots: int, rank: int, device: torch.device):
        self.slots, self.rank, self.device = slots, rank, torch.device(device)
        width = slots * rank
        self.buffers: dict[tuple[int, str], SlotBuffers] = {}
        for layer in range(spec.num_layers):
            for module in MODULE_IDS:
                n_in, n_out = module_shape(spec, module)
                self.buffers[(layer, module)] = SlotBuffers(torch.zeros(width, n_in, dtype=F32, device=device),
                                                            torch.zeros(n_out, width, dtype=F32, device=device),
                                                            torch.zeros(width, dtype=F32, device=device))
        self.owner = torch.arange(slots, device=device).repeat_interleave(rank)  # [S * r]: column -> slot
        self._held: list[Optional[weakref.ref]] = [None] * slots  # slot -> its adapter (a weak reference)
        self._used = [0] * slots  # slot -> the last step that used it (least recently used first)
        self._clock = 0
        self.loads = 0  # adapters copied into a slot (monitoring, tests)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.buffers.values() for t in (s.a, s.b, s.scale))

    def fits(self, adapter: Adapter) -> bool:
        return all(m.rank <= self.rank and key in self.buffers for key, m in adapter.modules.items())

    def _slot_of(self, adapter: Adapter) -> int:
        for s, ref in enumerate(self._held):
            if ref is not None and ref() is adapter:
                return s
        return -1

    def assign(self, row_adapters: Sequence[Optional[Adapter]]) -> Optional[list[int]]:
        """Each row's slot (-1: no adapter), loading the step's adapters that hold none; None (nothing loaded) when
        they do not fit (module doc): the step runs eager."""
        uniq = list({id(a): a for a in row_adapters if a is not None}.values())
        if len(uniq) > self.slots or not all(self.fits(a) for a in uniq):
            return None
        self._clock += 1
        where = {id(a): self._slot_of(a) for a in uniq}
        taken = {s for s in where.values() if s >= 0}
        for a in uniq:
            if where[id(a)] < 0:
                free = [s for s in range(self.slots) if s not in taken]
                s = min(free, key=lambda k: (self._held[k] is not None and self._held[k]() is not None,
                                             self._used[k]))  # an empty slot first, then least recently used
                self.load(s, a)
                where[id(a)] = s
                taken.add(s)
        for s in taken:
            self._used[s] = self._clock
        return [-1 if a is None else where[id(a)] for a in row_adapters]

    @torch.inference_mode()
    def load(self, slot: int, adapter: Adapter) -> None:
        """Copy `adapter` into `slot`'s rows / columns of every buffer (the others' untouched, none reallocated)."""
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        for key, buf in self.buffers.items():
            buf.a[cols].zero_()
            buf.b[:, cols].zero_()
            buf.scale[cols].zero_()
            m = adapter.modules.get(key)
            if m is None:
                continue
            r = m.rank
            buf.a[cols][:r].copy_(m.a)
            buf.b[:, cols][:, :r].copy_(m.b)
            buf.scale[cols][:r].fill_(m.scale)
        self._held[slot] = weakref.ref(adapter)
        self.loads += 1

    def batch(self, row_slots: torch.Tensor) -> "GraphLoraBatch":
        return GraphLoraBatch(self, row_slots)


class GraphLoraBatch:
    """The adapter batch of one graphed step (`model.AdapterBatch`): row_slots [B] int64, a view of the step's
    static inputs; the masks are computed inside the step (inside the graph)."""

    def __init__(self, slots: GraphAdapters, row_slots: torch.Tensor):
        self.slots, self.row_slots = slots, row_slots

    def add(self, x: torch.Tensor, y: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        buf = self.slots.buffers.get((layer, module))
        if buf is None:  # lm_head: no adapter targets it
            return y
        return add_masked_delta(x, y, buf.a, buf.b, row_mask(self.row_slots, self.slots.owner, buf.scale))
