"""The vision model's work for one `execute()`: the images of every queued request, encoded together, each image
at most once, cached embeddings reused.

`VisionService.encode(requests)` takes, per request, its pixel values [n_i, 3, H, W] (or None) and its images'
content keys (n_i SHA-256 hex strings from preprocess, or None) and returns, per request, its embeddings
[n_i, T, hidden] (torch, in `out_dtype`, on the backend's device: a GPU backend's embeddings never touch host
memory) or the InvalidArgument its input raised (the others are unaffected). Images found in the embedding
cache are not encoded; the rest, deduplicated by key across requests, go to the backend `max_batch` at a time.
`build(model_dir, params)` makes the backend, the cache and the service from the model's parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import InvalidArgument
from .backends import BackendSettings, make_backend
from .cache import EmbeddingCache
from .encoder import VisionSettings, check_pixel_values

log = logging.getLogger("triton_vlm")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class VisionStats:
    images_encoded: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # encoder calls since the last `take_batches()`

    def take_batches(self) -> list[int]:
        out, self.batch_sizes = self.batch_sizes, []
        return out


@dataclass
class _Request:
    pixels: np.ndarray  # [n, 3, H, W]
    keys: list  # per image: the cache key (bytes) or None (no content key sent)
    slots: list  # per image: index into the encoded batch, or the cached embeddings


class VisionService:
    def __init__(self, backend, image_size: int, tokens: int, hidden: int,
                 cache: Optional[EmbeddingCache] = None, out_dtype: torch.dtype = torch.float32):
        self.backend, self.image_size, self.tokens, self.hidden = backend, image_size, tokens, hidden
        self.cache, self.out_dtype = cache, out_dtype
        self.stats = VisionStats()

    def encode(self, requests: Sequence[tuple[Optional[np.ndarray], Optional[Sequence[str]]]]) -> list:
        parsed, todo, todo_keys = [], [], {}
        for pixels, keys in requests:
            try:
                parsed.append(self._plan(pixels, keys, todo, todo_keys))
            except InvalidArgument as e:
                parsed.append(e)
        embeds = self._run(todo)  # [len(todo), T, hidden]
        out = []
        for r in parsed:
            if isinstance(r, Exception):
                out.append(r)
                continue
            rows = [embeds[s] if isinstance(s, int) else s for s in r.slots]
            out.append(torch.stack(rows).to(self.out_dtype) if rows else self._empty())  # [n, T, hidden]
            for key, slot in zip(r.keys, r.slots):
                if key is not None and isinstance(slot, int) and self.cache is not None:
                    self.cache.put(key, embeds[slot])
        return out

    def _plan(self, pixels, keys, todo: list, todo_keys: dict) -> _Request:
        """Validate one request and decide, per image, cached embeddings or a slot in this call's batch."""
        s = self.image_size
        pixels = np.zeros((0, 3, s, s), np.float32) if pixels is None else pixels
        check_pixel_values(pixels, s)
        n = pixels.shape[0]
        if keys is not None and len(keys) not in (0, n):
            raise InvalidArgument(f"input 'image_keys' must hold one key per image ({n}), got {len(keys)}")
        if keys and not all(isinstance(k, str) and _HEX64.match(k) for k in keys):
            raise InvalidArgument("input 'image_keys' must hold SHA-256 hex digests (64 characters 0-9a-f)")
        cache_keys = [self.cache.key(k) if keys and self.cache is not None else None for k in keys or [None] * n]
        slots = []
        for i, key in enumerate(cache_keys):
            hit = self.cache.get(key) if key is not None else None
            if hit is not None:
                slots.append(hit)
            elif key is not None and key in todo_keys:  # the same image twice in this batch: encoded once
                slots.append(todo_keys[key])
            else:
                todo.append(pixels[i])
                slots.append(len(todo) - 1)
                if key is not None:
                    todo_keys[key] = slots[-1]
        return _Request(pixels, cache_keys, slots)

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.tokens, self.hidden, dtype=self.out_dtype, device=self.backend.device)

    def _run(self, todo: list) -> torch.Tensor:
        if not todo:
            return self._empty()
        allpix = np.ascontiguousarray(np.stack(todo), np.float32)  # [m, 3, H, W]
        chunks = []
        for start in range(0, len(allpix), self.backend.max_batch):
            part = allpix[start:start + self.backend.max_batch]
            chunks.append(self.backend(part))  # [k, T, hidden] torch
            self.stats.batch_sizes.append(len(part))
        self.stats.images_encoded += len(allpix)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def build(model_dir, params: dict, explicit: set[str] = frozenset(), out_dtype: str = "float32") -> VisionService:
    """The `vision` model's parameters -> backend + embedding cache + service."""
    from ..spec import CheckpointSpec  # noqa: PLC0415
    from .export import checkpoint_key  # noqa: PLC0415

    device = params.get("device") or "cpu"
    s = BackendSettings(
        backend=choose_backend(params.get("vision_backend") or "auto", device, explicit),
        torch=VisionSettings(vision_device=params.get("vision_device") or device,
                             vision_bits=params.get("vision_bits") or 32,
                             projector_device=params.get("projector_device") or device,
                             projector_bits=params.get("projector_bits") or 32,
                             pipeline=params.get("pipeline") or "auto"),
        onnx_path=params.get("onnx_path", ""), plan_path=params.get("trt_plan", ""),
        max_batch=_int(params, "max_images_per_forward", 32))
    try:
        backend = make_backend(model_dir, s, explicit)
    except Exception as e:  # noqa: BLE001 - "auto" falls back to torch; an explicit choice fails loudly
        if (params.get("vision_backend") or "auto") != "auto" or s.backend == "torch":
            raise
        log.warning("vision: %s backend unavailable (%s: %s); falling back to torch", s.backend, type(e).__name__, e)
        backend = make_backend(model_dir, dataclasses.replace(s, backend="torch"), explicit)
    spec = CheckpointSpec.load(model_dir)
    mb = _int(params, "embedding_cache_mb", 256)
    cache = None
    if mb > 0:  # the namespace: checkpoint content, backend, dtype
        cache = EmbeddingCache(mb * 2**20, f"{checkpoint_key(model_dir, 'float32')}/{backend.name}/{backend.dtype}")
    return VisionService(backend, spec.vision.image_size, spec.vision.num_image_tokens, spec.text.hidden_size,
                         cache, out_dtype=getattr(torch, out_dtype))


def choose_backend(name: str, device: str, explicit: set[str]) -> str:
    """"auto": onnxruntime on a CPU (as fast as torch or faster: `bench/vision.py`), torch on a GPU or when a
    torch-only setting (vision_bits, ...) is given; tensorrt only when asked for (it needs TensorRT)."""
    if name != "auto":
        return name
    return "onnxruntime" if device == "cpu" and not explicit else "torch"


def _int(params: dict, key: str, default: int) -> int:
    value = params.get(key) or str(default)
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"vision parameter {key} must be an integer, got {value!r}") from None
