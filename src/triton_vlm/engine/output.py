"""The output step: decoder steps, stream pieces and final results of one request.

- `step(active, logits)`: one step of logits [rows, vocab] to the request's decoder; returns its
  `StepResult` (the rows to keep, `parents`, and the tokens they feed next). `step_greedy` / `step_beams` /
  `step_samples` do the same for several requests at once (`decoder.step_greedy`, `decoder.step_beams`,
  `decoder.step_samples`).
- `stream(active)`: for a request with `params.stream`, the new tokens of `Decoder.stream_prefixes()` (one
  per sequence_index) as non-final results, with their text from a per-sequence `IncrementalDetokenizer`
  (made where the result is delivered: `delivery.Deferred`, not in the step). For
  beam search that is one prefix, the part every hypothesis still in the running shares, so nothing streamed is
  ever retracted and the pieces concatenate to the final best sequence; sampling streams each of its
  num_return_sequences sequences under its own index.
- `complete(active)`: the final result (ranked `Decoder.finalize()` sequences, text =
  `tokenizer.decode(ids, skip_special_tokens=True)`, made where it is delivered), after the rest of every
  streamed sequence.
- `fail(active, error)`: the final result carrying the error.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..params import GenerationResult, KVUsage, RequestStats, Sequence_
from .delivery import Deferred
from .search.decoder import step_beams, step_greedy, step_samples
from .state import Active, Output, StreamState


# the engine's clock (monotonic) -> ns since the epoch, for the timing outputs (TensorRT-LLM's `*_time_ns`)
_EPOCH_NS = time.time_ns() - time.monotonic_ns()


class OutputProcessor:
    def __init__(self, decode_text: Callable[[list[int]], str], block_size: int = 0):
        self.decode_text = decode_text
        self.block_size = block_size  # KV block size (0: no per-request KV counts)

    def step(self, a: Active, logits: torch.Tensor):
        res = a.decoder.step(logits)
        _count_step(a)
        return res

    def step_greedy(self, actives: list[Active], logits: torch.Tensor) -> list:
        """One step of greedy requests batched (`decoder.step_greedy`): logits [len(actives), vocab] -> per request
        its `StepResult` or the error that ends it."""
        results = step_greedy([a.decoder for a in actives], logits)
        for a, r in zip(actives, results):
            if not isinstance(r, Exception):
                _count_step(a)
        return results

    def step_beams(self, actives: list[Active], logits: torch.Tensor, starts: list[int]) -> list:
        """One step of beam requests with the same `Decoder.beam_key` batched (`decoder.step_beams`): logits = the
        decode step's [rows, vocab], actives[i]'s rows beginning at starts[i] -> per request its `StepResult` or
        the error that ends it."""
        results = step_beams([a.decoder for a in actives], logits, starts)
        for a, r in zip(actives, results):
            if not isinstance(r, Exception):
                _count_step(a)
        return results

    def step_samples(self, actives: list[Active], logits: torch.Tensor, starts: list[int]) -> list:
        """One step of batchable sampling requests (`decoder.step_samples`): logits = the decode step's
        [rows, vocab], actives[i]'s rows beginning at starts[i] -> per request its `StepResult` or the error that
        ends it."""
        results = step_samples([a.decoder for a in actives], logits, starts)
        for a, r in zip(actives, results):
            if not isinstance(r, Exception):
                _count_step(a)
        return results

    def stream(self, a: Active) -> list[Output]:
        out: list[Output] = []
        for j, tokens in enumerate(a.decoder.stream_prefixes()):
            self._piece(a, j, tokens, out)
        return out

    def complete(self, a: Active) -> list[Output]:
        out: list[Output] = []
        seqs = a.decoder.finalize()
        if a.req.params.stream:  # the rest of every sequence that was being streamed
            for j in sorted(a.streams):
                self._piece(a, j, seqs[j].token_ids, out, flush=True)
        decode = self.decode_text

        def fill(res: GenerationResult) -> str:
            for s in res.sequences:
                s.text = decode(s.token_ids)
            return "final"

        out.append((Deferred(a.on_result, fill), GenerationResult(a.id, seqs, final=True,
                                                                  stats=_stats(a, self.block_size),
                                                                  cached_tokens=a.kv.cached)))
        return out

    def fail(self, a: Active, error: Exception) -> list[Output]:
        return [(a.on_result, GenerationResult(a.id, [], final=True, error=error, stats=_stats(a)))]

    def _piece(self, a: Active, j: int, tokens: list[int], out: list[Output], flush: bool = False) -> None:
        """Send sequence j's tokens beyond what it was already sent (only ever an extension)."""
        st = a.streams.get(j)
        if st is None:
            st = a.streams[j] = StreamState(detok=a.make_detok())
        n = len(st.sent)
        if len(tokens) < n or (len(tokens) == n and not flush):
            return
        if not getattr(a.decoder, "append_only", False) and tokens[:n] != st.sent:  # O(n): beams only
            return
        new = list(tokens[n:])
        detok = st.detok

        def fill(res: GenerationResult) -> str:  # on the delivery thread, in order (`delivery.py`)
            text = detok.push(new) if new else ""
            if flush and hasattr(detok, "flush"):
                text += detok.flush()
            res.sequences[0].text = text
            return text

        piece = Sequence_(token_ids=new, text="")
        p = a.req.params
        if new and (p.return_log_probs or p.top_log_probs):  # greedy / sampling know them already
            info = a.decoder.token_info(j, n, n + len(new))
            if info is not None:
                piece.log_probs, piece.top_log_probs, piece.top_ids = info
        st.sent.extend(new)
        out.append((Deferred(a.on_result, fill, skip_empty=not new),
                    GenerationResult(a.id, [piece], final=False, sequence_index=j, cached_tokens=a.kv.cached)))


def _count_step(a: Active) -> None:
    a.timing.steps += 1
    a.timing.last_token = time.monotonic()
    if a.timing.first_token is None:
        a.timing.first_token = a.timing.last_token


def _epoch_ns(t: float | None) -> int:
    return 0 if t is None else int(t * 1e9) + _EPOCH_NS


def _kv_usage(a: Active, block_size: int) -> KVUsage:
    """Its prompt's blocks found in the prefix cache (reused) or not (missed), and the blocks it held at the end
    (total) of which the reused ones were not new; TensorRT-LLM's per-request KV-cache counts."""
    if block_size <= 0:
        return KVUsage()
    reused = a.kv.cached // block_size
    missed = max(0, -(-a.prompt_len // block_size) - reused)
    total = max(a.kv.held_blocks, reused)
    return KVUsage(reused_blocks=reused, missed_blocks=missed, new_blocks=total - reused, total_blocks=total)


def _stats(a: Active, block_size: int = 0) -> RequestStats:
    now, t = time.monotonic(), a.timing
    return RequestStats(prompt_tokens=a.prompt_len, generated_tokens=t.steps,
                        queue_s=(t.admitted if t.admitted is not None else now) - t.submitted,
                        ttft_s=None if t.first_token is None else t.first_token - t.submitted,
                        e2e_s=now - t.submitted,
                        times_ns=(_epoch_ns(t.submitted), _epoch_ns(t.admitted), _epoch_ns(t.first_token),
                                  _epoch_ns(t.last_token)),
                        kv=_kv_usage(a, block_size))
