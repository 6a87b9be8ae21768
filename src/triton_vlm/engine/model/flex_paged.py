"""Paged attention with PyTorch's FlexAttention: the same result as `attention.attend_torch` without gathering K/V.

The keys and values are the whole pool of one layer, viewed (no copy) as `[1, kv_heads, slots, hd]` (the pool's
blocks; the scratch slot after them is left out: no row reads it). The queries are `[rows, heads, q_len, hd]`
(FlexAttention broadcasts the key batch of 1 over the rows). Which keys a row reads is a `BlockMask`, built once per
forward (`plan`, from the `AttentionBatch`) and shared by every layer:

- KV blocks of the mask = the cache's blocks (`KV_BLOCK` = the cache's `block_size`); Q blocks of `q_block` new
  tokens (16 for a decode step, `PREFILL_Q_BLOCK` for a prefill chunk).
- For row b and Q block i, whose queries sit at positions qmin..qmax: the row's logical blocks wholly at or before
  qmin are *full* (`full_kv_indices`: every query of the tile sees every key of the block, no mask is evaluated);
  the blocks after them up to the one holding qmax are *partial* (`kv_indices`, at most `q_block // block_size + 2`
  of them): there `mask_mod` maps the physical slot back to the row's logical position through a per-row
  physical -> logical block map (`_offsets [rows, num_blocks]`; prefix caching shares a physical block between
  rows, so it must be per row) and keeps the keys at or before the query's position. That hides the stale slots
  of a row's last block and every slot of a block that is not the row's. The listed indices are physical block
  ids, zero-padded to the pool's block count.
- Blocks a row does not read are in neither list: the kernel never loads them.

Eager FlexAttention (the CPU path, when forced) evaluates `mask_mod` over every (query, pool slot) pair and ignores
the block lists, so `mask_mod` is exact on its own and the lists are a pure speed-up; compiled FlexAttention (CUDA,
or inductor's CPU template in the tests) reads only the listed blocks and skips `mask_mod` on the full ones. On
CUDA the call goes through `torch.compile(flex_attention, dynamic=True)` (one compiled function for decode steps,
one for prefill chunks, so each keeps its own recompile budget; dynamic: one graph per shape class, rows 1 or
more, one Q block or more, not one per row count), with the main FlexAttention kernel forced
(`FORCE_USE_FLEX_ATTENTION`: the decode kernel needs a static batch) and kernel tiles `BLOCK_M = q_block`,
`BLOCK_N = 16` dividing the KV block. None of it has run on a GPU yet (docs/engine.md).
Everything `plan` does is device tensor ops without a host sync, so it records into a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..kv.kv_cache import AttentionBatch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    IMPORT_ERROR: Optional[str] = None
except ImportError as e:  # an older torch: the engine uses SDPA (attention.Attention logs why)
    BlockMask = flex_attention = None  # type: ignore[assignment, misc]
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

DECODE_Q_BLOCK = 16  # the smallest tile a tensor-core dot takes
PREFILL_Q_BLOCK = 64
KERNEL_BLOCK_N = 16  # KV rows per kernel tile on CUDA: must divide the cache's block_size
DYNAMIC = True  # torch.compile(dynamic=...) of the flex calls
RECOMPILE_LIMIT = 16  # torch._dynamo's per-function budget (default 8), raised process-wide at the first compile


@dataclass
class PagedMask:
    """One forward's block mask over the pool (shared by all layers)."""

    block_mask: "BlockMask"
    slots: int  # KV length: num_blocks * block_size (the pool's blocks, without the scratch slot)
    q_block: int


def unsupported(block_size: int, device: torch.device) -> Optional[str]:
    """Why the flex path cannot run with this cache on this device (None: it can)."""
    if IMPORT_ERROR is not None:
        return f"torch.nn.attention.flex_attention does not import ({IMPORT_ERROR})"
    if device.type == "cuda" and block_size % KERNEL_BLOCK_N:
        return f"block_size {block_size} is not a multiple of {KERNEL_BLOCK_N} (the kernel's KV tile)"
    return None


def _mask_mod(offset: torch.Tensor, bs: int) -> Callable:
    """offset [rows, num_blocks] int32: each physical block's first logical position in that row minus the row's
    first new position (`NOT_MINE` where the block is not the row's). Query q_idx of row b sits at start[b] + q_idx;
    it sees pool slot kv_idx iff that slot holds a position of its own row at or before its own:
    logical(kv_idx) <= start[b] + q_idx  <=>  offset[b, kv_idx // bs] + kv_idx % bs <= q_idx."""
    def mask_mod(b, h, q_idx, kv_idx):
        return offset[b, kv_idx // bs] + kv_idx % bs <= q_idx
    return mask_mod


NOT_MINE = 1 << 30  # an offset no query index reaches


def _offsets(table: torch.Tensor, start: torch.Tensor, blocks: torch.Tensor, bs: int, num_blocks: int
             ) -> torch.Tensor:
    """table [rows, NB] physical block of each logical block (padding past `blocks` [rows]: anything), start
    [rows] -> [rows, num_blocks] int32 offsets for `_mask_mod`: the physical -> logical map, per row (prefix
    caching shares a physical block between rows)."""
    rows, nb = table.shape
    col = torch.arange(nb, device=table.device)  # [NB]
    target = torch.where(col[None] < blocks[:, None], table, num_blocks)  # padding -> a dump column
    rel = (col[None] * bs - start[:, None]).to(torch.int32)  # [rows, NB]
    out = torch.full((rows, num_blocks + 1), NOT_MINE, dtype=torch.int32, device=table.device)
    out.scatter_(1, target, rel)
    return out[:, :num_blocks]


def _lists(blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[rows, nqb, n] block ids -> [rows, 1, nqb, num_blocks] int32, zero-padded: the lists span the whole KV
    length (inductor's CPU lowering asserts it; torch's PagedAttention pads them so too)."""
    rows, nqb, n = blocks.shape
    out = torch.zeros(rows, 1, nqb, num_blocks, dtype=torch.int32, device=blocks.device)
    out[:, 0, :, :n] = blocks
    return out


def plan(batch: AttentionBatch, block_size: int, num_blocks: int) -> PagedMask:
    """The forward's BlockMask (module doc). `batch.read_slots` column j*bs is block j's first slot (as
    `KVCache.plan` and the CUDA graphs' buffers lay them out); `batch.positions` [rows, q_len] are consecutive."""
    bs = block_size
    rows, q_len = batch.positions.shape
    qb = DECODE_Q_BLOCK if q_len == 1 else PREFILL_Q_BLOCK
    dev = batch.positions.device
    table = batch.read_slots[:, ::bs] // bs  # [rows, NB] physical block of logical block j
    nb = table.shape[1]
    start = batch.positions[:, 0]  # [rows]
    offset = _offsets(table, start, (start + q_len + bs - 1) // bs, bs, num_blocks)  # [rows, num_blocks]
    nqb = -(-q_len // qb)
    first = torch.arange(nqb, device=dev) * qb  # [nqb] first query index of each Q block
    qmin = start[:, None] + first  # [rows, nqb]
    qmax = start[:, None] + torch.clamp(first + qb, max=q_len) - 1  # [rows, nqb]
    n_full = torch.div(qmin + 1, bs, rounding_mode="floor")  # [rows, nqb] logical blocks 0..n_full-1
    n_part = torch.div(qmax, bs, rounding_mode="floor") + 1 - n_full  # [rows, nqb] the next ones
    width = min(qb // bs + 2, num_blocks)  # the most partial blocks one Q block meets
    cols = torch.clamp(n_full[..., None] + torch.arange(width, device=dev), max=nb - 1)  # [rows, nqb, width]
    part = table.gather(1, cols.view(rows, -1)).view(rows, nqb, width)
    mask = BlockMask.from_kv_blocks(
        n_part.to(torch.int32)[:, None], _lists(part, num_blocks), n_full.to(torch.int32)[:, None],
        _lists(table[:, None, :num_blocks].expand(rows, nqb, min(nb, num_blocks)), num_blocks), (qb, bs),
        _mask_mod(offset, bs), seq_lengths=(q_len, num_blocks * bs), compute_q_blocks=False)
    return PagedMask(mask, num_blocks * bs, qb)


def _flex_decode(q, k, v, block_mask, enable_gqa, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=kernel_options)


def _flex_prefill(q, k, v, block_mask, enable_gqa, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=kernel_options)


_compiled: dict[str, Callable] = {}


def _compiled_fn(kind: str) -> Callable:
    """torch.compile'd flex_attention for decode steps or prefill chunks (module doc), compiled at first use."""
    fn = _compiled.get(kind)
    if fn is None:
        # past its recompile budget dynamo would run flex_attention eagerly: scores over the whole pool. Raise
        # instead (the caller falls back to SDPA, logged); the budget per function is 16 shape classes
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        fn = _compiled[kind] = torch.compile(_flex_decode if kind == "decode" else _flex_prefill,
                                             dynamic=DYNAMIC, fullgraph=True)
    return fn


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: PagedMask, compiled: Optional[bool] = None
           ) -> torch.Tensor:
    """q [rows, heads, q_len, hd] (rotated); kc, vc [slots + 1, kv_heads, hd] one layer's pool, the new tokens'
    K/V already written -> [rows, heads, q_len, hd]. `compiled`: torch.compile'd (default: on CUDA) or eager."""
    k = kc[:mask.slots].permute(1, 0, 2)[None]  # [1, kv_heads, slots, hd], a view
    v = vc[:mask.slots].permute(1, 0, 2)[None]
    gqa = q.shape[1] != k.shape[1]
    if compiled is None:
        compiled = q.device.type == "cuda"
    if not compiled:
        return flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": mask.q_block, "BLOCK_N": KERNEL_BLOCK_N}
    fn = _compiled_fn("decode" if q.shape[2] == 1 else "prefill")
    return fn(q, k, v, mask.block_mask, gqa, options if q.device.type == "cuda" else None)
