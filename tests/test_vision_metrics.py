"""The vision model's metrics: batch sizes are taken on every update, with the metrics on or off (unit, fakes)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from triton_vlm.triton import metrics as base
from triton_vlm.triton import vision_metrics as vm
from triton_vlm.vision.cache import CacheStats
from triton_vlm.vision.service import VisionStats


@dataclass
class FakeCache:
    stats: CacheStats = field(default_factory=CacheStats)
    used_bytes: int = 0
    entries: int = 0

    def __len__(self) -> int:
        return self.entries


@dataclass
class FakeService:
    stats: VisionStats = field(default_factory=VisionStats)
    cache: FakeCache = field(default_factory=FakeCache)


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict = {}
    fail = False

    def __init__(self, name, description, kind):
        if FakeFamily.fail:
            raise RuntimeError("metrics are disabled in this server")
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        m = FakeMetric(labels, buckets)
        FakeFamily.made[self.name] = m
        return m


@pytest.fixture
def fake_pb(monkeypatch):
    pb = type("pb_utils", (), {"MetricFamily": FakeFamily})
    monkeypatch.setattr(base, "pb_utils", pb)
    monkeypatch.setattr(vm, "pb_utils", pb)
    FakeFamily.made, FakeFamily.fail = {}, False
    return FakeFamily


def encode(svc: FakeService, *sizes: int) -> None:
    """What VisionService records per encoder call."""
    for n in sizes:
        svc.stats.batch_sizes.append(n)
        svc.stats.images_encoded += n


@pytest.mark.parametrize("why", ["no python backend", "creation failed"])
def test_batch_sizes_do_not_pile_up_with_the_metrics_off(monkeypatch, fake_pb, why):
    if why == "no python backend":
        monkeypatch.setattr(base, "pb_utils", None)
        monkeypatch.setattr(vm, "pb_utils", None)
    else:
        fake_pb.fail = True
    svc = FakeService()
    m = vm.VisionMetrics(svc)
    for _ in range(1000):
        encode(svc, 4, 8)
        m.update()
        assert svc.stats.batch_sizes == []
    assert fake_pb.made == {}


def test_update_reports_deltas_and_each_batch_once(fake_pb):
    svc = FakeService()
    m = vm.VisionMetrics(svc)
    encode(svc, 3, 1)
    svc.cache.stats.hits, svc.cache.stats.misses, svc.cache.used_bytes, svc.cache.entries = 2, 4, 4096, 4
    m.update()
    m.update()  # nothing new: no double counting
    encode(svc, 2)
    svc.cache.stats.hits = 5
    m.update()
    made = fake_pb.made
    assert made["triton_vlm_vision_batch_size"].observed == [3.0, 1.0, 2.0]
    assert made["triton_vlm_vision_batch_size"].buckets == vm.BATCH_BUCKETS
    assert made["triton_vlm_vision_images_encoded_total"].value == 6
    assert made["triton_vlm_embedding_cache_hits_total"].value == 5
    assert made["triton_vlm_embedding_cache_misses_total"].value == 4
    assert made["triton_vlm_embedding_cache_bytes"].value == 4096.0
    assert made["triton_vlm_embedding_cache_entries"].value == 4.0
    assert svc.stats.batch_sizes == []
    assert made["triton_vlm_vision_images_encoded_total"].labels == {"model": "vision"}
