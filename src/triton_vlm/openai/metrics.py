"""`GET /metrics` on the API port (written by `prometheus_client`): Triton's metrics (scraped from its metrics port on each call) followed by the
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
import logging
import time
import urllib.request
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
PREFIX = "triton_vlm_openai"
WEIGHTS_INFO = "triton_vlm_engine_weights_info"  # the llm's gauge naming the weights served (triton/metrics.py)
HELD_TTL_S, HELD_RETRY_S = 60.0, 2.0  # how long a read `held` is reused; how soon an unknown one is read again
log = logging.getLogger("triton_vlm.openai")


class FrontendMetrics:
    """The front end's metrics in a registry of their own (`prometheus_client`), exposed by `text()`."""

    def __init__(self, triton_metrics_url: Optional[str] = None):
        self.triton_url = triton_metrics_url
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = PREFIX
        self._requests = Counter(f"{p}_requests", "OpenAI API requests answered, by endpoint and HTTP status",
                                 ("endpoint", "status"), registry=r)
        self._running = Gauge(f"{p}_requests_running", "OpenAI API requests being served", registry=r)
        self._latency = Histogram(f"{p}_request_seconds", "arrival to the end of the response", ("endpoint",),
                                  buckets=BUCKETS, registry=r)
        self._ttft = Histogram(f"{p}_time_to_first_token_seconds", "streamed requests: arrival to the first text",
                               buckets=BUCKETS, registry=r)
        self._tokens = {what: Counter(f"{p}_{what}_tokens", f"{what} tokens of answered requests (usage)",
                                      registry=r) for what in ("prompt", "completion")}
        self._n_running = 0
        self._held: tuple[float, Optional[str]] = (-float("inf"), None)  # (when read, `held`): `weights_held`

    @property
    def running(self) -> int:
        return self._n_running

    @running.setter
    def running(self, value: int) -> None:
        self._n_running = value
        self._running.set(value)

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        self._requests.labels(endpoint, str(status)).inc()
        self._latency.labels(endpoint).observe(seconds)

    def refused(self, endpoint: str, status: int) -> None:
        """A request answered before any work (no latency observed: it would pull the histogram down)."""
        self._requests.labels(endpoint, str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens(self, prompt: int, completion: int) -> None:
        self._tokens["prompt"].inc(prompt)
        self._tokens["completion"].inc(completion)

    def text(self) -> str:
        """Prometheus' text format; without the `_created` series (a scraper that sums counters does not want
        timestamps as samples)."""
        lines = generate_latest(self.registry).decode().splitlines()
        return "\n".join(line for line in lines if "_created" not in line) + "\n"

    async def scrape_triton(self) -> str:
        """Triton's metrics text, or a comment saying why there is none (the error's kind, never the URL: the
        front end's log has it)."""
        if not self.triton_url:
            return "# Triton metrics: no metrics URL configured\n"
        try:
            return await asyncio.to_thread(_get, self.triton_url)
        except Exception as e:  # noqa: BLE001 - the front end's own metrics are still served
            log.warning("cannot read Triton's metrics from %s: %s", self.triton_url, e)
            return f"# Triton metrics unavailable ({type(e).__name__})\n"

    async def weights_held(self) -> Optional[str]:
        """How the served llm keeps its weights in memory (the `held` label of Triton's
        `triton_vlm_engine_weights_info`, e.g. "float8_e4m3fn+bfloat16", decided at load by the kernels' races),
        or None where Triton does not say (no metrics URL, unreachable, a backend without the gauge). Read at most
        once per `HELD_TTL_S` (`HELD_RETRY_S` while unknown): `/v1/models` never costs a scrape of Triton's
        metrics per call."""
        read_at, held = self._held
        now = time.monotonic()
        if now - read_at < (HELD_TTL_S if held is not None else HELD_RETRY_S):
            return held
        held = held_label(await self.scrape_triton())
        self._held = (now, held)
        return held


def held_label(text: str, model: str = "llm") -> Optional[str]:
    """The `held` label of the llm's `triton_vlm_engine_weights_info` series in a Prometheus text, or None."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    if WEIGHTS_INFO not in text:
        return None
    try:
        for family in text_string_to_metric_families(text):
            if family.name == WEIGHTS_INFO:
                return next((s.labels.get("held") for s in family.samples if s.labels.get("model") == model), None)
    except ValueError:  # a text the parser refuses: no claim
        return None
    return None


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        text = resp.read().decode("utf-8", "replace")
    return text if text.endswith("\n") else text + "\n"
