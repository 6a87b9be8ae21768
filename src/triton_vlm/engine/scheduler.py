"""In-flight batching: which requests run, which rows each step computes, and what gets sent back.

Policy, per `step()`:

1. Cancellations: a cancelled request, queued or running, frees its rows, blocks and reservation now and
   gets a final result carrying `errors.Cancelled`.
2. Admission, first come first served: the head of the queue is admitted while (a) the rows it can ever use
   (`max(beam_width, num_return_sequences)`) fit in `max_rows` and (b) its worst-case KV blocks
   (`kv_cache.blocks_needed`) can be reserved. The head is never overtaken (no starvation of long or wide
   requests). Reservation makes every later allocation succeed: nothing is ever preempted or evicted.
3. Prefill: admitted requests whose prompt is not yet cached get up to `prefill_chunk` prompt tokens in total
   this step (oldest first), one forward per request (one row, causal over its own length). The prompt's
   embeddings, with image features merged in (`merge.py`), are built on its first chunk; a bad image count
   ends that request with `InvalidArgument`. When a prompt completes, its last position's logits go to the
   request's `Decoder` and the prompt row forks into the decoder's rows.
4. Decode: one forward with one new token for every running row of every request (including those whose
   prompt completed in 3). Each request's slice of logits goes to its `Decoder`; its `parents` reorder the
   rows (a parent kept by one child hands its blocks over, further children fork them; unkept rows are
   freed).
5. Results: a finished request frees everything and gets its final result (ranked `Decoder.finalize()`
   sequences, text = `tokenizer.decode(ids, skip_special_tokens=True)`). A request with `params.stream`
   also gets, after each of its steps, non-final results with the new tokens of `Decoder.stream_prefixes()`
   (one per sequence_index) and their text from a per-sequence `IncrementalDetokenizer`. For beam search
   that is one prefix, the part every hypothesis still in the running shares, so nothing streamed is ever
   retracted and the pieces concatenate to the final best sequence; sampling streams each of its
   num_return_sequences sequences under its own index.

Any exception while handling one request ends that request with an error result; the others go on.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import Cancelled, Internal, VLMError
from ..params import GenerationRequest, GenerationResult, RequestStats, Sequence_
from .kv_cache import KVCache, RowKV
from .merge import merge_image_embeds
from .model import LlamaModel

log = logging.getLogger(__name__)
Callback = Callable[[GenerationResult], None]
Output = tuple[Callback, GenerationResult]


@dataclass
class _Stream:
    detok: Any  # IncrementalDetokenizer
    sent: list[int] = field(default_factory=list)  # token ids already streamed


@dataclass(eq=False)  # compared by identity (requests hold tensors)
class Active:
    """One request inside the engine."""

    req: GenerationRequest
    on_result: Callback
    decoder: Any  # engine.decoder.Decoder
    width: int  # most rows it can ever need
    reserved: int  # KV blocks reserved for it
    make_detok: Optional[Callable[[], Any]] = None  # streaming: a new IncrementalDetokenizer per sequence
    embeds: Optional[torch.Tensor] = None  # [P, hidden] prompt embeddings while prefilling
    prefilled: int = 0  # prompt tokens cached
    rows: list[RowKV] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)  # token each row feeds at the next decode step
    streams: dict[int, "_Stream"] = field(default_factory=dict)  # sequence index -> what was streamed
    admitted: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: Optional[float] = None
    first_token_at: Optional[float] = None
    steps: int = 0  # decoder steps run (new tokens)

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.input_ids)


class Scheduler:
    def __init__(self, model: LlamaModel, cache: KVCache, *, max_rows: int, prefill_chunk: int,
                 decode_text: Callable[[list[int]], str]):
        self.model, self.cache = model, cache
        self.max_rows, self.prefill_chunk = max_rows, prefill_chunk
        self.decode_text = decode_text
        self.waiting: deque[Active] = deque()
        self.running: list[Active] = []
        self.rows_reserved = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, active: Active) -> None:
        self.waiting.append(active)

    def step(self, cancelled: set[str] = frozenset()) -> list[Output]:
        out: list[Output] = []
        if cancelled:
            self._cancel(cancelled, out)
        self._admit()
        self._prefill(out)
        self._decode(out)
        return out

    def fail_all(self, error: VLMError) -> list[Output]:
        """End every request (shutdown)."""
        out: list[Output] = []
        for a in list(self.waiting) + list(self.running):
            self._finish(a, out, error)
        return out

    # --- phases -------------------------------------------------------------------------------------------
    def _cancel(self, ids: set[str], out: list[Output]) -> None:
        for a in [a for a in list(self.waiting) + self.running if a.id in ids]:
            self._finish(a, out, Cancelled(f"request {a.id} was cancelled"))

    def _admit(self) -> None:
        while self.waiting:
            a = self.waiting[0]
            if self.rows_reserved + a.width > self.max_rows or not self.cache.try_reserve(a.reserved):
                return
            self.waiting.popleft()
            self.rows_reserved += a.width
            a.admitted = True
            a.admitted_at = time.monotonic()
            a.rows = [self.cache.new_row()]
            self.running.append(a)

    def _prefill(self, out: list[Output]) -> None:
        budget = self.prefill_chunk
        for a in [a for a in self.running if a.prefilling]:
            if budget <= 0:
                return
            try:
                if a.embeds is None:
                    ids = torch.tensor(a.req.input_ids, dtype=torch.long, device=self.model.device)
                    a.embeds = merge_image_embeds(ids, self.model.embed(ids), a.req.image_embeds,
                                                  self.model.config.image_token_id)  # [P, hidden]
                n = min(len(a.req.input_ids) - a.prefilled, budget)
                batch = self.cache.plan(a.rows, n)
                logits = self.model.forward(a.embeds[None, a.prefilled:a.prefilled + n], batch, self.cache)
                a.prefilled += n
                budget -= n
                if not a.prefilling:
                    a.embeds = None
                    self._advance(a, logits, out)  # logits [1, vocab] of the prompt's last position
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                self._finish(a, out, _as_error(e))

    def _decode(self, out: list[Output]) -> None:
        batch_reqs = [a for a in self.running if not a.prefilling]
        if not batch_reqs:
            return
        rows = [r for a in batch_reqs for r in a.rows]
        tokens = torch.tensor([t for a in batch_reqs for t in a.next_tokens], dtype=torch.long)
        try:
            x = self.model.embed(tokens)[:, None]  # [rows, 1, hidden]
            logits = self.model.forward(x, self.cache.plan(rows, 1), self.cache)  # [rows, vocab]
        except Exception as e:  # noqa: BLE001
            log.exception("decode step failed")
            for a in batch_reqs:
                self._finish(a, out, _as_error(e))
            return
        start = 0
        for a in batch_reqs:
            n = len(a.rows)
            try:
                self._advance(a, logits[start:start + n], out)
            except Exception as e:  # noqa: BLE001
                self._finish(a, out, _as_error(e))
            start += n

    # --- per request ----------------------------------------------------------------------------------------
    def _advance(self, a: Active, logits: torch.Tensor, out: list[Output]) -> None:
        """Feed one step of logits [rows, vocab] to the request's decoder and act on its answer."""
        res = a.decoder.step(logits)
        a.steps += 1
        if a.first_token_at is None:
            a.first_token_at = time.monotonic()
        if len(res.parents) > a.width:
            raise Internal(f"decoder asked for {len(res.parents)} rows, more than the {a.width} reserved")
        a.rows = self._reorder(a.rows, res.parents)
        a.next_tokens = list(res.tokens)
        if res.done:
            self._finish(a, out)
        elif a.req.params.stream:
            for j, tokens in enumerate(a.decoder.stream_prefixes()):
                self._stream(a, j, tokens, out)

    def _reorder(self, rows: list[RowKV], parents: list[int]) -> list[RowKV]:
        new, kept = [], set()
        for p in parents:
            if p in kept:
                new.append(self.cache.fork(rows[p]))
            else:
                kept.add(p)
                new.append(rows[p])
        for i, r in enumerate(rows):
            if i not in kept:
                self.cache.free(r)
        return new

    def _stream(self, a: Active, j: int, tokens: list[int], out: list[Output], flush: bool = False) -> None:
        """Send sequence j's tokens beyond what it was already sent (only ever an extension)."""
        st = a.streams.get(j)
        if st is None:
            st = a.streams[j] = _Stream(detok=a.make_detok())
        n = len(st.sent)
        if tokens[:n] != st.sent or (len(tokens) == n and not flush):
            return
        new = list(tokens[n:])
        text = st.detok.push(new) if new else ""
        if flush and hasattr(st.detok, "flush"):
            text += st.detok.flush()
        if not new and not text:
            return
        st.sent.extend(new)
        piece = Sequence_(token_ids=new, text=text)
        out.append((a.on_result, GenerationResult(a.id, [piece], final=False, sequence_index=j)))

    def _finish(self, a: Active, out: list[Output], error: Optional[Exception] = None) -> None:
        for r in a.rows:
            self.cache.free(r)
        a.rows, a.embeds = [], None
        if a.admitted:
            self.cache.release(a.reserved)
            self.rows_reserved -= a.width
            self.running.remove(a)
            a.admitted = False
        elif a in self.waiting:
            self.waiting.remove(a)
        if error is None:
            try:
                seqs = a.decoder.finalize()
                for s in seqs:
                    s.text = self.decode_text(s.token_ids)
                if a.req.params.stream:  # the rest of every sequence that was being streamed
                    for j in sorted(a.streams):
                        self._stream(a, j, seqs[j].token_ids, out, flush=True)
                out.append((a.on_result, GenerationResult(a.id, seqs, final=True, stats=_stats(a))))
                return
            except Exception as e:  # noqa: BLE001
                error = _as_error(e)
        out.append((a.on_result, GenerationResult(a.id, [], final=True, error=error, stats=_stats(a))))


def _stats(a: Active) -> RequestStats:
    now, t0 = time.monotonic(), a.submitted_at
    return RequestStats(prompt_tokens=len(a.req.input_ids), generated_tokens=a.steps,
                        queue_s=(a.admitted_at if a.admitted_at is not None else now) - t0,
                        ttft_s=None if a.first_token_at is None else a.first_token_at - t0, e2e_s=now - t0)


def _as_error(e: Exception) -> VLMError:
    if isinstance(e, VLMError):
        return e
    log.exception("request failed", exc_info=e)
    return Internal(f"{type(e).__name__}: {e}")
