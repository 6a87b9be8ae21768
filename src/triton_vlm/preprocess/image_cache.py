"""An LRU cache of preprocessed images keyed by the encoded file's SHA-256, so the same image is not
processed twice (as vLLM caches multimodal processor outputs). Multi-turn chats resend every earlier image with each turn; a hit skips decoding, EXIF
handling, resizing and normalisation. Thread-safe; bounded by entry count (0 disables it).
The key is computed by preprocess from the bytes it received (`image_key`), never taken from a client, and it
stays inside preprocess: the vision model keys its embeddings by the pixels it receives (issue 24)."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def image_key(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class ProcessedImage:
    """One image as preprocess keeps it: its tiles and the size they were cut from."""

    pixels: np.ndarray  # [tiles, 3, H, W] float32 (one tile for fixed-size families), read-only once cached
    size: tuple[int, int]  # (height, width) of the decoded image (EXIF orientation applied)


class ImageCache:
    def __init__(self, max_entries: int = 64):
        self.max_entries = max(0, int(max_entries))
        self._items: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> ProcessedImage | None:
        with self._lock:
            px = self._items.get(key)
            if px is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return px

    def put(self, key: bytes, image: ProcessedImage) -> None:
        if not self.max_entries:
            return
        image.pixels.setflags(write=False)  # shared between requests: never modified in place
        with self._lock:
            self._items[key] = image
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
