"""The LoRA metrics' bookkeeping with a stand-in for the python backend's metric API (the live server test only
sees them at rest): per-level counters follow the caches, and the Gateway API Inference Extension gauge is one
series whose labels follow the running and waiting adapters."""
from __future__ import annotations

import time
import types
import weakref

import pytest

from triton_vlm.engine.engine import LoraInfo
from triton_vlm.triton import metrics as M


class FakeFamily:
    """Like the python backend's MetricFamily: its series exist while the family object lives."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    live: "weakref.WeakSet" = weakref.WeakSet()

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, []
        FakeFamily.live.add(self)

    def Metric(self, labels, buckets=None):  # noqa: N802 - the python backend's spelling
        m = types.SimpleNamespace(labels=labels, value=0.0)
        m.set = lambda v, m=m: setattr(m, "value", v)
        m.increment = lambda v, m=m: setattr(m, "value", m.value + v)
        m.observe = lambda v: None
        self.metrics.append(m)
        return m


def series(name):
    return [m for f in FakeFamily.live if f.name == name for m in f.metrics]


@pytest.fixture
def fake_backend(monkeypatch):
    FakeFamily.live = weakref.WeakSet()
    monkeypatch.setattr(M, "pb_utils", types.SimpleNamespace(MetricFamily=FakeFamily))
    yield


def test_gateway_gauge_is_one_series_following_the_adapters(fake_backend):
    from triton_vlm.engine.lora.adapter_slots import DeviceAdapters
    from triton_vlm.lora.cache import CacheStats

    info = {"now": LoraInfo((), (), 4)}
    host = type("Host", (), {"stats": CacheStats(), "used_bytes": 10, "__len__": lambda self: 1})()
    device = DeviceAdapters(max_adapters=4, max_bytes=1000)
    metrics = M.LLMMetrics(None, lora=host, lora_slots=device, lora_info=lambda: info["now"])
    metrics.update_gauges()
    [s] = series("triton_vlm_lora_requests_info")
    assert s.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "4"}
    info["now"] = LoraInfo(("french",), ("french", "sentence"), 4)
    host.stats.hits, device.stats.misses = 3, 2
    metrics.update_gauges()
    [s] = series("triton_vlm_lora_requests_info")  # the old label set is gone
    assert s.labels == {"running_lora_adapters": "french", "waiting_lora_adapters": "french,sentence",
                        "max_lora": "4"}
    assert abs(s.value - time.time()) < 5
    by_level = {m.labels["level"]: m.value for m in series("triton_vlm_lora_cache_hits_total")}
    assert by_level == {"host": 3.0, "device": 0.0}
    assert {m.labels["level"]: m.value for m in series("triton_vlm_lora_cache_misses_total")}["device"] == 2.0
    metrics.close()
    assert not series("triton_vlm_lora_requests_info")
