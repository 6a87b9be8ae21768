"""Projected image embeddings by image content, as vLLM's encoder cache (keyed by a content hash of the image).

Keys are the SHA-256 of the pixels the vision model received (`service.content_digest`, never a key a client
sends) within a namespace of checkpoint content + backend + dtype, so a changed checkpoint or backend never reuses
another's embeddings. An LRU bounded
in bytes (`embedding_cache_mb`); an entry larger than the whole cache is not kept. Entries are tensors shared
(never modified) by every request that hits them. Used by the vision model's one execute thread (no lock needed).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class EmbeddingCache:
    max_bytes: int
    namespace: str  # checkpoint content key + backend + dtype
    stats: CacheStats = field(default_factory=CacheStats)
    used_bytes: int = 0
    _items: "OrderedDict[bytes, torch.Tensor]" = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._items)

    def key(self, digest: bytes) -> bytes:
        """The cache key of an image's content digest."""
        return hashlib.sha256(f"{self.namespace}\n".encode() + digest).digest()

    def get(self, key: bytes) -> Optional[torch.Tensor]:
        hit = self._items.get(key)
        if hit is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        return hit

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        """embeds [T, hidden] of one image (kept on its device, in the encoder's dtype)."""
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = embeds.clone()  # its own copy, not a view of the batch; never modified after
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
            self.stats.evictions += 1
