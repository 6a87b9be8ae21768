"""Async scheduling: the host prepares step N+1 while the device runs step N (vLLM v1's `--async-scheduling`,
SGLang's overlap scheduler); `EngineConfig.async_scheduling`, llm parameter `async_scheduling`.

A steady decode step, overlapped (`Overlap.step`, called by the scheduler after the policy's plan):
    plan = policy.schedule()                      # step N+1's admission and decode set, on the host, N running
    launch(N+1): block tables (`cache.plan`), positions, the rows' map to step N's rows, on the host; then on the
        device: input ids = step N's chosen tokens gathered there (never read back) -> forward -> `decoder.pick`
    finish(N): wait for N's read-back (by now the device is busy with N+1), then the host half of each decoder's
        step (`Decoder.advance_picked`: stop checks), prefix-cache blocks, KV reorder, stream pieces and final
        results (their text is made on the delivery thread, `delivery.py`)
So the only host-device synchronisation of a steady step is step N's read-back, waited for while N+1 is queued.

The device: on a CPU a worker thread of its own (`DeviceQueue`: jobs in launch order, as a CUDA stream; torch
releases the GIL inside its ops); on CUDA the host thread itself queues the kernels and step N's packed results are
copied non-blocking into pinned memory, an event marking when they are there.

A request in step N+1 whose step N ends it (an end id, a stop word) computed one wasted row there, dropped at
finish(N+1) (vLLM's rule); one that max_tokens ends at N is left out of N+1. Its blocks are freed at finish(N)
while N+1 may still write them: every later use of a block is a later device job (in order) or comes after a drain.

Where the next step needs this step's tokens on the host the step runs synchronously (`Overlap.step` declines and
the scheduler drains the pending step first): a prefill in the plan (a new request's first token, chunks),
beam search (its next rows depend on the chosen beams), guided decoding (the grammar's mask), context processors
(penalties, no-repeat-ngram, bad words), rows inside min_tokens, sampling with num_return_sequences > 1, LoRA rows,
and CUDA graphs (their inputs are host-built; not wired yet). On CUDA without graphs it is exact but the eager
step's attention batch (`KVCache.plan`) is copied from pageable memory, a stream sync: not overlapped yet. Under
`max_utilization` the pending step is drained before scheduling (preemption reads the decoders' tokens), so little
overlaps there. The tokens are the synchronous path's, bit for bit (tests/engine/test_overlap.py).
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .output import _count_step
from .runner import _delta
from .search.decoder import pick
from .search.processors import on_device
from .state import Active, Output

SWITCH_INTERVAL_S = float(os.environ.get("TRITON_VLM_SWITCH_S", "0.0005"))

if TYPE_CHECKING:
    from .policy import StepPlan
    from .scheduler import Scheduler


@dataclass
class Picked:
    """A launched step's device results: the chosen tokens [rows] (stay on the device, the next step's inputs), per
    kind (rows, packed [n, 3 + 2 max k]) on the host once `ready` (a CUDA event) has passed, the fp32 logits."""

    tokens: torch.Tensor
    groups: list
    raw: torch.Tensor
    ready: Optional[object] = None  # torch.cuda.Event of the non-blocking copies, None on a CPU

    def values(self) -> list[list]:
        """Per row, its read-back [token, stuck, log prob, top lp..., top ids...] (the step's one sync)."""
        if self.ready is not None:
            self.ready.synchronize()
        rows: list = [None] * int(self.tokens.shape[0])
        for idx, packed in self.groups:
            for i, v in zip(idx, packed.tolist()):
                rows[i] = v
        return rows


class DeviceQueue:
    """Runs the launched steps' device work in launch order: a worker thread on a CPU; on CUDA inline (the
    kernels are asynchronous already)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pool = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix="triton-vlm-device")
        if self._pool is not None:  # each op of the worker takes the GIL back within this of the host's Python
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def submit(self, job: Callable[[], Picked]) -> Future:
        if self._pool is not None:
            return self._pool.submit(job)
        f: Future = Future()
        try:
            f.set_result(job())
        except Exception as e:  # noqa: BLE001 - surfaces at finish, as the CPU's does
            f.set_exception(e)
        return f

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass
class Launched:
    actives: list[Active]  # row i = actives[i]'s one row
    future: Future  # -> Picked


class Overlap:
    """The scheduler's overlapped decode steps; `pending` is the step launched and not finished yet."""

    def __init__(self, scheduler: "Scheduler"):
        self.s = scheduler
        self.runner = scheduler.runner
        self.device = DeviceQueue(self.runner.model.device)
        self.pending: Optional[Launched] = None
        self.steps = 0  # overlapped steps launched
        self.wasted_rows = 0  # rows computed for a request its previous step had ended
        self.wait_s = 0.0  # the host's time waiting for launched steps' results (the device's, not the host's)
        self.waits: Optional[list] = None  # a list: each wait's (start, end) is appended (`bench.engine.overlap`)

    def step(self, plan: "StepPlan", out: list[Output]) -> bool:
        """Run the plan's decode overlapped (launch N+1, then finish N) -> True; False (nothing done) where it must
        run synchronously: the caller drains and runs it."""
        decode = [a for a in plan.decode if a.admitted]
        if plan.prefill or self.runner.graphs is not None or not (decode or self.pending):
            return False
        if not all(a.lora is None and a.decoder.overlap_kind is not None for a in decode):
            return False
        t0 = time.perf_counter()
        prev = self.pending
        ahead = set() if prev is None else {id(a) for a in prev.actives}
        # max_tokens ends these at step N: no row for them in N+1
        live = [a for a in decode if not (id(a) in ahead and a.decoder.steps_left <= 1)]
        failed: Optional[Exception] = None
        try:
            self.pending = self._launch(live, prev) if live else None
        except Exception as e:  # noqa: BLE001 - as a failed forward: it ends the requests in it (after step N)
            self.pending, failed = None, e
        if prev is not None:
            self._finish(prev, out)
        if failed is not None:
            for a in live:
                if a.admitted:
                    self.s._fail(a, out, self.s._error(failed))
        times = self.s.times
        if live:
            times.decode_steps += 1
            times.decode_rows += len(live)
        times.decode_seconds += time.perf_counter() - t0
        return True

    def drain(self, out: list[Output]) -> None:
        """Finish the pending step (waits for it): every decoder is then up to date on the host."""
        prev, self.pending = self.pending, None
        if prev is not None:
            self._finish(prev, out)

    def discard(self) -> None:
        """Wait for the pending step and drop its results (its requests end otherwise: shutdown, a fault)."""
        prev, self.pending = self.pending, None
        if prev is not None:
            try:
                prev.future.result()
            except Exception:  # noqa: BLE001 - its requests are being ended anyway
                pass

    def close(self) -> None:
        self.discard()
        self.device.close()

    # --- the two halves ------------------------------------------------------------------------------------
    def _launch(self, live: list[Active], prev: Optional[Launched]) -> Launched:
        """Host: block tables, positions and the map of each row to step N's row; device: the rest."""
        runner = self.runner
        model, cache, dev = runner.model, runner.cache, runner.model.device
        at = {} if prev is None else {id(a): i for i, a in enumerate(prev.actives)}
        src = [at.get(id(a), -1) for a in live]  # its row in step N, or -1: its next token is on the host
        host_ids = torch.tensor([a.kv.next_tokens[0] if j < 0 else 0 for a, j in zip(live, src)], dtype=torch.long)
        gather = None
        if any(j >= 0 for j in src):
            gather = (torch.tensor([max(j, 0) for j in src], dtype=torch.long),
                      torch.tensor([j >= 0 for j in src], dtype=torch.bool), prev.future)
        batch = cache.plan([a.kv.rows[0] for a in live], 1)
        deltas = [_delta(a) for a in live]
        rope = batch.positions + torch.tensor(deltas, device=batch.positions.device)[:, None] if any(deltas) else None
        decoders = [a.decoder for a in live]
        kinds = [d.overlap_kind for d in decoders]
        queue = self.device

        def job() -> Picked:
            with torch.inference_mode():
                ids = on_device(host_ids, dev)  # [rows] (on CUDA from pinned memory: no sync)
                if gather is not None:  # step N's tokens, where they are: on the device
                    take, mask, before = gather
                    prev_tokens = before.result().tokens
                    ids = torch.where(on_device(mask, dev), prev_tokens[on_device(take, dev)], ids)
                logits = model.forward(model.embed(ids)[:, None], batch, cache, None, rope=rope)  # [rows, vocab]
                tokens, groups = pick(decoders, kinds, logits)
                ready = None
                if queue.cuda:
                    groups = [(rows, _to_host(packed)) for rows, packed in groups]
                    ready = torch.cuda.Event()
                    ready.record()
                return Picked(tokens, groups, logits.to(torch.float32), ready)

        self.steps += 1
        return Launched(live, queue.submit(job))

    def _finish(self, launched: Launched, out: list[Output]) -> None:
        """Host: step N's read-back, then per request its decoder's host half, blocks, rows, results."""
        s = self.s
        try:
            t0 = time.perf_counter()
            picked: Picked = launched.future.result()
            values = picked.values()
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if self.waits is not None:
                self.waits.append((t0, t1))
        except Exception as e:  # noqa: BLE001 - a failed step ends the requests in it
            for a in launched.actives:
                if a.admitted:
                    s._fail(a, out, s._error(e))
            return
        live = [(i, a) for i, a in enumerate(launched.actives) if a.admitted and not a.decoder.done]
        self.wasted_rows += len(launched.actives) - len(live)
        self.runner._cache_decoded_blocks([a for _, a in live])  # the tokens this step fed: their KV is there now
        for i, a in live:
            try:
                res = a.decoder.advance_picked(values[i], lambda i=i: not bool(torch.isfinite(picked.raw[i]).all()))
                if isinstance(res, Exception):
                    raise res
                _count_step(a)
                s._advance(a, None, out, res)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                s._fail(a, out, s._error(e))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking device-to-host copy into pinned memory (valid once the step's event has passed)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
