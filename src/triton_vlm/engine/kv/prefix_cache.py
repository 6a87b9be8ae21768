"""Prefix caching: full KV blocks found again by a hash of everything that decided their content (vLLM v1's
automatic prefix caching).

- Block hash (`hash_block_tokens` in vLLM): SHA-256 over the parent block's hash, the block's `block_size` token
  ids and extra keys. The chain makes a block's hash stand for the whole prefix up to its end. The first block's
  parent is the request's root: a constant for the base model, else the adapter's identity (`adapter_key`),
  so KV computed with one adapter is never found by a request with another one or with none; the request's
  `cache_salt` (vLLM's), when it has one, enters the root too, so requests of different salts (or a salt and
  none) never share a block, and a tenant cannot time another tenant's prompts through cache hits.
- Extra keys for image placeholder positions: for each image span with placeholders in the block, the span's
  content digest, the offset inside it of its first placeholder in the block and how many follow (vLLM's
  `(mm_hash, offset)`). A span is an image's run of adjacent placeholders (`image_spans`); its digest is the
  SHA-256 of its embedding rows as the request carries them (`image_embeds`, bytes + dtype + shape): exactly
  what is merged at those positions, so the same image at the same place matches and different features never
  do, whoever sends them (the llm model is callable directly, so image keys a client sends are not trusted).
  About 2.5 ms per llava-1.5 image (576 x 4096 fp16).
- Adapter identity (`adapter_key`): the adapter's name and a SHA-256 of its weights (every module's A, B, scale,
  dtype), computed once per adapter object. Wire adapters are named by their task id, registry adapters by
  their folder: weights sent again under a task id hit only if they are the same weights.
- M-RoPE (Qwen2-VL): a token's rotary position depends on the sizes (grids) of the images before it, so with M-RoPE
  every span's digest also covers the prompt's image sizes; blocks after an image chain from its blocks.
- Only full blocks are hashed, and a full block is never written again (copy-on-write touches a row's partial
  last block only), so a cached block's content is fixed until it is evicted. Blocks are registered after the
  forward that wrote them returned, never before.

`RequestHasher` holds a request's root, image spans and prompt block hashes (computed at submit, off the engine
thread); `KVCache` (`kv_cache.py`) keeps the hash -> block index, the idle cached blocks in LRU order, and the
counters (`PrefixStats`).

KV-cache events (`BlockEvents`): when `KVCache.events` is set, the cache reports a block registered (`stored`,
with its parent's hash and the request's hasher, which remembers every block it hashed: `BlockMeta`, the block's
token ids and the keys that entered its hash besides them) and a cached block evicted (`removed`); `kv_events.py`
publishes them in vLLM's format for llm-d's KV-cache indexer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

BlockHash = bytes  # 32 bytes
_ROOT = hashlib.sha256(b"triton-vlm prefix cache v1").digest()


@dataclass(frozen=True)
class BlockMeta:
    """What entered a block's hash besides its parent's: its `block_size` token ids, and `extra_keys`, the
    identifiers (hex) of the image spans with placeholders in it, then for a request's first block its cache
    salt (vLLM's per-block `extra_keys`, mm identifiers then `cache_salt`). The adapter enters the root: its name
    is `RequestHasher.lora_name`."""

    tokens: Any  # block_size token ids (a numpy slice of the prompt, or a row's list)
    extra_keys: tuple[str, ...] = ()


class BlockEvents(Protocol):
    """Receives the prefix cache's changes on the engine thread; must return at once (`kv_events.py`)."""

    def stored(self, block_hash: "BlockHash", parent: "Optional[BlockHash]", hasher: "RequestHasher") -> None: ...

    def removed(self, block_hash: "BlockHash") -> None: ...


@dataclass
class PrefixStats:
    """vLLM's prefix-cache counters, in tokens: `queries` = prompt tokens of requests looked up, `hits` = those
    found cached (`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class ImageSpan:
    """Placeholder ordinals [first, first + count) of the prompt take consecutive feature rows of one image
    whose digest is `digest`: the rows of one run of adjacent placeholders within one image."""

    first: int
    count: int
    digest: bytes


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def tensor_digest(t: torch.Tensor) -> bytes:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(_tensor_bytes(t))
    return h.digest()


_ADAPTER_KEYS: dict[int, tuple[Any, bytes]] = {}  # id(adapter) -> (weakref, key)
_ADAPTER_LOCK = threading.Lock()


def adapter_key(adapter) -> bytes:
    """Identity of a `lora.format.Adapter`: its name and the SHA-256 of all its weights, memoized per object
    (adapters are immutable; a new upload is a new object)."""
    with _ADAPTER_LOCK:
        hit = _ADAPTER_KEYS.get(id(adapter))
        if hit is not None and hit[0]() is adapter:
            return hit[1]
    h = hashlib.sha256(b"lora\0" + adapter.name.encode() + b"\0")
    for (layer, module), m in sorted(adapter.modules.items()):
        h.update(f"{layer}.{module}.{m.scale!r}.".encode())
        h.update(tensor_digest(m.a))
        h.update(tensor_digest(m.b))
    key = h.digest()
    with _ADAPTER_LOCK:
        ident = id(adapter)
        _ADAPTER_KEYS[ident] = (weakref.ref(adapter, lambda _r, i=ident: _ADAPTER_KEYS.pop(i, None)), key)
    return key


def image_spans(input_ids: Sequence[int], image_embeds,
                image_token_id: Optional[int] | tuple[int, ...]) -> Optional[list[ImageSpan]]:
    """The prompt's feature rows cut into spans, each hashed: a span ends where an image ends ([images, T, hidden]:
    every T rows) and where the placeholders stop being adjacent, so with [N, hidden] features (images of
    different lengths, concatenated) each image's own run of placeholders is still a span of its own. None when
    the embeddings do not fit the placeholders (the prefill refuses the request with the reason)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    pos = np.flatnonzero(np.isin(ids, image_token_id)) if image_token_id is not None else np.zeros(0, np.int64)
    if image_embeds is None:
        return [] if len(pos) == 0 else None
    feats = image_embeds
    if not isinstance(feats, torch.Tensor) or feats.dim() not in (2, 3):
        return None
    per_image = int(feats.shape[1]) if feats.dim() == 3 else 0
    flat = feats.reshape(-1, feats.shape[-1]) if feats.dim() == 3 else feats  # [rows, hidden]
    if flat.shape[0] != len(pos):
        return None
    cuts = [k for k in range(1, len(pos)) if pos[k] != pos[k - 1] + 1 or (per_image and k % per_image == 0)]
    bounds = [0] + cuts + [len(pos)]
    return [ImageSpan(a, b - a, tensor_digest(flat[a:b])) for a, b in zip(bounds, bounds[1:]) if b > a]


class RequestHasher:
    """Block hashes of one request: the prompt's full blocks at once, later blocks as rows fill them."""

    def __init__(self, input_ids: Sequence[int], block_size: int, *, spans: list[ImageSpan],
                 image_token_id: Optional[int] | tuple[int, ...], adapter=None, salt: Optional[str] = None):
        self.block_size, self.spans = block_size, spans
        self.lora_name = None if adapter is None else adapter.name
        self.salt = salt
        self.meta: dict[BlockHash, BlockMeta] = {}  # every block hashed here (for KV-cache events)
        self.root = _ROOT if adapter is None else hashlib.sha256(_ROOT + adapter_key(adapter)).digest()
        if salt is not None:  # after the fixed-size root: unambiguous
            self.root = hashlib.sha256(self.root + b"salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
        self.prompt_len = len(input_ids)
        ids = np.asarray(input_ids, dtype=np.int64)
        # placeholder positions of the prompt, in order (ordinal k is at position self._ph[k])
        self._ph = np.flatnonzero(np.isin(ids, image_token_id)).tolist() if spans else []
        self.prompt_hashes: list[BlockHash] = []
        parent = self.root
        for b in range(len(ids) // block_size):
            parent = self.block(parent, b * block_size, ids[b * block_size:(b + 1) * block_size])
            self.prompt_hashes.append(parent)

    def block(self, parent: BlockHash, start: int, tokens) -> BlockHash:
        """Hash of the full block holding positions [start, start + block_size) with these token ids."""
        h = hashlib.sha256(parent)
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        keys = []
        if self._ph and start < self.prompt_len:
            lo = bisect_left(self._ph, start)
            hi = bisect_left(self._ph, start + self.block_size)
            for s in self.spans:  # spans are few (images per prompt)
                a, b = max(lo, s.first), min(hi, s.first + s.count)
                if a < b:
                    h.update(b"img" + s.digest + np.array([a - s.first, b - a], dtype=np.int64).tobytes())
                    keys.append(s.digest.hex())
        if start == 0 and self.salt is not None:
            keys.append(self.salt)
        digest = h.digest()
        self.meta[digest] = BlockMeta(tokens, tuple(keys))
        return digest


def request_hasher(req, block_size: int,
                   image_token_id: Optional[int] | tuple[int, ...]) -> Optional[RequestHasher]:
    """The hasher of a `GenerationRequest`, or None when its images do not fit its placeholders (such a request
    fails at prefill and caches nothing)."""
    spans = image_spans(req.input_ids, req.image_embeds, image_token_id)
    if spans is None:
        return None
    if getattr(req, "rope", None) is not None:  # M-RoPE: positions depend on every image's grid (its size)
        grids = hashlib.sha256(b"mrope" + np.asarray(req.image_sizes, dtype=np.int64).tobytes()).digest()
        spans = [dataclasses.replace(s, digest=hashlib.sha256(s.digest + grids).digest()) for s in spans]
    return RequestHasher(req.input_ids, block_size, spans=spans, image_token_id=image_token_id, adapter=req.adapter,
                         salt=req.cache_salt)
