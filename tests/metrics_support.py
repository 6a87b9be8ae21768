"""The llm's metrics with a stand-in for the python backend's `pb_utils.MetricFamily`: each metric's last value by
name, for unit tests of the gauges (`triton_vlm.triton.metrics`)."""
from __future__ import annotations

import re
import time
import types
import urllib.request
from dataclasses import dataclass, field


@dataclass
class FakeLLMMetrics:
    series: dict = field(default_factory=dict)  # metric name -> SimpleNamespace(labels, value)
    now: dict = field(default_factory=dict)  # {"stats": the EngineStats the gauges read next}
    metrics: object = None
    fields: dict = field(default_factory=dict)  # every EngineStats field at 0

    def show(self, **stats) -> None:
        """The engine reports `stats` (the other fields 0); the gauges are updated."""
        from triton_vlm.engine.engine import EngineStats

        self.now["stats"] = EngineStats(**{**self.fields, **stats})
        self.metrics.update_gauges()

    def value(self, name: str) -> float:
        return self.series[name].value


def fake_llm_metrics(monkeypatch) -> FakeLLMMetrics:
    from triton_vlm.engine.engine import EngineStats
    from triton_vlm.triton import metrics as M

    fake = FakeLLMMetrics(fields=dict.fromkeys(EngineStats.__dataclass_fields__, 0))

    class Family:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # noqa: N802 - the python backend's spelling
            m = types.SimpleNamespace(labels=labels, value=None)
            m.set = lambda v: setattr(m, "value", v)
            fake.series[self.name] = m
            return m

    monkeypatch.setattr(M, "pb_utils", types.SimpleNamespace(MetricFamily=Family))
    fake.now["stats"] = EngineStats(**fake.fields)
    fake.metrics = M.LLMMetrics(lambda: fake.now["stats"])
    return fake


# --- a live llm's metrics after its next refresh ------------------------------------------------------------------
TICK_STAMP = re.compile(r"^triton_vlm_lora_requests_info\{[^}]*\} (\S+)$", re.M)


def after_next_refresh(metrics_url: str, timeout: float = 10.0) -> str:
    """Triton's metrics text once the llm has refreshed its gauges and counters (every 0.5 s) after this call:
    what happened before the call is in it. Waits on the refresh itself, not on a fixed sleep: each refresh
    stamps `triton_vlm_lora_requests_info` with its time (a server with adapters), and updates the prefix-cache
    counters just after; scraped once more, so that refresh has finished."""
    t0 = time.time()
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            stamp = TICK_STAMP.search(r.read().decode())
        if stamp is not None and float(stamp.group(1)) > t0:
            with urllib.request.urlopen(metrics_url, timeout=10) as r:
                return r.read().decode()
        assert time.monotonic() < deadline, f"the llm's metrics were not refreshed within {timeout:.0f} s " + (
            "(no triton_vlm_lora_requests_info: a server without adapters?)" if stamp is None else "")
        time.sleep(0.05)
