"""Paged KV cache: allocation, fork / copy-on-write, free, budget, attention addressing."""
from __future__ import annotations

import pytest
import torch

from triton_vlm.engine.kv.kv_cache import CacheFull, KVCache, blocks_needed


def make_cache(num_blocks=8, block_size=4, layers=2):
    return KVCache(num_layers=layers, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def write(cache: KVCache, slots: list[int], values: list[float]) -> None:
    for s, v in zip(slots, values):
        cache.k[:, s] = v
        cache.v[:, s] = -v


def read(cache: KVCache, row) -> list[float]:
    bs = cache.block_size
    return [float(cache.k[0, row.blocks[p // bs] * bs + p % bs, 0, 0]) for p in range(row.length)]


def test_append_allocates_blocks_on_demand():
    c = make_cache()
    r = c.new_row()
    slots = c.append(r, 6)
    assert r.length == 6 and len(r.blocks) == 2 and c.used_blocks == 2
    assert slots == [r.blocks[0] * 4 + i for i in range(4)] + [r.blocks[1] * 4 + i for i in range(2)]
    c.append(r, 2)  # fills block 2 exactly: no new block
    assert c.used_blocks == 2
    c.append(r, 1)
    assert c.used_blocks == 3 and c.refcount[r.blocks[2]] == 1


def test_free_returns_blocks_and_blocks_are_reused():
    c = make_cache(num_blocks=3)
    r = c.new_row()
    c.append(r, 12)
    assert c.free_blocks == 0
    with pytest.raises(CacheFull):
        c.append(c.new_row(), 1)
    c.free(r)
    assert c.free_blocks == 3 and r.blocks == [] and r.length == 0
    assert all(n == 0 for n in c.refcount)


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_partial_block():
    c = make_cache()
    parent = c.new_row()
    write(c, c.append(parent, 6), [1, 2, 3, 4, 5, 6])
    child = c.fork(parent)
    assert child.blocks == parent.blocks and c.used_blocks == 2
    assert [c.refcount[b] for b in parent.blocks] == [2, 2]
    # the child writes position 6, inside the shared partial block 1: it gets its own copy of that block
    write(c, c.append(child, 1), [70])
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    assert c.used_blocks == 3 and c.refcount[parent.blocks[0]] == 2 and c.refcount[parent.blocks[1]] == 1
    # the parent, now sole owner of its block, writes in place
    write(c, c.append(parent, 1), [7])
    assert c.used_blocks == 3
    assert read(c, parent) == [1, 2, 3, 4, 5, 6, 7]
    assert read(c, child) == [1, 2, 3, 4, 5, 6, 70]
    assert float(c.v[1, child.blocks[1] * 4 + 1, 0, 0]) == -6  # copied in every layer, K and V
    c.free(parent)
    assert c.refcount[child.blocks[0]] == 1 and c.used_blocks == 2
    c.free(child)
    assert c.used_blocks == 0


def test_fork_at_block_boundary_needs_no_copy():
    c = make_cache()
    parent = c.new_row()
    write(c, c.append(parent, 4), [1, 2, 3, 4])
    child = c.fork(parent)
    write(c, c.append(child, 1), [5])
    assert child.blocks[0] == parent.blocks[0] and c.used_blocks == 2
    assert read(c, child) == [1, 2, 3, 4, 5] and read(c, parent) == [1, 2, 3, 4]


def test_budget_reservations():
    c = make_cache(num_blocks=8)
    assert c.try_reserve(5) and not c.try_reserve(4) and c.try_reserve(3)
    c.release(5)
    assert c.reserved == 3 and c.try_reserve(5)


@pytest.mark.parametrize("prompt,max_tokens,rows,bs", [(5, 1, 1, 4), (5, 7, 3, 4), (8, 9, 4, 4), (3, 20, 2, 16),
                                                        (16, 1, 4, 16), (17, 16, 2, 16)])
def test_blocks_needed_bounds_beam_like_usage(prompt, max_tokens, rows, bs):
    """Worst case: every row diverges at every step (all rows fork from row 0, each writes its own token)."""
    c = make_cache(num_blocks=64, block_size=bs)
    r = c.new_row()
    c.append(r, prompt)
    peak = c.used_blocks
    live = [r]
    for _ in range(max_tokens - 1):  # the last generated token is never fed back
        new = [live[0]] + [c.fork(live[0]) for _ in range(rows - 1)]
        for old in live[1:]:
            c.free(old)
        live = new
        for row in live:
            c.append(row, 1)
        peak = max(peak, c.used_blocks)
    need = blocks_needed(prompt, max_tokens, rows, bs)
    assert peak <= need
    # without divergence (rows == 1) the bound is exact
    if rows == 1:
        assert peak == need


def test_plan_addresses_and_masks_rows_of_different_lengths():
    c = make_cache(block_size=4)
    a, b = c.new_row(), c.new_row()
    c.append(a, 6)
    c.append(b, 2)
    batch = c.plan([a, b], 1)
    assert batch.positions.tolist() == [[6], [2]]
    assert batch.write_slots.tolist() == [a.blocks[1] * 4 + 2, b.blocks[0] * 4 + 2]
    assert batch.read_slots.shape == (2, 7) and batch.mask.shape == (2, 1, 1, 7)
    assert batch.mask[0, 0, 0].tolist() == [True] * 7
    assert batch.mask[1, 0, 0].tolist() == [True] * 3 + [False] * 4
    assert batch.read_slots[0].tolist() == [a.blocks[p // 4] * 4 + p % 4 for p in range(7)]
    # a prefill chunk after 2 cached tokens: causal inside the chunk, full view of the past
    chunk = c.plan([b], 3)
    assert chunk.positions.tolist() == [[3, 4, 5]]
    m = chunk.mask[0, 0].int().tolist()
    assert m == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert torch.equal(chunk.read_slots[0], torch.tensor([b.blocks[p // 4] * 4 + p % 4 for p in range(6)]))
