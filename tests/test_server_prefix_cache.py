"""Prefix caching through the server: a chat turn sent again reuses the KV of its history and images
(`num_cached_tokens` > 0), answers the same, and the prefix-cache counters count it (live server)."""
from __future__ import annotations

import io
import random
import re
import time
import urllib.request

import pytest

from triton_vlm.demo.shapes import draw
from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server


def scrape(server) -> dict[str, float]:
    """Our metrics without labels: name -> value."""
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(triton_vlm_[a-z_]+)(?:\{[^}]*\})? (\S+)$", text,
                                                               re.M)}


def metric(values: dict[str, float], name: str) -> float:
    assert name in values, f"no metric {name}"
    return values[name]


def png(shape, color, seed) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, size=(64, 64), rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


def test_a_chat_turn_sent_again_reuses_its_prefix_and_answers_the_same(triton_server):
    before = scrape(triton_server)
    first_image, second_image = png("circle", "red", 9101), png("square", "blue", 9102)  # images no other test sends
    turn1 = "USER: <image>\nDescribe the image in a few words. ASSISTANT:"
    params = dict(max_tokens=8, min_tokens=8, return_num_input_tokens=True)
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=120) as client:
        a = client.generate(turn1, [first_image], **params)
        b = client.generate(turn1, [first_image], **params)
        turn2 = f"{turn1} {a.text} USER: <image>\nAnd this one? ASSISTANT:"
        c = client.generate(turn2, [first_image, second_image], **params)
        streamed = list(client.stream(turn2, [first_image, second_image], **params))
    assert a.num_cached_tokens < b.num_cached_tokens and b.num_cached_tokens > 0
    assert b.num_cached_tokens < b.num_input_tokens  # the last prompt token is always computed
    assert b.output_ids == a.output_ids and b.texts == a.texts
    # the next turn resends the first turn and its image: at least the first turn's cached blocks are reused
    assert c.num_cached_tokens >= b.num_cached_tokens
    assert "".join(p.text for p in streamed if p.sequence_index == 0) == c.text
    queries = a.num_input_tokens + b.num_input_tokens + 2 * c.num_input_tokens
    hits = a.num_cached_tokens + b.num_cached_tokens + c.num_cached_tokens
    deadline = time.monotonic() + 10  # the counters are refreshed every 0.5 s
    while True:
        after = scrape(triton_server)
        dq = metric(after, "triton_vlm_prefix_cache_queries_total") - \
            metric(before, "triton_vlm_prefix_cache_queries_total")
        dh = metric(after, "triton_vlm_prefix_cache_hits_total") - metric(before, "triton_vlm_prefix_cache_hits_total")
        if (dq >= queries and dh >= hits) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert dq >= queries and dh >= hits + c.num_cached_tokens  # the streamed repeat hit at least as much as c
