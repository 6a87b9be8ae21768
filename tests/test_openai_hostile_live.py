"""The OpenAI front end under hostile clients, live (issue 24, item 4): the real front end (in-process uvicorn)
against the session's tritonserver, driven by the official openai client and raw sockets: a 256 MB body without a
key refused unread, a stream cancelled when its client leaves before its first chunk, a failing prompt cancelling
the call's others, engine requests counted against --max-concurrent-requests, continuous streamed `text_offset`,
no paths in /v1/models, image URLs checked and counted. The pure parts are in test_openai_hostile.py."""
from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest

from metrics_support import after_next_refresh
from test_openai import base_config, start  # noqa: F401 - fixtures: front ends on the session's server
from test_openai_hostile import MiB, image_server, post_raw  # noqa: F401 - image_server is a fixture

pytestmark = pytest.mark.server


# --- live: the real front end against the session's tritonserver --------------------------------------------------
@pytest.fixture(scope="module")
def fe(start):
    return start()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10


def test_live_256mb_body_without_key_is_refused_unread(start):
    fe = start(api_key="s3cret")  # in this process: its RSS is the front end's
    before = _rss()
    status, body, sent, elapsed = post_raw(fe.port, "/v1/chat/completions", 256 * MiB)
    grown = _rss() - before
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert sent == 0 and elapsed < 5 and grown < 16 * MiB, (sent, elapsed, grown)  # was: 257 MB read, 1.5 s
    key = {"Authorization": "Bearer s3cret"}
    status, body, sent, _ = post_raw(fe.port, "/v1/chat/completions", 33 * MiB, key)  # default limit 32 MiB
    assert status == 413 and sent == 0 and "--max-request-bytes" in body["error"]["message"], body
    status, body, sent, _ = post_raw(fe.port, "/v1/completions", 64 * MiB, key, chunked=True)
    assert status == 413 and sent < 48 * MiB, (status, sent)
    assert _rss() - before < 48 * MiB  # at most the limit was taken in


def _engine(triton_server) -> dict[str, float]:
    from test_openai import engine_metrics

    return engine_metrics(triton_server)


def _wait(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_stream_whose_client_leaves_before_its_first_chunk_is_cancelled(fe, triton_server):
    # beam search with logprobs streams only at its end: its first chunk waits for the whole generation
    request = {"model": "demo-v3", "prompt": "USER: Say hello. ASSISTANT:", "stream": True, "logprobs": 0,
               "use_beam_search": True, "best_of": 8, "ignore_eos": True}
    _wait(lambda: _engine(triton_server).get("running", 1.0) == 0.0, 60, "the engine idle first")
    before = _engine(triton_server)
    body = json.dumps(request).encode()
    sock = socket.create_connection(("127.0.0.1", fe.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait(lambda: _engine(triton_server).get("running", 0.0) >= 1, 30, "the request reached the engine")
    sock.close()  # the client goes away before any chunk
    t0 = time.monotonic()
    _wait(lambda: _engine(triton_server).get("cancelled", 0.0) >= before.get("cancelled", 0.0) + 1, 10,
          "the engine's request cancelled")
    _wait(lambda: _engine(triton_server).get("running", 1.0) == 0.0, 10, "the engine idle again")
    after = _engine(triton_server)
    assert after.get("success", 0.0) == before.get("success", 0.0), "it ran to the end"
    assert time.monotonic() - t0 < 10


def test_a_failing_prompt_cancels_the_calls_other_prompts(fe, triton_server):
    c = fe.client()
    _wait(lambda: _engine(triton_server).get("running", 1.0) == 0.0, 60, "the engine idle first")
    before = _engine(triton_server)
    bad = 'USER: <img src="data:image/png;base64,AAAA"> What is it? ASSISTANT:'
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="demo-v3", prompt=["USER: Say hello. ASSISTANT:", bad], n=16, temperature=1.0,
                             extra_body={"ignore_eos": True})  # the good one: 16 rows to the context's end
    after_next_refresh(triton_server.metrics_url)  # the running gauge from now on, not from before the request
    _wait(lambda: _engine(triton_server).get("running", 1.0) == 0.0, 10, "the engine idle again")
    after = _engine(triton_server)
    assert after.get("success", 0.0) == before.get("success", 0.0), "the other prompt ran on"


def test_every_engine_request_counts_against_max_concurrent_requests(start):
    fe = start(max_concurrent_requests=2)
    c = fe.client()
    with pytest.raises(openai.BadRequestError) as e:  # 3 prompts: 3 engine requests, never within 2
        c.completions.create(model="demo-v3", prompt=["USER: Say hello. ASSISTANT:"] * 3, max_tokens=2)
    assert e.value.body["code"] == "too_many_prompts" and "--max-concurrent-requests 2" in e.value.body["message"]
    stream = c.chat.completions.create(model="demo-v3", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:  # 1 running + 2 prompts > 2
            c.completions.create(model="demo-v3", prompt=["USER: Say hello. ASSISTANT:"] * 2, max_tokens=2)
        assert e.value.body["code"] == "too_many_requests", e.value.body
        out = c.completions.create(model="demo-v3", prompt=["USER: Say hello. ASSISTANT:"], max_tokens=2)
        assert out.choices[0].text
    finally:
        stream.close()


def test_streamed_completion_text_offset_is_continuous(fe):
    c = fe.client()
    kw = dict(model="demo-v3", prompt="USER: Say hello. ASSISTANT:", max_tokens=24, logprobs=1,
              extra_body={"ignore_eos": True})
    tokens, offsets, text = [], [], ""
    for chunk in c.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    assert len(tokens) == 24 and "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))], offsets
    full = c.completions.create(**kw).choices[0]
    assert full.text == text and full.logprobs.text_offset == offsets


def test_models_show_no_paths_and_unknown_models_list_none(fe, demo_model, demo_adapters):
    c = fe.client()
    cards = c.models.list().model_dump_json()
    assert str(demo_model) not in cards and str(demo_adapters) not in cards and "/" not in cards, cards
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    message = e.value.body["message"]
    assert "no-such-adapter" in message and "french" not in message and "sentence" not in message, message


def test_live_image_urls_are_checked_and_counted(start, image_server):
    port = image_server.port
    strict = start(allowed_image_domains=("127.0.0.1", "localhost"), image_ports=(port,)).client()
    url = f"http://localhost:{port}/shape.png"

    def ask(client, n):
        return client.chat.completions.create(model="demo-v3", max_tokens=4, messages=[{"role": "user", "content": [
            *[{"type": "image_url", "image_url": {"url": url}}] * n, {"type": "text", "text": "What is it?"}]}])

    with pytest.raises(openai.BadRequestError) as e:  # localhost resolves to loopback: refused
        ask(strict, 1)
    assert "could not be fetched" in e.value.body["message"] and image_server.hits == []
    with pytest.raises(openai.BadRequestError) as e:  # the preprocess model's max_images is 8
        ask(strict, 9)
    assert "9 images; at most 8" in e.value.body["message"] and image_server.hits == []
    private = start(allowed_image_domains=("localhost",), image_ports=(port,), allow_private_image_hosts=True)
    assert ask(private.client(), 1).choices[0].message.content is not None and image_server.hits == ["/shape.png"]
