"""The vision model's Prometheus metrics (beside Triton's `nv_*`), all labelled `model="vision"`:

`triton_vlm_vision_images_encoded_total` (encoder runs, per image), `triton_vlm_embedding_cache_{hits,misses,
evictions}_total`, `triton_vlm_embedding_cache_{bytes,entries}` (gauges), `triton_vlm_vision_batch_size`
(histogram: images per encoder call, so cross-request batching shows). Refreshed after every `execute()`.
Created once per process (Triton keys families by name); without the python backend, or when the metrics could
not be created, every method only drops the batch sizes the service recorded.
"""
from __future__ import annotations

from .metrics import MetricsBase, pb_utils

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


class VisionMetrics(MetricsBase):
    def __init__(self, service, model: str = "vision"):
        super().__init__()
        self.service = service  # vision.service.VisionService
        self._counters, self._gauges, self._seen, self._hist = {}, {}, {}, None
        self._start(self._create, {"model": model})

    def _create(self, labels: dict) -> None:
        F = pb_utils.MetricFamily
        self._counters["images_encoded"] = self._family(
            "triton_vlm_vision_images_encoded_total", "images run through the vision encoder", F.COUNTER
        ).Metric(labels=labels)
        for field in ("hits", "misses", "evictions"):
            self._counters[field] = self._family(f"triton_vlm_embedding_cache_{field}_total",
                                                 f"image embedding cache {field}", F.COUNTER).Metric(labels=labels)
        for field in ("bytes", "entries"):
            self._gauges[field] = self._family(f"triton_vlm_embedding_cache_{field}",
                                               f"image embedding cache: {field} held", F.GAUGE).Metric(labels=labels)
        self._hist = self._family("triton_vlm_vision_batch_size", "images per vision encoder call",
                                  F.HISTOGRAM).Metric(labels=labels, buckets=BATCH_BUCKETS)

    def update(self) -> None:
        svc, cache = self.service, self.service.cache
        batches = svc.stats.take_batches()  # taken even with the metrics off: the list must not grow
        if not self._counters:
            return
        now = {"images_encoded": svc.stats.images_encoded}
        if cache is not None:
            now.update(hits=cache.stats.hits, misses=cache.stats.misses, evictions=cache.stats.evictions)
            self._gauges["bytes"].set(float(cache.used_bytes))
            self._gauges["entries"].set(float(len(cache)))
        for field, value in now.items():
            if value > self._seen.get(field, 0):
                self._counters[field].increment(value - self._seen.get(field, 0))
                self._seen[field] = value
        for size in batches:
            self._hist.observe(float(size))

    def close(self) -> None:
        self._counters, self._gauges, self._hist = {}, {}, None  # metrics before their families
        super().close()
