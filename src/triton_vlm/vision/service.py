"""The vision model's work for one `execute()`: the images of every queued request, encoded together, each image
at most once, cached embeddings reused.

`VisionService.encode_rows(inputs)` takes, per request row, a `VisionInput`: its tiles [tiles, 3, H, W] (or
None), its images' sizes [n, 2] (height, width; the tiles and features of an image follow from its size in the
family's layout, LLaVA-NeXT) and the number of real images (the rest is a batched request's padding). It returns,
per row, `Encoded`: embeddings [n, T, hidden] (torch, in `out_dtype`, on the backend's device: a GPU backend's
embeddings never touch host memory), zero padded beyond each image's `lens`, or the InvalidArgument its input
raised (the others are unaffected). Images found in the embedding cache are not encoded; the tiles of the rest,
deduplicated by content across rows, go to the backend `max_batch` tiles at a time (the tiles of images of every
size in one call); the family's packer turns each image's tile features into its features (LLaVA-NeXT: grid,
unpad, row separators) and the cache keeps those. `encode(requests)` is the same for (pixels[, sizes]) tuples,
returning the embeddings. `build(model_dir, params)` makes the backend, the cache and the service.

Cache keys are never taken from a client: an image's key is the SHA-256 of what this model received for it (its
tiles' float32 bytes, their shape and the image's size), so the cached features are the features of exactly those
pixels, whoever sent them (the model is callable directly, so a key sent with pixels could name another tenant's
image; issue 24). Hashing costs about 0.9 ms per 336x336 tile (1.35 MB) on one core with SHA-NI; the tiles of
one `execute()` are hashed on up to `HASH_THREADS` threads (hashlib releases the GIL), and nothing is hashed
without a cache. Figures beside the encoder's time: `bench/vision/cache_trust.py`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import Internal, InvalidArgument
from ..families import ImageLayout, Packer, family_of
from ..weight_source import TensorSource
from .backends import BackendSettings, make_backend
from .cache import EmbeddingCache
from .encoder import VisionSettings, check_pixel_values

log = logging.getLogger("triton_vlm")
HASH_THREADS = min(8, os.cpu_count() or 1)
HASH_PARALLEL_BYTES = 2 << 20  # fewer bytes than this in one execute() (2 tiles of 336): hashed on the caller
MAX_SIDE = 1 << 20  # the largest image side accepted in image_sizes (preprocess's pixel cap is far below)


@dataclass
class VisionStats:
    images_encoded: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # tiles per encoder call since the last `take_batches()`

    def take_batches(self) -> list[int]:
        out, self.batch_sizes = self.batch_sizes, []
        return out


@dataclass
class VisionInput:
    """One request row as the vision model receives it."""

    pixels: Optional[np.ndarray]  # [tiles, 3, H, W] (padding rows beyond the real images' tiles allowed)
    sizes: Optional[np.ndarray] = None  # [images, 2] (height, width); required when tiles depend on the size
    num_images: Optional[int] = None  # real images (None: every image the other inputs describe)
    grids: Optional[np.ndarray] = None  # [images, 3] (t, h, w) patches: native resolution (videos need them)


@dataclass
class Encoded:
    embeds: torch.Tensor  # [n, T, hidden], image i zero padded beyond lens[i]
    lens: list[int]  # [n] features of each image


@dataclass
class _Image:
    tiles: Optional[np.ndarray]  # [t, 3, H, W], None when its features came from the cache or the batch
    size: tuple  # (height, width); for a native-resolution tower its patch grid (t, h, w)
    key: Optional[bytes] = None  # the embedding cache's key (from the content), None without a cache
    slot: object = None  # index into this call's encoded images, or the cached features [T, hidden]


class VisionService:
    def __init__(self, backend, image_size: int, tokens: int, hidden: int,
                 cache: Optional[EmbeddingCache] = None, out_dtype: torch.dtype = torch.float32, *,
                 layout: Optional[ImageLayout] = None, packer: Optional[Packer] = None):
        """`layout` / `packer`: the family's (`families/`); None: one tile per image, its features as they are."""
        self.backend, self.image_size, self.tokens, self.hidden = backend, image_size, tokens, hidden
        self.tile_hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.whole_images = getattr(layout, "whole_images", False)  # native resolution (Qwen2-VL): whole images
        self.cache, self.out_dtype = cache, out_dtype
        self.layout, self.packer = layout, packer or Packer()
        self.stats = VisionStats()

    @property
    def fixed(self) -> bool:
        return self.layout is None or self.layout.fixed

    def encode(self, requests: Sequence[tuple]) -> list:
        """(pixels[, sizes]) per request -> embeddings [n, T, hidden] or the request's InvalidArgument."""
        out = self.encode_rows([r if isinstance(r, VisionInput) else VisionInput(*r) for r in requests])
        return [r if isinstance(r, Exception) else r.embeds for r in out]

    def encode_rows(self, inputs: Sequence[VisionInput]) -> list:
        parsed = []
        for x in inputs:
            try:
                parsed.append(self._images(x))
            except InvalidArgument as e:
                parsed.append(e)
        if self.cache is not None:
            images = [img for r in parsed if not isinstance(r, Exception) for img in r]
            for img, digest in zip(images, content_digests([(img.tiles, img.size) for img in images])):
                img.key = self.cache.key(digest)
        todo, todo_keys = [], {}
        for r in parsed:
            if not isinstance(r, Exception):
                self._place(r, todo, todo_keys)
        feats = self._run(todo)  # per encoded image [T_i, hidden]
        for img in todo:
            if img.key is not None:
                self.cache.put(img.key, feats[img.slot])
        return [r if isinstance(r, Exception) else self._gather(r, feats) for r in parsed]

    def _gather(self, images: list[_Image], feats: list[torch.Tensor]) -> Encoded:
        rows = [feats[i.slot] if isinstance(i.slot, int) else i.slot for i in images]  # each [T_i, hidden]
        if not rows:
            return Encoded(self._empty(), [])
        lens = [int(r.shape[0]) for r in rows]
        if len(set(lens)) == 1:
            return Encoded(torch.stack(rows).to(self.out_dtype), lens)  # [n, T, hidden]
        out = torch.zeros(len(rows), max(lens), self.hidden, dtype=self.out_dtype, device=rows[0].device)
        for i, r in enumerate(rows):
            out[i, :lens[i]] = r
        return Encoded(out, lens)

    def _images(self, x: VisionInput) -> list[_Image]:
        """Validate one row: its images, each with its tiles and size."""
        pixels = np.zeros((0, 3, *self.tile_hw), np.float32) if x.pixels is None else x.pixels
        check_pixel_values(pixels, self.tile_hw)
        sizes = _sizes(x.sizes)
        if sizes is None and not self.fixed and (pixels.shape[0] or x.num_images):
            raise InvalidArgument("input 'image_sizes' ([images, 2] height, width) is required: this "
                                  "checkpoint's tiles and image tokens depend on each image's size")
        limit = pixels.shape[0] if self.fixed else (len(sizes) if sizes is not None else 0)
        n = limit if x.num_images is None else x.num_images
        if not 0 <= n <= limit:
            what = "pixel_values rows" if self.fixed else "image_sizes rows"
            raise InvalidArgument(f"num_images {n} is outside [0, {limit}] ({what})")
        if sizes is None:
            sizes = np.zeros((n, 2), np.int64)
        elif len(sizes) < n:
            raise InvalidArgument(f"input 'image_sizes' has {len(sizes)} rows for {n} images")
        elif not self.fixed and ((sizes[:n] <= 0).any() or (sizes[:n] > MAX_SIDE).any()):
            raise InvalidArgument(f"input 'image_sizes' must hold sizes in [1, {MAX_SIDE}], got {sizes[:n].tolist()}")
        if self.whole_images:  # the patch grid of each image or video: sent, or from the image's size
            keys = _grids(x.grids, n, self.layout.merge) or [self.layout.grid(tuple(sz)) for sz in sizes[:n].tolist()]
            tiles = [t * h * w for t, h, w in keys]
        else:
            keys = [tuple(sz) for sz in sizes[:n].tolist()]
            tiles = [1] * n if self.fixed else [self.layout.tiles(k) for k in keys]
        if sum(tiles) > pixels.shape[0] or (x.num_images is None and sum(tiles) != pixels.shape[0]):
            raise InvalidArgument(f"input 'pixel_values' has {pixels.shape[0]} tiles; image_sizes "
                                  f"{sizes[:n].tolist()} take {sum(tiles)}")
        starts = np.cumsum([0] + tiles)
        return [_Image(pixels[a:b], key) for a, b, key in zip(starts, starts[1:], keys)]

    def _place(self, images: list[_Image], todo: list, todo_keys: dict) -> None:
        """Per image of a row: cached features, the slot of the same content earlier in this call, or a new slot
        in this call's batch."""
        for img in images:
            hit = self.cache.get(img.key) if img.key is not None else None
            if hit is not None:
                img.tiles, img.slot = None, hit
            elif img.key is not None and img.key in todo_keys:  # the same image twice in this call: encoded once
                img.tiles, img.slot = None, todo_keys[img.key]
            else:
                img.slot = len(todo)
                todo.append(img)
                if img.key is not None:
                    todo_keys[img.key] = img.slot

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.tokens, self.hidden, dtype=self.out_dtype, device=self.backend.device)

    def _run(self, todo: list[_Image]) -> list[torch.Tensor]:
        """Every tile of the images to encode, `max_batch` tiles per backend call -> each image's features."""
        if not todo:
            return []
        if self.whole_images:
            return self._run_whole(todo)
        allpix = np.ascontiguousarray(np.concatenate([i.tiles for i in todo]), np.float32)  # [tiles, 3, H, W]
        chunks = []
        for start in range(0, len(allpix), self.backend.max_batch):
            part = allpix[start:start + self.backend.max_batch]
            chunks.append(self.backend(part))  # [k, T, hidden] torch
            self.stats.batch_sizes.append(len(part))
        self.stats.images_encoded += len(todo)
        tile_feats = chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # [tiles, T, hidden]
        out, start = [], 0
        for img in todo:
            t = len(img.tiles)
            feats = self.packer(tile_feats[start:start + t], img.size)  # [T_i, hidden]
            if not self.fixed and feats.shape[0] != self.layout.tokens(img.size):
                raise Internal(f"image of size {img.size}: {feats.shape[0]} features, the layout counts "
                               f"{self.layout.tokens(img.size)}")
            out.append(feats)
            start += t
        return out


    def _run_whole(self, todo: list[_Image]) -> list[torch.Tensor]:
        """Native-resolution towers: whole images per backend call (at most `max_batch` images and
        `max_patches` patches, or one larger image alone) -> each image's features [tokens_i, hidden]."""
        grids = [img.size for img in todo]  # (t, h, w) each
        out: list[torch.Tensor] = []
        start = 0
        while start < len(todo):
            end, patches = start, 0
            while end < len(todo) and end - start < self.backend.max_batch and (
                    end == start or patches + len(todo[end].tiles) <= self.backend.max_patches):
                patches += len(todo[end].tiles)
                end += 1
            part = np.concatenate([img.tiles for img in todo[start:end]])  # [patches, 3, T*P, P]
            feats = self.backend.encode(part, grids[start:end])  # [tokens, hidden]
            self.stats.batch_sizes.append(end - start)
            counts = [t * h * w // self.layout.merge ** 2 for t, h, w in grids[start:end]]
            if feats.shape[0] != sum(counts):
                raise Internal(f"the tower gave {feats.shape[0]} features for {counts} tokens")
            out += list(torch.split(feats, counts))
            start = end
        self.stats.images_encoded += len(todo)
        return out


def content_digest(tiles: np.ndarray, size: tuple[int, int], leaves: Optional[Sequence[bytes]] = None) -> bytes:
    """SHA-256 of an image as the encoder sees it: its tiles' shape, the image's size (which decides how
    LLaVA-NeXT packs the tiles' features) and the SHA-256 of each tile's float32 bytes (`leaves`, computed here
    when not given): a hash tree, so that the tiles of an image can be hashed on several threads."""
    tiles = np.ascontiguousarray(tiles, np.float32)
    h = hashlib.sha256(repr((tiles.shape, tuple(int(v) for v in size))).encode())
    for leaf in leaves if leaves is not None else map(_tile_digest, tiles):
        h.update(leaf)
    return h.digest()


def _tile_digest(tile: np.ndarray) -> bytes:
    return hashlib.sha256(memoryview(np.ascontiguousarray(tile, np.float32)).cast("B")).digest()


_POOL: Optional[ThreadPoolExecutor] = None


def content_digests(images: Sequence[tuple[np.ndarray, tuple[int, int]]]) -> list[bytes]:
    """`content_digest` of each (tiles, size); every tile of the call on `HASH_THREADS` threads (hashlib releases
    the GIL) when there are at least HASH_PARALLEL_BYTES to hash."""
    global _POOL
    if HASH_THREADS < 2 or sum(t.nbytes for t, _ in images) < HASH_PARALLEL_BYTES:
        return [content_digest(t, s) for t, s in images]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="vision-hash")
    leaves = iter(_POOL.map(_tile_digest, [tile for t, _ in images for tile in t]))
    return [content_digest(t, s, [next(leaves) for _ in range(len(t))]) for t, s in images]


def pad_tokens(embeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Rows' embeddings [n_i, T_i, hidden] zero padded to the longest T (rows already that long are not copied)."""
    t = max(e.shape[1] for e in embeds)
    out = []
    for e in embeds:
        if e.shape[1] != t:
            padded = torch.zeros(e.shape[0], t, e.shape[2], dtype=e.dtype, device=e.device)
            padded[:, :e.shape[1]] = e
            e = padded
        out.append(e)
    return out


MAX_GRID_PATCHES = 1 << 20  # patches of one image or video (a 16-Mpx image has 85k; transformers' largest video less)


def _grids(grids, n: int, merge: int) -> Optional[list[tuple[int, int, int]]]:
    """`media_grids` of a row's n real images as (t, h, w) tuples, checked; None when not sent (or all zeros: a
    fixed-tile family's)."""
    if grids is None:
        return None
    arr = np.asarray(grids)
    if arr.size == 0 or not arr.any():
        return None
    if arr.ndim != 2 or arr.shape[1] != 3 or not np.issubdtype(arr.dtype, np.integer) or len(arr) < n:
        raise InvalidArgument(f"input 'media_grids' must be [images, 3] integers (t, h, w) for {n} images, got "
                              f"shape {list(arr.shape)} of {arr.dtype}")
    out = [tuple(int(v) for v in g) for g in arr[:n]]
    for g in out:
        t, h, w = g
        if t < 1 or h < merge or w < merge or h % merge or w % merge or t * h * w > MAX_GRID_PATCHES:
            raise InvalidArgument(f"input 'media_grids' holds {list(g)}: t >= 1, h and w positive multiples of "
                                  f"{merge}, at most {MAX_GRID_PATCHES} patches are allowed")
    return out


def _sizes(sizes) -> Optional[np.ndarray]:
    """image_sizes as int64 [n, 2] (padding rows of a batched request included), or None."""
    if sizes is None:
        return None
    arr = np.asarray(sizes)
    if arr.size == 0:
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"input 'image_sizes' must be [images, 2] integers (height, width), got shape "
                              f"{list(arr.shape)} of {arr.dtype}")
    return arr.astype(np.int64)


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
    family = family_of(spec, params.get("pipeline") or "auto")
    mb = _int(params, "embedding_cache_mb", 256)
    cache = None
    if mb > 0:  # the namespace: checkpoint content, backend, dtype
        cache = EmbeddingCache(mb * 2**20, f"{checkpoint_key(model_dir, 'float32')}/{backend.name}/{backend.dtype}")
    layout = family.layout(spec)
    whole = layout.whole_images  # native resolution (Qwen2-VL): image sizes of every kind, no fixed tile
    return VisionService(backend, layout.tile_hw if whole else spec.vision.image_size,
                         layout.max_tokens if whole else spec.vision.num_image_tokens,
                         spec.text.hidden_size * (1 + family.text_rules(spec).deepstack_levels),  # + DeepStack
                         cache, out_dtype=getattr(torch, out_dtype), layout=layout,
                         packer=family.packer(spec, TensorSource(model_dir)).to(backend.device))


def choose_backend(name: str, device: str, explicit: set[str]) -> str:
    """"auto": onnxruntime on a CPU (as fast as torch or faster: `bench/vision/encoder.py`), torch on a GPU or when a
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
