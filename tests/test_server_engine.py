"""Our engine through Triton against the `transformers` generate() backend through Triton, same weights.

The engine server gets all requests at once (in-flight batching, different beam widths, prompt lengths and
images); the baseline server runs them one at a time. Tokens must be identical and scores within 1e-4.
"""
from __future__ import annotations

import io
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from triton_vlm.demo.shapes import draw
from triton_vlm_client import VLMClient, VLMClientError

pytestmark = pytest.mark.server


def png(shape, color, size=(64, 64), seed=0) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, size=size, rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


D = "USER: <image>\nDescribe the image. ASSISTANT:"
CASES = [
    (D, ("circle", "red"), dict(max_tokens=8)),
    (D, ("square", "blue"), dict(max_tokens=10, beam_width=4, num_return_sequences=3, return_log_probs=True)),
    ("USER: Say hello. ASSISTANT:", None, dict(max_tokens=12, beam_width=3, length_penalty=2.0, min_tokens=6)),
    ("USER: <image>\nWhat shape is this? ASSISTANT:", ("triangle", "green"),
     dict(max_tokens=9, beam_width=2, early_stopping=1, return_log_probs=True)),
    (D, ("circle", "yellow"), dict(max_tokens=16, repetition_penalty=1.3, no_repeat_ngram_size=2, min_tokens=10)),
    ("USER: <image>\n<image>\nDescribe the image. ASSISTANT:", ("square", "red"),
     dict(max_tokens=10, beam_width=5, num_return_sequences=5, length_penalty=0.0, early_stopping=2)),
    (D, ("triangle", "blue"), dict(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=1234,
                                   num_return_sequences=3, min_tokens=12)),
    (D, ("circle", "green"), dict(max_tokens=10, beam_width=3, bad_words=["circle"], return_log_probs=True)),
]


def _images(case):
    prompt, img, _ = case
    if img is None:
        return []
    return [png(*img, seed=i) for i in range(prompt.count("<image>"))]


def _run(url, case):
    prompt, _, params = case
    with VLMClient(url, timeout=300) as c:
        return c.generate(prompt, _images(case), **params)


def test_engine_matches_transformers_under_load(triton_server, hf_server):
    with ThreadPoolExecutor(len(CASES)) as ex:  # all at once on the engine
        ours = list(ex.map(lambda c: _run(triton_server.grpc_url, c), CASES))
    base = [_run(hf_server.grpc_url, c) for c in CASES]  # one by one on the baseline
    for case, a, b in zip(CASES, ours, base):
        assert a.output_ids == b.output_ids, case
        assert a.texts == b.texts, case
        if case[2].get("return_log_probs"):
            np.testing.assert_allclose(a.cum_log_probs, b.cum_log_probs, atol=1e-4)
            for x, y in zip(a.output_log_probs, b.output_log_probs):
                np.testing.assert_allclose(x, y, atol=1e-4)


LORA_CASES = [  # the demo adapters (and none) mixed: images, beams with several sequences, sampling, stop words
    (D, ("circle", "red"), dict(max_tokens=12, lora_name="french")),
    (D, ("square", "blue"), dict(max_tokens=14, lora_name="sentence", beam_width=3, num_return_sequences=2,
                                 return_log_probs=True)),
    ("USER: <image>\nWhat shape is this? ASSISTANT:", ("triangle", "green"),
     dict(max_tokens=10, lora_name="french", beam_width=2, return_log_probs=True)),
    (D, ("triangle", "yellow"), dict(max_tokens=12, lora_name="sentence", temperature=0.9, top_k=20, seed=77,
                                     num_return_sequences=2)),
    (D, ("circle", "blue"), dict(max_tokens=8, beam_width=2)),
    ("USER: <image>\n<image>\nDescribe the image. ASSISTANT:", ("square", "red"),
     dict(max_tokens=12, lora_name="sentence", stop_words=["red"], return_log_probs=True)),
]


def test_engine_with_adapters_matches_hf_peft(triton_server, hf_server):
    """Adapters and the base model in concurrent requests on the engine, one by one on the `hf` baseline whose
    adapters run through `peft`: identical tokens, scores within 1e-4."""
    with ThreadPoolExecutor(len(LORA_CASES)) as ex:
        ours = list(ex.map(lambda c: _run(triton_server.grpc_url, c), LORA_CASES))
    base = [_run(hf_server.grpc_url, c) for c in LORA_CASES]
    for case, a, b in zip(LORA_CASES, ours, base):
        assert a.output_ids == b.output_ids and a.texts == b.texts, case
        if case[2].get("return_log_probs"):
            np.testing.assert_allclose(a.cum_log_probs, b.cum_log_probs, atol=1e-4)
    assert ours[0].texts != _run(triton_server.grpc_url, (D, ("circle", "red"), dict(max_tokens=12))).texts


def test_batch_invariance_through_server(triton_server):
    """A request's answer is the same alone and with 15 others arriving at different times."""
    target = CASES[1]
    alone = _run(triton_server.grpc_url, target)
    others = [CASES[i % len(CASES)] for i in range(15)]

    def late(i_case):
        i, case = i_case
        time.sleep(0.05 * (i % 5))
        return _run(triton_server.grpc_url, case)

    with ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(late, (i, c)) for i, c in enumerate(others)]
        together = ex.submit(late, (2, target)).result()
        [f.result() for f in futs]
    assert together.output_ids == alone.output_ids
    np.testing.assert_allclose(together.cum_log_probs, alone.cum_log_probs, atol=1e-5)


def test_beam_streaming_reassembles(triton_server):
    prompt, _, _ = CASES[1]
    params = dict(max_tokens=12, beam_width=4, num_return_sequences=2)
    with VLMClient(triton_server.grpc_url, timeout=120) as c:
        full = c.generate(prompt, _images(CASES[1]), **params)
        pieces = list(c.stream(prompt, _images(CASES[1]), **params))
    for j, text in enumerate(full.texts):
        assert "".join(p.text for p in pieces if p.sequence_index == j) == text


def test_streaming_multibyte_and_spaces(triton_server):
    """Streamed pieces never split a character or drop a space, whatever the model emits."""
    with VLMClient(triton_server.grpc_url, timeout=120) as c:
        for seed in range(3):
            kw = dict(max_tokens=24, min_tokens=24, temperature=1.5, seed=seed)
            full = c.generate("USER: Say hello. ASSISTANT:", **kw)
            pieces = list(c.stream("USER: Say hello. ASSISTANT:", **kw))
            assert "".join(p.text for p in pieces) == full.text
            assert all("\ufffd" not in p.text or "\ufffd" in full.text for p in pieces)


def _metric(server, name: str, label: str = "") -> float:
    """The value of metric `name` (the series whose labels contain `label`) on the server's metrics port."""
    import urllib.request

    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}{{{label}}}")


def _gauge(server, name: str) -> float:
    return _metric(server, f"triton_vlm_engine_{name}")


def _wait_for(check, what: str, timeout: float = 20.0) -> None:
    """Poll `check()` until it is true (the gauges are refreshed every 0.5 s); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def _grpc_input(name, arr, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def test_cancelled_request_frees_the_engine(triton_server):
    """A client cancels a long generation sent to the llm model (Triton forwards the cancellation there;
    through the ensemble Triton 2.51 checks it only between steps): the engine drops the request and later
    requests are served promptly."""
    import queue

    import tritonclient.grpc as grpcclient

    inp = _grpc_input

    def gauge(name):
        return _gauge(triton_server, name)

    assert gauge("kv_blocks_total") > 0
    for _ in range(2):
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(triton_server.grpc_url)
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer("llm", [
            inp("input_ids", np.array([[1, 50, 60, 70]], np.int32), "INT32"),
            inp("max_tokens", np.array([[500]], np.int32), "INT32"),
            inp("min_tokens", np.array([[500]], np.int32), "INT32"),
            inp("beam_width", np.array([[16]], np.int32), "INT32"),
            inp("stream", np.array([[True]]), "BOOL")])
        first, err = q.get(timeout=60)
        assert err is None and first.as_numpy("text_output") is not None
        _wait_for(lambda: gauge("running_rows") == 16 and gauge("kv_blocks_used") > 0,
                  "the gauges show the 16 rows of the running request")
        c.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 20
    log = ""
    while time.monotonic() < deadline and log.count("cancelled by the client;") < 2:
        time.sleep(0.2)
        log = triton_server.log_file.read_text(errors="replace")
    assert log.count("cancelled by the client;") >= 2, "the cancellation reached the engine"
    _wait_for(lambda: gauge("running_requests") == 0 and gauge("kv_blocks_used") == 0, "rows and KV blocks freed")
    with VLMClient(triton_server.grpc_url, timeout=120) as client:
        t0 = time.monotonic()
        assert client.generate("USER: Say hello. ASSISTANT:", max_tokens=8).text.strip() == "hello"
        assert time.monotonic() - t0 < 10, "no cancelled work left in the way"


def test_context_length_error(triton_server, demo_model):
    from triton_vlm.preprocess.checkpoint import ModelInfo

    ctx = ModelInfo.load(demo_model).context_length
    with VLMClient(triton_server.grpc_url, timeout=60) as c:
        with pytest.raises(VLMClientError) as ei:
            c.generate("USER: Say hello. ASSISTANT:", max_tokens=ctx)
        assert "context length" in ei.value.message and "max_tokens" in ei.value.message


def test_sampled_sequences_stream_each(triton_server):
    params = dict(max_tokens=12, min_tokens=12, temperature=1.2, top_k=50, seed=99, num_return_sequences=3)
    with VLMClient(triton_server.grpc_url, timeout=120) as c:
        full = c.generate("USER: Say hello. ASSISTANT:", **params)
        pieces = list(c.stream("USER: Say hello. ASSISTANT:", **params))
    assert len(full.texts) == 3 and {p.sequence_index for p in pieces} == {0, 1, 2}
    for j, text in enumerate(full.texts):
        assert "".join(p.text for p in pieces if p.sequence_index == j) == text
        assert [t for p in pieces if p.sequence_index == j for t in p.token_ids] == full.output_ids[j]


def test_a_request_failing_inside_the_engine_leaves_it_serving(triton_server, demo_model):
    """Bad words covering the vocabulary plus min_tokens, with sampling, leave no token to choose at the first
    step (unchecked, such a row reaches `multinomial`: a device-side assert on CUDA). Six such requests sent to
    the llm model with stock tritonclient, alongside ordinary requests on the ensemble, each end alone with
    INVALID_ARG naming the cause; the ordinary ones get what they get alone, and afterwards the engine holds no
    request and no KV block. (Admission failures are injected in-process: tests/engine/test_faults.py.)"""
    import json
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    vocab = json.loads((demo_model / "config.json").read_text())["text_config"]["vocab_size"]
    flat = np.array([[x for t in range(vocab) for x in (1, t)]], np.int32)  # every id a one-token bad word
    ordinary = [CASES[0], CASES[2], CASES[6]]  # greedy, beam search, sampling
    alone = [_run(triton_server.grpc_url, c) for c in ordinary]

    def stuck(i: int):
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(triton_server.grpc_url)
        try:
            c.start_stream(callback=lambda result, error: q.put((result, error)))
            c.async_stream_infer("llm", [
                _grpc_input("input_ids", np.array([[1, 50, 60, 70 + i]], np.int32), "INT32"),
                _grpc_input("max_tokens", np.array([[8]], np.int32), "INT32"),
                _grpc_input("min_tokens", np.array([[4]], np.int32), "INT32"),
                _grpc_input("temperature", np.array([[0.9]], np.float32), "FP32"),
                _grpc_input("seed", np.array([[i]], np.uint64), "UINT64"),
                _grpc_input("bad_words_ids", flat, "INT32")])
            return q.get(timeout=60)
        finally:
            c.stop_stream()
            c.close()

    def invalid_args() -> float:
        return _metric(triton_server, "triton_vlm_requests_total", 'outcome="invalid_arg"')

    before = invalid_args()
    with ThreadPoolExecutor(9) as ex:
        failing = [ex.submit(stuck, i) for i in range(6)]
        together = list(ex.map(lambda c: _run(triton_server.grpc_url, c), ordinary))
        answers = [f.result() for f in failing]
    for result, error in answers:
        assert result is None and isinstance(error, InferenceServerException), (result, error)
        assert (f"every token is excluded at generated token 1 by bad_words ({vocab} words) and min_tokens (4"
                in error.message()), error.message()
    # a stream's error carries no status code over gRPC: the llm model counts the outcome it sent
    _wait_for(lambda: invalid_args() >= before + 6, "six more requests ended with INVALID_ARG")
    for a, b in zip(together, alone):
        assert a.output_ids == b.output_ids and a.texts == b.texts
    _wait_for(lambda: _gauge(triton_server, "running_requests") == 0
              and _gauge(triton_server, "waiting_requests") == 0 and _gauge(triton_server, "kv_blocks_used") == 0,
              "the engine holds no request and no KV block")
