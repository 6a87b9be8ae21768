"""The paged KV cache of a hybrid model, with a state slot per row: rows carry their linear layers' states.

A hybrid text model (Qwen3.5: Gated DeltaNet `linear_attention` layers beside `full_attention` ones) keeps K/V only
for its full-attention layers (this cache's `k` / `v` have those layers only) and, per sequence, a fixed-size state
per linear layer (`state_cache.StateCache`). Every row (`RowKV`) holds one state slot for as long as it holds
blocks, so everything the engine already does to rows moves the states with them, with no engine code knowing:
- `new_row()` takes a zeroed slot (a fresh prompt; a preempted request's recompute rebuilds its state from zero);
- `fork(row)` (beam search keeping a parent twice, `n` samples / `num_return_sequences` forking the prompt's row,
  a resumed request's rows) takes a slot and copies the parent's state into it (one indexed copy per tensor);
- a row handed over to another position of the batch (beam reordering keeps the object) keeps its slot: the state
  moves with the object;
- `free(row)` (a finished, cancelled or preempted request, a beam nobody continues) gives the slot back.
`plan(rows, q_len)` adds each row's slot, the position its tokens start at and where its prompt ends
(`StateBatch`) to the `AttentionBatch` the model reads.

Slots are sized by the KV profile (`profile.py`): one per row the engine can run at once (`max_rows`), so admission
(which never runs more than `max_rows` rows) never finds them short; `StateCacheFull` would be a bug.
Prefix caching is off for these models (a cached prefix's KV without the linear layers' state at its end cannot
continue; vLLM keeps state snapshots at block boundaries for that, not done here): `register` / `reuse` are
never called (the engine gives no request a hasher).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import AttentionBatch, KVCache, RowKV
from .state_cache import StateCache, StateSpec


@dataclass
class StateBatch:
    """The linear layers' view of one forward's rows."""

    slots: torch.Tensor  # [rows] long: each row's state slot
    starts: list[int]  # each row's first new position (0: a fresh sequence, no state yet)
    prompt_ends: list[int]  # positions before this are prompt (chunked rule), after it generated (recurrent rule)


class HybridCache(KVCache):
    """`KVCache` over the full-attention layers plus a `StateCache` of `slots` rows (module doc)."""

    def __init__(self, *, spec: StateSpec, slots: int, **kv):
        super().__init__(**kv)
        self.states = StateCache(spec, slots, self.device)

    @property
    def free_slots(self) -> int:
        return self.states.free

    def new_row(self, prompt_len: int = 1 << 62) -> RowKV:
        row = super().new_row(prompt_len)
        row.slot = self.states.allocate()
        return row

    def fork(self, row: RowKV) -> RowKV:
        child = super().fork(row)
        child.slot = self.states.allocate()
        self.states.copy([row.slot], [child.slot])
        return child

    def free(self, row: RowKV) -> None:
        super().free(row)
        if row.slot >= 0:
            self.states.release(row.slot)
            row.slot = -1

    def plan(self, rows: list[RowKV], q_len: int) -> AttentionBatch:
        starts = [r.length for r in rows]
        batch = super().plan(rows, q_len)
        batch.states = StateBatch(slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device),
                                  starts=starts, prompt_ends=[r.prompt_len for r in rows])
        return batch
