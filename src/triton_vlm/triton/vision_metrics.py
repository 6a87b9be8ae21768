"""The vision model's Prometheus metrics (beside Triton's `nv_*`), all labelled `model="vision"`:

`triton_vlm_vision_images_encoded_total` (encoder runs, per image), `triton_vlm_embedding_cache_{hits,misses,
evictions}_total`, `triton_vlm_embedding_cache_{bytes,entries}` (gauges), `triton_vlm_vision_batch_size`
(histogram: images per encoder call, so cross-request batching shows). Refreshed after every `execute()`.
Created once per process (Triton keys families by name); without the python backend every method is a no-op.
"""
from __future__ import annotations

import logging

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None

log = logging.getLogger("triton_vlm")
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


class VisionMetrics:
    def __init__(self, service, model: str = "vision"):
        self.service = service  # vision.batch.VisionService
        self._families, self._counters, self._gauges, self._seen, self._hist = [], {}, {}, {}, None
        if pb_utils is None:
            return
        try:
            self._create({"model": model})
        except Exception as e:  # noqa: BLE001 - metrics are optional
            log.warning("vision metrics unavailable: %s", e)
            self.close()

    def _family(self, name: str, description: str, kind):
        fam = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(fam)
        return fam

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
        if not self._counters:
            return
        svc, cache = self.service, self.service.cache
        now = {"images_encoded": svc.stats.images_encoded}
        if cache is not None:
            now.update(hits=cache.stats.hits, misses=cache.stats.misses, evictions=cache.stats.evictions)
            self._gauges["bytes"].set(float(cache.used_bytes))
            self._gauges["entries"].set(float(len(cache)))
        for field, value in now.items():
            if value > self._seen.get(field, 0):
                self._counters[field].increment(value - self._seen.get(field, 0))
                self._seen[field] = value
        for size in svc.stats.take_batches():
            self._hist.observe(float(size))

    def close(self) -> None:
        self._counters, self._gauges, self._hist = {}, {}, None  # metrics before their families
        self._families = []
