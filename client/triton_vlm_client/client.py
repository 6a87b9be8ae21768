"""`VLMClient`: generate and stream from the triton-vlm ensemble over gRPC or HTTP.

gRPC: the ensemble contains a decoupled model, so every request (streamed or not) goes through the
bidirectional stream API with `enable_empty_final_response`; the request is complete when a response carries
`triton_final_response`. Each call opens its own stream, so one client may be used from several threads.
HTTP: Triton's generate extension (`/generate`, `/generate_stream` with Server-Sent Events), standard library
only. Every wait is bounded by `timeout` (seconds, for the whole request).
A server started with `--api-key` wants the key on every call but health: `api_key` (default
`$TRITON_VLM_API_KEY`) goes in the header `authorization: Bearer KEY` over HTTP, and in the metadata
`triton-grpc-protocol-authorization` over gRPC (where Triton 2.51 looks for it).
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import socket
import ssl
import time
import uuid
from typing import Any, Iterable, Iterator, Optional
from urllib.parse import urlsplit

from . import protocol as P
from .errors import VLMClientError
from .request import ImageLike, build_json, build_tensors, load_image, wire_params
from .response import GenerateResult, Outputs, PieceDecoder, StreamPiece, flat, iter_sse, json_error, parse_result

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_TIMEOUT = 60.0


class VLMClient:
    def __init__(self, url: Optional[str] = None, protocol: str = "grpc", model: str = P.MODEL,
                 timeout: float = DEFAULT_TIMEOUT, api_key: Optional[str] = None):
        protocol = protocol.lower()
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.protocol = protocol
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        self.timeout = float(timeout)
        key = os.environ.get(P.API_KEY_ENV, "") if api_key is None else api_key  # "": send none
        if any(not ("!" <= c <= "~") for c in key):
            raise ValueError("api_key must be printable ASCII without spaces (it goes in a header)")
        self._api_key = key

    def _headers(self) -> dict[str, str]:
        """The API key as this protocol carries it (none without a key)."""
        if not self._api_key:
            return {}
        name = P.GRPC_AUTH_HEADER if self.protocol == "grpc" else P.HTTP_AUTH_HEADER
        return {name: f"Bearer {self._api_key}"}

    def __repr__(self) -> str:
        return f"VLMClient(url={self.url!r}, protocol={self.protocol!r}, model={self.model!r})"

    def __enter__(self) -> "VLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own connection."""

    # ------------------------------------------------------------ public API

    def generate(self, prompt: str, images: Iterable[ImageLike] = (), **params: Any) -> GenerateResult:
        """Generate a complete answer. `images`: file paths or encoded bytes, one per `<image>` marker in
        the prompt; `params`: generation parameters named as the ensemble's inputs (see docs/interfaces.md), and
        `lora_dir`: a LoRA adapter folder whose tensors are sent with `lora_task_id`."""
        wire, imgs = self._wire(params), [load_image(i) for i in images]
        want_lp = bool(wire.get(P.RETURN_LOG_PROBS))
        if self.protocol == "grpc":
            last: Optional[Outputs] = None
            for outputs in self._grpc_responses(prompt, imgs, wire, stream=False):
                if P.TEXT_OUTPUT in outputs:
                    last = outputs
            if last is None:
                raise VLMClientError("PROTOCOL", "the server completed the request without any output")
            return parse_result(last, want_lp)
        return parse_result(self._http_generate(prompt, imgs, wire), want_lp)

    def _wire(self, params: dict) -> dict:
        wire = wire_params(params)
        if P.LORA_WEIGHTS in wire and self.protocol != "grpc":
            raise ValueError("lora_dir needs protocol 'grpc': Triton's HTTP generate extension cannot carry the "
                             "FP16 lora_weights; send the adapter once over gRPC, then its lora_task_id over HTTP")
        return wire

    def stream(self, prompt: str, images: Iterable[ImageLike] = (), **params: Any) -> Iterator[StreamPiece]:
        """Generate, yielding `StreamPiece`s as the server produces them (the `stream` input is set).
        Closing the iterator early cancels the request."""
        wire, imgs = self._wire(params), [load_image(i) for i in images]
        decoder = PieceDecoder(bool(wire.get(P.RETURN_LOG_PROBS)))
        source = (self._grpc_responses(prompt, imgs, wire, stream=True) if self.protocol == "grpc"
                  else self._http_stream(prompt, imgs, wire))
        return self._pieces(source, decoder)

    @staticmethod
    def _pieces(source: Iterator[Outputs], decoder: PieceDecoder) -> Iterator[StreamPiece]:
        try:
            for outputs in source:
                yield from decoder.pieces(outputs)
            yield from decoder.flush()
        finally:
            source.close()  # type: ignore[attr-defined]

    def ready(self) -> bool:
        """True when the server is up and the model is ready (never raises)."""
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as grpcclient
                client = grpcclient.InferenceServerClient(self.url)
                try:
                    t = min(self.timeout, 5.0)
                    return bool(client.is_server_ready(headers=self._headers(), client_timeout=t)
                                and client.is_model_ready(self.model, headers=self._headers(), client_timeout=t))
                finally:
                    client.close()
            status, _ = self._http_simple("GET", f"/v2/models/{self.model}/ready")
            return status == 200
        except Exception:
            return False

    # ------------------------------------------------------------ gRPC

    def _grpc_responses(self, prompt: str, images: list[bytes], params: dict,
                        stream: bool) -> Iterator[Outputs]:
        """Send one request on a fresh stream; yield the outputs of each response until the final one."""
        tensors = build_tensors(prompt, images, params, stream)
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + self.timeout
        url = self.url.split("://", 1)[-1]
        responses: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        started = False
        try:
            inputs = []
            for name, dtype, arr in tensors:
                inp = grpcclient.InferInput(name, list(arr.shape), dtype)
                inp.set_data_from_numpy(arr)
                inputs.append(inp)
            client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                stream_timeout=self.timeout + 1.0, headers=self._headers() or None)  # our own deadline below fires first
            started = True
            client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex,
                                      enable_empty_final_response=True)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise queue.Empty
                    result, error = responses.get(timeout=remaining)
                except queue.Empty:
                    raise VLMClientError("StatusCode.DEADLINE_EXCEEDED",
                                         f"no complete response from {self.url} within {self.timeout:g} s") from None
                if error is not None:
                    raise VLMClientError(error.status(), error.message())
                response = result.get_response()
                outputs = {o.name: flat(result.as_numpy(o.name)) for o in response.outputs}
                final_param = response.parameters.get("triton_final_response")
                final = final_param.bool_param if final_param is not None else True
                if outputs:
                    yield outputs
                if final:
                    return
        except InferenceServerException as e:
            raise _stream_error(responses, e) from None
        finally:
            if started:
                try:
                    client.stop_stream(cancel_requests=True)  # never blocks on a stuck server
                except Exception:
                    pass
            client.close()

    # ------------------------------------------------------------ HTTP

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, str]:
        url = self.url if "://" in self.url else "http://" + self.url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad HTTP url {self.url!r}; expected host:port or http(s)://host:port[/prefix]")
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port or 443, timeout=timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        return conn, parts.path.rstrip("/")

    def _open(self, method: str, path: str, body: Optional[dict], deadline: float,
              accept: str = "application/json") -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn, prefix = self._connection(max(deadline - time.monotonic(), 0.001))
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Accept": accept, **self._headers()}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, prefix + path, body=data, headers=headers)
            return conn, conn.getresponse()
        except BaseException as e:
            conn.close()
            raise self._transport_error(e) from None

    def _transport_error(self, e: BaseException) -> BaseException:
        if isinstance(e, (socket.timeout, TimeoutError)):
            return VLMClientError("DEADLINE_EXCEEDED", f"no complete response from {self.url} within {self.timeout:g} s")
        if isinstance(e, (OSError, http.client.HTTPException)):
            return VLMClientError("UNAVAILABLE", f"cannot talk to {self.url}: {e}")
        return e

    def _http_simple(self, method: str, path: str, body: Optional[dict] = None) -> tuple[int, bytes]:
        deadline = time.monotonic() + self.timeout
        conn, resp = self._open(method, path, body, deadline)
        try:
            return resp.status, resp.read()
        except BaseException as e:
            raise self._transport_error(e) from None
        finally:
            conn.close()

    def _http_generate(self, prompt: str, images: list[bytes], params: dict) -> Outputs:
        status, raw = self._http_simple("POST", f"/v2/models/{self.model}/generate",
                                        build_json(prompt, images, params))
        message = json_error(raw)
        if status != 200 or message is not None:
            raise VLMClientError(status, message if message is not None else raw.decode("utf-8", "replace"))
        try:
            obj = json.loads(raw)
        except ValueError:
            raise VLMClientError("PROTOCOL", f"the server sent no JSON: {raw[:200]!r}") from None
        return obj

    def _http_stream(self, prompt: str, images: list[bytes], params: dict) -> Iterator[Outputs]:
        deadline = time.monotonic() + self.timeout
        conn, resp = self._open("POST", f"/v2/models/{self.model}/generate_stream",
                                build_json(prompt, images, params, stream=True), deadline, "text/event-stream")
        try:
            if resp.status != 200:
                raw = resp.read()
                message = json_error(raw)
                raise VLMClientError(resp.status, message if message is not None else raw.decode("utf-8", "replace"))

            def lines() -> Iterator[bytes]:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise socket.timeout()
                    if conn.sock is not None:
                        conn.sock.settimeout(remaining)
                    line = resp.readline()
                    if not line:
                        return
                    yield line

            try:
                for event in iter_sse(lines()):
                    if "error" in event:
                        raise VLMClientError(resp.status, str(event["error"]))
                    yield event
            except VLMClientError:
                raise
            except (OSError, http.client.HTTPException) as e:
                raise self._transport_error(e) from None
        finally:
            conn.close()


def _stream_error(responses: "queue.Queue[tuple[Any, Any]]", e: Any) -> VLMClientError:
    """The error of a failed stream request. When the server ends the stream at once (e.g. a refused API key:
    UNAVAILABLE), tritonclient raises only 'The stream is no longer in valid state' and hands the cause to the
    stream's callback: that cause, if it comes within a second."""
    if "no longer in valid state" in (e.message() or ""):
        deadline = time.monotonic() + 1.0
        while True:
            try:
                _, error = responses.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                break
            if error is not None:
                return VLMClientError(error.status(), error.message())
    return VLMClientError(e.status(), e.message())

