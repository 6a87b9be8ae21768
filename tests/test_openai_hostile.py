"""The OpenAI front end under hostile clients (issue 24, items 4 and 5), without a server: request bodies refused
before they are read (API key first, then --max-request-bytes; the guard in front of a small app), stop strings and
log probs linear in the text, a failing awaitable cancelling the others, image URLs that may not reach the server's
network and are counted before any fetch, and the KV gauge admission reads. The live tests, against the real front
end and tritonserver, are in test_openai_hostile_live.py.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from metrics_support import fake_llm_metrics
from triton_vlm.openai.aio import gather_all
from triton_vlm.openai.choices import Choice, StopMatcher
from triton_vlm.openai.errors import APIError, install_handlers
from triton_vlm.openai.fetch import address_allowed
from triton_vlm.openai.guard import RequestGuard
from triton_vlm.openai.media import MediaPolicy
from triton_vlm.server.process import free_port

MiB = 1 << 20


# --- raw HTTP: a client that sends a body only while the server has not answered -----------------------------
def post_raw(port: int, path: str, length: int, headers: dict | None = None, chunked: bool = False,
             wait_s: float = 0.5) -> tuple[int, dict, int, float]:
    """POST `length` bytes (JSON whitespace, 1 MiB at a time, never held whole) to 127.0.0.1:port, stopping as
    soon as the server answers. Returns (status, JSON body, bytes the server took in, seconds to the answer)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    t0, sent, block = time.monotonic(), 0, b" " * MiB
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        select.select([sock], [], [], wait_s)  # a server that answers from the headers does so now
        while sent < length and not select.select([sock], [], [], 0)[0]:
            n = min(MiB, length - sent)
            sock.sendall(b"%x\r\n%s\r\n" % (n, block[:n]) if chunked else block[:n])
            sent += n
        if chunked and sent >= length and not select.select([sock], [], [], 0)[0]:
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed the connection
    status, body = _read_response(sock)
    elapsed = time.monotonic() - t0
    sock.close()
    return status, body, sent, elapsed


def _read_response(sock) -> tuple[int, dict]:
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, json.loads(body[:_length(data)] or b"{}")


def _length(data: bytes) -> int:
    m = re.search(rb"(?i)content-length: *(\d+)", data.split(b"\r\n\r\n", 1)[0])
    return int(m.group(1)) if m else 0


class Served:
    """An ASGI app served by uvicorn on a thread of this process."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def guarded():
    """A small app behind the guard (key "k", 1 MiB), counting the bodies its endpoint parsed."""
    from fastapi import FastAPI

    app, parsed = FastAPI(), []

    @app.post("/v1/echo")
    async def echo(body: dict):
        parsed.append(len(json.dumps(body)))
        return {"keys": sorted(body)}

    install_handlers(app)
    app.add_middleware(RequestGuard, api_key="k", max_bytes=MiB)
    served = Served(app)
    served.parsed = parsed
    yield served
    served.stop()


def test_key_is_checked_before_the_body_is_read(guarded):
    status, body, sent, elapsed = post_raw(guarded.port, "/v1/echo", 256 * MiB)
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert sent == 0 and elapsed < 5, (sent, elapsed)  # answered from the headers: no byte of the body sent
    status, body, sent, _ = post_raw(guarded.port, "/v1/echo", 256 * MiB, {"Authorization": "Bearer wrong"})
    assert status == 401 and sent == 0 and body["error"]["message"] == "Incorrect API key provided"
    assert guarded.parsed == []


def test_bodies_over_the_limit_are_413_before_parsing(guarded):
    key = {"Authorization": "Bearer k"}
    status, body, sent, _ = post_raw(guarded.port, "/v1/echo", 2 * MiB, key)  # Content-Length says it
    assert status == 413 and body["error"]["code"] == "request_too_large" and sent == 0, body
    assert f"over {MiB} bytes" in body["error"]["message"] and "--max-request-bytes" in body["error"]["message"]
    status, body, sent, _ = post_raw(guarded.port, "/v1/echo", 64 * MiB, key, chunked=True)  # counted as read
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert sent < 32 * MiB, sent  # refused once past the limit, not after the whole body
    assert guarded.parsed == []
    req = urllib.request.Request(f"http://127.0.0.1:{guarded.port}/v1/echo", json.dumps({"a": 1}).encode(),
                                 {"Authorization": "Bearer k", "Content-Type": "application/json"})
    try:
        answer = urllib.request.urlopen(req, timeout=10).read()
    except urllib.error.HTTPError as e:
        raise AssertionError(e.read()) from None
    assert json.loads(answer) == {"keys": ["a"]}
    assert guarded.parsed == [8]


# --- stop strings and log probs: linear in the text -----------------------------------------------------------
def _reference_cut(text: str, stops: list[str]):
    """The earliest-ending stop string's start (of two ending together, the longer), by brute force."""
    best = None
    for s in stops:
        i = text.find(s)
        while i >= 0:
            key = (i + len(s), -len(s))
            best = key if best is None or key < best else best
            i = text.find(s, i + 1)
    return None if best is None else best[0] + best[1]


def test_stop_matching_equals_brute_force_in_any_pieces():
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        cut = _reference_cut(text, stops)
        expected = text if cut is None else text[:cut]
        c, out, pos = Choice(0, StopMatcher(stops)), "", 0
        while pos < len(text):
            step = rng.randint(1, 5)
            out += c.feed(text[pos:pos + step].encode(), [], [])
            pos += step
        out += c.finish()
        assert out == c.text == expected and c.stopped == (cut is not None), (text, stops)


def test_long_stop_strings_cost_per_token_does_not_grow_with_them():
    # 16 stop strings of 8k characters, none of whose prefixes ends the text: a re-search of the text's tail for
    # every prefix took 47 ms a token at 8k characters (4.6 ms for one such string); linear matching ~0.02 ms
    stops = ["Q" + "ab cd " * 1365 for _ in range(16)]
    c = Choice(0, StopMatcher(stops))
    while len(c.text) < 8000:
        c.feed(b"ab cd ", [1], [])
    t0 = time.perf_counter()
    for _ in range(300):
        c.feed(b"ab cd ", [1], [])
    assert time.perf_counter() - t0 < 1.5, "300 tokens at 8k characters"  # was 14 s
    assert not c.stopped and c.text.endswith("ab cd ")


class CountingTokenizer:
    """The demo tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_logprob_token_texts_are_decoded_incrementally(demo_model):
    from transformers import AutoTokenizer

    tok = CountingTokenizer(AutoTokenizer.from_pretrained(str(demo_model)))
    ids = tok.tokenizer.encode("a red circle, and a blue square: 12.5% off! " * 60, add_special_tokens=False)[:1500]
    c, taken = Choice(0, StopMatcher([])), []
    for t in ids:
        c.feed(tok.tokenizer.decode([t]).encode(), [t], [-0.5])
        taken += c.take_tokens(tok, frozenset())
    c.finish()
    taken += c.take_tokens(tok, frozenset())
    assert "".join(t[1] for t in taken) == c.text == tok.tokenizer.decode(ids)
    assert len(taken) == len(ids) and all(t[2] == -0.5 for t in taken)
    assert tok.decoded < 30 * len(ids), tok.decoded  # a short window per token; the whole text each time: ~1.1M


# --- cancellation and fan-out -----------------------------------------------------------------------------------
def test_gather_all_cancels_the_others_when_one_fails():
    cancelled = []

    async def slow(i):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def bad():
        await asyncio.sleep(0.01)
        raise APIError(400, "bad prompt")

    async def run():
        t0 = time.monotonic()
        with pytest.raises(APIError, match="bad prompt"):
            await gather_all([slow(0), bad(), slow(2)])
        return time.monotonic() - t0

    assert asyncio.run(run()) < 5 and sorted(cancelled) == [0, 2]
    assert asyncio.run(_ok()) == [1, 2]


async def _ok():
    async def one(i):
        return i
    return await gather_all([one(1), one(2)])


# --- image URLs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("address,public", [
    ("93.184.215.14", True), ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("169.254.1.1", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("fe80::1", False), ("fd00:ec2::254", False),
    ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("ff02::1", False),
])
def test_only_public_addresses_are_fetched(address, public):
    ip = ipaddress.ip_address(address)
    assert address_allowed(ip, allow_private=False) == public
    metadata = address in ("169.254.169.254", "fd00:ec2::254")
    assert address_allowed(ip, allow_private=True) == (not metadata)  # metadata addresses: never


class ImageServer:
    """Local HTTP server: /shape.png an image, /to?u=URL a redirect to URL, /404, /slow; counts requests."""

    def __init__(self, image: bytes):
        hits = self.hits = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                if self.path.startswith("/to?u="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/to?u="):])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/slow.png":
                    time.sleep(3)
                status = 404 if self.path == "/404.png" else 200
                self.send_response(status)
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                try:
                    self.wfile.write(image)
                except OSError:
                    pass  # the client gave up (the slow image)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def image_server():
    from triton_vlm.demo.shapes import draw
    import io

    buf = io.BytesIO()
    draw("circle", "red", (96, 96), random.Random(3)).save(buf, format="PNG")
    s = ImageServer(buf.getvalue())
    s.png = buf.getvalue()
    yield s
    s.close()


def _load(policy: MediaPolicy, url: str) -> str:
    try:
        asyncio.run(policy.load(url))
    except APIError as e:
        assert e.status == 400
        return e.message.replace(url, "URL")
    return "ok"


def test_image_urls_may_not_reach_the_servers_network(image_server):
    port = image_server.port
    hosts = ("127.0.0.1", "localhost", "*.example.org")
    strict = MediaPolicy(hosts, ports=(80, 443, port), timeout_s=1.0)
    private = replace(strict, allow_private=True)
    base = f"http://127.0.0.1:{port}"
    assert asyncio.run(private.load(base + "/shape.png")) == image_server.png
    assert asyncio.run(private.load(f"http://localhost:{port}/shape.png")) == image_server.png
    # refused: a loopback literal, a name resolving to loopback, a port not allowed, a redirect to a refused
    # address or port, a metadata address even when private ones are allowed, a closed port, an error status,
    # a timeout, too many redirects: one text for all, nothing that tells them apart
    closed = free_port()
    refusals = {
        "loopback literal": _load(strict, base + "/shape.png"),
        "name -> loopback": _load(strict, f"http://localhost:{port}/shape.png"),
        "port": _load(replace(private, ports=(80, 443)), base + "/shape.png"),
        "redirect to a port": _load(private, f"{base}/to?u=http://127.0.0.1:22/x.png"),
        "redirect to a host": _load(private, f"{base}/to?u=http://169.254.169.254/latest/meta-data/"),
        "closed port": _load(replace(private, ports=(closed,)), f"http://127.0.0.1:{closed}/shape.png"),
        "status": _load(private, base + "/404.png"),
        "timeout": _load(private, base + "/slow.png"),
        "redirect loop": _load(private, f"{base}/to?u=/to?u=/to?u=/to?u=/to?u=/shape.png"),
    }
    texts = {text.split(" (images are fetched")[0] for text in refusals.values()}  # the rest names the policy
    assert texts == {"the image at URL could not be fetched"}, refusals
    same_policy = {k: v for k, v in refusals.items() if k not in ("loopback literal", "name -> loopback", "port",
                                                                  "closed port")}
    assert len(set(same_policy.values())) == 1, same_policy
    assert asyncio.run(private.load(f"{base}/to?u=/shape.png")) == image_server.png  # an allowed redirect
    assert "not allowed" in _load(strict, "http://evil.com/a.png")  # the host allowlist comes first


def test_video_urls_take_the_same_policy_and_their_own_size_limit(image_server):
    """`video_url` over http(s): the same allowlist, address and port checks as images; the file is not sniffed
    as an image (preprocess decodes videos) and its limit is `max_video_bytes`."""
    base = f"http://127.0.0.1:{image_server.port}"
    strict = MediaPolicy(("127.0.0.1",), ports=(image_server.port,), timeout_s=1.0)
    private = replace(strict, allow_private=True)
    assert asyncio.run(private.load_videos([base + "/shape.png"])) == [image_server.png]
    for policy, url, needle in ((strict, base + "/shape.png", "the video at URL could not be fetched"),
                                (replace(private, max_video_bytes=100), base + "/shape.png", "over 100 bytes"),
                                (private, "http://evil.com/v.mp4", "video host 'evil.com' is not allowed"),
                                (MediaPolicy(), "https://example.com/v.mp4", "video URLs over http(s) are not "),
                                (private, "data:image/png;base64,AAAA", "must be data:video/")):
        with pytest.raises(APIError) as ei:
            asyncio.run(policy.load(url, "video"))
        assert ei.value.status == 400 and needle in ei.value.message.replace(url, "URL"), ei.value.message


def test_image_parts_are_counted_before_any_fetch(image_server):
    policy = MediaPolicy(("127.0.0.1",), ports=(image_server.port,), allow_private=True, max_images=2)
    urls = [f"http://127.0.0.1:{image_server.port}/shape.png"] * 3
    with pytest.raises(APIError, match="3 images; at most 2 are accepted"):
        asyncio.run(policy.load_all(urls))
    assert image_server.hits == []
    assert asyncio.run(policy.load_all(urls[:2])) == [image_server.png] * 2


# --- the gauge admission reads ----------------------------------------------------------------------------------
def test_reserved_kv_gauge_is_what_admission_sees(monkeypatch):
    import triton_vlm.triton.metrics as M

    fake = fake_llm_metrics(monkeypatch)
    fake.show()
    assert fake.value(M.KV_RESERVED) == 0.0 and fake.series[M.KV_RESERVED].labels == {"model": "llm"}
    # every block reserved by admitted requests' worst cases, few held yet: admission is full, the held
    # fraction alone reads nearly idle
    fake.show(kv_blocks_used=6, kv_blocks_reserved=64, kv_blocks_total=64)
    assert fake.value(M.KV_RESERVED) == 1.0 and fake.value(M.KV_USAGE) == 6 / 64
    assert fake.value("triton_vlm_engine_kv_blocks_reserved") == 64.0
