"""In-flight batching: one step = a plan from the policy, executed by the runner, turned into results.

    plan = policy.schedule(cancelled)      # policy.py: admission (every budget in one place), prefill chunks, decode set
    runner.prefill_many(plan.prefill): one-row chunks sharing an adapter in one ragged forward, the others one
        by one -> for each chunk that completes its prompt: advance
    (a request resuming after a preemption, `preempt.py`: its prefill recomputes prompt and generated tokens,
     whose logits are not stepped; it decodes on with the token its decoder chose before)
    runner.decode(plan.decode) -> logits [rows, vocab] -> greedy requests' decoders in one batched
        step (`decoder.step_greedy`, one device read-back), batchable sampling requests in one batched step
        (`decoder.step_samples`, one read-back), batchable beam requests in one batched step per (num_beams, K)
        (`decoder.step_beams`, one read-back each), the others on their slices -> advance each
    advance: output.step (decoder) -> runner.reorder (KV rows) -> done ? complete : stream
    (async scheduling, `overlap.py`: a steady decode step is launched before the previous one's results are
     processed; any other step finishes the pending one first, then runs as above)

Every request ends through `_complete` (its sequences) or `_fail` (its error, CANCELLED, or UNAVAILABLE at
shutdown); both give its budgets back first (`policy.retire`). An exception while handling one request ends
that request only, with the error `faults.as_error` makes of it: at admission (the policy rolls its
reservations back and lists it in `plan.failed`), in its prefill chunk, or in its decoder step; a failed decode
forward ends the requests in it; the others go on. A CUDA error (`faults.is_device_fault`) is also kept in
`fault` for the engine, which stops on it (the device context may be unusable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import Cancelled, Internal, VLMError
from .lora.adapter_slots import DeviceAdapters
from .model.faults import as_error, is_device_fault
from .kv.kv_cache import KVCache
from .model.model import LlamaModel
from .output import OutputProcessor
from .policy import Policy, StepPlan
from .preempt import GUARANTEED_NO_EVICT
from .runner import ModelRunner
from .state import Active, Output

SAMPLE = ("sample",)  # the group key of batchable sampling requests (beam keys are (num_beams, K))


@dataclass
class StepTimes:
    """Where the engine's steps spend their time, cumulative since start (exported as gauges,
    `triton_vlm_engine_<field>`): the prefill phase of the steps that had prompt chunks (its forwards, the first
    tokens and their hand-off to the caller) and the decode phase of the steps that had decode rows (its forward and
    the decoders' steps; the engine hands those results off after the step). Admission and the hand-off after the
    step are in neither. Host wall time (`time.perf_counter`): on a GPU a phase ends at its device read-back.
    Busy fraction = d(prefill_seconds + decode_seconds) / d(wall time)."""

    prefill_steps: int = 0  # steps with at least one prompt chunk
    prefill_tokens: int = 0  # prompt positions computed (chunks x rows x length)
    prefill_seconds: float = 0.0
    decode_steps: int = 0  # steps with at least one decode row
    decode_rows: int = 0  # rows decoded (one new token each)
    decode_seconds: float = 0.0


class Scheduler:
    def __init__(self, model: LlamaModel, cache: KVCache, adapters: DeviceAdapters, *, max_rows: int,
                 prefill_chunk: int, decode_text: Callable[[list[int]], str],
                 scheduler_policy: str = GUARANTEED_NO_EVICT):
        self.policy = Policy(cache, adapters, max_rows=max_rows, prefill_chunk=prefill_chunk,
                             scheduler_policy=scheduler_policy,
                             prefill_granule=getattr(model, "prefill_granule", 1))  # hybrid models: 64
        self.runner = ModelRunner(model, cache)
        # stacked copies of adapters get the device level's budget again (the adapters themselves use the first)
        self.runner.lora_stacks.max_bytes = adapters.max_bytes
        adapters.on_evict = self.runner.lora_stacks.drop  # an evicted adapter's stacks go with it
        self.output = OutputProcessor(decode_text, cache.block_size)
        self.fault: Optional[BaseException] = None  # the first CUDA error seen: the engine stops on it
        self.times = StepTimes()
        self.overlap = None  # async scheduling (`overlap.Overlap`), set by the engine when on

    # the policy's queue and budgets, for the engine's stats and the tests
    @property
    def waiting(self):
        return self.policy.waiting

    @property
    def running(self) -> list[Active]:
        return self.policy.running

    @property
    def rows_reserved(self) -> int:
        return self.policy.rows_reserved

    @property
    def preemptions(self) -> int:
        return self.policy.preemptions

    def has_work(self) -> bool:
        return self.policy.has_work() or (self.overlap is not None and self.overlap.pending is not None)

    def add(self, active: Active) -> None:
        self.policy.add(active)

    def step(self, cancelled: set[str] = frozenset(), out: Optional[list[Output]] = None,
             flush: Optional[Callable[[], None]] = None) -> list[Output]:
        """One step; its results are appended to `out` as they are made (so that an exception escaping the
        step loses none of them) and returned. `flush()`, when given, is called after the step's prefill
        forwards when they made a result: the caller delivers (and takes out of `out`) what is there, so that
        a request's first token leaves when its prefill ends, not after the step's decode."""
        out = [] if out is None else out
        lap = self.overlap
        if lap is not None and self.policy.on_demand:
            lap.drain(out)  # preemption reads the decoders' tokens: none may be in flight
        plan = self.policy.schedule(cancelled)
        for a in plan.cancelled:
            self._fail(a, out, Cancelled(f"request {a.id} was cancelled"))
        for a, e in plan.failed:
            self._fail(a, out, self._error(e, f"while admitting request {a.id}"))
        if lap is not None:  # a steady decode step overlapped (`overlap.py`); else the pending step first
            if lap.step(plan, out):
                return out
            lap.drain(out)
        t = self.times
        if plan.prefill:
            t.prefill_tokens += sum(c.length * (len(c.active.kv.resume_rows) if c.rows else 1) for c in plan.prefill)
            t0 = time.perf_counter()
            self._prefill(plan, out, flush)
            t.prefill_seconds += time.perf_counter() - t0
            t.prefill_steps += 1
        decode = [a for a in plan.decode if a.admitted]
        if decode:
            t.decode_rows += sum(len(a.kv.rows) for a in decode)  # before: a request that ends gives its rows back
            t0 = time.perf_counter()
            self._decode(decode, out)
            t.decode_seconds += time.perf_counter() - t0
            t.decode_steps += 1
        return out

    def fail_all(self, error: VLMError) -> list[Output]:
        """End every request (shutdown)."""
        out: list[Output] = []
        if self.overlap is not None:
            self.overlap.discard()
        for a in list(self.policy.waiting) + list(self.policy.running):
            self._fail(a, out, error)
        return out

    # --- phases -------------------------------------------------------------------------------------------
    def _prefill(self, plan: StepPlan, out: list[Output], flush: Optional[Callable[[], None]] = None) -> None:
        for chunk, logits in self.runner.prefill_many(plan.prefill):  # [1, vocab] when the prompt is complete
            a = chunk.active
            try:
                if isinstance(logits, Exception):
                    raise logits
                if logits is not None and a.kv.resume_ids is None:  # resumed: its next token was chosen already
                    self._advance(a, logits, out)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(a, out, self._error(e))
        if flush is not None and out:
            flush()

    def _decode(self, batch: list[Active], out: list[Output]) -> None:
        if not batch:
            return
        try:
            logits = self.runner.decode(batch)  # [rows, vocab]
        except Exception as e:  # noqa: BLE001
            for a in batch:
                self._fail(a, out, self._error(e))
            return
        starts, start = [], 0
        for a in batch:
            starts.append(start)
            start += len(a.kv.rows)
        done = self._batched_steps(batch, logits, starts)
        for i, a in enumerate(batch):
            try:
                res = done.get(i)
                if isinstance(res, Exception):
                    raise res
                self._advance(a, logits[starts[i]:starts[i] + len(a.kv.rows)], out, res)
            except Exception as e:  # noqa: BLE001
                self._fail(a, out, self._error(e))

    def _batched_steps(self, batch: list[Active], logits: torch.Tensor, starts: list[int]) -> dict[int, object]:
        """The decoder steps that run batched: every greedy request's row in one step, every batchable sampling
        request's rows in one step, beam requests in one step per (num_beams, K); one device read-back each.
        -> batch index -> `StepResult` or the error that ends that request."""
        done: dict[int, object] = {}
        greedy = [i for i, a in enumerate(batch) if getattr(a.decoder, "batched_greedy", False)]
        if greedy:
            rows = logits if len(greedy) == len(batch) else logits.index_select(
                0, torch.tensor([starts[i] for i in greedy], device=logits.device))  # [greedy, vocab]
            try:
                done = dict(zip(greedy, self.output.step_greedy([batch[i] for i in greedy], rows)))
            except Exception as e:  # noqa: BLE001
                done = {i: self._error(e) for i in greedy}
        groups: dict[tuple, list[int]] = {}  # SAMPLE: batchable sampling; beam requests by (num_beams, K)
        for i, a in enumerate(batch):
            key = SAMPLE if getattr(a.decoder, "batched_sampling", False) else getattr(a.decoder, "beam_key", None)
            if key is not None:
                groups.setdefault(key, []).append(i)
        for key, group in groups.items():
            step = self.output.step_samples if key == SAMPLE else self.output.step_beams
            try:
                done.update(zip(group, step([batch[i] for i in group], logits, [starts[i] for i in group])))
            except Exception as e:  # noqa: BLE001
                done.update({i: self._error(e) for i in group})
        return done

    # --- per request ----------------------------------------------------------------------------------------
    def _advance(self, a: Active, logits: torch.Tensor, out: list[Output], res=None) -> None:
        """One step of logits [rows, vocab] for `a`: decoder (unless its `res` was computed batched already), KV
        rows, then its results."""
        if res is None:
            res = self.output.step(a, logits)
        if len(res.parents) > a.width:
            raise Internal(f"decoder asked for {len(res.parents)} rows, more than the {a.width} reserved")
        if res.done:  # its per-request KV counts, before its rows go
            a.kv.held_blocks = len({b for r in a.kv.rows for b in r.blocks})
        self.runner.reorder(a, res.parents)
        a.kv.next_tokens = list(res.tokens)
        if res.done:
            self._complete(a, out)
        elif a.req.params.stream:
            out.extend(self.output.stream(a))

    def _complete(self, a: Active, out: list[Output]) -> None:
        """The decoder finished: budgets back, then the final result (or the error building it raised)."""
        self.policy.retire(a)
        try:
            out.extend(self.output.complete(a))
        except Exception as e:  # noqa: BLE001
            out.extend(self.output.fail(a, self._error(e)))

    def _error(self, e: BaseException, during: str = "") -> VLMError:
        if self.fault is None and is_device_fault(e):
            self.fault = e
        return as_error(e, during)

    def _fail(self, a: Active, out: list[Output], error: VLMError) -> None:
        """Failed, cancelled or shut down: budgets back, then a final result carrying `error`."""
        self.policy.retire(a)
        out.extend(self.output.fail(a, error))
