"""Paged KV cache: a fixed pool of blocks, per-row block tables, reference counts and copy-on-write.

Design choice: block tables with copy-on-write (as vLLM's PagedAttention), read by index gathers.

- Memory: one preallocated pool per K and V, `[layers, num_blocks * block_size, kv_heads, head_dim]`, sized by
  `kv_cache_tokens` (a budget in *tokens*; bytes = tokens * layers * 2 * kv_heads * head_dim * dtype size).
  Slot `b * block_size + i` holds token `i` of block `b`.
- A row (one beam / sample / prompt being prefilled) is a `RowKV`: its block table and its length. Rows
  join and leave between steps by getting or returning blocks; nothing else in the batch moves.
- Forks (beam reordering, the prompt row turning into `beam_width` rows) copy the block table and bump each
  block's reference count: O(blocks) integers, no tensor copy. Only the block a row writes into may be
  shared, and only a row's last, partially filled block is ever written, so copy-on-write copies at most one
  block per row per step (`append`).
- Attention reads a row's keys by gathering its slots (`read_slots`, `[rows, T]`) from the pool; a GPU build
  can replace the gather with a paged-attention kernel over the same tables.
- Budget: the scheduler *reserves* a request's worst case (`blocks_needed`) at admission and releases it at
  the end, so an allocation during a step never fails and nothing is ever evicted (TensorRT-LLM's
  "guaranteed no evict" policy). Requests that do not fit wait in the queue.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class AttentionBatch:
    """Cache addressing of one forward: every row of the call gets `q_len` new tokens."""

    positions: torch.Tensor  # [rows, q_len] long, absolute position of each new token
    write_slots: torch.Tensor  # [rows * q_len] long, pool slot of each new token's K/V (row-major)
    read_slots: torch.Tensor  # [rows, T] long, pool slots of the keys each row reads (padding -> slot 0)
    mask: torch.Tensor  # [rows, 1, q_len, T] bool, True = attend (causal and within the row's length)


class KVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # stack: lowest ids handed out first
        self.refcount = [0] * num_blocks
        self.reserved = 0  # blocks promised to admitted requests

    # --- budget -------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

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
        if not self._free:
            raise CacheFull(f"all {self.num_blocks} KV blocks are in use")
        b = self._free.pop()
        self.refcount[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self._free.append(b)

    def new_row(self) -> RowKV:
        return RowKV()

    def fork(self, row: RowKV) -> RowKV:
        """A new row continuing `row`'s tokens; shares its blocks until one of them writes (copy-on-write)."""
        for b in row.blocks:
            self.refcount[b] += 1
        return RowKV(list(row.blocks), row.length)

    def free(self, row: RowKV) -> None:
        for b in row.blocks:
            self._decref(b)
        row.blocks, row.length = [], 0

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
