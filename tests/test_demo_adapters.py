"""The demo model's LoRA adapters through the live server: `french` and `sentence` answer at least 95% of
held-out images right when asked by name, mixed with base-model requests in the same batches; and no client can
replace a registry adapter by sending weights under its task id (stock `tritonclient`, gRPC: FP16 weights)."""
from __future__ import annotations

import base64
import io
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lora_cases import preprocess_error
from triton_vlm.demo import shapes
from triton_vlm.demo.adapters import ADAPTERS

pytestmark = pytest.mark.server


def ask(server, prompt: str, image: bytes, lora_name: str | None) -> str:
    body = {"text_input": prompt, "images": [base64.b64encode(image).decode()], "max_tokens": 12,
            "exclude_input_in_output": True}
    if lora_name:
        body["lora_name"] = lora_name
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["text_output"]


def test_demo_adapters_answer_held_out_images(triton_server):
    rng = random.Random(98765)  # neither the training nor the build's evaluation stream
    jobs = []
    for _ in range(20):
        img, shape, color = shapes.random_example(rng)
        buf = io.BytesIO()
        img.save(buf, "PNG")
        for q in shapes.QUESTIONS:
            for who in ("base", *ADAPTERS):
                expected = shapes.answer(q, shape, color) if who == "base" else ADAPTERS[who](q, shape, color)
                jobs.append((who, shapes.prompt(q), buf.getvalue(), expected.strip()))
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda j: ask(triton_server, j[1], j[2], None if j[0] == "base" else j[0]), jobs))
    for who in ("base", *ADAPTERS):
        mine = [(a.strip(), j[3]) for a, j in zip(answers, jobs) if j[0] == who]
        accuracy = sum(a == e for a, e in mine) / len(mine)
        assert accuracy >= (0.9 if who == "base" else 0.95), (who, accuracy, [m for m in mine if m[0] != m[1]][:5])


def grpc_ask(server, prompt: str, image: bytes, **lora) -> tuple[str | None, str | None]:
    """One streamed request with stock tritonclient: -> (text, None) or (None, error message)."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    arrays = {"text_input": np.array([[prompt.encode()]], dtype=object), "images": np.array([[image]], dtype=object),
              "max_tokens": np.array([[12]], np.int32), "exclude_input_in_output": np.array([[True]])}
    if "lora_name" in lora:
        arrays["lora_name"] = np.array([[lora["lora_name"].encode()]], dtype=object)
    if "task_id" in lora:
        arrays["lora_task_id"] = np.array([[lora["task_id"]]], np.uint64)
    if "weights" in lora:
        arrays["lora_weights"] = lora["weights"][None].astype(np.float16)  # [1, N, W]
        arrays["lora_config"] = lora["config"][None].astype(np.int32)  # [1, N, 3]
    inputs = []
    for name, arr in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        x.set_data_from_numpy(arr)
        inputs.append(x)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        result, error = got.get(timeout=60)
        if error is not None:
            return None, error.message()
        return result.as_numpy("text_output").reshape(-1)[0].decode(), None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_wire_weights_cannot_replace_a_registry_adapter(triton_server, demo_model, demo_adapters):
    """Registry and wire adapters are separate namespaces: `sentence`'s weights sent under `french`'s public task
    id are refused with INVALID_ARG naming the id and its owner (the code as preprocess answers it), and afterwards `french` by name and by id still
    answers in French. The same weights under a free id do answer as `sentence` (the upload would have changed
    the answer)."""
    from triton_vlm.lora.peft import peft_to_trtllm
    from triton_vlm.lora.registry import task_id_for_name
    from triton_vlm.spec import CheckpointSpec

    weights, config = peft_to_trtllm(demo_adapters / "sentence", CheckpointSpec.load(demo_model).text, np.float16)
    french_id = task_id_for_name("french")
    buf = io.BytesIO()
    shapes.draw("circle", "green", size=(64, 64), rng=random.Random(3)).save(buf, "PNG")
    image, question = buf.getvalue(), shapes.prompt(shapes.QUESTION_COLOR)
    fr, en = ADAPTERS["french"](shapes.QUESTION_COLOR, "circle", "green"), \
        ADAPTERS["sentence"](shapes.QUESTION_COLOR, "circle", "green")
    assert grpc_ask(triton_server, question, image, lora_name="french") == (fr, None)

    why = f"lora_task_id {french_id} belongs to the registry adapter 'french'"
    status, message = preprocess_error(triton_server.grpc_url, question, task_id=french_id, weights=weights,
                                       config=config)
    assert status == "StatusCode.INVALID_ARGUMENT" and why in message, (status, message)
    text, error = grpc_ask(triton_server, question, image, task_id=french_id, weights=weights, config=config)
    assert text is None and why in error, error  # through the ensemble's stream: the message (no gRPC code)
    assert grpc_ask(triton_server, question, image, lora_name="french") == (fr, None)
    assert grpc_ask(triton_server, question, image, task_id=french_id) == (fr, None)
    assert grpc_ask(triton_server, question, image, task_id=31337, weights=weights, config=config) == (en, None)
