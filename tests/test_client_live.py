"""The client (triton_vlm_client) against a live tritonserver serving the `ensemble`.

Uses the `triton_server` fixture of tests/conftest.py (attributes `grpc_url`, `http_url`); greedy decoding
throughout, so both protocols and both APIs must agree exactly.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import zlib

import pytest

from triton_vlm_client import VLMClient, VLMClientError, inline_image

pytestmark = pytest.mark.server

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
PROTOCOLS = ["grpc", "http"]


def _png(width: int = 40, height: int = 30) -> bytes:
    """A small RGB gradient PNG, written with the standard library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in (x * 6 % 256, y * 8 % 256, 128))
                    for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


IMAGE = _png()


def _client(server, protocol: str, **kw) -> VLMClient:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return VLMClient(url, protocol=protocol, timeout=kw.pop("timeout", 60), **kw)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "gradient.png"
    path.write_bytes(IMAGE)
    return path


def test_ready(triton_server):
    for protocol in PROTOCOLS:
        assert _client(triton_server, protocol).ready()
        assert not _client(triton_server, protocol, model="no_such_model").ready()


def test_generate_agrees_across_protocols(triton_server, image_file):
    results = [_client(triton_server, p).generate(PROMPT, [image_file], max_tokens=8) for p in PROTOCOLS]
    for r in results:
        assert len(r.texts) == 1 and len(r.output_ids) == 1
        assert r.sequence_lengths == [len(r.output_ids[0])] and 1 <= r.sequence_lengths[0] <= 8
        assert r.dropped_images == 0 and r.cum_log_probs is None
    assert results[0].to_dict() == results[1].to_dict()
    # bytes and paths are the same image
    assert _client(triton_server, "grpc").generate(PROMPT, [IMAGE], max_tokens=8).output_ids == results[0].output_ids


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stream_concatenates_to_generate(triton_server, protocol):
    client = _client(triton_server, protocol)
    full = client.generate(PROMPT, [IMAGE], max_tokens=10, min_tokens=10)
    pieces = list(client.stream(PROMPT, [IMAGE], max_tokens=10, min_tokens=10))
    assert len(pieces) > 1 and {p.sequence_index for p in pieces} == {0}
    assert "".join(p.text for p in pieces) == full.text
    assert [t for p in pieces for t in p.token_ids] == full.output_ids[0]


def test_exclude_input_in_output_default(triton_server):
    client = _client(triton_server, "grpc")
    answer = client.generate(PROMPT, [IMAGE], max_tokens=6)
    whole = client.generate(PROMPT, [IMAGE], max_tokens=6, exclude_input_in_output=False)
    server_default = client.generate(PROMPT, [IMAGE], max_tokens=6, exclude_input_in_output=None)
    n = len(answer.output_ids[0])
    assert len(whole.output_ids[0]) > n and whole.output_ids[0][-n:] == answer.output_ids[0]
    assert server_default.output_ids == whole.output_ids  # the server's default is False


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_beam_search_returns_ranked_sequences(triton_server, protocol):
    r = _client(triton_server, protocol).generate(PROMPT, [IMAGE], max_tokens=6, beam_width=3,
                                                  num_return_sequences=2, return_log_probs=True)
    assert len(r.texts) == len(r.output_ids) == len(r.sequence_lengths) == 2
    assert r.cum_log_probs is not None and len(r.cum_log_probs) == 2
    assert r.cum_log_probs[0] >= r.cum_log_probs[1]  # best first
    assert r.output_log_probs is not None and len(r.output_log_probs) == 2


def test_inline_image_tag(triton_server):
    prompt = PROMPT.replace("<image>", inline_image(IMAGE))
    for protocol in PROTOCOLS:
        r = _client(triton_server, protocol).generate(prompt, max_tokens=4)
        assert len(r.texts) == 1 and r.sequence_lengths[0] >= 1 and r.dropped_images == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_errors_carry_the_message(triton_server, protocol):
    client = _client(triton_server, protocol)
    with pytest.raises(VLMClientError) as e:
        client.generate(PROMPT, [IMAGE], max_tokens=0)
    assert "max_tokens" in e.value.message
    if protocol == "http":
        assert e.value.status == 400
    with pytest.raises(VLMClientError) as e:
        list(client.stream(PROMPT, [IMAGE], max_tokens=0))
    assert "max_tokens" in e.value.message
    with pytest.raises(VLMClientError) as e:
        _client(triton_server, protocol, model="no_such_model").generate("hi", max_tokens=2)
    assert "no_such_model" in e.value.message
    if protocol == "http":
        assert e.value.status == 404


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stream_closed_early_then_next_request(triton_server, protocol):
    client = _client(triton_server, protocol)
    it = client.stream(PROMPT, [IMAGE], max_tokens=30, min_tokens=30)
    first = next(it)
    it.close()
    assert first.text is not None
    assert client.generate(PROMPT, [IMAGE], max_tokens=3).sequence_lengths[0] >= 1


def test_concurrent_requests_from_threads(triton_server):
    client = _client(triton_server, "grpc")
    expected = client.generate(PROMPT, [IMAGE], max_tokens=5).output_ids
    results, errors = [], []

    def run():
        try:
            results.append(client.generate(PROMPT, [IMAGE], max_tokens=5).output_ids)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and results == [expected] * 3


# ---------------------------------------------------------------- the CLI as a subprocess


def _cli(server, protocol, *args, timeout=120):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    cmd = [sys.executable, "-m", "triton_vlm_client", *args, "--protocol", protocol, "--url", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_json_and_stream(triton_server, protocol, image_file):
    expected = _client(triton_server, protocol).generate(PROMPT, [IMAGE], max_tokens=5)
    # no marker in the prompt: the CLI prepends "<image>\n"
    prompt = PROMPT.replace("<image>\n", "")
    prepended = _client(triton_server, protocol).generate("<image>\n" + prompt, [IMAGE], max_tokens=5)
    proc = _cli(triton_server, protocol, prompt, "--image", str(image_file), "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == prepended.to_dict()
    proc = _cli(triton_server, protocol, PROMPT, "--image", str(image_file), "--max-tokens", "5", "--stream")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected.text + "\n"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_exit_codes(triton_server, protocol, image_file, tmp_path):
    proc = _cli(triton_server, protocol, PROMPT, "--image", str(image_file), "--max-tokens", "0")
    assert proc.returncode == 1 and "max_tokens" in proc.stderr and proc.stdout == ""
    proc = _cli(triton_server, protocol, PROMPT, "--image", str(tmp_path / "missing.png"))
    assert proc.returncode == 2 and "missing.png" in proc.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_lora_name_from_the_client_and_the_cli(triton_server, protocol, tmp_path):
    """The demo's `french` adapter by name, from the Python API (streamed too) and the CLI."""
    import io
    import random

    from triton_vlm.demo.shapes import draw

    buf = io.BytesIO()
    draw("square", "red", (96, 96), random.Random(5)).save(buf, "PNG")
    question = "USER: <image>\nWhat color is the shape? ASSISTANT:"
    client = _client(triton_server, protocol)
    assert client.generate(question, [buf.getvalue()], max_tokens=8).text.strip() == "red"
    assert client.generate(question, [buf.getvalue()], max_tokens=8, lora_name="french").text.strip() == "rouge"
    pieces = client.stream(question, [buf.getvalue()], max_tokens=8, lora_name="sentence")
    assert "".join(p.text for p in pieces).strip() == "The color is red."
    image = tmp_path / "red.png"
    image.write_bytes(buf.getvalue())
    proc = _cli(triton_server, protocol, question, "--image", str(image), "--max-tokens", "8", "--lora-name",
                "french")
    assert proc.returncode == 0 and proc.stdout.strip() == "rouge", proc.stderr
    proc = _cli(triton_server, protocol, question, "--image", str(image), "--lora-task-id", "999")
    assert proc.returncode == 1 and "LoRA task 999 not found in cache" in proc.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_lora_dir_sends_the_adapter_then_the_id_alone(triton_server, protocol, demo_adapters, tmp_path):
    """--lora-dir: the client reads the adapter (PEFT folder, or TensorRT-LLM's .npy pair) with numpy only and
    sends it with the task id; the id alone then finds it in the server's cache."""
    import io
    import random

    from triton_vlm.demo.shapes import draw
    from triton_vlm.lora.convert import main as convert

    buf = io.BytesIO()
    draw("circle", "blue", (96, 96), random.Random(7)).save(buf, "PNG")
    question = "USER: <image>\nWhat color is the shape? ASSISTANT:"
    task = {"grpc": 5001, "http": 5002}[protocol]
    client = _client(triton_server, protocol)
    if protocol == "http":  # the generate extension cannot carry FP16 tensors: gRPC sends, HTTP uses the id
        with pytest.raises(ValueError, match="lora_dir needs protocol 'grpc'"):
            client.generate(question, [buf.getvalue()], lora_dir=demo_adapters / "french", lora_task_id=task)
    sender = _client(triton_server, "grpc")
    assert sender.generate(question, [buf.getvalue()], max_tokens=8, lora_dir=demo_adapters / "french",
                           lora_task_id=task).text.strip() == "bleu"
    assert client.generate(question, [buf.getvalue()], max_tokens=8, lora_task_id=task).text.strip() == "bleu"
    npy = tmp_path / "npy"
    assert convert(["-i", str(demo_adapters / "sentence"), "-o", str(npy)]) == 0
    image = tmp_path / "blue.png"
    image.write_bytes(buf.getvalue())
    proc = _cli(triton_server, "grpc", question, "--image", str(image), "--max-tokens", "12", "--lora-dir",
                str(npy), "--lora-task-id", str(task + 10))
    assert proc.returncode == 0 and proc.stdout.strip() == "The color is blue.", proc.stderr
    with pytest.raises(ValueError, match="lora_dir needs a lora_task_id"):
        client.generate(question, [buf.getvalue()], lora_dir=npy)
