"""Adapters by `lora_task_id`, as TensorRT-LLM's LoRA cache: the first request carries id + weights + config,
later ones the id alone; ids the server's registry knows are loaded from disk on a miss.

This is the host level (`lora_cache_host_mb`), least recently used evicted first; the device level, the slots the
batched adapter math reads, is the engine's (`engine/lora/adapter_slots.py`). A request holds its own reference to
its adapter, so evicting or replacing an id never changes a request already resolved. Wire adapters are named
by their task id, registry adapters by their folder name (the names metrics and the LoRA gauge show).

Two namespaces: registry adapters are keyed by their name, wire adapters by their task id, so weights sent over
the wire can never take the place of a registry adapter (`request.parse_request` also refuses weights sent under
a registry id; should a folder appear later under an id that was uploaded earlier, the registry's adapter wins).
Wire ids themselves are shared by every client, as in TensorRT-LLM: weights sent again under a wire id replace
that adapter for every later request; an adapter that must not be replaceable belongs in the registry.

A third namespace, folders (`tensorrt_llm`'s `lora_id` + `lora_path`, `resolve_path`): the first request binds its
`lora_id` to the folder's real path for the server's lifetime; a request sending another folder under that id is
refused (no client can change what another's id resolves to), as are ids of the registry or of uploaded
weights. The adapter is cached like the others (same budget, same LRU) and read again from its folder after an
eviction.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..errors import InvalidArgument
from ..spec import TextSpec
from .format import MAX_RANK, Adapter
from .paths import resolve_lora_path
from .peft import load_peft
from .registry import Registry
from .request import LoraRequest


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
    wire_dtype: torch.dtype = torch.float32  # the model's dtype: FP16 wire weights are cast to it
    stats: CacheStats = field(default_factory=CacheStats)
    # ("registry", name) or ("wire", task id) -> adapter, least recently used first
    _items: "OrderedDict[tuple[str, object], Adapter]" = field(default_factory=OrderedDict)
    used_bytes: int = 0
    path_roots: tuple[Path, ...] = ()  # lora_root: the folders `lora_path` may name (none: lora_path refused)
    _bound: dict[int, Path] = field(default_factory=dict)  # lora_id -> the folder it was first sent with

    def __len__(self) -> int:
        return len(self._items)

    def resolve(self, req: Optional[LoraRequest]) -> Optional[Adapter]:
        """The adapter of a checked request (`request.parse_request`); None: the base model. Weights sent with
        the request (re)place their wire task id's entry; an id alone is a hit, or loaded from the registry (a
        registry id or name always resolves to the registry's adapter, never to uploaded weights)."""
        if req is None:
            return None
        if req.wire is not None:
            if req.task_id in self._bound:
                raise InvalidArgument(f"lora_task_id {req.task_id} is bound to an adapter folder (lora_path); send "
                                      "your weights under another lora_task_id")
            self._put(("wire", req.task_id), req.task_id, req.wire)
            return req.wire
        return self._get_or_load(req.task_id, req.name)

    def resolve_path(self, lora_id: Optional[int], path: str) -> Adapter:
        """The adapter of the PEFT folder `path` (under `path_roots`), cached under `lora_id`, which is bound to
        that folder from its first use on; another folder under a bound id is refused, as are ids the registry
        or uploaded weights hold."""
        if lora_id is None:
            raise InvalidArgument(f"lora_path {path!r} needs a lora_id to cache the adapter under")
        real = resolve_lora_path(path, self.path_roots)
        bound = self._bound.get(lora_id)
        if bound is not None and bound != real:
            raise InvalidArgument(f"lora_id {lora_id} is bound to another adapter folder; a lora_id keeps the "
                                  "folder it was first sent with: send this folder under another lora_id")
        owner = self.registry.find_id(lora_id)
        if owner is not None or ("wire", lora_id) in self._items:
            what = f"the registry adapter {owner!r}" if owner is not None else "adapter weights sent with lora_weights"
            raise InvalidArgument(f"lora_id {lora_id} belongs to {what}; send this folder under another lora_id")
        key = ("path", lora_id)
        adapter = self._items.get(key)
        if adapter is not None:
            self._items.move_to_end(key)
            self.stats.hits += 1
            return adapter
        self.stats.misses += 1
        adapter = load_peft(real, self.spec, f"lora_id {lora_id}")
        if adapter.max_rank > self.max_rank:
            raise InvalidArgument(f"lora_path {path!r} has rank {adapter.max_rank}; Invalid low_rank (r): must be "
                                  f"<= {self.max_rank} (max_lora_rank)")
        self.stats.registry_loads += 1
        self._put(key, lora_id, adapter)
        self._bound.setdefault(lora_id, real)  # bound once it loaded (a broken folder binds nothing)
        return adapter

    def _get_or_load(self, task_id: int, name: Optional[str]) -> Adapter:
        if name is None and task_id in self._bound:  # an id bound to a folder, sent alone
            return self.resolve_path(task_id, str(self._bound[task_id]))
        key = ("wire", task_id) if name is None else ("registry", name)
        adapter = self._items.get(key)
        if adapter is not None:
            self._items.move_to_end(key)
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
        self._put(key, task_id, adapter)
        return adapter

    def _put(self, key: tuple[str, object], task_id: int, adapter: Adapter) -> None:
        size = adapter.nbytes
        if size > self.max_bytes:
            raise InvalidArgument(f"LoRA task {task_id} needs {size} bytes, more than the whole adapter cache "
                                  f"({self.max_bytes} bytes, lora_cache_host_mb)")
        old = self._items.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        while self.used_bytes + size > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.used_bytes -= evicted.nbytes
            self.stats.evictions += 1
        self._items[key] = adapter
        self.used_bytes += size
