"""The operator metrics on Triton's metrics port move with real traffic (live server)."""
from __future__ import annotations

import re
import urllib.request

import pytest

from triton_vlm_client import VLMClient, VLMClientError

pytestmark = pytest.mark.server


def scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
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
