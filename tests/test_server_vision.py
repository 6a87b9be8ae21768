"""The vision model through the real server: the embedding cache (the same image sent 10 times is encoded once,
with identical answers), cross-request batching, the onnxruntime backend (the CPU default) against torch, and
embeddings in the language model's dtype."""
from __future__ import annotations

import io
import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from triton_vlm.demo.shapes import draw
from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server
Q = "USER: <image>\nWhat color is the shape? ASSISTANT:"


def png(shape: str, color: str, seed: int) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, (80, 80), random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


def vision_metrics(server) -> dict[str, float]:
    time.sleep(0.1)
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^(triton_vlm_(?:vision|embedding)_\w+)\{[^}]*model="vision"[^}]*\} ([0-9.e+]+)$', text,
                       re.M)
    return {name: float(v) for name, v in found}


def test_same_image_ten_times_is_encoded_once(triton_server):
    image = png("triangle", "green", seed=9001)  # an image no other test sends
    before = vision_metrics(triton_server)
    with VLMClient(triton_server.grpc_url, timeout=60) as c:
        answers = [c.generate(Q, [image], max_tokens=6).output_ids for _ in range(10)]
    after = vision_metrics(triton_server)
    assert after["triton_vlm_vision_images_encoded_total"] - before["triton_vlm_vision_images_encoded_total"] == 1
    assert after["triton_vlm_embedding_cache_hits_total"] - before["triton_vlm_embedding_cache_hits_total"] == 9
    assert after["triton_vlm_embedding_cache_bytes"] > 0
    assert all(a == answers[0] for a in answers)  # the first one was encoded, the other nine came from the cache


def test_a_chat_resending_its_images_reuses_their_embeddings(triton_server):
    a, b = png("circle", "red", seed=9002), png("square", "blue", seed=9003)
    with VLMClient(triton_server.grpc_url, timeout=60) as c:
        fresh = c.generate(Q.replace("<image>", "<image>\n<image>"), [b, a], max_tokens=6).output_ids
        before = vision_metrics(triton_server)
        # turn 1 sends a; turn 2 sends a again and b (already seen above), twice in one prompt
        c.generate(Q, [a], max_tokens=6)
        again = c.generate(Q.replace("<image>", "<image>\n<image>"), [b, a], max_tokens=6).output_ids
    after = vision_metrics(triton_server)
    assert after["triton_vlm_vision_images_encoded_total"] == before["triton_vlm_vision_images_encoded_total"]
    assert again == fresh


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory, demo_model):
    from conftest import _start_server, _stop_server

    server = _start_server(tmp_path_factory, demo_model, {"vision": {"vision_backend": "torch",
                                                                     "embedding_cache_mb": "0"}}, "torch-server")
    yield server
    _stop_server(server)


def test_onnxruntime_backend_answers_as_torch(triton_server, torch_server):
    """The default server's vision (onnxruntime on the exported graph, exported on first start) gives the torch
    backend's answers."""
    cases = [png(s, col, seed=100 + i) for i, (s, col) in
             enumerate((s, col) for s in ("circle", "square", "triangle") for col in ("red", "blue", "yellow"))]

    def ask(server, img):
        with VLMClient(server.grpc_url, timeout=120) as c:
            return c.generate(Q, [img], max_tokens=6).output_ids

    with ThreadPoolExecutor(9) as ex:
        ref = list(ex.map(lambda img: ask(torch_server, img), cases))
    assert [ask(triton_server, img) for img in cases] == ref
    assert "vision: onnxruntime on" in (triton_server.run_dir / "server.log").read_text()  # the CPU default


def test_concurrent_requests_share_encoder_calls(torch_server, demo_model):
    """32 requests released at once on the vision model: fewer encoder calls than images (the batch-size
    histogram), every request answered with its own image's embeddings."""
    import threading

    import numpy as np
    import tritonclient.grpc as grpcclient

    from triton_vlm.spec import CheckpointSpec

    size = CheckpointSpec.load(demo_model).vision.image_size
    pixels = [np.random.default_rng(i).standard_normal((1, 1, 3, size, size)).astype(np.float32) for i in range(32)]
    before = vision_metrics(torch_server)
    start, out = threading.Barrier(32), {}

    def call(i):
        client = grpcclient.InferenceServerClient(torch_server.grpc_url)
        x = grpcclient.InferInput("pixel_values", list(pixels[i].shape), "FP32")
        x.set_data_from_numpy(pixels[i])
        start.wait(30)
        out[i] = client.infer("vision", [x], timeout=60).as_numpy("image_embeds")
        client.close()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    after = vision_metrics(torch_server)
    calls = after["triton_vlm_vision_batch_size_count"] - before["triton_vlm_vision_batch_size_count"]
    images = after["triton_vlm_vision_images_encoded_total"] - before["triton_vlm_vision_images_encoded_total"]
    assert images == 32 and calls < 32, (images, calls)
    assert len({out[i].tobytes() for i in range(32)}) == 32  # each its own


@pytest.mark.parametrize("dtype,triton_type", [("float16", "TYPE_FP16"), ("bfloat16", "TYPE_BF16")])
def test_the_repository_declares_embeddings_in_the_language_models_dtype(tmp_path, demo_model, dtype, triton_type):
    """The filled repository: vision's output and llm's input `image_embeds` in the llm's dtype."""
    from triton_vlm.server.process import TritonServer
    from triton_vlm.server.repository import prepare_model_repository

    server = TritonServer(str(demo_model), 0, 0, 0, params={"llm": {"dtype": dtype}})
    repo = prepare_model_repository(tmp_path / "repo", server.model_params())
    for model in ("vision", "llm"):
        text = (repo / model / "config.pbtxt").read_text()
        assert re.search(rf'name: "image_embeds"\s*data_type: {triton_type}', text), model


def test_embeddings_travel_in_the_language_models_dtype(tmp_path_factory, demo_model):
    """With a bf16 language model, vision sends its embeddings in bf16 (half the bytes of FP32 through shared
    memory), llm takes them by DLPack, and the demo still answers right (fp16 takes the same path: its
    repository is checked above)."""
    from conftest import _start_server, _stop_server

    server = _start_server(tmp_path_factory, demo_model, {"llm": {"dtype": "bfloat16"}}, "bfloat16-server")
    try:
        repo = server.run_dir / "model_repository"
        for model in ("vision", "llm"):
            text = (repo / model / "config.pbtxt").read_text()
            assert re.search(r'name: "image_embeds"\s*data_type: TYPE_BF16', text), model
        with VLMClient(server.grpc_url, timeout=60) as c:
            for shape, color in (("circle", "red"), ("square", "blue"), ("triangle", "yellow")):
                assert c.generate(Q, [png(shape, color, seed=7)], max_tokens=4).text.strip() == color
    finally:
        _stop_server(server)
