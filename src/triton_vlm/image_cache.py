"""An LRU cache of preprocessed images keyed by the encoded file's SHA-256, so the same image is not
processed twice (as vLLM caches multimodal processor outputs). Multi-turn chats resend every earlier image with each turn; a hit skips decoding, EXIF
handling, resizing and normalisation. Thread-safe; bounded by entry count (0 disables it)."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np


def image_key(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class ImageCache:
    def __init__(self, max_entries: int = 64):
        self.max_entries = max(0, int(max_entries))
        self._items: OrderedDict[bytes, np.ndarray] = OrderedDict()  # key -> pixel values [3, H, W]
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            px = self._items.get(key)
            if px is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return px

    def put(self, key: bytes, pixels: np.ndarray) -> None:
        if not self.max_entries:
            return
        pixels.setflags(write=False)  # shared between requests: never modified in place
        with self._lock:
            self._items[key] = pixels
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
