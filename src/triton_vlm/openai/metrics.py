"""`GET /metrics` on the API port: Triton's metrics (scraped from its metrics port on each call) followed by the
front end's own, in Prometheus' text format, so an endpoint picker that scrapes the API port sees the engine's
queue, running and KV-cache gauges as well as the front end's counters.

The front end's own (vLLM's names are `vllm:*`; ours follow the project's `triton_vlm_` prefix):

| metric | kind | meaning |
|---|---|---|
| `triton_vlm_openai_requests_total{endpoint,status}` | counter | requests answered, by HTTP status |
| `triton_vlm_openai_requests_running` | gauge | requests being served now |
| `triton_vlm_openai_request_seconds{endpoint}` | histogram | arrival to the last byte of the response |
| `triton_vlm_openai_time_to_first_token_seconds` | histogram | streamed requests: arrival to the first text |
| `triton_vlm_openai_prompt_tokens_total`, `..._completion_tokens_total` | counter | usage reported |
"""
from __future__ import annotations

import asyncio
import bisect
import urllib.request
from collections import defaultdict
from typing import Optional

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class _Histogram:
    def __init__(self):
        self.counts = [0] * len(BUCKETS)
        self.sum, self.n = 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cum = [], 0
        sep = "," if labels else ""
        for b, c in zip(BUCKETS, self.counts):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cum}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum}", f"{name}_count{lab} {self.n}"]
        return out


class FrontendMetrics:
    def __init__(self, triton_metrics_url: Optional[str] = None):
        self.triton_url = triton_metrics_url
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, _Histogram] = defaultdict(_Histogram)
        self.ttft = _Histogram()
        self.running = 0
        self.prompt_tokens = self.completion_tokens = 0

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[(endpoint, status)] += 1
        self.latency[endpoint].observe(seconds)

    def refused(self, endpoint: str, status: int) -> None:
        """A request answered before any work (no latency observed: it would pull the histogram down)."""
        self.requests[(endpoint, status)] += 1

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def text(self) -> str:
        p = "triton_vlm_openai"
        lines = [f"# HELP {p}_requests_total OpenAI API requests answered, by endpoint and HTTP status",
                 f"# TYPE {p}_requests_total counter"]
        lines += [f'{p}_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())]
        lines += [f"# HELP {p}_requests_running OpenAI API requests being served",
                  f"# TYPE {p}_requests_running gauge", f"{p}_requests_running {self.running}",
                  f"# HELP {p}_request_seconds arrival to the end of the response",
                  f"# TYPE {p}_request_seconds histogram"]
        for e, h in sorted(self.latency.items()):
            lines += h.lines(f"{p}_request_seconds", f'endpoint="{e}"')
        lines += [f"# HELP {p}_time_to_first_token_seconds streamed requests: arrival to the first text",
                  f"# TYPE {p}_time_to_first_token_seconds histogram"]
        lines += self.ttft.lines(f"{p}_time_to_first_token_seconds")
        for what, v in (("prompt", self.prompt_tokens), ("completion", self.completion_tokens)):
            lines += [f"# HELP {p}_{what}_tokens_total {what} tokens of answered requests (usage)",
                      f"# TYPE {p}_{what}_tokens_total counter", f"{p}_{what}_tokens_total {v}"]
        return "\n".join(lines) + "\n"

    async def scrape_triton(self) -> str:
        """Triton's metrics text, or a comment saying why there is none."""
        if not self.triton_url:
            return "# Triton metrics: no metrics URL configured\n"
        try:
            return await asyncio.to_thread(_get, self.triton_url)
        except Exception as e:  # noqa: BLE001 - the front end's own metrics are still served
            return f"# Triton metrics unavailable from {self.triton_url}: {type(e).__name__}: {e}\n"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        text = resp.read().decode("utf-8", "replace")
    return text if text.endswith("\n") else text + "\n"
