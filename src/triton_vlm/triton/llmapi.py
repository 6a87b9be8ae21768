"""The `tensorrt_llm` model's Triton side: TensorRT-LLM's `llmapi` tensors in, the ensemble's pipeline run by BLS.

Why BLS: the engine lives in the `llm` model's stub process (one per instance) and every other model is another
process, so no in-process route reaches it; the ensemble's own path is preprocess -> vision -> llm, and calling
those three models (`pb_utils.InferenceRequest(...).exec()`) runs exactly that path, the same checkpoint
processor, vision encoder, adapter cache and engine, so a request gives the ensemble's tokens. Like the OpenAI
front end's `pipeline` route, text-only prompts skip `vision`; the llm call is a decoupled stream, so streamed
pieces are forwarded as they come.

Threads: `execute()` reads every input (the python backend frees a request's input buffers when it returns) and
hands the parsed request to a worker pool; a worker fetches the images, runs the three steps and sends every
response. A poller asks `is_cancelled()` of the live requests; a request is only asked while it has no final
response (`_Job.lock`: the poll and the final send never overlap, nothing touches a request after FINAL).
Cancellation (`stop` true with the running request's id, as TensorRT-LLM's model, or the client going away):
the running request is answered at once with its final response, `finish_reason` "cancelled", and its llm
request is stopped the same way (a `stop` request to the llm under the llm request's id; Triton 2.51's BLS has no
`InferenceResponseIterator.cancel()`), so the engine frees its rows at its next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

try:  # available only inside the python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None

from .. import names as N
from ..errors import Cancelled, Internal, InvalidArgument, Unavailable, VLMError
from ..llmapi import outputs as O
from ..llmapi.request import LlmapiRequest, parse, with_markers
from ..lora.paths import resolve_lora_path
from ..params import words_from_flat
from .errors import error_response
from .tensors import ResponseSender

log = logging.getLogger("triton_vlm")
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
_SCALARS = tuple(s for s in N.LLMAPI_INPUTS if s.dims == (1,))
_OUT = {s.name: s for s in N.LLMAPI_OUTPUTS}
_NP = {N.BOOL: np.bool_, N.INT32: np.int32, N.INT64: np.int64, N.UINT64: np.uint64, N.FP32: np.float32}
_GEN = {s.name: s for s in N.GENERATION_INPUTS}
_TO_VISION, _TO_LLM = N.fed_by("vision", "preprocess"), N.fed_by("llm", "preprocess")
_VISION_TO_LLM = N.fed_by("llm", "vision")
_LLM_OUT = (N.TEXT_OUTPUT, N.OUTPUT_IDS, N.SEQUENCE_LENGTH, N.CUM_LOG_PROBS, N.ARRIVAL_TIME_NS)
_PERF = tuple(s.name for s in N.PERF_OUTPUTS)
_IDS = itertools.count()


@dataclass(frozen=True)
class Checkpoint:
    """What the model needs to know of the served checkpoint (read on the first request: it imports torch and
    transformers, which a server that never gets a tensorrt_llm request should not pay for at start)."""

    eos_ids: frozenset = frozenset()
    markers: tuple[str, ...] = ("<image>",)


@dataclass(frozen=True)
class Settings:
    media: Any  # openai.media.MediaPolicy: the one image-URL policy and fetcher
    lora_roots: tuple = ()
    model_path: str = ""
    preprocess: str = "preprocess"
    vision: str = "vision"
    llm: str = "llm"


@dataclass(eq=False)
class _Job:
    request_id: str
    sender: Any
    req: LlmapiRequest
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    cancelled: bool = False
    iterator: Any = None
    llm_id: str = ""
    stop_llm: Any = None  # () -> None: cancels the generation in the llm, once its stream is open

    def send(self, response, final: bool) -> bool:
        """Sent unless the request already has its final response (then dropped)."""
        with self.lock:
            if self.done:
                return False
            self.done = final
            self.sender.send(response, flags=FINAL if final else 0)
            return True

    def asked_to_cancel(self) -> bool:
        with self.lock:  # never after the final response (the server frees the request with it)
            return not self.done and self.sender.is_cancelled()

    def cancel(self) -> None:
        """Ends the request now (final response, finish_reason "cancelled") and its llm stream."""
        if self.cancelled:
            return
        self.cancelled = True
        self.send(_response(_cancelled_outputs(self.req)), final=True)
        stop = self.stop_llm
        if stop is not None:
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - the generation then runs to its end, unseen
                log.warning("tensorrt_llm: could not cancel the llm request: %s", e)


class LlmapiService:
    def __init__(self, settings: Settings, *, workers: int = 64, poll_s: float = 0.1):
        self.s = settings
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmapi")
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()
        self._stopped = threading.Event()
        self._poll_s = poll_s
        self._poller = threading.Thread(target=self._poll, name="llmapi-poll", daemon=True)
        self._poller.start()
        self._checkpoint: Optional[Checkpoint] = None

    @property
    def checkpoint(self) -> Checkpoint:
        if self._checkpoint is None:
            with self._lock:
                if self._checkpoint is None:
                    self._checkpoint = read_checkpoint(self.s.model_path)
        return self._checkpoint

    def shutdown(self) -> None:
        self._stopped.set()
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancelled = True
            job.send(error_response(Unavailable("the model is shutting down")), final=True)
        log.info("tensorrt_llm: shutting down (%d requests live)", len(jobs))
        self._poller.join(timeout=2)
        self.pool.shutdown(wait=True, cancel_futures=True)  # Triton waits for in-flight requests first: idle
        log.info("tensorrt_llm: workers stopped")
        import gc  # noqa: PLC0415

        gc.collect()  # the BLS tensors and responses go now, while the stub is whole, not at its exit
        log.info("tensorrt_llm: shut down")

    # --- requests ----------------------------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            sender = ResponseSender(request.get_response_sender())
            try:
                values, prompts, urls, stop = read_inputs(request)
                if values.get(N.STOP_REQUEST):
                    self._stop(request.request_id(), sender)
                    continue
                job = _Job(request.request_id(), sender, parse(values, prompts, urls, stop))
            except Exception as e:  # noqa: BLE001 - one bad request never affects the others
                sender.send(error_response(_theirs(e)), flags=FINAL)
                continue
            with self._lock:
                self._jobs.add(job)
            self.pool.submit(self._run, job)

    def _stop(self, request_id: str, sender) -> None:
        """`stop` true: cancel the running requests of this id; the stop request itself is answered CANCELLED, as
        TensorRT-LLM's model answers it."""
        if not request_id:
            sender.send(error_response(InvalidArgument("stop needs the id of the request to cancel: send it as "
                                                       "this request's id")), flags=FINAL)
            return
        with self._lock:
            jobs = [j for j in self._jobs if j.request_id == request_id]
        for job in jobs:
            job.cancel()
        sender.send(error_response(Cancelled("Request cancelled by client")), flags=FINAL)

    def _poll(self) -> None:
        while not self._stopped.wait(self._poll_s):
            with self._lock:
                jobs = list(self._jobs)
            for job in jobs:
                try:
                    if job.asked_to_cancel():
                        job.cancel()
                except Exception as e:  # noqa: BLE001
                    log.warning("tensorrt_llm: is_cancelled failed: %s", e)

    def _run(self, job: _Job) -> None:
        try:
            self._generate(job)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            if not job.cancelled:
                job.send(error_response(_theirs(e)), final=True)
        finally:
            with self._lock:
                self._jobs.discard(job)

    # --- the pipeline ------------------------------------------------------------------------------------
    def _generate(self, job: _Job) -> None:
        req = job.req
        if req.lora is not None and req.lora.path is not None:  # refused before any image is fetched or encoded
            resolve_lora_path(req.lora.path, self.s.lora_roots)
        images = self._images(req.image_urls)
        pre = _infer(self.s.preprocess, self._pre_inputs(req, images),
                     [s.name for s in N.PREPROCESS_OUTPUTS])
        llm_inputs = [pre[n] for n in sorted(_TO_LLM & pre.keys())]
        if int(pre[N.PIXEL_VALUES].shape()[1]):  # [1, tiles, 3, H, W]: text-only prompts skip vision
            emb = _infer(self.s.vision, [pre[n] for n in sorted(_TO_VISION & pre.keys())],
                         [s.name for s in N.VISION_OUTPUTS])
            llm_inputs += [emb[n] for n in sorted(_VISION_TO_LLM & emb.keys())]
        llm_inputs += self._generation_inputs(req)
        prompt_len = int(pre[N.INPUT_IDS].shape()[-1])
        stop_ids = words_from_flat(pre[N.STOP_WORDS_IDS].as_numpy().reshape(-1)) if req.stop else []
        outputs = list(_LLM_OUT) + (list(_PERF) if req.return_perf_metrics else [])
        if job.cancelled:
            return
        job.llm_id = f"llmapi-{next(_IDS)}"
        job.iterator = pb_utils.InferenceRequest(model_name=self.s.llm, inputs=llm_inputs, request_id=job.llm_id,
                                                 requested_output_names=outputs).exec(decoupled=True)
        job.stop_llm = lambda: self._stop_llm(job.llm_id)
        if job.cancelled:  # cancelled while the stream opened: its answer is sent, the generation is stopped
            job.stop_llm()
            return
        self._forward(job, prompt_len, stop_ids)

    def _stop_llm(self, llm_id: str) -> None:
        """Cancel the generation in the engine: a `stop` request to the llm under the llm request's id (Triton 2.51's
        BLS has no `InferenceResponseIterator.cancel()`)."""
        resp = pb_utils.InferenceRequest(model_name=self.s.llm, request_id=llm_id, requested_output_names=[],
                                         inputs=[_tensor(N.STOP_REQUEST, np.array([[True]]))]).exec(decoupled=True)
        for r in resp:
            if r.has_error():
                log.warning("tensorrt_llm: stopping llm request %s: %s", llm_id, r.error().message())

    def _forward(self, job: _Job, prompt_len: int, stop_ids: list) -> None:
        req, acc = job.req, O.Accumulated()
        for resp in job.iterator:
            if job.cancelled:
                return
            if resp.has_error():
                raise _error(resp.error())
            out = {t.name(): t.as_numpy() for t in resp.output_tensors()}
            if N.TEXT_OUTPUT not in out:
                continue  # the stream's closing flag
            texts = [_str(t) for t in out[N.TEXT_OUTPUT].reshape(-1)]
            ids = out[N.OUTPUT_IDS].reshape(len(texts), -1)
            lens = out[N.SEQUENCE_LENGTH].reshape(-1)
            if N.ARRIVAL_TIME_NS not in out:  # a streamed piece (only final responses carry the perf outputs)
                acc.add(texts[0], ids[0, :lens[0]])
                job.send(_response({N.TEXT_OUTPUT: [texts[0]]}), final=False)
                continue
            cum = out[N.CUM_LOG_PROBS].reshape(-1)
            j = O.best(cum.tolist()) if req.best_of_samples > 1 else 0
            new_ids = [int(t) for t in ids[j, :lens[j]]]
            if req.streaming:
                new_ids = acc.ids + new_ids
            elif not req.exclude_input:
                new_ids = new_ids[prompt_len:]
            reason, stop_reason = O.finish_reason(new_ids, self.checkpoint.eos_ids, stop_ids, req.stop,
                                                  req.max_tokens)
            fin = O.Finished(texts[j], new_ids, float(cum[j]), reason, stop_reason)
            job.send(_response(_final_outputs(req, fin, out)), final=True)
            return
        if not job.cancelled:
            raise Internal("the llm stream ended without a final response")

    def _images(self, urls: list[str]) -> list[bytes]:
        if not urls:
            return []
        from ..openai.errors import APIError  # noqa: PLC0415

        try:
            return asyncio.run(self.s.media.load_all(urls))
        except APIError as e:
            raise InvalidArgument(f"{N.IMAGE_URL}: {e.message}") from None

    def _pre_inputs(self, req: LlmapiRequest, images: list[bytes]) -> list:
        prompt = with_markers(req.prompt, len(images), self.checkpoint.markers if images else ())
        t = [_tensor(N.TEXT_INPUT, np.array([[prompt.encode()]], dtype=np.object_)),
             _tensor(N.MAX_TOKENS, np.array([[req.max_tokens]], dtype=np.int32))]
        if images:
            t.append(_tensor(N.IMAGES, np.array([images], dtype=np.object_)))
        if req.stop:
            t.append(_tensor(N.STOP_WORDS, np.array([[s.encode() for s in req.stop]], dtype=np.object_)))
        lora = req.lora
        if lora is not None and lora.path is None:  # a registry adapter by name: preprocess checks it
            t.append(_tensor(N.LORA_NAME, np.array([[lora.name.encode()]], dtype=np.object_)))
            if lora.lora_id is not None:
                t.append(_tensor(N.LORA_TASK_ID, np.array([[lora.lora_id]], dtype=np.uint64)))
        return t

    def _generation_inputs(self, req: LlmapiRequest) -> list:
        t = [_tensor(name, np.array([[v]], dtype=_NP[_GEN[name].dtype])) for name, v in req.generation.items()]
        lora = req.lora
        if lora is not None:
            if lora.lora_id is not None:
                t.append(_tensor(N.LORA_TASK_ID, np.array([[lora.lora_id]], dtype=np.uint64)))
            if lora.path is not None:
                t.append(_tensor(N.LORA_PATH, np.array([[lora.path.encode()]], dtype=np.object_)))
            else:
                t.append(_tensor(N.LORA_NAME, np.array([[lora.name.encode()]], dtype=np.object_)))
        return t


# --- tensors -------------------------------------------------------------------------------------------------
def read_inputs(request) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """(scalar inputs by name, text_input, image_url, sampling_param_stop): this model has no batch dim."""
    values: dict[str, Any] = {}
    for s in _SCALARS:
        t = pb_utils.get_input_tensor_by_name(request, s.name)
        if t is None:
            continue
        arr = t.as_numpy().reshape(-1)
        if arr.size != 1:
            raise InvalidArgument(f"input {s.name!r} must hold exactly one value, got {arr.size}")
        v = arr[0]
        values[s.name] = _str(v, s.name) if s.dtype == N.BYTES else bool(v) if s.dtype == N.BOOL else v.item()
    lists = []
    for name in (N.TEXT_INPUT, N.IMAGE_URL, N.SP_STOP):
        t = pb_utils.get_input_tensor_by_name(request, name)
        lists.append([] if t is None else [_str(v, name) for v in t.as_numpy().reshape(-1)])
    return values, *lists


def _str(v, name: str = N.TEXT_OUTPUT) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"input {name!r} is not valid UTF-8 text: {e}") from None
    return str(v)


def _tensor(name: str, arr: np.ndarray):
    return pb_utils.Tensor(name, arr)


def _response(values: dict[str, Any]):
    tensors = []
    for name, v in values.items():
        spec = _OUT[name]
        if spec.dtype == N.BYTES:
            arr = np.array([x.encode() if isinstance(x, str) else x for x in v], dtype=np.object_)
        else:
            arr = np.asarray(v, dtype=_NP[spec.dtype]).reshape(-1)
        tensors.append(pb_utils.Tensor(name, arr))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _final_outputs(req: LlmapiRequest, fin: O.Finished, llm_out: dict) -> dict[str, Any]:
    out: dict[str, Any] = {N.TEXT_OUTPUT: [fin.text]}
    if req.return_finish_reason:
        out[N.FINISH_REASON] = [fin.finish_reason]
    if req.return_stop_reason:
        out[N.STOP_REASON] = [str(fin.stop_reason)]
    if req.return_cumulative_logprob:
        out[N.CUMULATIVE_LOGPROB] = [fin.cum_log_prob]
    if req.return_perf_metrics:
        for name in _PERF:
            out[name] = llm_out[name].reshape(-1)
    return out


def _cancelled_outputs(req: LlmapiRequest) -> dict[str, Any]:
    out: dict[str, Any] = {N.TEXT_OUTPUT: [""]}
    if req.return_finish_reason:
        out[N.FINISH_REASON] = [O.CANCELLED]
    if req.return_stop_reason:
        out[N.STOP_REASON] = ["None"]
    return out


def _infer(model: str, inputs: list, outputs: list[str]) -> dict:
    resp = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()
    if resp.has_error():
        raise _error(resp.error())
    return {t.name(): t for t in resp.output_tensors()}


_CODES = {"INVALID_ARG": InvalidArgument, "UNAVAILABLE": Unavailable, "CANCELLED": Cancelled}


def _error(err) -> VLMError:
    """A BLS error -> the domain error of its code (INVALID_ARG stays INVALID_ARG for the client)."""
    code = err.code() if hasattr(err, "code") else None
    for name, cls in _CODES.items():
        if code == getattr(pb_utils.TritonError, name, object()):
            return cls(err.message())
    return Internal(err.message())


def _theirs(e: BaseException) -> BaseException:
    """A domain error whose text names the llmapi model's inputs."""
    if isinstance(e, VLMError):
        return type(e)(O.their_names(e.message))
    return e


def settings_from(p: dict[str, str]) -> Settings:
    """The model's parameters (config.pbtxt) -> its settings: the image-URL policy (the OpenAI API's, one fetcher),
    the adapter folders, the checkpoint, the three models it calls."""
    from ..lora.paths import parse_roots  # noqa: PLC0415
    from ..openai.media import MediaPolicy  # noqa: PLC0415
    from .config import parse_int  # noqa: PLC0415

    ports = tuple(int(x) for x in (p.get("allowed_image_ports") or "80,443").split(",") if x.strip())
    media = MediaPolicy(allowed_domains=tuple(d.strip() for d in (p.get("allowed_image_domains") or "").split(",")
                                              if d.strip()),
                        max_bytes=parse_int(p, "max_image_bytes", 20 << 20),
                        timeout_s=float(p.get("image_fetch_timeout_s") or 10.0),
                        max_images=parse_int(p, "max_images", 8), ports=ports,
                        allow_private=parse_int(p, "allow_private_image_hosts", 0) != 0)
    return Settings(media=media, lora_roots=parse_roots(p.get("lora_root")), model_path=p.get("model_path", ""),
                    preprocess=p.get("preprocess_model") or "preprocess", vision=p.get("vision_model") or "vision",
                    llm=p.get("llm_model") or "llm")


def read_checkpoint(model_path: str) -> Checkpoint:
    """The checkpoint's end ids and image markers (the family's, besides `<image>`)."""
    from ..openai.served import image_markers  # noqa: PLC0415
    from ..spec import CheckpointSpec  # noqa: PLC0415
    from .config import resolve_model_path  # noqa: PLC0415

    spec = CheckpointSpec.load(resolve_model_path(model_path))
    return Checkpoint(eos_ids=frozenset(spec.eos_ids), markers=image_markers(spec)[0])
