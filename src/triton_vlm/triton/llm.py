"""The decoupled llm model's Triton side: requests -> `GenerationRequest`, results -> responses.

`execute()` parses each request, hands it to a `Responder` (which owns it from then on) and to the backend
(our engine or the `transformers` baseline), and returns at once. The backend's thread only queues its
results; the responder's thread sends every response and a poller thread asks `is_cancelled()` in bounded
batches, so nothing touches a request after its final response (see `responder.py`). Triton 2.51 forwards a client's cancellation to a request sent
to `llm` directly; through the ensemble it checks cancellation only between steps.

Streaming protocol (`stream` true): non-final responses carry one piece of one sequence (`text_output` [1],
`sequence_index`); the final response carries, for every returned sequence j, the text still missing from what
was streamed for j (`text_output` [n], index j), so that per sequence the concatenation of everything received
equals the non-streamed text; `output_ids` / `output_log_probs` likewise hold only the ids not yet sent, and
`cum_log_probs` the final scores.

Outputs: a response carries only the outputs its request asked for (all when the client named none), read at
`execute()`; the python backend would otherwise drop the rest inside `send()` without the GIL, which crashed the
stub (see `tensors.ResponseSender`, which also keeps a response's tensors referenced across `send()`).

Batched requests (batch dim B > 1, TensorRT-LLM's `--batch-inputs`): every row is its own generation request
(engine id `<key>/<row>`), validated on its own (an error names the row and refuses the whole request); its
responses carry `batch_index` = the row, and the last row to finish sends the request's FINAL flag with its
final response, as TensorRT-LLM's ensemble does. A row's error ends the request (the other rows are cancelled).
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

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
_SALT = N.spec(N.CACHE_SALT, N.LLM_INPUTS)
_LORA_PATH = N.spec(N.LORA_PATH, N.LLM_INPUTS)
_STOP = N.spec(N.STOP_REQUEST, N.LLM_INPUTS)


@dataclass
class _Row:
    gen: GenerationRequest
    index: int = 0  # batch_index: the row of the request
    streamed: dict[int, str] = field(default_factory=dict)  # sequence index -> text sent so far
    streamed_ids: dict[int, list[int]] = field(default_factory=dict)  # sequence index -> ids sent so far
    done: bool = False


@dataclass
class _Live:
    """One Triton request: its rows (one per prompt)."""

    rows: list[_Row]
    outputs: Optional[frozenset[str]] = None  # the outputs the request asked for (None: all)
    triton_id: str = ""  # the Triton request id it was sent with (a `stop` request names it)

    def __post_init__(self):
        self.by_id = {r.gen.request_id: r for r in self.rows}

    @property
    def gen(self) -> GenerationRequest:  # the request of a one-row request
        return self.rows[0].gen

    def pending(self) -> list[_Row]:
        return [r for r in self.rows if not r.done]


def request_key(row_id: str) -> str:
    """The responder's key of a row's engine request id (`r5` for one row, `r5/1` for row 1 of a batch)."""
    return row_id.split("/", 1)[0]


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
        self._batches: dict[str, list[str]] = {}  # key -> row ids, for requests of several rows
        self._by_triton_id: dict[str, str] = {}  # Triton request id -> key, for `stop` requests
        self.adapters = adapters  # lora.cache.AdapterCache, or None when the backend applies no adapters
        self.metrics = LLMMetrics(enabled=False)  # the real ones are created once, in start()
        self.responder = Responder(self._build, self._error, self._cancel, tick=self._tick)

    def start(self) -> None:
        lora = self.adapters is not None
        self.metrics = LLMMetrics(getattr(self.backend, "stats", None), lora=self.adapters,
                                  lora_slots=getattr(self.backend, "lora_slots", None) if lora else None,
                                  lora_info=getattr(self.backend, "lora_info", None) if lora else None,
                                  memory=getattr(self.backend, "memory", None),
                                  prefix_cache=getattr(self.backend, "prefix_cache_stats", None),
                                  weights=getattr(self.backend, "weights_info", None))
        log.info("llm: %s backend started, context length %d", type(self.backend).__name__, self.context_length)
        if hasattr(self.backend, "on_fatal"):
            self.backend.on_fatal = self._fatal
        self.backend.start()
        self.responder.start()

    def shutdown(self) -> None:
        self.backend.shutdown()  # queues a final result for every request it still holds
        self.responder.stop()  # sends them; anything still live gets UNAVAILABLE
        self.metrics.close()

    def _fatal(self, error: BaseException) -> None:
        """The engine stopped on a CUDA error (the context may be unusable): send the final errors queued, then
        end this stub so that the python backend starts a fresh one."""
        log.critical("llm: the engine stopped on a CUDA error (%s); exiting so that the model restarts", error)
        self.responder.stop(timeout=2.0)
        os._exit(1)

    def _tick(self) -> None:
        self.metrics.update_gauges()

    def _cancel(self, key: str) -> None:
        """The client cancelled the request or went away: the backend drops its rows (their final results are
        ignored)."""
        self.metrics.outcome("cancelled")
        for row_id in self._batches.pop(key, [key]):
            self.backend.cancel(row_id)

    # --- requests ----------------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = tensors.ResponseSender(request.get_response_sender())
            try:
                gens = self.parse(request)
            except _StopAsked as stop:
                self._stop(stop.triton_id, sender)
                continue
            except Exception as e:  # noqa: BLE001 - one bad request never affects the others
                self.metrics.outcome(getattr(e, "code", "INTERNAL"))
                sender.send(self._error(e), flags=FINAL)  # never opened: this thread is its only owner
                continue
            key = request_key(gens[0].request_id)
            if len(gens) > 1:
                self._batches[key] = [g.request_id for g in gens]
            live = _Live([_Row(g, i) for i, g in enumerate(gens)], tensors.requested_outputs(request),
                         _triton_id(request))
            self.responder.open(key, sender, live)
            if live.triton_id:
                self._by_triton_id[live.triton_id] = key
            for i, gen in enumerate(gens):
                try:
                    self.backend.submit(gen, self._on_result)
                except Exception as e:  # noqa: BLE001 - refused (queue full, invalid): the responder answers
                    self.metrics.outcome(getattr(e, "code", "INTERNAL"))
                    for done in gens[:i]:
                        self.backend.cancel(done.request_id)
                    self._batches.pop(key, None)
                    self.responder.fail(key, tensors.in_row(e, i, len(gens)))
                    break

    def _stop(self, triton_id: str, sender) -> None:
        """`stop` true: the running request sent with this Triton request id is cancelled (the engine frees its rows
        at its next step and it ends CANCELLED); the stop request gets an empty final response."""
        key = self._by_triton_id.get(triton_id) if triton_id else None
        if key is not None:
            for row_id in self._batches.get(key, [key]):
                self.backend.cancel(row_id)
        sender.send(self._response({}), flags=FINAL)

    def parse(self, request) -> list[GenerationRequest]:
        """The request's rows (one for a single prompt), each validated on its own; `_StopAsked` for a `stop`
        request."""
        if tensors.scalar(request, _STOP):
            raise _StopAsked(_triton_id(request))
        rows = tensors.batch_size(request, [s.name for s in N.LLM_INPUTS])
        key = f"r{next(self._ids)}"
        gens = tensors.per_row(rows, lambda row: self._parse_row(request, row, key if row is None
                                                                  else f"{key}/{row}"))
        embeds = own_copies([g.image_embeds for g in gens])  # the engine reads them after execute() returned
        for g, e in zip(gens, embeds):
            g.image_embeds = e
        return gens

    def _parse_row(self, request, row, request_id: str) -> GenerationRequest:
        ids = tensors.input_array(request, N.INPUT_IDS, row)
        if ids is not None and row is not None:  # rows of a batch are padded to one length
            ids = _strip_padding(ids.reshape(-1))
        if ids is None or ids.size == 0:
            raise InvalidArgument("the prompt is empty: send a non-empty text_input")
        values = tensors.scalars(request, N.GENERATION_INPUTS + N.GUIDED_INPUTS, row)
        params = GenerationParams.from_inputs(values)  # the request itself is validated by backend.submit
        emb = tensors.input_tensor(request, N.IMAGE_EMBEDS, row)  # [images, T, hidden], the device it came on
        n_images = tensors.scalar(request, N.spec(N.NUM_IMAGES, N.LLM_INPUTS), row)
        if emb is not None and n_images is not None:
            if not 0 <= n_images <= emb.shape[0]:
                raise InvalidArgument(f"num_images {n_images} is outside [0, {emb.shape[0]}] (image_embeds rows)")
            emb = emb[:n_images]
        sizes = tensors.input_array(request, N.IMAGE_SIZES, row)  # [images, 2]: M-RoPE's grids (Qwen2-VL)
        if sizes is not None:
            sizes = sizes.reshape(-1, 2)[:n_images if n_images is not None else None]
        grids = tensors.input_array(request, N.MEDIA_GRIDS, row)  # [images, 3], or zeros (fixed-tile families)
        if grids is not None:
            grids = grids.reshape(-1, 3)[:n_images if n_images is not None else None]
            grids = [tuple(int(v) for v in g) for g in grids] if grids.any() else None
        seconds = tensors.input_array(request, N.MEDIA_SECONDS, row)
        lens = tensors.input_array(request, N.IMAGE_FEATURE_LENS, row)
        if emb is not None and lens is not None:
            emb = unpad_images(emb, lens.reshape(-1))  # [features, hidden] when the images' lengths differ
        bad = tensors.input_array(request, N.BAD_WORDS_IDS, row)
        stop = tensors.input_array(request, N.STOP_WORDS_IDS, row)
        dropped = tensors.input_array(request, N.DROPPED_IMAGES, row)
        return GenerationRequest(
            request_id=request_id,
            adapter=self._adapter(request, row),
            input_ids=[int(t) for t in ids.reshape(-1)],
            params=params,
            image_embeds=None if emb is None or emb.numel() == 0 else emb,  # a view of Triton's buffer for now
            bad_words_ids=[] if bad is None else words_from_flat(bad.reshape(-1)),
            stop_words_ids=[] if stop is None else words_from_flat(stop.reshape(-1)),
            dropped_images=0 if dropped is None else int(dropped.reshape(-1)[0]),
            cache_salt=tensors.scalar(request, _SALT, row),  # checked by GenerationRequest.validate
            image_sizes=None if sizes is None else [(int(h), int(w)) for h, w in sizes],
            media_grids=grids,
            media_seconds=None if seconds is None or grids is None else
            [float(v) for v in seconds.reshape(-1)[:len(grids)]],
        )

    def _adapter(self, request, row=None):
        """The LoRA adapter the request asks for (task id, wire tensors, or a registry name), or None."""
        inputs = tensors.lora_inputs(request, row)
        path = tensors.scalar(request, _LORA_PATH, row)
        if inputs is None and not path:
            return None
        if self.adapters is None:
            raise InvalidArgument("this llm backend does not apply LoRA adapters (use backend 'engine')")
        cache = self.adapters
        if path:  # a PEFT folder under lora_root, cached under lora_task_id (the tensorrt_llm model's lora_path)
            task_id, weights, _, name = inputs or (None, None, None, None)
            if weights is not None or name is not None:
                raise InvalidArgument(f"{N.LORA_PATH} selects an adapter folder; send neither lora_weights nor "
                                      "lora_name with it")
            return cache.resolve_path(task_id, path)
        return cache.resolve(parse_request(*inputs, cache.spec, cache.registry, cache.max_rank, cache.wire_dtype))

    # --- results (the responder's thread) ------------------------------------------------------------------
    def _on_result(self, result: GenerationResult) -> None:
        self.responder.post(request_key(result.request_id), result)

    def _build(self, key: str, live: _Live, result: GenerationResult):
        """-> (response, final) for one backend result of one of the request's rows."""
        row = live.by_id[result.request_id]
        if result.final and (result.error is not None or len(live.pending()) <= 1):
            if self._by_triton_id.get(live.triton_id) == key:
                self._by_triton_id.pop(live.triton_id, None)
        if result.final:
            self.metrics.outcome("success" if result.error is None else getattr(result.error, "code", "INTERNAL"))
            self.metrics.finished(result.stats)
        if result.error is not None:
            for other in live.pending():
                if other is not row:
                    self.backend.cancel(other.gen.request_id)
            self._batches.pop(key, None)
            return self._error(tensors.in_row(result.error, row.index, len(live.rows))), True
        if not result.final:
            return self._asked(live, self._piece(row, result)), False
        row.done = True
        last = not live.pending()
        if last:
            self._batches.pop(key, None)
        return self._asked(live, self._final(row, result)), last

    def _asked(self, live: _Live, outputs: dict):
        """The response with only the outputs the request asked for: the python backend would drop the others
        inside `send()` without the GIL (see `tensors.ResponseSender`), and they would cost copies for nothing."""
        if live.outputs is not None:
            outputs = {name: v for name, v in outputs.items() if name in live.outputs}
        return self._response(outputs)

    def _counts(self, row: _Row, new_tokens: int, cached_tokens: int) -> dict:
        """num_input_tokens / num_output_tokens when the request asked for them (TensorRT-LLM's outputs); with
        num_input_tokens, num_cached_tokens (the prompt tokens the prefix cache spared)."""
        p, out = row.gen.params, {}
        if p.return_num_input_tokens:
            out[N.NUM_INPUT_TOKENS] = (_OUT[N.NUM_INPUT_TOKENS], [len(row.gen.input_ids)])
            out[N.NUM_CACHED_TOKENS] = (_OUT[N.NUM_CACHED_TOKENS], [cached_tokens])
        if p.return_num_output_tokens:
            out[N.NUM_OUTPUT_TOKENS] = (_OUT[N.NUM_OUTPUT_TOKENS], [new_tokens])
        return out

    def _top(self, row: _Row, tops: list[list[list[float]]], ids: list[list[list[int]]]) -> dict:
        """output_top_log_probs / output_top_log_prob_ids [sequences, new_tokens, k] when asked (padding: log
        prob 0, id -1)."""
        k = row.gen.params.top_log_probs
        if not k:
            return {}
        width = max((len(t) for t in tops), default=0)
        lp = np.zeros((len(tops), width, k), np.float32)  # [sequences, new_tokens, k]
        tid = np.full((len(tops), width, k), -1, np.int32)
        for i, (t, d) in enumerate(zip(tops, ids)):
            if t:
                lp[i, :len(t)], tid[i, :len(d)] = t, d
        return {N.OUTPUT_TOP_LOG_PROBS: (_OUT[N.OUTPUT_TOP_LOG_PROBS], lp),
                N.OUTPUT_TOP_LOG_PROB_IDS: (_OUT[N.OUTPUT_TOP_LOG_PROB_IDS], tid)}

    def _piece(self, row: _Row, result: GenerationResult) -> dict:
        seq = result.sequences[0]
        j = result.sequence_index
        row.streamed[j] = row.streamed.get(j, "") + seq.text
        row.streamed_ids.setdefault(j, []).extend(seq.token_ids)
        return {
            N.TEXT_OUTPUT: (_OUT[N.TEXT_OUTPUT], [seq.text]),
            N.OUTPUT_IDS: (_OUT[N.OUTPUT_IDS], np.array([seq.token_ids], dtype=np.int32).reshape(1, -1)),
            N.SEQUENCE_LENGTH: (_OUT[N.SEQUENCE_LENGTH], [len(seq.token_ids)]),
            N.CUM_LOG_PROBS: (_OUT[N.CUM_LOG_PROBS], [seq.cum_log_prob]),
            N.OUTPUT_LOG_PROBS: (_OUT[N.OUTPUT_LOG_PROBS],
                                 np.array([seq.log_probs or [0.0] * len(seq.token_ids)], np.float32).reshape(1, -1)),
            N.BATCH_INDEX: (_OUT[N.BATCH_INDEX], [row.index]),
            N.SEQUENCE_INDEX: (_OUT[N.SEQUENCE_INDEX], [j]),
            N.DROPPED_IMAGES: (_OUT[N.DROPPED_IMAGES], [row.gen.dropped_images]),
            **self._counts(row, len(seq.token_ids), result.cached_tokens),
            **self._top(row, [seq.top_log_probs], [seq.top_ids]),
        }

    def _final(self, row: _Row, result: GenerationResult) -> dict:
        p, gen = row.gen.params, row.gen
        # streamed responses never repeat the prompt (as in TensorRT-LLM), the final one included
        prompt_ids = [] if p.exclude_input_in_output or p.stream else gen.input_ids
        prompt_text = "" if p.exclude_input_in_output or p.stream else self.prompt_text(gen.input_ids)
        texts, rows, lps, new_tokens, tops, top_ids = [], [], [], 0, [], []
        for j, s in enumerate(result.sequences):
            full, ids, lp = prompt_text + s.text, prompt_ids + list(s.token_ids), list(s.log_probs)
            top, top_id = list(s.top_log_probs), list(s.top_ids)
            if p.stream:  # only what sequence j has not received yet
                sent, sent_ids = row.streamed.get(j, ""), row.streamed_ids.get(j, [])
                if full.startswith(sent) and ids[:len(sent_ids)] == sent_ids:
                    full, ids, lp = full[len(sent):], ids[len(sent_ids):], lp[len(sent_ids):]
                    top, top_id = top[len(sent_ids):], top_id[len(sent_ids):]
                else:  # cannot happen with the engine (it streams a stable prefix only)
                    log.warning("request %s: final sequence %d does not extend what was streamed", gen.request_id, j)
            texts.append(full)
            rows.append(ids)
            lps.append(lp)
            tops.append(top)
            top_ids.append(top_id)
            new_tokens += len(ids) if p.stream else len(s.token_ids)  # streamed: those not sent yet
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
        return {
            N.TEXT_OUTPUT: (_OUT[N.TEXT_OUTPUT], texts),
            N.OUTPUT_IDS: (_OUT[N.OUTPUT_IDS], out_ids),
            N.SEQUENCE_LENGTH: (_OUT[N.SEQUENCE_LENGTH], [len(r) for r in rows]),
            N.CUM_LOG_PROBS: (_OUT[N.CUM_LOG_PROBS], [s.cum_log_prob for s in result.sequences]),
            N.OUTPUT_LOG_PROBS: (_OUT[N.OUTPUT_LOG_PROBS], out_lp),
            N.BATCH_INDEX: (_OUT[N.BATCH_INDEX], [row.index]),
            N.SEQUENCE_INDEX: (_OUT[N.SEQUENCE_INDEX], [0]),
            N.DROPPED_IMAGES: (_OUT[N.DROPPED_IMAGES], [gen.dropped_images]),
            **self._counts(row, new_tokens, result.cached_tokens),
            **self._top(row, tops, top_ids),
            **_perf(result),
        }

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


class _StopAsked(Exception):
    """A `stop` request: cancel the running request of `triton_id`."""

    def __init__(self, triton_id: str):
        super().__init__(triton_id)
        self.triton_id = triton_id


def _triton_id(request) -> str:
    get = getattr(request, "request_id", None)  # the unit tests' fakes have none
    return (get() or "") if get is not None else ""


def _perf(result: GenerationResult) -> dict:
    """TensorRT-LLM's per-request perf outputs (final responses): the prefix cache's KV counts and the engine's
    timestamps (ns since the epoch; 0 where the backend keeps none); no speculative decoding yet (0)."""
    st = result.stats
    kv = st.kv if st is not None else None
    times = st.times_ns if st is not None else (0, 0, 0, 0)
    out = {}
    if kv is not None:
        for name, v in ((N.KV_CACHE_REUSED_BLOCK, kv.reused_blocks), (N.KV_CACHE_MISSED_BLOCK, kv.missed_blocks),
                        (N.KV_CACHE_ALLOC_NEW_BLOCKS, kv.new_blocks),
                        (N.KV_CACHE_ALLOC_TOTAL_BLOCKS, kv.total_blocks)):
            out[name] = (_OUT[name], [v])
        out[N.KV_CACHE_HIT_RATE] = (_OUT[N.KV_CACHE_HIT_RATE], [kv.hit_rate])
    for name, v in zip((N.ARRIVAL_TIME_NS, N.FIRST_SCHEDULED_TIME_NS, N.FIRST_TOKEN_TIME_NS, N.LAST_TOKEN_TIME_NS),
                       times):
        out[name] = (_OUT[name], [v])
    out[N.ACCEPTANCE_RATE] = (_OUT[N.ACCEPTANCE_RATE], [0.0])
    for name in (N.TOTAL_ACCEPTED_DRAFT_TOKENS, N.TOTAL_DRAFT_TOKENS):
        out[name] = (_OUT[name], [0])
    return out


def unpad_images(emb, lens: np.ndarray):
    """image_embeds [images, T, hidden] and each image's feature count -> the features without the padding: the
    same tensor when every image fills T (llava-1.5), else [sum(lens), hidden], images in order. The merge then
    checks the total against the placeholders both ways."""
    import torch  # noqa: PLC0415

    n, t = int(emb.shape[0]), int(emb.shape[1]) if emb.dim() == 3 else 0
    if emb.dim() != 3 or len(lens) < n or not all(0 <= int(x) <= t for x in lens[:n]):
        raise InvalidArgument(f"image_feature_lens {lens.tolist()} must give each of the {n} images of "
                              f"image_embeds {list(emb.shape)} a length in [0, {t}]")
    lens = [int(x) for x in lens[:n]]
    if all(x == t for x in lens):
        return emb
    return torch.cat([emb[i, :x] for i, x in enumerate(lens)]) if n else emb.reshape(0, emb.shape[-1])


def _strip_padding(ids: np.ndarray) -> np.ndarray:
    """A row of a batched request's `input_ids` without the trailing INPUT_IDS_PAD (never a token id)."""
    n = len(ids)
    while n and ids[n - 1] == N.INPUT_IDS_PAD:
        n -= 1
    return ids[:n]


def own_copies(embeds: list) -> list:
    """Each row's image embeddings (a view of Triton's input buffer, or None) copied, the copies complete when
    this returns. The python backend frees (and reuses) the input buffer as soon as execute() returns, and the
    engine reads the embeddings later. On CUDA a plain clone() is only queued on the current stream, behind the
    engine's forward passes already queued there, so it could run after the buffer was reused and read another
    request's embeddings: the copies run on a stream of their own, which is synchronized (waiting for these
    copies only, not for the engine's work). The engine reads them on the default stream: `record_stream` keeps
    the caching allocator from reusing their memory before the work queued there when they are freed is done."""
    cuda = [e for e in embeds if e is not None and e.is_cuda]
    if not cuda:  # host memory: clone() is complete when it returns
        return [None if e is None else e.clone() for e in embeds]
    import torch  # noqa: PLC0415

    stream = _copy_stream(cuda[0].device)
    with torch.cuda.stream(stream):
        out = [None if e is None else e.clone() for e in embeds]
    stream.synchronize()
    for e in out:
        if e is not None and e.is_cuda:
            e.record_stream(torch.cuda.default_stream(e.device))
    return out


_COPY_STREAMS: dict = {}


def _copy_stream(device):
    import torch  # noqa: PLC0415

    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return _COPY_STREAMS[device]
