"""Scheduling policy: which requests run, and what each step computes (a `StepPlan`).

First come first served. `schedule()`:
1. retires cancelled requests (queued or running) and lists them in the plan, to be ended with CANCELLED;
1b. under the `max_utilization` scheduler policy (`preempt.py`), grows the KV reservations of running requests to
   what the coming step can write, oldest first, preempting the latest arrived running requests where the cache
   runs out (listed in `plan.preempted`; no admission in such a step);
2. admits waiting requests in arrival order while they fit every budget (`_fits`, one place: rows it can ever
   use, `max(beam_width, num_return_sequences)`, within `max_rows`; its worst-case KV blocks,
   `kv_cache.blocks_needed`, reservable; its LoRA adapter, if any, resident in a device slot
   (`adapter_slots.DeviceAdapters`: only idle adapters are evicted for it)). A request short of rows or KV
   blocks is never overtaken (no starvation of long or wide requests). A request waiting only for an adapter
   slot lets base-model requests behind it pass (they hold no slot, so they cannot delay its slot), but no
   request with an adapter, which could keep the slots busy: tenants without adapters never wait on a busy
   adapter cache, and rare adapters are not starved. Reservation makes every later block allocation succeed
   (under `guaranteed_no_evict` the worst case is reserved and nothing is ever preempted). Taking the budgets is
   all or nothing: when taking one raises (the adapter's device copy runs out of memory, a cache fault), what
   was taken before is given back, the request leaves the queue and is listed in `plan.failed` with the exception (the scheduler ends it with an error), and admission goes
   on with the next request;
3. gives requests whose prompt is not cached yet up to `prefill_chunk` prompt tokens in all, oldest first (a
   request admitted with a cached prefix starts after it: `KVCache.reuse`; a resumed one computes its tokens
   again the same way: `_chunk`);
4. decodes every running request whose prompt is complete after this step's prefill.

`retire()` gives a finished request's budgets back (rows, blocks, reservation, adapter slot; idempotent). The
policy never runs the model.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from . import preempt
from ..errors import InvalidArgument
from .lora.adapter_slots import DeviceAdapters
from .kv.kv_cache import KVCache
from .state import Active


CPU_PREFILL_CHUNK = 512  # prompt tokens a step on a CPU (the engine's default before any GPU ran it)
GiB = 1 << 30


def default_prefill_chunk(device: torch.device) -> int:
    """`prefill_chunk` where the deployment sets none (0): 512 on a CPU; on a GPU vLLM's default token budget of a
    step for its OpenAI server by the device's memory (`EngineArgs`, its PR #17885 measured a larger budget slower
    on an A100): >= 160 GiB 16384, >= 70 GiB and not an A100 (H100, H200) 8192, else 2048. On the GPU a step with a
    prefill runs its decode rows outside the CUDA graphs (~60 ms a step for a 7B on an H200: 16.6 tok/s without
    graphs): 64 prompts of 587 tokens took 74 such steps at 512 (2026-11-28 GPU check). Not yet measured on a GPU
    at these values."""
    if device.type != "cuda":
        return CPU_PREFILL_CHUNK
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= 160 * GiB:
        return 16384
    if props.total_memory >= 70 * GiB and "a100" not in props.name.lower():
        return 8192
    return 2048


@dataclass(frozen=True)
class PrefillChunk:
    active: Active
    start: int  # first position of the chunk (of the prompt, or of a preempted request's recompute)
    length: int  # positions in the chunk (of each row)

    @property
    def rows(self) -> bool:
        """A resumed request's rows after its first was forked into them, each computing its own tokens."""
        return self.start >= self.active.prefill_len

    @property
    def tokens(self) -> int:
        return self.length * (len(self.active.kv.resume_rows) if self.rows else 1)

    @property
    def completes(self) -> bool:
        return self.start + self.length == self.active.compute_len


@dataclass
class StepPlan:
    cancelled: list[Active] = field(default_factory=list)
    failed: list[tuple[Active, Exception]] = field(default_factory=list)  # admission raised: out of the queue
    admitted: list[Active] = field(default_factory=list)
    preempted: list[Active] = field(default_factory=list)  # running requests sent back to the queue (recompute)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Active] = field(default_factory=list)  # one new token for each of their rows


class Policy:
    def __init__(self, cache: KVCache, adapters: DeviceAdapters, *, max_rows: int, prefill_chunk: int,
                 scheduler_policy: str = preempt.GUARANTEED_NO_EVICT, prefill_granule: int = 1):
        if scheduler_policy not in preempt.POLICIES:
            raise ValueError(f"scheduler_policy must be one of {list(preempt.POLICIES)}, got {scheduler_policy!r}")
        self.cache, self.adapters = cache, adapters
        self.max_rows, self.prefill_chunk = max_rows, prefill_chunk
        # a chunk that stops inside a prompt stops at a multiple of this (hybrid models: the linear layers' chunked
        # rule then starts its chunks where one pass over the prompt would, `deltanet.CHUNK`)
        self.granule = prefill_granule
        if prefill_granule > 1 and prefill_chunk % prefill_granule:
            raise InvalidArgument(f"prefill_chunk {prefill_chunk} must be a multiple of {prefill_granule} for this "
                                  "model (its linear-attention layers' chunk size)")
        self.on_demand = scheduler_policy == preempt.MAX_UTILIZATION
        self.waiting: deque[Active] = deque()
        self.running: list[Active] = []
        self.rows_reserved = 0
        self.preemptions = 0  # running requests preempted since start
        self._arrivals = 0

    def add(self, active: Active) -> None:
        active.arrival, self._arrivals = self._arrivals, self._arrivals + 1
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
        if self.on_demand:
            self._grow(plan)
        if not plan.preempted:  # vLLM's rule: a step short of blocks admits nothing
            self._admit(plan)
        budget = self.prefill_chunk
        for a in self.running:
            if a.prefilling:
                if budget <= 0:
                    continue
                chunk = self._chunk(a, budget)
                if chunk is None:
                    continue
                plan.prefill.append(chunk)
                budget -= chunk.tokens
                if not chunk.completes:
                    continue
            plan.decode.append(a)
        return plan

    def _chunk(self, a: Active, budget: int) -> Optional[PrefillChunk]:
        """`a`'s next prefill chunk within `budget` tokens: of its first row up to `prefill_len`, then (resuming
        several rows) of every row at once, at least one position each. A chunk ending inside the prompt ends at a
        multiple of the granule (None: not one fits the budget left this step)."""
        done = a.kv.prefilled
        if done < a.prefill_len:
            end = min(a.prefill_len, done + budget)
            if end < a.prompt_len:
                end -= end % self.granule
            return PrefillChunk(a, done, end - done) if end > done else None
        return PrefillChunk(a, done, min(a.compute_len - done, max(1, budget // len(a.kv.resume_rows))))

    def _fits(self, a: Active) -> Optional[str]:
        """Reserve every budget `a` needs, all or nothing: its rows, its worst-case KV blocks, its adapter's
        device slot and its first KV row, started with the cached blocks of its prompt's longest cached prefix
        (prefix caching; the reservation counts them too). None when it holds them all; else the budget that is
        short ("rows", "kv" or "slot"), holding none. If taking one raises, the ones taken before are given
        back first."""
        if self.rows_reserved + a.width > self.max_rows:
            return "rows"
        want = self._reservation(a)
        if not self.cache.try_reserve(want):
            return "kv"
        a.kv.reserved = want
        adapter = a.req.adapter
        try:
            if adapter is not None:
                lora = self.adapters.acquire(adapter)  # may copy it to the device
                if lora is None:  # every slot holds an adapter a running request uses: wait for one to finish
                    self._unreserve(a)
                    return "slot"
                a.lora = lora
            a.kv.rows = [self.cache.new_row(a.prompt_len)]
            self._reuse_prefix(a)
        except BaseException:
            lora, a.lora = a.lora, None
            rows, a.kv.rows, a.kv.prefilled = a.kv.rows, [], 0
            if a.kv.resume_ids is None:
                a.kv.cached = 0
            try:
                for r in rows:
                    self.cache.free(r)
                self._unreserve(a)
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
                if a.timing.admitted is None:  # a preempted request keeps its first admission's time
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
                self._unreserve(a)
                self.running.remove(a)
            elif a in self.waiting:
                self.waiting.remove(a)

    # --- KV reservations: the worst case, or on demand (`preempt.py`) ------------------------------------------
    def _reservation(self, a: Active) -> int:
        """The KV blocks `a` must hold reserved now: its worst case, or on demand what the coming step needs."""
        if self.on_demand:  # every request can be preempted and resumed exactly (beams as a group)
            return preempt.blocks_now(a, self.cache.block_size)
        return a.kv.worst

    def _unreserve(self, a: Active) -> None:
        reserved, a.kv.reserved = a.kv.reserved, 0
        self.cache.release(reserved)

    def _reuse_prefix(self, a: Active) -> None:
        """Start `a`'s first row with the cached blocks of its longest cached prefix: its prompt's, or after a
        preemption its recompute's (not counted in the prefix-cache statistics, which count prompts)."""
        kv = a.kv
        if kv.hasher is None:
            return
        if kv.resume_ids is None:
            kv.cached = kv.prefilled = self.cache.reuse(kv.rows[0], kv.hasher.prompt_hashes, a.prompt_len)
        else:
            kv.prefilled = self.cache.reuse(kv.rows[0], kv.resume_hashes, len(kv.resume_ids), count=False)

    def _grow(self, plan: StepPlan) -> None:
        """On demand: each running request's reservation grows to what the coming step can write, oldest first;
        where the cache is short, the latest arrived running request is preempted (possibly the
        growing one itself: then nothing arrived after it holds blocks it could take)."""
        for a in sorted(self.running, key=lambda r: r.arrival):
            grow = self._reservation(a) - a.kv.reserved
            while grow > 0 and a.admitted:
                if self.cache.try_reserve(grow):
                    a.kv.reserved += grow
                    break
                victim = max(self.running, key=lambda r: r.arrival)
                self.preempt(victim)
                plan.preempted.append(victim)

    def preempt(self, a: Active) -> None:
        """Send running `a` back to the queue (ahead of every request that arrived after it) with nothing held;
        it computes its tokens again when it is admitted again (`preempt.suspend`)."""
        preempt.suspend(a)
        self.retire(a)
        a.kv.prefilled = 0
        a.preemptions += 1
        self.preemptions += 1
        later = next((i for i, w in enumerate(self.waiting) if w.arrival > a.arrival), len(self.waiting))
        self.waiting.insert(later, a)
