"""The device level of the LoRA cache: the adapters resident where the batched adapter math reads them.

The host level (`lora.cache.AdapterCache`) resolves a request's adapter by task id; this level decides which of
those adapters may be used by running requests at once, as TensorRT-LLM's device LoRA cache and vLLM's
`max_loras` slots do:

- a budget of `max_adapters` slots and `max_bytes` bytes (`lora_cache_device_mb`);
- `acquire(adapter)` at admission: a resident adapter gains a reference; another one is copied to the model's
  device, evicting idle adapters (no reference) least recently used first. It returns None when the budget is
  held by adapters running requests use: the request waits in the queue (`Policy._fits`), it is not failed;
- `release(adapter)` when the request ends; the adapter stays resident (idle) until evicted;
- `check(adapter)` at submit: an adapter larger than the whole level can never run (InvalidArgument, sizes).

A slot is charged the adapter's size (`Adapter.nbytes`, its tensors in their own dtype): what the copy to a GPU
allocates; on a CPU device the "copy" is the host adapter itself (`Tensor.to` returns it), and the budget still
bounds how many adapters running requests may use at once. The fp32 stacks the adapter math builds from the
resident adapters are charged by the engine's `lora.StackCache`, against a budget of the same size.

Entries are keyed by the host `Adapter` object: resending weights for a cached task id creates a new object, so
requests already running keep the old copy and later ones get the new one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ...errors import InvalidArgument
from ...lora.format import Adapter


@dataclass
class SlotStats:
    hits: int = 0  # admissions whose adapter was resident
    misses: int = 0  # admissions that copied their adapter in
    evictions: int = 0


@dataclass(eq=False)
class _Slot:
    host: Adapter
    device: Adapter
    nbytes: int
    refs: int = 0


@dataclass
class DeviceAdapters:
    max_adapters: int
    max_bytes: int
    device: torch.device = torch.device("cpu")
    on_evict: Optional[Callable[[Adapter], None]] = None  # told of every device copy dropped
    stats: SlotStats = field(default_factory=SlotStats)
    used_bytes: int = 0
    _slots: "OrderedDict[int, _Slot]" = field(default_factory=OrderedDict)  # id(host adapter) -> slot, LRU first

    def __len__(self) -> int:
        return len(self._slots)

    def check(self, adapter: Adapter) -> None:
        size = adapter.nbytes
        if size > self.max_bytes or self.max_adapters < 1:
            raise InvalidArgument(
                f"LoRA adapter {adapter.name!r} needs {size} bytes; the device adapter cache holds "
                f"{self.max_bytes} bytes (lora_cache_device_mb) in {self.max_adapters} slots (max_loras)")

    def acquire(self, adapter: Adapter) -> Optional[Adapter]:
        """The device copy of `adapter`, referenced until `release`; None while the budget is in use."""
        slot = self._slots.get(id(adapter))
        if slot is not None:
            self._slots.move_to_end(id(adapter))
            self.stats.hits += 1
        else:
            size = adapter.nbytes
            if not self._make_room(size):
                return None
            slot = _Slot(adapter, adapter.to(self.device), size)
            self._slots[id(adapter)] = slot
            self.used_bytes += size
            self.stats.misses += 1
        slot.refs += 1
        return slot.device

    def release(self, adapter: Adapter) -> None:
        slot = self._slots.get(id(adapter))
        if slot is not None and slot.refs > 0:
            slot.refs -= 1

    def _make_room(self, size: int) -> bool:
        """Evict idle adapters, least recently used first, until `size` more bytes and one more slot fit;
        False (evicting nothing) when the adapters in use leave too little."""
        idle = [k for k, s in self._slots.items() if s.refs == 0]
        held = sum(s.nbytes for s in self._slots.values() if s.refs > 0)
        if len(self._slots) - len(idle) + 1 > self.max_adapters or held + size > self.max_bytes:
            return False
        for k in idle:
            if len(self._slots) < self.max_adapters and self.used_bytes + size <= self.max_bytes:
                break
            slot = self._slots.pop(k)
            self.used_bytes -= slot.nbytes
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(slot.device)
        return True
