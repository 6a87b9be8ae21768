"""Scheduling policy: which requests run, and what each step computes (a `StepPlan`).

First come first served. `schedule()`:
1. retires cancelled requests (queued or running) and lists them in the plan, to be ended with CANCELLED;
2. admits waiting requests in arrival order while they fit every budget (`_fits`, one place: rows it can ever
   use, `max(beam_width, num_return_sequences)`, within `max_rows`; its worst-case KV blocks,
   `kv_cache.blocks_needed`, reservable; its LoRA adapter, if any, resident in a device slot
   (`adapter_slots.DeviceAdapters`: only idle adapters are evicted for it)). A request short of rows or KV
   blocks is never overtaken (no starvation of long or wide requests). A request waiting only for an adapter
   slot lets base-model requests behind it pass (they hold no slot, so they cannot delay its slot), but no
   request with an adapter, which could keep the slots busy: tenants without adapters never wait on a busy
   adapter cache, and rare adapters are not starved. Reservation makes every later block allocation succeed:
   nothing is ever preempted. Taking the budgets is all or nothing: when taking one raises (the adapter's device
   copy runs out of memory, a cache fault), what was taken before is given back, the request leaves the queue
   and is listed in `plan.failed` with the exception (the scheduler ends it with an error), and admission goes
   on with the next request;
3. gives requests whose prompt is not cached yet up to `prefill_chunk` prompt tokens in all, oldest first (a
   request admitted with a cached prefix starts after it: `KVCache.reuse`);
4. decodes every running request whose prompt is complete after this step's prefill.

`retire()` gives a finished request's budgets back (rows, blocks, reservation, adapter slot; idempotent). The
policy never runs the model.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .adapter_slots import DeviceAdapters
from .kv_cache import KVCache
from .state import Active


@dataclass(frozen=True)
class PrefillChunk:
    active: Active
    start: int  # first prompt position of the chunk
    length: int  # prompt tokens in the chunk

    @property
    def completes(self) -> bool:
        return self.start + self.length == self.active.prompt_len


@dataclass
class StepPlan:
    cancelled: list[Active] = field(default_factory=list)
    failed: list[tuple[Active, Exception]] = field(default_factory=list)  # admission raised: out of the queue
    admitted: list[Active] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Active] = field(default_factory=list)  # one new token for each of their rows


class Policy:
    def __init__(self, cache: KVCache, adapters: DeviceAdapters, *, max_rows: int, prefill_chunk: int):
        self.cache, self.adapters = cache, adapters
        self.max_rows, self.prefill_chunk = max_rows, prefill_chunk
        self.waiting: deque[Active] = deque()
        self.running: list[Active] = []
        self.rows_reserved = 0

    def add(self, active: Active) -> None:
        self.waiting.append(active)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, cancelled_ids: Iterable[str] = ()) -> StepPlan:
        plan = StepPlan()
        ids = set(cancelled_ids)
        if ids:
            plan.cancelled = [a for a in list(self.waiting) + self.running if a.id in ids]
        for a in plan.cancelled:  # their budgets are free for this step's admission
            self.retire(a)
        self._admit(plan)
        budget = self.prefill_chunk
        for a in self.running:
            if a.prefilling:
                if budget <= 0:
                    continue
                chunk = PrefillChunk(a, a.kv.prefilled, min(a.prompt_len - a.kv.prefilled, budget))
                plan.prefill.append(chunk)
                budget -= chunk.length
                if not chunk.completes:
                    continue
            plan.decode.append(a)
        return plan

    def _fits(self, a: Active) -> Optional[str]:
        """Reserve every budget `a` needs, all or nothing: its rows, its worst-case KV blocks, its adapter's
        device slot and its first KV row, started with the cached blocks of its prompt's longest cached prefix
        (prefix caching; the reservation counts them too). None when it holds them all; else the budget that is
        short ("rows", "kv" or "slot"), holding none. If taking one raises, the ones taken before are given
        back first."""
        if self.rows_reserved + a.width > self.max_rows:
            return "rows"
        if not self.cache.try_reserve(a.kv.reserved):
            return "kv"
        adapter = a.req.adapter
        try:
            if adapter is not None:
                lora = self.adapters.acquire(adapter)  # may copy it to the device
                if lora is None:  # every slot holds an adapter a running request uses: wait for one to finish
                    self.cache.release(a.kv.reserved)
                    return "slot"
                a.lora = lora
            a.kv.rows = [self.cache.new_row()]
            if a.kv.hasher is not None:
                a.kv.cached = a.kv.prefilled = self.cache.reuse(a.kv.rows[0], a.kv.hasher.prompt_hashes,
                                                                a.prompt_len)
        except BaseException:
            lora, a.lora = a.lora, None
            rows, a.kv.rows, a.kv.cached, a.kv.prefilled = a.kv.rows, [], 0, 0
            try:
                for r in rows:
                    self.cache.free(r)
                self.cache.release(a.kv.reserved)
            finally:
                if lora is not None:
                    self.adapters.release(adapter)
            raise
        self.rows_reserved += a.width
        a.admitted = True
        return None

    def _admit(self, plan: StepPlan) -> None:
        slot_wait = False
        for a in list(self.waiting):
            if slot_wait and a.req.adapter is not None:
                continue  # only base-model requests pass one waiting for a slot
            try:
                short = self._fits(a)
            except Exception as e:  # noqa: BLE001 - this request fails, admission goes on
                self.waiting.remove(a)
                plan.failed.append((a, e))
                continue
            if short is None:
                self.waiting.remove(a)
                a.timing.admitted = time.monotonic()
                self.running.append(a)
                plan.admitted.append(a)
            elif short == "slot" and not slot_wait:
                slot_wait = True
            elif short != "slot":
                break  # short of rows or KV blocks: nothing behind it overtakes it

    def retire(self, a: Active) -> None:
        """Give back everything `a` holds: its rows' blocks, its reservation, its rows budget, its place."""
        rows, a.kv.rows, a.kv.embeds = a.kv.rows, [], None
        try:
            for r in rows:
                self.cache.free(r)
        finally:  # the budgets go back even if freeing a row failed
            if a.admitted:
                a.admitted = False
                self.rows_reserved -= a.width
                lora, a.lora = a.lora, None
                if lora is not None:
                    self.adapters.release(a.req.adapter)
                self.cache.release(a.kv.reserved)
                self.running.remove(a)
            elif a in self.waiting:
                self.waiting.remove(a)
