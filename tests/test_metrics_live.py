"""The operator metrics on Triton's metrics port move with real traffic (live server)."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from triton_vlm_client import VLMClient, VLMClientError

from metrics_support import after_next_refresh

pytestmark = pytest.mark.server


def scrape(server, refreshed: bool = False) -> dict[str, float]:
    """The llm's metrics now, or (`refreshed`) once its gauges were refreshed after this call."""
    if refreshed:
        text = after_next_refresh(server.metrics_url)
    else:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(triton_vlm_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|\+Inf|NaN)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(values: dict[str, float], name: str, **labels) -> float:
    for key, v in values.items():
        if key.split("{")[0] == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
            return v
    raise AssertionError(f"no metric {name} {labels} in {sorted(values)[:40]}")


def test_latency_histograms_token_counters_and_outcomes(triton_server):
    before = scrape(triton_server)
    with VLMClient(triton_server.grpc_url, protocol="grpc", timeout=60) as client:
        for _ in range(3):
            client.generate("USER: Say hello. ASSISTANT:", max_tokens=6, min_tokens=6)
        with pytest.raises(VLMClientError):
            client.generate("USER: Say hello. ASSISTANT:", max_tokens=6, beam_width=0)
    after = scrape(triton_server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("triton_vlm_requests_total", outcome="success") >= 3
    assert delta("triton_vlm_requests_total", outcome="invalid_arg") >= 1
    assert delta("triton_vlm_generated_tokens_total") >= 18
    assert delta("triton_vlm_prompt_tokens_total") >= 3 * 8
    for h in ("triton_vlm_time_to_first_token_seconds", "triton_vlm_time_per_output_token_seconds",
              "triton_vlm_queue_seconds", "triton_vlm_request_seconds"):
        assert delta(f"{h}_count") >= 3, h
        assert delta(f"{h}_sum") > 0, h
        assert metric(after, f"{h}_bucket", le="+Inf") == metric(after, f"{h}_count")
    assert metric(after, "triton_vlm_engine_kv_blocks_total") > 0
    after = scrape(triton_server, refreshed=True)  # the engine gauges refresh every 0.5 s
    assert delta("triton_vlm_engine_prefill_tokens") >= 3 * 8  # where the steps' time went (StepTimes)
    assert delta("triton_vlm_engine_decode_rows") >= 3 * 5  # 6 tokens each, the first from the prefill
    assert delta("triton_vlm_engine_prefill_seconds") > 0 and delta("triton_vlm_engine_decode_seconds") > 0
    assert delta("triton_vlm_engine_decode_steps") >= 5


def test_engine_gauges_see_a_serial_stream_of_requests_shorter_than_their_refresh(triton_server):
    """One client sending one short request after another keeps the engine busy most of the time, each request
    well under the gauges' 0.5 s refresh: scraped at 20 Hz, the running-requests gauge and the LoRA gauge must show
    the request about as often as the engine was busy (an unbiased sample), not only between requests.

    Regression: the llm responder ran its metrics tick only when a result woke it, which for back-to-back requests
    was right after it sent a final response, the moment the engine had just finished that request: requests
    shorter than the refresh were never seen running (an endpoint picker saw a busy replica as idle)."""
    body = json.dumps({"text_input": "USER: Say hello. ASSISTANT:", "max_tokens": 60, "min_tokens": 60,
                       "exclude_input_in_output": True, "lora_name": "sentence", "beam_width": 2}).encode()
    url = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    stop, latencies, errors = threading.Event(), [], []

    def loop():
        while not stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        url, body, {"Content-Type": "application/json"}), timeout=60) as r:
                    r.read()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                return
            latencies.append(time.monotonic() - start)

    client = threading.Thread(target=loop, daemon=True)
    client.start()
    try:
        wait = time.monotonic() + 60
        while not latencies and not errors and time.monotonic() < wait:  # the first answer: warmed up
            time.sleep(0.05)
        first, t0 = scrape(triton_server), time.monotonic()
        scrapes, running, lora_running = 0, 0, 0
        while time.monotonic() - t0 < 6:
            values = scrape(triton_server)
            scrapes += 1
            running += metric(values, "triton_vlm_engine_running_requests") > 0
            lora_running += any(k.startswith("triton_vlm_lora_requests_info{") and
                                'running_lora_adapters="sentence"' in k for k in values)
            time.sleep(0.05)
        last, wall = scrape(triton_server), time.monotonic() - t0
    finally:
        stop.set()
        client.join(60)
    assert not errors, errors
    # the share of the time the llm held a request (arrival in llm to its last token), as a sample would see it
    busy = (metric(last, "triton_vlm_request_seconds_sum") - metric(first, "triton_vlm_request_seconds_sum")) / wall
    seen = f"{running}/{scrapes} scrapes running, {lora_running} with the adapter running; llm busy {busy:.2f}; " \
           f"{len(latencies)} requests, median {sorted(latencies)[len(latencies) // 2]:.3f} s"
    assert busy > 0.3, seen  # the stream kept the engine busy
    assert running >= busy / 2 * scrapes, seen
    assert lora_running >= busy / 2 * scrapes, seen


def test_reserved_kv_gauge_reads_what_admission_sees(triton_server):
    """A request reserves its worst case (rows x (prompt + max_tokens)) at admission, long before its rows hold that
    many blocks: the reserved fraction (what admission is limited by, what the endpoint picker reads) is above the held
    one while it runs, never below it, and both are 0 once it is done."""
    body = json.dumps({"text_input": "USER: Say hello. ASSISTANT:", "max_tokens": 450, "min_tokens": 450,
                       "beam_width": 4, "exclude_input_in_output": True}).encode()  # 4 rows: seconds, not one refresh
    url = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    done, enough, answers = threading.Event(), threading.Event(), []

    def requests():  # one after another until the gauges caught one running (a fast machine may finish one
        try:         # request between two refreshes of the gauges, 0.5 s apart)
            for _ in range(8):
                with urllib.request.urlopen(urllib.request.Request(
                        url, body, {"Content-Type": "application/json"}), timeout=120) as r:
                    answers.append(r.read())
                if enough.is_set():
                    break
        except Exception as e:  # noqa: BLE001 - reported below
            answers.append(repr(e))
        finally:
            done.set()

    deadline = time.monotonic() + 30  # the engine idle first (an earlier test's last request may still run)
    while metric(scrape(triton_server), "triton_vlm_engine_running_requests") > 0:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.1)
    threading.Thread(target=requests, daemon=True).start()
    seen = []
    while not done.is_set():
        values = scrape(triton_server)
        if metric(values, "triton_vlm_engine_running_requests") > 0:
            seen.append((metric(values, "triton_vlm_engine_kv_cache_reserved_perc", model="llm"),
                         metric(values, "triton_vlm_engine_kv_cache_usage_perc", model="llm"),
                         metric(values, "triton_vlm_engine_kv_blocks_reserved")))
            if seen[-1][0] > seen[-1][1] > 0:
                enough.set()
        time.sleep(0.05)
    assert seen, f"the request was never seen running: {answers}"
    assert all(reserved >= used for reserved, used, _ in seen), seen
    assert any(reserved > used > 0 for reserved, used, _ in seen), seen
    assert any(blocks >= 4 * 450 // 16 for _, _, blocks in seen), seen  # its worst case: 4 x (prompt + 450)
    values = scrape(triton_server, refreshed=True)  # the gauges' next refresh
    assert metric(values, "triton_vlm_engine_kv_cache_reserved_perc", model="llm") == 0.0
    assert metric(values, "triton_vlm_engine_kv_cache_usage_perc", model="llm") == 0.0
