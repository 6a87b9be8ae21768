"""Paged KV cache: a fixed pool of blocks, per-row block tables, reference counts and copy-on-write.

Design choice: block tables with copy-on-write (as vLLM's PagedAttention), read by index gathers.

- Memory: one preallocated pool per K and V, `[layers, num_blocks * block_size + 1, kv_heads, head_dim]`, sized
  by `kv_cache_tokens` (a budget in *tokens*; bytes = tokens * layers * 2 * kv_heads * head_dim * dtype size).
  Slot `b * block_size + i` holds token `i` of block `b`. The one slot after the blocks (`scratch_slot`) belongs
  to no block and no row reads it: the padding rows of a bucketed decode step (`cuda_graph.py`) write there.
- A row (one beam / sample / prompt being prefilled) is a `RowKV`: its block table and its length. Rows
  join and leave between steps by getting or returning blocks; nothing else in the batch moves.
- Forks (beam reordering, the prompt row turning into `beam_width` rows) copy the block table and bump each
  block's reference count: O(blocks) integers, no tensor copy. Only the block a row writes into may be
  shared, and only a row's last, partially filled block is ever written, so copy-on-write copies at most one
  block per row per step (`append`).
- Attention reads a row's keys by gathering its slots (`read_slots`, `[rows, T]`) from the pool; a GPU build
  can replace the gather with a paged-attention kernel over the same tables.
- Budget: the scheduler *reserves* blocks before it writes them, so an allocation during a step never fails.
  Under the `guaranteed_no_evict` policy a request reserves its worst case (`blocks_needed`) at admission and
  releases it at the end: no running request ever loses a block (TensorRT-LLM's policy of that name); requests
  that do not fit wait in the queue. Under `max_utilization` (`preempt.py`) a one-row request reserves what the
  coming step writes, step by step, and the latest arrived one is preempted (its blocks freed) when none is left.
- Prefix caching (`prefix_cache.py`, vLLM v1's design): full blocks whose KV is complete are registered under
  their block hash (`register`). When no row holds such a block any more it stays cached, *idle*, in least
  recently used order, instead of going back to the free list; a later request with the same prefix takes it
  again (`reuse`: its reference count goes from 0 to 1). An allocation takes a free block first, else evicts
  the least recently used idle block. Idle blocks count as available capacity everywhere (`free_blocks`,
  `used_blocks`) and are never reserved: the sum of reservations stays <= num_blocks, and blocks held by rows
  never exceed the reservations of their requests, so a reserved allocation always finds a free or idle
  block. A row frees its blocks last to first, so the tail of a prefix is evicted before its head.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .prefix_cache import BlockEvents, BlockHash, PrefixStats, RequestHasher


class CacheFull(RuntimeError):
    """No free block: a reservation was exceeded (a bug; the scheduler reserves the worst case)."""


def blocks_needed(prompt_len: int, max_tokens: int, rows: int, block_size: int) -> int:
    """Worst-case blocks of one request: its prompt's full blocks are shared by all rows (never written again),
    everything after them may be private to each of `rows` rows. The last generated token is never fed back,
    so a row holds at most prompt_len + max_tokens - 1 positions."""
    longest = prompt_len + max_tokens - 1
    shared = prompt_len // block_size
    per_row = -(-longest // block_size) - shared  # >= 0 since max_tokens >= 1
    return shared + rows * per_row


@dataclass
class RowKV:
    blocks: list[int] = field(default_factory=list)  # block table
    length: int = 0  # tokens cached
    # prefix caching (only for requests that hash): the hashes of the row's first len(hashes) blocks, and the
    # token ids of the positions after them (the block being filled)
    hashes: list[BlockHash] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # hybrid models (`hybrid_cache.py`): the row's state slot (-1: none) and where its prompt ends (positions from
    # there on were decoded one at a time: a recompute computes them so again)
    slot: int = -1
    prompt_len: int = 1 << 62


@dataclass
class AttentionBatch:
    """Cache addressing of one forward: every row of the call gets `q_len` new tokens."""

    positions: torch.Tensor  # [rows, q_len] long, absolute position of each new token
    write_slots: torch.Tensor  # [rows * q_len] long, pool slot of each new token's K/V (row-major)
    read_slots: torch.Tensor  # [rows, T] long, pool slots of the keys each row reads (padding -> slot 0)
    mask: torch.Tensor  # [rows, 1, q_len, T] bool, True = attend (causal and within the row's length)
    states: Optional[Any] = None  # hybrid models: the rows' state slots (`hybrid_cache.StateBatch`)


class KVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.scratch_slot = num_blocks * block_size  # written by padding rows only, never read by a row
        shape = (num_layers, num_blocks * block_size + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # stack: lowest ids handed out first
        self.refcount = [0] * num_blocks
        self.reserved = 0  # blocks promised to admitted requests
        # prefix cache: hash -> block and back, for full blocks whose KV is complete; the ones no row holds
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached; least recently used first
        self.prefix_stats = PrefixStats()
        self.events: Optional[BlockEvents] = None  # KV-cache events: blocks registered / evicted (kv_events.py)

    # --- budget -------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        """Blocks some row holds."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache index, held or idle."""
        return len(self._hash_of)

    def try_reserve(self, n: int) -> bool:
        if self.reserved + n > self.num_blocks:
            return False
        self.reserved += n
        return True

    def release(self, n: int) -> None:
        self.reserved -= n
        assert self.reserved >= 0, "released more blocks than reserved"

    # --- blocks ---------------------------------------------------------------------------------------------
    def _alloc(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._idle:  # evict the least recently used cached block
            b, _ = self._idle.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._by_hash[h]
            if self.events is not None:
                self.events.removed(h)
        else:
            raise CacheFull(f"all {self.num_blocks} KV blocks are in use")
        self.refcount[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if b in self._hash_of:
                self._idle[b] = None  # most recently used end
            else:
                self._free.append(b)

    def new_row(self, prompt_len: int = 1 << 62) -> RowKV:
        """An empty row; `prompt_len`: where its request's prompt ends (read by hybrid models only)."""
        return RowKV(prompt_len=prompt_len)

    def fork(self, row: RowKV) -> RowKV:
        """A new row continuing `row`'s tokens; shares its blocks until one of them writes (copy-on-write)."""
        for b in row.blocks:
            self.refcount[b] += 1
        return RowKV(list(row.blocks), row.length, list(row.hashes), list(row.tokens), prompt_len=row.prompt_len)

    def free(self, row: RowKV) -> None:
        for b in reversed(row.blocks):  # last block first: the tail of a cached prefix is evicted first
            self._decref(b)
        row.blocks, row.length, row.hashes, row.tokens = [], 0, [], []

    def _copy_block(self, src: int, dst: int, n: int) -> None:
        bs = self.block_size
        self.k[:, dst * bs:dst * bs + n] = self.k[:, src * bs:src * bs + n]
        self.v[:, dst * bs:dst * bs + n] = self.v[:, src * bs:src * bs + n]

    def append(self, row: RowKV, n: int) -> list[int]:
        """Make room for `n` more tokens of `row`; return their pool slots. Copies the last block first when
        it is partially filled and shared with another row."""
        bs = self.block_size
        used = row.length % bs
        if used and self.refcount[row.blocks[-1]] > 1:
            old, new = row.blocks[-1], self._alloc()
            self._copy_block(old, new, used)
            self._decref(old)
            row.blocks[-1] = new
        slots = []
        for pos in range(row.length, row.length + n):
            if pos // bs == len(row.blocks):
                row.blocks.append(self._alloc())
            slots.append(row.blocks[pos // bs] * bs + pos % bs)
        row.length += n
        return slots

    # --- prefix cache ---------------------------------------------------------------------------------------
    def reuse(self, row: RowKV, hashes: Sequence[BlockHash], prompt_len: int, count: bool = True) -> int:
        """Start the empty `row` with the longest run of cached blocks matching `hashes` (a prompt's full-block
        hashes), leaving at least the prompt's last token to compute (its logits start decoding). Counts the
        lookup in `prefix_stats` (tokens) unless not `count` (a preempted request's recompute); returns the tokens
        reused."""
        assert not row.blocks, "reuse() starts an empty row"
        hit: list[int] = []
        for h in hashes[:(prompt_len - 1) // self.block_size]:
            b = self._by_hash.get(h)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if self.refcount[b] == 0:
                del self._idle[b]
            self.refcount[b] += 1
        row.blocks, row.length, row.hashes = hit, len(hit) * self.block_size, list(hashes[:len(hit)])
        if count:
            st = self.prefix_stats
            st.requests, st.queries, st.hits = st.requests + 1, st.queries + prompt_len, st.hits + row.length
        return row.length

    def register(self, row: RowKV, index: int, h: BlockHash, hasher: Optional[RequestHasher] = None) -> None:
        """Block `index` of `row` is full, its KV complete, and hashes to `h` (computed by `hasher`): findable from
        now on. A hash already cached keeps its first block (this one is then freed as usual when its rows let it
        go)."""
        b = row.blocks[index]
        if h not in self._by_hash and b not in self._hash_of:
            self._by_hash[h] = b
            self._hash_of[b] = h
            if self.events is not None and hasher is not None:
                self.events.stored(h, row.hashes[index - 1] if index else None, hasher)

    # --- addressing for one forward ---------------------------------------------------------------------
    def plan(self, rows: list[RowKV], q_len: int) -> AttentionBatch:
        """Append `q_len` tokens to every row and describe where they go and what each row attends to."""
        starts = [r.length for r in rows]
        write = [s for r in rows for s in self.append(r, q_len)]
        dev, bs = self.device, self.block_size
        lengths = torch.tensor([r.length for r in rows], dtype=torch.long)
        t = int(lengths.max())
        nb = -(-t // bs)
        table = torch.zeros(len(rows), nb, dtype=torch.long)  # [rows, blocks], padding -> block 0
        for i, r in enumerate(rows):
            table[i, :len(r.blocks)] = torch.tensor(r.blocks[:nb], dtype=torch.long)
        read = (table[:, :, None] * bs + torch.arange(bs)).reshape(len(rows), nb * bs)[:, :t]  # [rows, T]
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(q_len)  # [rows, q_len]
        mask = torch.arange(t)[None, None, :] <= positions[:, :, None]  # [rows, q_len, T]; also hides padding
        return AttentionBatch(
            positions=positions.to(dev), write_slots=torch.tensor(write, dtype=torch.long, device=dev),
            read_slots=read.to(dev), mask=mask[:, None].to(dev))
