"""Calling the `tensorrt_llm` model with stock `tritonclient`, as a TensorRT-LLM `llmapi` client does: gRPC
streaming (the model is decoupled) and HTTP generate."""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

MODEL = "tensorrt_llm"
_TYPES = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}
_UINT64 = ("sampling_param_seed", "lora_id")


def infer_inputs(inputs: dict[str, Any]) -> list:
    """name -> value (a str / list of str, a bool, an int, a float) -> InferInputs with the model's dims."""
    out = []
    for name, value in inputs.items():
        if isinstance(value, (str, list, tuple)):
            items = [value] if isinstance(value, str) else list(value)
            arr = np.array([v.encode() for v in items], dtype=np.object_)
            t = grpcclient.InferInput(name, [len(items)], "BYTES")
        elif name in _UINT64:
            arr = np.array([value], dtype=np.uint64)
            t = grpcclient.InferInput(name, [1], "UINT64")
        else:
            dtype, np_type = _TYPES[type(value)]
            arr = np.array([value], dtype=np_type)
            t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@dataclass
class Answer:
    pieces: list[dict[str, Any]] = field(default_factory=list)  # every response's outputs, in order
    error: Optional[InferenceServerException] = None

    @property
    def final(self) -> dict[str, Any]:
        return self.pieces[-1]

    @property
    def text(self) -> str:
        return "".join(p["text_output"][0] for p in self.pieces)


def _outputs(result) -> dict[str, Any]:
    out = {}
    for o in result.get_response().outputs:
        arr = result.as_numpy(o.name)
        out[o.name] = [v.decode() if isinstance(v, bytes) else v for v in arr.reshape(-1).tolist()]
    return out


class Stream:
    """One gRPC stream to the server: requests sent on it, their responses collected by request id."""

    def __init__(self, url: str):
        """Errors arrive as messages without a status code (with the `triton_grpc_error` header Triton 2.51 ends
        the stream with the code, but a client that then closes its stream crashes that server: SIGSEGV after
        "HandleCancellation called even when the context was not cancelled"); `http_generate` shows the codes."""
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: "queue.Queue" = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, inputs: dict[str, Any], request_id: str = "") -> None:
        self.client.async_stream_infer(MODEL, infer_inputs(inputs), request_id=request_id,
                                       enable_empty_final_response=True)

    def collect(self, request_id: str = "", timeout: float = 60) -> Answer:
        answer = Answer()
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                answer.error = error
                return answer
            resp = result.get_response()
            if resp.id != request_id:
                raise AssertionError(f"a response of request {resp.id!r} while collecting {request_id!r}")
            if resp.outputs:
                answer.pieces.append(_outputs(result))
            if resp.parameters["triton_final_response"].bool_param:
                return answer

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def grpc_generate(url: str, inputs: dict[str, Any], request_id: str = "1") -> Answer:
    s = Stream(url)
    try:
        s.send(inputs, request_id)
        return s.collect(request_id)
    finally:
        s.close()


def http_generate(http_url: str, body: dict[str, Any]) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http_stream(http_url: str, body: dict[str, Any]) -> list[dict]:
    req = urllib.request.Request(f"http://{http_url}/v2/models/{MODEL}/generate_stream",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    return events
