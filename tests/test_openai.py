"""The OpenAI-compatible front end against the live server, through the official `openai` client (sync, async,
streaming): images answered right, adapters by name, n, beam search and log probs equal to the ensemble's, usage,
stop strings, every error status, disconnects cancelling the engine's request, 32+ concurrent chats.

Each front end runs in-process (uvicorn on a thread, free port) against the session's tritonserver; the CLI
entry point is started once as a subprocess.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest

from triton_vlm.demo.shapes import QUESTION_COLOR, QUESTION_DESCRIBE, QUESTION_SHAPE, answer, draw
from triton_vlm.openai import FrontendConfig, build_app
from triton_vlm.server.process import free_port
from triton_vlm.openai.errors import strip_triton_prefix
from triton_vlm_client import VLMClient, VLMClientError

pytestmark = pytest.mark.server
PROMPT = "USER: Say hello. ASSISTANT:"


class Running:
    """A front end served by uvicorn on a thread of this process."""

    def __init__(self, config: FrontendConfig):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the OpenAI front end did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=kw.pop("timeout", 60), **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve_api(tmp_path_factory, model, name: str):
    """A generator for a module fixture: a live tritonserver on `model` and a front end on it, (front end, server);
    both stopped after the module."""
    from conftest import _start_server, _stop_server

    server = _start_server(tmp_path_factory, model, {}, name)
    try:
        fe = Running(FrontendConfig(triton=server.grpc_url, model_dir=model,
                                    triton_metrics_url=f"http://localhost:{server.metrics_port}/metrics"))
    except BaseException:
        _stop_server(server)
        raise
    yield fe, server
    fe.stop()
    _stop_server(server)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def base_config(triton_server, demo_model, demo_adapters) -> FrontendConfig:
    return FrontendConfig(triton=triton_server.grpc_url, model_dir=demo_model, lora_dir=demo_adapters,
                          triton_metrics_url=f"http://localhost:{triton_server.metrics_port}/metrics")


@pytest.fixture(scope="module")
def start(base_config):
    running = []

    def _start(**changes) -> Running:
        running.append(Running(replace(base_config, **changes)))
        return running[-1]

    yield _start
    for r in running:
        r.stop()


@pytest.fixture(scope="module")
def fe(start) -> Running:
    return start()


@pytest.fixture(scope="module")
def client(fe) -> openai.OpenAI:
    return fe.client()


@pytest.fixture(scope="module")
def ensemble(triton_server):
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=60) as c:
        yield c


def png(shape: str, color: str, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    draw(shape, color, (96, 96), random.Random(seed)).save(buf, fmt)
    return buf.getvalue()


def image_message(data: bytes, question: str, mime: str = "image/png") -> list[dict]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def chat(client, messages, model="demo-v3", **kw):
    return client.chat.completions.create(model=model, messages=messages, **kw)


# --- models, images, adapters ------------------------------------------------------------------------------
def test_models_lists_the_base_model_and_every_adapter(client, demo_adapters):
    cards = {m.id: m for m in client.models.list().data}
    folders = [n for n in os.listdir(demo_adapters) if not n.startswith(".")]  # the registry skips hidden ones
    assert set(cards) == {"demo-v3", *folders} and {"french", "sentence"} <= set(cards)
    assert cards["french"].model_extra["parent"] == "demo-v3" and cards["demo-v3"].model_extra["parent"] is None
    # the precision served (FP8 servers: test_qwen_vl_openai.py, test_hub_layout.py): an fp32 checkpoint, held so
    assert (cards["demo-v3"].model_extra["weights"], cards["demo-v3"].model_extra["held"]) == ("unquantized",
                                                                                             "float32")
    assert "held" not in cards["french"].model_extra  # an adapter's card: its base's says it


@pytest.mark.parametrize("shape,color,seed", [("circle", "red", 11), ("square", "blue", 12),
                                              ("triangle", "green", 13), ("square", "yellow", 14)])
def test_images_answered_right(client, shape, color, seed):
    img = png(shape, color, seed)
    for question in (QUESTION_COLOR, QUESTION_SHAPE, QUESTION_DESCRIBE):
        r = chat(client, image_message(img, question))
        assert r.choices[0].message.content == answer(question, shape, color)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("fmt,mime", [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_image_formats(client, fmt, mime):
    r = chat(client, image_message(png("circle", "blue", 3, fmt), QUESTION_DESCRIBE, mime))
    assert r.choices[0].message.content == " a blue circle"


def test_adapters_by_model_name_equal_the_ensemble(client, ensemble):
    img = png("circle", "red", 1)
    for name, expected in (("french", " rouge"), ("sentence", None)):
        r = chat(client, image_message(img, QUESTION_COLOR), model=name)
        direct = ensemble.generate("USER: <image>\nWhat color is the shape? ASSISTANT:", [img], max_tokens=32,
                                   lora_name=name)
        assert r.choices[0].message.content == direct.text and r.model == name
        if expected:
            assert r.choices[0].message.content == expected
    assert "red" in chat(client, image_message(img, QUESTION_COLOR), model="sentence").choices[0].message.content


def test_usage_counts_image_tokens(client, ensemble):
    img = png("square", "green", 2)
    r = chat(client, image_message(img, QUESTION_COLOR))
    direct = ensemble.generate("USER: <image>\nWhat color is the shape? ASSISTANT:", [img], max_tokens=32,
                               return_num_input_tokens=True)
    assert r.usage.prompt_tokens == direct.num_input_tokens > 16  # 16 image tokens + the text
    assert r.usage.completion_tokens == direct.sequence_lengths[0]  # the end token included
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


# --- streaming ---------------------------------------------------------------------------------------------
def test_stream_equals_unstreamed_with_role_first_and_usage_last(client):
    messages = [{"role": "user", "content": "What colors do you know?"}]
    full = chat(client, messages, max_tokens=12)
    chunks = list(chat(client, messages, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and len(text) > 5
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_streams(fe):
    async def run():
        c = fe.async_client()
        stream = await c.chat.completions.create(model="demo-v3", stream=True, messages=image_message(
            png("triangle", "yellow", 5), QUESTION_DESCRIBE))
        return "".join([ch.choices[0].delta.content or "" async for ch in stream])
    assert asyncio.run(run()) == " a yellow triangle"


def test_32_concurrent_chats_all_right(fe):
    combos = [(s, c, q) for s in ("circle", "square", "triangle") for c in ("red", "green", "blue", "yellow")
              for q in (QUESTION_COLOR, QUESTION_DESCRIBE)]
    cases = [combos[i % len(combos)] for i in range(36)]

    async def one(c, i, shape, color, question):
        kw = dict(model="sentence" if i % 6 == 5 else "demo-v3",
                  messages=image_message(png(shape, color, i), question))
        if i % 2:
            stream = await c.chat.completions.create(stream=True, **kw)
            return kw["model"], "".join([ch.choices[0].delta.content or "" async for ch in stream])
        return kw["model"], (await c.chat.completions.create(**kw)).choices[0].message.content

    async def run():
        c = fe.async_client()
        return await asyncio.gather(*(one(c, i, *case) for i, case in enumerate(cases)))

    results = asyncio.run(run())
    assert len(results) == 36
    for (model, text), (shape, color, question) in zip(results, cases):
        if model == "demo-v3":
            assert text == answer(question, shape, color)
        else:
            assert color in text


# --- n, beam search, log probs, stop -----------------------------------------------------------------------
def test_n_samples_and_greedy_copies(client):
    messages = [{"role": "user", "content": "Say hello."}]
    r = chat(client, messages, n=4, temperature=1.8, seed=7, max_tokens=6, extra_body={"min_tokens": 6})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1 and r.usage.completion_tokens == 24
    again = chat(client, messages, n=4, temperature=1.8, seed=7, max_tokens=6, extra_body={"min_tokens": 6})
    assert [c.message.content for c in again.choices] == texts  # seeded
    streamed: dict[int, str] = {}
    for chunk in chat(client, messages, n=4, temperature=1.8, seed=7, max_tokens=6, stream=True,
                      extra_body={"min_tokens": 6}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts
    greedy = chat(client, messages, n=3, temperature=0)
    assert [c.message.content for c in greedy.choices] == [" hello"] * 3
    chunks = [c for chunk in chat(client, messages, n=3, stream=True) for c in chunk.choices]
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert ["".join(c.delta.content or "" for c in chunks if c.index == i) for i in range(3)] == [" hello"] * 3


def test_beam_search_equals_the_ensemble(client, ensemble):
    kw = dict(beam_width=4, num_return_sequences=3, length_penalty=0.5, max_tokens=6, min_tokens=6)
    direct = ensemble.generate(PROMPT, **kw)
    r = client.completions.create(model="demo-v3", prompt=PROMPT, n=3, max_tokens=6, extra_body=dict(
        use_beam_search=True, best_of=4, length_penalty=0.5, min_tokens=6))
    assert [c.text for c in r.choices] == direct.texts and len(set(direct.texts)) == 3
    img = png("circle", "green", 4)
    direct = ensemble.generate("USER: <image>\nDescribe the image. ASSISTANT:", [img], beam_width=3,
                               num_return_sequences=2, max_tokens=8, early_stopping=True)
    r = chat(client, image_message(img, QUESTION_DESCRIBE), n=2, max_tokens=8,
             extra_body=dict(use_beam_search=True, best_of=3, early_stopping=True))
    assert [c.message.content for c in r.choices] == direct.texts


def test_logprobs_join_to_the_text_and_equal_the_ensemble(client, ensemble):
    kw = dict(max_tokens=8, min_tokens=8)
    direct = ensemble.generate(PROMPT, return_log_probs=True, **kw)
    r = chat(client, [{"role": "user", "content": "Say hello."}], logprobs=True, max_tokens=8,
             extra_body={"min_tokens": 8})
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content == direct.text
    assert [t.logprob for t in content] == pytest.approx(direct.output_log_probs[0][:len(content)], abs=1e-5)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    streamed = list(chat(client, [{"role": "user", "content": "Say hello."}], logprobs=True, stream=True,
                         max_tokens=8, extra_body={"min_tokens": 8}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in tokens] == [(t.token, t.logprob) for t in content]
    top = chat(client, [{"role": "user", "content": "What colors do you know?"}], logprobs=True, top_logprobs=3)
    assert "".join(t.token for t in top.choices[0].logprobs.content) == " red green blue yellow"
    for t in top.choices[0].logprobs.content:  # greedy, no processors: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    comp = client.completions.create(model="demo-v3", prompt=PROMPT, logprobs=0, **{"max_tokens": 8},
                                     extra_body={"min_tokens": 8})
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text == direct.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_stop_strings_cut_the_text_streamed_or_not(client):
    messages = image_message(png("circle", "red", 6), QUESTION_DESCRIBE)  # " a red circle"
    for stop, expected in ((" circle", " a red"), (["ed", "zz"], " a r"), ("nothing", " a red circle")):
        r = chat(client, messages, stop=stop)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, messages, stop=stop, stream=True)
                           if c.choices)
        assert r.choices[0].message.content == streamed == expected
        assert r.choices[0].finish_reason == "stop"
    r = chat(client, [{"role": "user", "content": "Say hello."}], max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_completions_batch_echo_and_inline_image(client):
    r = client.completions.create(model="demo-v3", prompt=[PROMPT, "USER: Say goodbye. ASSISTANT:"], n=2,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [" hello", " hello", " goodbye", " goodbye"]
    assert client.completions.create(model="demo-v3", prompt=PROMPT, echo=True).choices[0].text == PROMPT + " hello"
    b64 = base64.b64encode(png("square", "red", 8)).decode()
    inline = f'USER: <img src="data:image/png;base64,{b64}">\nWhat shape is this? ASSISTANT:'
    assert client.completions.create(model="demo-v3", prompt=inline).choices[0].text == " square"


# --- errors ------------------------------------------------------------------------------------------------
def status_of(fn) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    body = e.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return e.value.status_code, body


def test_invalid_requests_are_400_with_openai_errors(client, fe, ensemble):
    img = png("circle", "red")
    cases = [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user", "content": "hi"}], temperature="hot"), "temperature"),
        (dict(messages=[{"role": "user", "content": "hi"}], extra_body={"frobnicate": 1}), "unrecognized"),
        (dict(messages=[{"role": "tool", "content": "hi"}]), "role"),
        (dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
            "name": "f"}}]), "tools"),
        (dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "yaml"}),
         "response_format"),
        (dict(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), "input_audio"),
        (dict(messages=[{"role": "user", "content": "look: <image>"}]), "<image>"),
        (dict(messages=image_message(b"not an image at all", "?")), "PNG, JPEG"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,@@@"}}]}]), "base64"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "http://example.com/a.png"}}]}]), "--allowed-image-domains"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "file:///etc/passwd"}}]}]), "not accepted"),
        (dict(messages=[{"role": "user", "content": "hi"}], n=99), "n must be"),
        (dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "top_logprobs"),
        (dict(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21), "top_logprobs"),
    ]
    for kw, needle in cases:
        kw.setdefault("model", "demo-v3")
        status, body = status_of(lambda: client.chat.completions.create(**kw))
        assert status == 400 and needle in body["message"] and body["type"] == "invalid_request_error", (kw, body)
    # the project's INVALID_ARG messages pass through unchanged
    with pytest.raises(VLMClientError) as direct:
        ensemble.generate("USER: <image>\nhi ASSISTANT:", [img], max_tokens=600)
    status, body = status_of(lambda: chat(client, image_message(img, "hi"), max_tokens=600))
    assert status == 400 and body["message"] == strip_triton_prefix(direct.value.message)
    assert "max_tokens" in body["message"]
    status, body = status_of(lambda: client.completions.create(model="demo-v3", prompt="<image> hi"))
    assert status == 400 and "<image> markers" in body["message"]
    req = urllib.request.Request(fe.url + "/v1/chat/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400


def test_unknown_model_is_404(client):
    status, body = status_of(lambda: chat(client, [{"role": "user", "content": "hi"}], model="gpt-4o"))
    assert status == 404 and body["code"] == "model_not_found"


def test_api_key_401(start):
    secured = start(api_key="s3cret")
    status, body = status_of(lambda: secured.client(api_key="wrong").models.list())
    assert status == 401 and body["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as e:  # no Authorization header at all
        urllib.request.urlopen(secured.url + "/v1/models", timeout=10)
    assert e.value.code == 401 and b"Missing bearer token" in e.value.read()
    r = secured.client(api_key="s3cret").chat.completions.create(
        model="demo-v3", messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content == " hello"
    # /health and /metrics tell the deployment's state and the adapters in use: the key too
    for path in ("/health", "/metrics", "/nonexistent"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(secured.url + path, timeout=10)
        body = e.value.read()
        assert e.value.code == 401 and b"Missing bearer token" in body, path
        assert b"lora" not in body and b"localhost" not in body and b"triton" not in body.lower(), body
    keyed = {"Authorization": "Bearer s3cret"}
    with urllib.request.urlopen(urllib.request.Request(secured.url + "/health", headers=keyed), timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}  # no internal address
    with urllib.request.urlopen(urllib.request.Request(secured.url + "/metrics", headers=keyed), timeout=10) as resp:
        assert resp.status == 200 and b"triton_vlm_openai_requests_total" in resp.read()


def test_triton_unreachable_is_503(start, base_config):
    port, metrics_port = free_port(), free_port()
    dead = start(triton=f"localhost:{port}", triton_metrics_url=f"http://localhost:{metrics_port}/metrics",
                 startup_timeout_s=0.0)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(dead.url + "/health", timeout=30)
    assert e.value.code == 503
    assert json.loads(e.value.read()) == {"status": "unavailable"}  # Triton's address is not the client's business
    status, body = status_of(lambda: chat(dead.client(), [{"role": "user", "content": "hi"}]))
    assert status == 503 and body["type"] == "service_unavailable"
    assert str(port) not in body["message"], body
    with urllib.request.urlopen(dead.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "# Triton metrics unavailable (URLError)" in text and str(metrics_port) not in text, text


def test_no_chat_template_is_400_until_one_is_given(start, demo_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(demo_model, bare)
    (bare / "chat_template.jinja").unlink()
    fe = start(model_dir=bare)
    status, body = status_of(lambda: chat(fe.client(), [{"role": "user", "content": "Say hello."}], model="bare"))
    assert status == 400 and "/v1/completions" in body["message"] and "--chat-template" in body["message"]
    assert fe.client().completions.create(model="bare", prompt=PROMPT).choices[0].text == " hello"
    template = tmp_path / "t.jinja"
    template.write_text((demo_model / "chat_template.jinja").read_text())
    r = chat(start(model_dir=bare, chat_template=template).client(),
             image_message(png("square", "blue", 9), QUESTION_COLOR), model="bare")
    assert r.choices[0].message.content == " blue"


def test_http_images_only_from_allowed_domains(start):
    data = png("triangle", "red", 10)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(3)
            body = data if self.path != "/big.png" else data * 200
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        host = f"http://127.0.0.1:{httpd.server_address[1]}"
        fe = start(allowed_image_domains=("127.0.0.1",), max_image_bytes=20_000, image_fetch_timeout_s=1.0,
                   image_ports=(httpd.server_address[1],), allow_private_image_hosts=True)  # a loopback server
        c = fe.client()

        def ask(url):
            return chat(c, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": QUESTION_DESCRIBE}]}])
        assert ask(host + "/shape.png").choices[0].message.content == " a red triangle"
        for path, needle in (("/big.png", "at most 20000"), ("/slow.png", "could not be fetched")):
            status, body = status_of(lambda: ask(host + path))
            assert status == 400 and needle in body["message"], body
        status, body = status_of(lambda: ask(f"http://localhost:{httpd.server_address[1]}/shape.png"))
        assert status == 400 and "not allowed" in body["message"]
    finally:
        httpd.shutdown()


def test_requests_beyond_max_concurrent_are_429_at_once(start):
    # the front end's bound on requests in flight (the Triton stages before the llm have no queue bound)
    fe = start(max_concurrent_requests=1)
    c = fe.client()
    stream = c.chat.completions.create(model="demo-v3", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the first request is being served (streaming)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="demo-v3", prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 429 and e.value.body["code"] == "too_many_requests", e.value.body
        assert "--max-concurrent-requests 1" in e.value.body["message"], e.value.body
        assert time.monotonic() - t0 < 5, "refused at once, not queued"
    finally:
        stream.close()
    deadline = time.monotonic() + 30  # the closed stream gives its place back
    while True:
        try:
            out = c.completions.create(model="demo-v3", prompt=PROMPT, max_tokens=4)
            break
        except openai.APIStatusError as e:
            assert e.status_code == 429 and time.monotonic() < deadline, e.body
            time.sleep(0.2)
    assert out.choices[0].text
    metrics = urllib.request.urlopen(fe.url + "/metrics", timeout=10).read().decode()
    assert re.search(r'triton_vlm_openai_requests_total\{[^}]*status="429"[^}]*\} [1-9]', metrics), metrics


# --- cancellation, metrics, CLI ----------------------------------------------------------------------------
def engine_metrics(triton_server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://localhost:{triton_server.metrics_port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        m = re.match(r'^(triton_vlm_requests_total)\{.*outcome="(\w+)".*\} (\S+)$', line)
        if m:
            out[m.group(2)] = float(m.group(3))
        m = re.match(r"^(triton_vlm_engine_running_requests)\{.*\} (\S+)$", line)
        if m:
            out["running"] = float(m.group(2))
    return out


def wait_for(check, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_disconnect_cancels_the_request_in_the_engine(client, fe, triton_server):
    long = dict(model="demo-v3", messages=[{"role": "user", "content": "Say hello."}], n=16, temperature=1.0,
                extra_body={"ignore_eos": True})  # 16 rows x ~500 tokens, over a second on the demo model
    before = engine_metrics(triton_server).get("cancelled", 0.0)
    stream = client.chat.completions.create(stream=True, **long)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: engine_metrics(triton_server).get("cancelled", 0.0) >= before + 1)
    with pytest.raises(openai.APITimeoutError):  # an unstreamed request whose client gives up
        fe.client(timeout=0.3).chat.completions.create(**long)
    wait_for(lambda: engine_metrics(triton_server).get("cancelled", 0.0) >= before + 2)
    wait_for(lambda: engine_metrics(triton_server).get("running", 1.0) == 0.0)


def test_metrics_and_health(fe, client):
    chat(client, [{"role": "user", "content": "Say hello."}])
    text = urllib.request.urlopen(fe.url + "/metrics", timeout=10).read().decode()
    for name in ("nv_inference_request_success", "triton_vlm_engine_running_requests",
                 'triton_vlm_openai_requests_total{endpoint="chat",status="200"}',
                 "triton_vlm_openai_request_seconds_bucket", "triton_vlm_openai_prompt_tokens_total"):
        assert name in text, name
    assert urllib.request.urlopen(fe.url + "/health", timeout=10).status == 200


def test_command_line_entry_point(triton_server, demo_model, demo_adapters):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triton_vlm.openai", "--triton", triton_server.grpc_url,
                             "--model-dir", str(demo_model), "--port", str(port), "--host", "127.0.0.1",
                             "--served-model-name", "shapes", "--log-level", "warning"])
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10)
        deadline = time.monotonic() + 120
        while True:
            try:
                ids = [m.id for m in c.models.list().data]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.25)
        assert ids == ["shapes", "french", "sentence"]  # adapters from the server's own lora_dir
        r = c.chat.completions.create(model="shapes", messages=[{"role": "user", "content": "Say goodbye."}])
        assert r.choices[0].message.content == " goodbye"
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
