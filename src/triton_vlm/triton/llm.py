"""The decoupled llm model's Triton side: requests -> `GenerationRequest`, results -> responses.

`execute()` parses each request, hands it to a `Responder` (which owns it from then on) and to the backend
(our engine or the `transformers` baseline), and returns at once. The backend's thread only queues its
results; the responder's thread sends every response and polls `is_cancelled()`, so nothing touches a request
after its final response (see `responder.py`). Triton 2.51 forwards a client's cancellation to a request sent
to `llm` directly; through the ensemble it checks cancellation only between steps.

Streaming protocol (`stream` true): non-final responses carry one piece of one sequence (`text_output` [1],
`sequence_index`); the final response carries, for every returned sequence j, the text still missing from what
was streamed for j (`text_output` [n], index j), so that per sequence the concatenation of everything received
equals the non-streamed text; `output_ids` / `output_log_probs` likewise hold only the ids not yet sent, and
`cum_log_probs` the final scores.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np

from .. import names as N
from ..errors import InvalidArgument
from ..lora.request import parse_request
from ..params import GenerationParams, GenerationRequest, GenerationResult, words_from_flat
from . import tensors
from .errors import error_response
from .metrics import LLMMetrics
from .responder import Responder

log = logging.getLogger("triton_vlm")
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
_OUT = {s.name: s for s in N.LLM_OUTPUTS}


@dataclass
class _Live:
    gen: GenerationRequest
    streamed: dict[int, str] = field(default_factory=dict)  # sequence index -> text sent so far
    streamed_ids: dict[int, list[int]] = field(default_factory=dict)  # sequence index -> ids sent so far


class LLMService:
    def __init__(self, backend, tokenizer, image_token_id: int, context_length: int, *,
                 make_response=None, make_error=None, adapters=None):
        """`make_response(outputs)` / `make_error(exc)` build Triton responses (defaults: `tensors.response`,
        `errors.error_response`; unit tests pass plain-Python fakes)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.context_length = context_length
        self._response = make_response or tensors.response
        self._error = make_error or error_response
        self._ids = itertools.count()
        self.adapters = adapters  # lora.cache.AdapterCache, or None when the backend applies no adapters
        self.metrics = LLMMetrics(enabled=False)  # the real ones are created once, in start()
        self.responder = Responder(self._build, self._error, self._cancel, tick=self._tick)

    def start(self) -> None:
        lora = self.adapters is not None
        self.metrics = LLMMetrics(getattr(self.backend, "stats", None), lora=self.adapters,
                                  lora_slots=getattr(self.backend, "lora_slots", None) if lora else None,
                                  lora_info=getattr(self.backend, "lora_info", None) if lora else None)
        log.info("llm: %s backend started, context length %d", type(self.backend).__name__, self.context_length)
        self.backend.start()
        self.responder.start()

    def shutdown(self) -> None:
        self.backend.shutdown()  # queues a final result for every request it still holds
        self.responder.stop()  # sends them; anything still live gets UNAVAILABLE
        self.metrics.close()

    def _tick(self) -> None:
        self.metrics.update_gauges()

    def _cancel(self, request_id: str) -> None:
        """The client cancelled the request or went away: the backend drops it (its final result is ignored)."""
        self.metrics.outcome("cancelled")
        self.backend.cancel(request_id)

    # --- requests ----------------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                gen = self.parse(request)
            except Exception as e:  # noqa: BLE001 - one bad request never affects the others
                self.metrics.outcome(getattr(e, "code", "INTERNAL"))
                sender.send(self._error(e), flags=FINAL)  # never opened: this thread is its only owner
                continue
            self.responder.open(gen.request_id, sender, _Live(gen))
            try:
                self.backend.submit(gen, self._on_result)
            except Exception as e:  # noqa: BLE001 - refused (queue full, invalid): the responder answers
                self.metrics.outcome(getattr(e, "code", "INTERNAL"))
                self.responder.fail(gen.request_id, e)

    def parse(self, request) -> GenerationRequest:
        ids = tensors.input_array(request, N.INPUT_IDS)
        if ids is None or ids.size == 0:
            raise InvalidArgument("the prompt is empty: send a non-empty text_input")
        values = tensors.scalars(request, N.GENERATION_INPUTS)
        params = GenerationParams.from_inputs(values)  # the request itself is validated by backend.submit
        emb = tensors.input_tensor(request, N.IMAGE_EMBEDS)  # [images, T, hidden], the device it came on
        bad = tensors.input_array(request, N.BAD_WORDS_IDS)
        stop = tensors.input_array(request, N.STOP_WORDS_IDS)
        dropped = tensors.input_array(request, N.DROPPED_IMAGES)
        return GenerationRequest(
            request_id=f"r{next(self._ids)}",
            adapter=self._adapter(request),
            input_ids=[int(t) for t in ids.reshape(-1)],
            params=params,
            # our own copy (on the same device): the engine reads it after execute() has returned
            image_embeds=None if emb is None or emb.numel() == 0 else emb.clone(),
            bad_words_ids=[] if bad is None else words_from_flat(bad.reshape(-1)),
            stop_words_ids=[] if stop is None else words_from_flat(stop.reshape(-1)),
            dropped_images=0 if dropped is None else int(dropped.reshape(-1)[0]),
        )

    def _adapter(self, request):
        """The LoRA adapter the request asks for (task id, wire tensors, or a registry name), or None."""
        inputs = tensors.lora_inputs(request)
        if inputs is None:
            return None
        if self.adapters is None:
            raise InvalidArgument("this llm backend does not apply LoRA adapters (use backend 'engine')")
        cache = self.adapters
        return cache.resolve(parse_request(*inputs, cache.spec, cache.registry, cache.max_rank, cache.wire_dtype))

    # --- results (the responder's thread) ------------------------------------------------------------------
    def _on_result(self, result: GenerationResult) -> None:
        self.responder.post(result.request_id, result)

    def _build(self, _key: str, live: _Live, result: GenerationResult):
        """-> (response, final) for one backend result."""
        if result.final:
            self.metrics.outcome("success" if result.error is None else getattr(result.error, "code", "INTERNAL"))
            self.metrics.finished(result.stats)
        if result.error is not None:
            return self._error(result.error), True
        if not result.final:
            return self._piece(live, result), False
        return self._final(live, result), True

    def _piece(self, live: _Live, result: GenerationResult):
        seq = result.sequences[0]
        j = result.sequence_index
        live.streamed[j] = live.streamed.get(j, "") + seq.text
        live.streamed_ids.setdefault(j, []).extend(seq.token_ids)
        return self._response({
            N.TEXT_OUTPUT: (_OUT[N.TEXT_OUTPUT], [seq.text]),
            N.OUTPUT_IDS: (_OUT[N.OUTPUT_IDS], np.array([seq.token_ids], dtype=np.int32).reshape(1, -1)),
            N.SEQUENCE_LENGTH: (_OUT[N.SEQUENCE_LENGTH], [len(seq.token_ids)]),
            N.CUM_LOG_PROBS: (_OUT[N.CUM_LOG_PROBS], [seq.cum_log_prob]),
            N.OUTPUT_LOG_PROBS: (_OUT[N.OUTPUT_LOG_PROBS],
                                 np.array([seq.log_probs or [0.0] * len(seq.token_ids)], np.float32).reshape(1, -1)),
            N.BATCH_INDEX: (_OUT[N.BATCH_INDEX], [0]),
            N.SEQUENCE_INDEX: (_OUT[N.SEQUENCE_INDEX], [j]),
            N.DROPPED_IMAGES: (_OUT[N.DROPPED_IMAGES], [live.gen.dropped_images]),
        })

    def _final(self, live: _Live, result: GenerationResult):
        p, gen = live.gen.params, live.gen
        # streamed responses never repeat the prompt (as in TensorRT-LLM), the final one included
        prompt_ids = [] if p.exclude_input_in_output or p.stream else gen.input_ids
        prompt_text = "" if p.exclude_input_in_output or p.stream else self.prompt_text(gen.input_ids)
        texts, rows, lps = [], [], []
        for j, s in enumerate(result.sequences):
            full, ids, lp = prompt_text + s.text, prompt_ids + list(s.token_ids), list(s.log_probs)
            if p.stream:  # only what sequence j has not received yet
                sent, sent_ids = live.streamed.get(j, ""), live.streamed_ids.get(j, [])
                if full.startswith(sent) and ids[:len(sent_ids)] == sent_ids:
                    full, ids, lp = full[len(sent):], ids[len(sent_ids):], lp[len(sent_ids):]
                else:  # cannot happen with the engine (it streams a stable prefix only)
                    log.warning("request %s: final sequence %d does not extend what was streamed", gen.request_id, j)
            texts.append(full)
            rows.append(ids)
            lps.append(lp)
        width = max((len(r) for r in rows), default=0)
        out_ids = np.full((len(rows), width), p.pad_id, dtype=np.int32)  # [sequences, max_len]
        for i, r in enumerate(rows):
            out_ids[i, :len(r)] = r
        lp_width = max((len(x) for x in lps), default=0)
        out_lp = np.zeros((len(lps), lp_width), dtype=np.float32)  # [sequences, new_tokens]
        for i, x in enumerate(lps):
            out_lp[i, :len(x)] = x
        if not p.return_log_probs:
            out_lp = np.zeros((len(lps), 0), dtype=np.float32)
        return self._response({
            N.TEXT_OUTPUT: (_OUT[N.TEXT_OUTPUT], texts),
            N.OUTPUT_IDS: (_OUT[N.OUTPUT_IDS], out_ids),
            N.SEQUENCE_LENGTH: (_OUT[N.SEQUENCE_LENGTH], [len(r) for r in rows]),
            N.CUM_LOG_PROBS: (_OUT[N.CUM_LOG_PROBS], [s.cum_log_prob for s in result.sequences]),
            N.OUTPUT_LOG_PROBS: (_OUT[N.OUTPUT_LOG_PROBS], out_lp),
            N.BATCH_INDEX: (_OUT[N.BATCH_INDEX], [0]),
            N.SEQUENCE_INDEX: (_OUT[N.SEQUENCE_INDEX], [0]),
            N.DROPPED_IMAGES: (_OUT[N.DROPPED_IMAGES], [gen.dropped_images]),
        })

    def prompt_text(self, ids: list[int]) -> str:
        """The prompt as text, each image's run of placeholder ids shown as one `<image>`."""
        parts, cur, prev_img = [], [], False
        for t in ids:
            is_img = t == self.image_token_id
            if is_img and not prev_img:
                parts.append(self.tokenizer.decode(cur, skip_special_tokens=True))
                parts.append("<image>")
                cur = []
            elif not is_img:
                cur.append(t)
            prev_img = is_img
        parts.append(self.tokenizer.decode(cur, skip_special_tokens=True))
        return "".join(parts)
