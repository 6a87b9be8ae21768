"""TensorRT-LLM's `llmapi` interface (the `tensorrt_llm` model) through one live tritonserver, with stock
`tritonclient` (gRPC streaming) and HTTP generate: the same tokens as the `ensemble` for the same inputs,
finish / stop reasons, timing and KV-cache outputs, LoRA by path, refusals, and `stop`."""
from __future__ import annotations

import base64
import io
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmapi_support import Stream, grpc_generate, http_generate, http_stream
from triton_vlm.demo.shapes import draw
from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server
PROMPT = "USER: <image>\nDescribe the image in a few words. ASSISTANT:"
TWO = "USER: <image>\n<image>\nDescribe the images in a few words. ASSISTANT:"
EXAMPLE = Path(__file__).resolve().parents[1] / "client" / "examples" / "llmapi_client.py"


def png(shape, color, seed) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, size=(64, 64), rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


IMG_A, IMG_B = png("circle", "red", 3701), png("square", "blue", 3702)


def data_url(img: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(img).decode()


@pytest.fixture(scope="module")
def images_http(image_host):
    base, folder = image_host
    (folder / "b.png").write_bytes(IMG_B)
    return base


@pytest.fixture(scope="module")
def roots(lora_root, demo_adapters):
    for name in ("french", "sentence"):
        if not (lora_root / name).exists():
            shutil.copytree(demo_adapters / name, lora_root / name)
    if not (lora_root / "out").exists():
        (lora_root / "out").symlink_to(demo_adapters / "sentence")  # a link out of the root
    return lora_root


@pytest.fixture(scope="module")
def server(triton_server, images_http, roots):
    """The session's shared server (conftest.py): its tensorrt_llm model reads lora_path under `roots` and image
    URLs of the local image host."""
    return triton_server


def ensemble(server, prompt, images, **params):
    params.setdefault("exclude_input_in_output", True)
    with VLMClient(server.grpc_url, protocol="grpc", timeout=60) as c:
        return c.generate(prompt, images, **params)


def llmapi(server, **inputs):
    inputs.setdefault("sampling_param_exclude_input_from_output", True)
    a = grpc_generate(server.grpc_url, inputs)
    assert a.error is None, a.error
    return a


@pytest.mark.parametrize("theirs,ours", [
    ({}, {}),
    ({"sampling_param_best_of": 3}, {"beam_width": 3}),
    ({"sampling_param_temperature": 0.9, "sampling_param_top_p": 0.9, "sampling_param_seed": 11},
     {"temperature": 0.9, "top_p": 0.9, "seed": 11}),
    ({"sampling_param_presence_penalty": 1.5, "sampling_param_frequency_penalty": 0.7},
     {"presence_penalty": 1.5, "frequency_penalty": 0.7}),
    ({"sampling_param_top_k": 1, "sampling_param_exclude_input_from_output": False},
     {"top_k": 1, "exclude_input_in_output": False}),
])
def test_answers_equal_the_ensembles(server, theirs, ours):
    a = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=12, **theirs)
    e = ensemble(server, PROMPT, [IMG_A], max_tokens=12, **ours)
    assert len(a.pieces) == 1 and a.text == e.texts[0]


def test_sampled_best_of_returns_the_most_likely_sample(server):
    a = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=10,
               sampling_param_best_of=3, sampling_param_temperature=1.0, sampling_param_seed=5,
               return_cumulative_logprob=True)
    e = ensemble(server, PROMPT, [IMG_A], max_tokens=10, num_return_sequences=3, temperature=1.0, seed=5,
                 return_log_probs=True)
    best = max(range(3), key=lambda j: e.cum_log_probs[j])
    assert a.text == e.texts[best]
    assert a.final["cumulative_logprob"][0] == pytest.approx(e.cum_log_probs[best], abs=1e-4)


def test_two_image_urls_data_and_http_equal_the_ensemble(server, images_http):
    a = llmapi(server, text_input=TWO, image_url=[data_url(IMG_A), f"{images_http}/b.png"],
               sampling_param_max_tokens=12)
    assert a.text == ensemble(server, TWO, [IMG_A, IMG_B], max_tokens=12).texts[0]
    # no markers in the prompt: one per image before the text, as TensorRT-LLM's loader places them
    b = llmapi(server, text_input="Describe the images in a few words. ASSISTANT:",
               image_url=[data_url(IMG_A), f"{images_http}/b.png"], sampling_param_max_tokens=12)
    assert b.text == ensemble(server, "<image>\n<image>\nDescribe the images in a few words. ASSISTANT:",
                              [IMG_A, IMG_B], max_tokens=12).texts[0]


def test_stop_strings_and_finish_reasons(server):
    full = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=3,
                  return_finish_reason=True, return_stop_reason=True)
    assert full.final["finish_reason"] == ["length"] and full.final["stop_reason"] == ["None"]
    long = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=40,
                  return_finish_reason=True)
    assert long.final["finish_reason"] == ["stop"]  # the answer ended with the end id before 40 tokens
    word = " " + long.text.split()[1]  # the answer's second word, as it is tokenized there, as a stop string
    cut = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=40,
                 sampling_param_stop=["zzzz", word], return_finish_reason=True, return_stop_reason=True)
    e = ensemble(server, PROMPT, [IMG_A], max_tokens=40, stop_words=["zzzz", word])
    assert cut.text == e.texts[0] and cut.text.endswith(word) and len(cut.text) < len(long.text)
    assert cut.final["finish_reason"] == ["stop"] and cut.final["stop_reason"] == [word]


def test_streamed_deltas_concatenate_to_the_text(server):
    inputs = dict(text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=12,
                  return_finish_reason=True)
    whole = llmapi(server, **inputs)
    streamed = llmapi(server, streaming=True, **inputs)
    assert len(streamed.pieces) > 2 and streamed.text == whole.text
    assert streamed.final["finish_reason"] == whole.final["finish_reason"]
    beams = llmapi(server, streaming=True, sampling_param_best_of=2, **inputs)
    assert beams.text == ensemble(server, PROMPT, [IMG_A], max_tokens=12, beam_width=2).texts[0]


def test_timing_and_kv_cache_outputs(server):
    prompt = "USER: <image>\nWhat shape and what color is it? Answer briefly, please. ASSISTANT:"
    inputs = dict(text_input=prompt, image_url=[data_url(png("triangle", "green", 3703))],
                  sampling_param_max_tokens=8, sampling_param_return_perf_metrics=True)
    t0 = time.time_ns()
    first = llmapi(server, **inputs).final
    t1 = time.time_ns()
    again = llmapi(server, **inputs).final
    f = {k: v[0] for k, v in first.items()}
    assert t0 <= f["arrival_time_ns"] <= f["first_scheduled_time_ns"] <= f["first_token_time_ns"] \
        <= f["last_token_time_ns"] <= t1
    assert f["kv_cache_reused_block"] == 0 and f["kv_cache_missed_block"] > 0 and f["kv_cache_hit_rate"] == 0
    assert f["kv_cache_alloc_total_blocks"] == f["kv_cache_alloc_new_blocks"] >= f["kv_cache_missed_block"]
    g = {k: v[0] for k, v in again.items()}
    assert g["kv_cache_reused_block"] > 0 and g["kv_cache_hit_rate"] > 0
    assert g["kv_cache_reused_block"] + g["kv_cache_missed_block"] == f["kv_cache_missed_block"]
    assert g["kv_cache_alloc_new_blocks"] < f["kv_cache_alloc_new_blocks"]
    assert g["acceptance_rate"] == 0 and g["total_draft_tokens"] == g["total_accepted_draft_tokens"] == 0


def test_lora_by_path_equals_the_registry_adapter(server, roots):
    inputs = dict(text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=10)
    by_path = llmapi(server, lora_id=3701, lora_name="fr", lora_path=str(roots / "french"), **inputs)
    by_name = ensemble(server, PROMPT, [IMG_A], max_tokens=10, lora_name="french")
    base = llmapi(server, **inputs)
    assert by_path.text == by_name.texts[0] != base.text
    again = llmapi(server, lora_id=3701, lora_path="french", **inputs)  # relative to the root, cached
    assert again.text == by_path.text
    sentence = llmapi(server, lora_id=3702, lora_path=str(roots / "sentence"), **inputs)
    assert sentence.text == ensemble(server, PROMPT, [IMG_A], max_tokens=10, lora_name="sentence").texts[0]


@pytest.mark.parametrize("inputs,message", [
    (dict(lora_id=3710, lora_path="/etc"), "lora_path '/etc' is outside the server's adapter folders"),
    (dict(lora_id=3711, lora_path="out"), "lora_path 'out' is outside the server's adapter folders"),
    (dict(lora_id=3712, lora_path="nowhere"), "lora_path 'nowhere' does not exist"),
    (dict(lora_id=3701, lora_path="sentence"), "lora_id 3701 is bound to another adapter folder"),
    (dict(image_url=["file:///etc/passwd"]), r"image_url\[0\] 'file:///etc/passwd': file:// URLs are refused"),
    (dict(image_url=["http://example.com/x.png"]), "image host 'example.com' is not allowed"),
    (dict(sampling_param_max_tokens=0), "sampling_param_max_tokens must be in"),
    (dict(sampling_param_presence_penalty=3.0), "sampling_param_presence_penalty must be a finite number"),
])
def test_refused_with_invalid_arg_naming_the_input(server, roots, inputs, message):
    if inputs.get("lora_id") == 3701:  # bound to roots/french by the LoRA test or here
        llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], lora_id=3701, lora_path="french")
    prompt = PROMPT if "image_url" in inputs else "USER: Describe a red circle. ASSISTANT:"
    a = grpc_generate(server.grpc_url, dict(text_input=prompt, **inputs))
    assert a.error is not None and re.search(message, a.error.message()), a.error
    status, body = http_generate(server.http_url, dict(text_input=prompt, **inputs))
    assert status == 400 and re.search(message, body["error"]), body  # INVALID_ARG


def test_http_generate_and_generate_stream(server):
    body = {"text_input": PROMPT, "image_url": [data_url(IMG_A)], "sampling_param_max_tokens": 12,
            "sampling_param_exclude_input_from_output": True, "return_finish_reason": True}
    status, out = http_generate(server.http_url, body)
    assert status == 200, out
    assert out["text_output"] == ensemble(server, PROMPT, [IMG_A], max_tokens=12).texts[0]
    assert out["finish_reason"] in ("stop", "length")
    events = http_stream(server.http_url, {**body, "streaming": True})
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == out["text_output"]
    status, err = http_generate(server.http_url, {**body, "image_url": ["file:///etc/passwd"]})
    assert status == 400 and "file:// URLs are refused" in err["error"]


def cancelled_in_llm(server) -> float:
    """The llm's requests that ended cancelled (its metric)."""
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^triton_vlm_requests_total\{[^}]*outcome="cancelled"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_stop_ends_a_running_request(server):
    long = dict(text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=460,
                sampling_param_temperature=50.0, sampling_param_seed=9, return_finish_reason=True)
    # this seed's sample never draws the end id: it runs to max_tokens (about 0.5 s alone on 2 cores)
    assert llmapi(server, **long).final["finish_reason"] == ["length"]
    before = cancelled_in_llm(server)
    s = Stream(server.grpc_url)
    try:
        s.send(dict(streaming=True, **long), "run-1")
        first = s.responses.get(timeout=60)
        assert first[1] is None and first[0].get_response().id == "run-1"
        stopped = grpc_generate(server.grpc_url, dict(text_input="", stop=True), request_id="run-1")
        while True:
            result, error = s.responses.get(timeout=30)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        s.close()
    # the stop request itself is answered as TensorRT-LLM answers it; the running one ends at once, cancelled
    assert "Request cancelled by client" in stopped.error.message()
    assert result.as_numpy("finish_reason").reshape(-1)[0] == b"cancelled"
    deadline = time.monotonic() + 10
    while cancelled_in_llm(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled_in_llm(server) >= before + 1  # the generation itself was cancelled in the engine
    after = llmapi(server, text_input=PROMPT, image_url=[data_url(IMG_A)], sampling_param_max_tokens=12)
    assert after.text == ensemble(server, PROMPT, [IMG_A], max_tokens=12).texts[0]  # the server goes on


def test_a_client_written_for_tensorrt_llms_llmapi_model_runs_unchanged(server):
    out = subprocess.run([sys.executable, str(EXAMPLE), "-u", server.grpc_url, "--text", PROMPT,
                          "--image-url", data_url(IMG_A), "--request-output-len", "12", "--streaming",
                          "--return-perf-metrics"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    expected = ensemble(server, PROMPT, [IMG_A], max_tokens=12).texts[0]
    assert f"Output text: {expected}" in out.stdout
    assert "first_token_time_ns" in out.stdout
