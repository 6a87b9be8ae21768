"""Adapters by `lora_task_id`, as TensorRT-LLM's LoRA cache: the first request carries id + weights + config,
later ones the id alone; ids the server's registry knows are loaded from disk on a miss.

This is the host level (`lora_cache_host_mb`), least recently used evicted first; the device level, the slots the
batched adapter math reads, is the engine's (`engine/adapter_slots.py`). A request holds its own reference to
its adapter, so evicting or replacing an id never changes a request already resolved. Wire adapters are named
by their task id, registry adapters by their folder name (the names metrics and the LoRA gauge show).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import InvalidArgument
from ..spec import TextSpec
from .format import MAX_RANK, Adapter, from_trtllm
from .registry import Registry


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    registry_loads: int = 0
    evictions: int = 0


@dataclass
class AdapterCache:
    spec: TextSpec
    registry: Registry
    max_bytes: int
    max_rank: int = MAX_RANK  # max_lora_rank: adapters of a higher rank are refused
    stats: CacheStats = field(default_factory=CacheStats)
    _items: "OrderedDict[int, Adapter]" = field(default_factory=OrderedDict)
    used_bytes: int = 0

    def __len__(self) -> int:
        return len(self._items)

    def resolve(self, task_id: Optional[int], weights: Optional[np.ndarray], config: Optional[np.ndarray],
                name: Optional[str]) -> Optional[Adapter]:
        """The adapter a request asks for (None: the base model); InvalidArgument says what is wrong."""
        if (weights is None) != (config is None):
            raise InvalidArgument("lora_weights and lora_config must be sent together (got only "
                                  f"{'lora_weights' if weights is not None else 'lora_config'})")
        if name is not None:
            self.registry.path(name)  # a name outside the registry is refused before anything is cached
            tid = self.registry.task_id(name)
            if task_id is not None and task_id != tid:
                raise InvalidArgument(f"lora_name {name!r} is task id {tid} but lora_task_id {task_id} was sent")
            return self._get_or_load(tid, name)
        if weights is not None:
            if task_id is None:
                raise InvalidArgument("lora_weights and lora_config need a lora_task_id to cache them under")
            adapter = from_trtllm(str(task_id), weights, config, self.spec, self.max_rank)
            self._put(task_id, adapter)
            return adapter
        if task_id is None:
            return None
        return self._get_or_load(task_id, self.registry.find_id(task_id))

    def _get_or_load(self, task_id: int, name: Optional[str]) -> Adapter:
        adapter = self._items.get(task_id)
        if adapter is not None:
            self._items.move_to_end(task_id)
            self.stats.hits += 1
            return adapter
        self.stats.misses += 1
        if name is None:
            raise InvalidArgument(f"LoRA task {task_id} not found in cache. Please send LoRA weights with request")
        adapter = self.registry.load(name)
        if adapter.max_rank > self.max_rank:
            raise InvalidArgument(f"LoRA adapter {name!r} has rank {adapter.max_rank}; Invalid low_rank (r): must be "
                                  f"<= {self.max_rank} (max_lora_rank)")
        self.stats.registry_loads += 1
        self._put(task_id, adapter)
        return adapter

    def _put(self, task_id: int, adapter: Adapter) -> None:
        size = adapter.nbytes
        if size > self.max_bytes:
            raise InvalidArgument(f"LoRA task {task_id} needs {size} bytes, more than the whole adapter cache "
                                  f"({self.max_bytes} bytes, lora_cache_host_mb)")
        old = self._items.pop(task_id, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        while self.used_bytes + size > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.used_bytes -= evicted.nbytes
            self.stats.evictions += 1
        self._items[task_id] = adapter
        self.used_bytes += size
