"""The front end's gRPC client to Triton (asyncio, `grpc.aio` with `tritonclient`'s protobuf stubs).

Two routes to the same models:

- `pipeline` (default): the front end runs the ensemble's three steps itself: `preprocess` (unary), `vision`
  (unary, only when the prompt kept an image) and `llm` (a stream). Triton 2.51 checks an ensemble request's
  cancellation only between steps, so a generation already running in `llm` is never cancelled through the
  ensemble; sent to `llm` directly, closing the stream cancels it (the llm's responder sees `is_cancelled()`
  within its sweep and the engine frees the rows and KV blocks at its next step). It also knows the prompt's
  token count (image tokens included) before generating, so an absent `max_tokens` fills the context as
  OpenAI does, and skips `vision` for text-only prompts. The cost: one more round trip per request with
  images, and the embeddings cross the front end in host memory (the ensemble keeps them on the GPU).
- `ensemble`: one stream to `ensemble` (tensors stay inside Triton; cancellation between steps only).

Each request gets its own gRPC stream, multiplexed over a few HTTP/2 channels. With the `triton_grpc_error`
header Triton ends a stream that fails with the error's gRPC status code (INVALID_ARGUMENT, UNAVAILABLE, ...);
on a shared bidirectional stream that would end every request on it, and without the header stream errors
carry only a message. Closing the request's own stream cancels exactly that request.

With an API key every call carries it (metadata `triton-grpc-protocol-authorization: Bearer KEY`), as a Triton
started with `--api-key` wants for every API but health (`triton_vlm.server.auth`).
"""
from __future__ import annotations

import itertools
import logging
import re
import struct
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .. import names as N
from ..server.auth import grpc_metadata
from .errors import APIError, from_triton

log = logging.getLogger("triton_vlm.openai")

PREPROCESS, VISION, LLM, ENSEMBLE = "preprocess", "vision", "llm", "ensemble"
ROUTES = ("pipeline", "ensemble")
_STREAM_ERRORS = (("triton_grpc_error", "true"),)
_MAX_MESSAGE = 2**31 - 1
_PACK = {N.INT32: "<i", N.FP32: "<f", N.UINT64: "<Q"}
_DTYPES = {N.INT32: np.int32, N.FP32: np.float32, N.UINT64: np.uint64, "INT64": np.int64, N.FP16: np.float16}
# the steps' wiring, as the ensemble has it (`names.PIPELINE`, `names.fed_by`)
_TO_VISION = N.fed_by(VISION, PREPROCESS)
_TO_LLM = N.fed_by(LLM, PREPROCESS)
_VISION_TO_LLM = N.fed_by(LLM, VISION)
_SPECS = {s.name: s for s in N.ENSEMBLE_INPUTS}


@dataclass
class TritonRequest:
    request_id: str
    prompt: str
    images: list[bytes] = field(default_factory=list)
    max_tokens: Optional[int] = None  # None: whatever the context leaves after the prompt
    params: dict[str, object] = field(default_factory=dict)  # ensemble generation input -> scalar
    stop_words: list[str] = field(default_factory=list)
    lora_name: Optional[str] = None
    stream: bool = False
    ignore_eos: bool = False  # min_tokens = max_tokens: EOS is never chosen
    videos: list[bytes] = field(default_factory=list)  # video files (checkpoints that take videos)


@dataclass
class LLMResponse:
    """One response of the llm (see names.ENSEMBLE_OUTPUTS): a streamed piece of `sequence_index`, or the final
    response with one entry per returned sequence."""

    texts: list[bytes]
    ids: list[list[int]]
    log_probs: list[list[float]]
    cum_log_probs: list[float]
    sequence_index: int
    final: bool
    prompt_tokens: Optional[int] = None
    top: list[list[list[tuple[int, float]]]] = field(default_factory=list)  # [sequence][token] -> (id, log prob)


# the llm outputs `parse_llm` reads; the others (batch_index, dropped_images, ...) are not asked for, so the llm
# neither builds nor sends them with every streamed token
_LLM_OUTPUTS = (N.TEXT_OUTPUT, N.OUTPUT_IDS, N.SEQUENCE_LENGTH, N.SEQUENCE_INDEX, N.CUM_LOG_PROBS)


def llm_outputs(params: dict[str, object]) -> tuple[str, ...]:
    """The outputs to ask the llm for, given the request's generation inputs: log probs only when asked."""
    names = list(_LLM_OUTPUTS)
    if params.get(N.RETURN_LOG_PROBS):
        names.append(N.OUTPUT_LOG_PROBS)
    if params.get(N.RETURN_TOP_LOG_PROBS):
        names += [N.OUTPUT_TOP_LOG_PROBS, N.OUTPUT_TOP_LOG_PROB_IDS]
    return tuple(names)


def bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def parse_bytes(raw: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def add_input(req, name: str, dtype: str, shape: list[int], raw: bytes) -> None:
    t = req.inputs.add()
    t.name, t.datatype = name, dtype
    t.shape.extend(shape)
    req.raw_input_contents.append(raw)


def add_scalar(req, name: str, value) -> None:
    dtype = _SPECS[name].dtype
    if dtype == N.BOOL:
        raw = b"\x01" if value else b"\x00"
    elif dtype == N.BYTES:
        raw = bytes_tensor([value.encode() if isinstance(value, str) else value])
    else:
        raw = struct.pack(_PACK[dtype], value)
    add_input(req, name, dtype, [1, 1], raw)


def _outputs(resp) -> dict[str, tuple[object, bytes]]:
    return {o.name: (o, raw) for o, raw in zip(resp.outputs, resp.raw_output_contents)}


def _array(out: dict, name: str) -> Optional[np.ndarray]:
    if name not in out:
        return None
    o, raw = out[name]
    return np.frombuffer(raw, dtype=_DTYPES[o.datatype]).reshape([int(d) for d in o.shape])


def parse_llm(resp) -> LLMResponse:
    out = _outputs(resp)
    texts = parse_bytes(out[N.TEXT_OUTPUT][1]) if N.TEXT_OUTPUT in out else []
    n = len(texts)
    ids = _array(out, N.OUTPUT_IDS)
    lengths = _array(out, N.SEQUENCE_LENGTH)
    lps = _array(out, N.OUTPUT_LOG_PROBS)
    cum = _array(out, N.CUM_LOG_PROBS)
    seq = _array(out, N.SEQUENCE_INDEX)
    n_in = _array(out, N.NUM_INPUT_TOKENS)
    ids2 = ids.reshape(n, -1) if ids is not None and n else np.zeros((n, 0), np.int32)  # [sequences, len]
    lens = lengths.reshape(-1).tolist() if lengths is not None else [ids2.shape[1]] * n
    rows = [ids2[k, :lens[k]].tolist() for k in range(n)]
    lp_rows = []
    if lps is not None and lps.size:
        lp2 = lps.reshape(n, -1)  # [sequences, new_tokens]
        lp_rows = [lp2[k, :lens[k]].tolist() for k in range(n)]
    final = resp.parameters.get("triton_final_response")
    return LLMResponse(
        texts=texts, ids=rows, log_probs=lp_rows,
        cum_log_probs=cum.reshape(-1).tolist() if cum is not None else [],
        sequence_index=int(seq.reshape(-1)[0]) if seq is not None and seq.size else 0,
        final=final.bool_param if final is not None else True,
        prompt_tokens=int(n_in.reshape(-1)[0]) if n_in is not None and n_in.size else None,
        top=_top(out, n, lens))


def _top(out: dict, n: int, lens: list[int]) -> list[list[list[tuple[int, float]]]]:
    """output_top_log_probs / _ids [sequences, new_tokens, k] -> per sequence, per token, (id, log prob) best
    first (padding, -inf / -1, left out)."""
    lp, ids = _array(out, N.OUTPUT_TOP_LOG_PROBS), _array(out, N.OUTPUT_TOP_LOG_PROB_IDS)
    if lp is None or ids is None or not lp.size or not n:
        return []
    lp, ids = lp.reshape(n, -1, lp.shape[-1]), ids.reshape(n, -1, ids.shape[-1])
    return [[[(int(t), float(v)) for t, v in zip(ids[j, i], lp[j, i]) if t >= 0]
             for i in range(min(lens[j], lp.shape[1]))] for j in range(n)]


# gRPC's own words for a connection that failed (not Triton's): they name Triton's internal address
_TRANSPORT = re.compile(r"failed to connect|ipv[46]:|unix:|dns resolution|socket closed|connection reset|broken pipe"
                        r"|connection refused|handshake", re.I)


def _rpc_error(e: grpc.aio.AioRpcError) -> APIError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and (not details.strip() or _TRANSPORT.search(details)):
        if details.strip():
            log.warning("Triton unreachable: %s", details)  # the address for the operator, not the client
        return from_triton("UNAVAILABLE", "the Triton server cannot be reached")
    return from_triton(code.name if code is not None else "UNKNOWN", e.details() or "")


class TritonClient:
    default_max_tokens = 256  # the ensemble route's max_tokens when a request sets none

    def __init__(self, url: str, *, route: str = "pipeline", channels: int = 2, timeout_s: float = 600.0,
                 context_length: int = 0, api_key: Optional[str] = None):
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.url, self.route, self.timeout_s = url, route, timeout_s
        self.context_length = context_length  # set by the app once the served model is known
        self._auth = grpc_metadata(api_key)  # on every call (health needs none, but it costs nothing)
        opts = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE),
                ("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
        self._channels = [grpc.aio.insecure_channel(url, options=opts) for _ in range(max(1, channels))]
        self._stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in self._channels]
        self._next = itertools.cycle(range(len(self._stubs)))

    def _stub(self):
        return self._stubs[next(self._next)]

    async def close(self) -> None:
        for c in self._channels:
            await c.close()

    # --- metadata --------------------------------------------------------------------------------------
    async def ready(self, models: tuple[str, ...] = (ENSEMBLE, PREPROCESS, VISION, LLM)) -> bool:
        try:
            stub = self._stub()
            if not (await stub.ServerReady(service_pb2.ServerReadyRequest(), metadata=self._auth, timeout=5)).ready:
                return False
            for m in models:
                ready = await stub.ModelReady(service_pb2.ModelReadyRequest(name=m), metadata=self._auth, timeout=5)
                if not ready.ready:
                    return False
            return True
        except grpc.aio.AioRpcError:
            return False

    async def model_parameters(self, model: str = LLM) -> dict[str, str]:
        """The string parameters of a model's config.pbtxt (model_path, context_length, lora_dir, ...)."""
        try:
            resp = await self._stub().ModelConfig(service_pb2.ModelConfigRequest(name=model), metadata=self._auth,
                                                  timeout=10)
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None
        return {k: v.string_value for k, v in resp.config.parameters.items()}

    # --- generation ------------------------------------------------------------------------------------
    async def generate(self, req: TritonRequest) -> AsyncIterator[LLMResponse]:
        """The llm's responses for one request, until the final one. Leaving the loop early (or being
        cancelled) closes the stream, which cancels the request in Triton."""
        stub = self._stub()
        if self.route == "pipeline":
            llm_req, prompt_tokens = await self._prepare(stub, req)
        else:
            llm_req, prompt_tokens = self._ensemble_request(req), None
        call = stub.ModelStreamInfer(metadata=_STREAM_ERRORS + self._auth, timeout=self.timeout_s)
        try:
            await call.write(llm_req)  # written here, not by a request-iterator task
            await call.done_writing()
            async for msg in call:
                if msg.error_message:  # a server without triton_grpc_error support
                    raise from_triton("UNKNOWN", msg.error_message)
                resp = parse_llm(msg.infer_response)
                if resp.prompt_tokens is None:
                    resp.prompt_tokens = prompt_tokens
                yield resp
                if resp.final:
                    return
            raise APIError(500, "the Triton stream ended without a final response", code="internal_error")
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None
        finally:
            if not call.done():
                call.cancel()  # Triton cancels the request

    def _generation_inputs(self, req: TritonRequest, llm, max_tokens: int) -> None:
        add_scalar(llm, N.MAX_TOKENS, max_tokens)
        params = dict(req.params)
        if req.ignore_eos:
            params[N.MIN_TOKENS] = max_tokens
        for name, value in params.items():
            add_scalar(llm, name, value)
        add_scalar(llm, N.EXCLUDE_INPUT_IN_OUTPUT, True)
        add_scalar(llm, N.STREAM, req.stream)
        if req.lora_name:
            add_scalar(llm, N.LORA_NAME, req.lora_name)

    def _ensemble_request(self, req: TritonRequest):
        ens = service_pb2.ModelInferRequest(model_name=ENSEMBLE, id=req.request_id)
        add_scalar(ens, N.TEXT_INPUT, req.prompt)
        if req.images:
            add_input(ens, N.IMAGES, N.BYTES, [1, len(req.images)], bytes_tensor(req.images))
        if req.videos:
            add_input(ens, N.VIDEOS, N.BYTES, [1, len(req.videos)], bytes_tensor(req.videos))
        if req.stop_words:
            add_input(ens, N.STOP_WORDS, N.BYTES, [1, len(req.stop_words)],
                      bytes_tensor([w.encode() for w in req.stop_words]))
        add_scalar(ens, N.RETURN_NUM_INPUT_TOKENS, True)  # usage's prompt_tokens (image tokens included)
        self._generation_inputs(req, ens, req.max_tokens or self.default_max_tokens)
        return ens

    async def _prepare(self, stub, req: TritonRequest):
        """preprocess (+ vision) -> the llm's request, and the prompt's token count."""
        pre = service_pb2.ModelInferRequest(model_name=PREPROCESS, id=req.request_id)
        add_scalar(pre, N.TEXT_INPUT, req.prompt)
        if req.images:
            add_input(pre, N.IMAGES, N.BYTES, [1, len(req.images)], bytes_tensor(req.images))
        if req.videos:
            add_input(pre, N.VIDEOS, N.BYTES, [1, len(req.videos)], bytes_tensor(req.videos))
        if req.stop_words:
            add_input(pre, N.STOP_WORDS, N.BYTES, [1, len(req.stop_words)],
                      bytes_tensor([w.encode() for w in req.stop_words]))
        add_scalar(pre, N.MAX_TOKENS, req.max_tokens or 1)  # no max_tokens: truncate only what cannot fit at all
        if req.lora_name:
            add_scalar(pre, N.LORA_NAME, req.lora_name)  # checked before any image is encoded
        try:
            out = _outputs(await stub.ModelInfer(pre, metadata=self._auth, timeout=self.timeout_s))
            prompt_tokens = int(out[N.INPUT_IDS][0].shape[-1])
            llm = service_pb2.ModelInferRequest(model_name=LLM, id=req.request_id)
            if int(out[N.PIXEL_VALUES][0].shape[1]):  # [1, images, 3, H, W]: text-only prompts skip vision
                vis = service_pb2.ModelInferRequest(model_name=VISION, id=req.request_id)
                for name in _TO_VISION & out.keys():
                    o, raw = out[name]
                    add_input(vis, name, o.datatype, list(o.shape), raw)
                emb = _outputs(await stub.ModelInfer(vis, metadata=self._auth, timeout=self.timeout_s))
                for name in _VISION_TO_LLM & emb.keys():  # image_embeds, image_feature_lens
                    o, raw = emb[name]
                    add_input(llm, name, o.datatype, list(o.shape), raw)
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from None
        for name in _TO_LLM & out.keys():
            o, raw = out[name]
            add_input(llm, name, o.datatype, list(o.shape), raw)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.context_length - prompt_tokens) if self.context_length else 16
        self._generation_inputs(req, llm, max_tokens)
        for name in llm_outputs(req.params):
            llm.outputs.add().name = name
        return llm, prompt_tokens
