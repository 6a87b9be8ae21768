"""The llm's metrics with a stand-in for the python backend's `pb_utils.MetricFamily`: each metric's last value by
name, for unit tests of the gauges (`triton_vlm.triton.metrics`)."""
from __future__ import annotations

import types
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
