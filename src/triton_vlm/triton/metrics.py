"""What operators watch, as Prometheus metrics on Triton's metrics port (beside Triton's own `nv_*` metrics).

Gauges (engine state, refreshed every 0.5 s): `triton_vlm_engine_<field>` for every `EngineStats` field,
`triton_vlm_engine_kv_cache_reserved_perc`, the KV-cache blocks reserved by admitted requests as a 0-1 fraction
(what admission sees: under the default policy each request reserves its worst case, as TensorRT-LLM's
GUARANTEED_NO_EVICT, so at 1.0 the replica admits nothing more; under max_utilization, what the next step writes;
the endpoint picker's KV-cache scorer reads it), and beside it
`triton_vlm_engine_kv_cache_usage_perc`, the blocks rows hold now (vLLM's `vllm:kv_cache_usage_perc`; below the
reserved fraction while requests have not grown to their worst case). Both 0 while the engine has no blocks.
The memory plan made at start (`engine/profile.py`), set once: `triton_vlm_engine_memory_bytes{part}` with part
`limit` (this instance's share; 0 when the budget was given), `weights`, `activations` (the worst-case forwards'
peak), `other` (LoRA device level, memory outside torch's allocator), `kv_cache` and `state_slots` (a hybrid
model's linear-layer states, one slot per row, 0 for others; the slots are the gauges
`triton_vlm_engine_state_slots_total` / `_free`), and `triton_vlm_engine_kv_cache_tokens`. Which weights are served, set once: `triton_vlm_engine_weights_info{weights,
held}` (value 1): `weights` what the checkpoint holds and what it is computed as (the `/v1/models` card's
"weights": "unquantized", or e.g. "fp8-e4m3 (block 128x128 weight_scale_inv), computed as its float32
dequantization"), `held` how the engine keeps its weight matrices in memory ("float32"; "float8_e4m3fn" where an
FP8 checkpoint's projections stay e4m3 and the products read them, `engine/cpu/gemv_fp8.py`; "+bfloat16" where
its bf16 embedding and lm_head stay bf16, `gemv_bf16.py`; `LlamaModel.weights_held`).
Counters: `triton_vlm_requests_total{outcome=...}` (success, invalid_arg, unavailable, cancelled, internal),
`triton_vlm_prompt_tokens_total`, `triton_vlm_generated_tokens_total`, and the prefix cache's, in tokens as
vLLM's `prefix_cache_queries` / `prefix_cache_hits`: `triton_vlm_prefix_cache_queries_total` (prompt tokens of
the requests looked up at admission) and `triton_vlm_prefix_cache_hits_total` (those found cached); hits /
queries is the hit rate. `triton_vlm_preemptions_total`: running requests preempted (scheduler policy
max_utilization: their KV blocks freed, their tokens recomputed when they run again; vLLM's
`num_preemptions_total`), beside the gauges `triton_vlm_engine_preemptions` (the same count) and
`triton_vlm_engine_preempted_requests` (waiting to run again). Where the engine's steps spend their time,
cumulative (`engine/scheduler.py` `StepTimes`): `triton_vlm_engine_prefill_{steps,tokens,seconds}` and
`triton_vlm_engine_decode_{steps,rows,seconds}`; the rate of `prefill_seconds + decode_seconds` is the fraction of
the time the engine computes (1.0: it is the bottleneck), `decode_seconds / decode_steps` the time of a step.
`triton_vlm_engine_spare_steps`: steps that borrowed threads from the spare CPUs (`engine/cpu/spare.py`).
`triton_vlm_engine_cuda_graph*`: the decode steps' CUDA graphs captured, replayed (with LoRA rows), run eager, failed
to capture or to replay (`EngineStats`; 0 without graphs).
Histograms (seconds, measured inside the llm model from the moment it received the request, so preprocess and
vision time is not included; Triton's `nv_inference_*_duration_us` cover those models):
`triton_vlm_queue_seconds` (until rows and KV blocks were reserved), `triton_vlm_time_to_first_token_seconds`,
`triton_vlm_time_per_output_token_seconds` (mean after the first), `triton_vlm_request_seconds` (end to end).
LoRA adapter cache, per `level` ("host": adapters by task id; "device": the slots running requests read):
`triton_vlm_lora_cache_{hits,misses,evictions}_total{level}` and `triton_vlm_lora_cache_registry_loads_total`
counters, `triton_vlm_lora_cache_{adapters,bytes}{level}` gauges. And the LoRA gauge of the Kubernetes Gateway
API Inference Extension's model-server protocol, with vLLM's `lora_requests_info` semantics:
`triton_vlm_lora_requests_info{running_lora_adapters="a,b",waiting_lora_adapters="c",max_lora="16"}`, value the
Unix time of the last update (one series at a time: the previous label set is removed when the adapters change).
The endpoint picker reads it as the `loraSpec` of its EndpointPickerConfig (deploy/kubernetes/overlays/
inference-gateway/endpoint-picker-config.yaml).

Without the python backend (unit tests) every method is a no-op. A Metric is only valid while its
MetricFamily lives, so the families are kept here and dropped after the metrics in `close()`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None

from ..params import RequestStats

log = logging.getLogger("triton_vlm")

OUTCOMES = ("success", "invalid_arg", "unavailable", "cancelled", "internal")
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
HISTOGRAMS = {  # name -> (description, buckets, RequestStats attribute)
    "triton_vlm_queue_seconds": ("time a request waited for rows and KV blocks", LATENCY_BUCKETS, "queue_s"),
    "triton_vlm_time_to_first_token_seconds": ("time to the first new token", LATENCY_BUCKETS, "ttft_s"),
    "triton_vlm_time_per_output_token_seconds": ("mean time per new token after the first", TOKEN_BUCKETS,
                                                 "tpot_s"),
    "triton_vlm_request_seconds": ("time from arrival in llm to the last token", LATENCY_BUCKETS, "e2e_s"),
}
KV_USAGE = "triton_vlm_engine_kv_cache_usage_perc"
KV_RESERVED = "triton_vlm_engine_kv_cache_reserved_perc"


def kv_cache_usage(stats) -> float:
    """KV-cache blocks in use as a 0-1 fraction (vLLM's `kv_cache_usage_perc`); 0 for an engine without blocks."""
    total = stats.kv_blocks_total
    return float(stats.kv_blocks_used) / total if total else 0.0


def kv_cache_reserved(stats) -> float:
    """KV-cache blocks reserved by admitted requests as a 0-1 fraction (what admission sees); 0 without blocks."""
    total = stats.kv_blocks_total
    return float(stats.kv_blocks_reserved) / total if total else 0.0


class MetricsBase:
    """Families kept alive with their metrics (a Metric is only valid while its MetricFamily lives); creation
    failures leave the metrics off (a no-op object) instead of failing the model."""

    def __init__(self):
        self._families: list = []

    def _start(self, create, *args) -> None:
        if pb_utils is None:
            return
        try:
            create(*args)
        except Exception as e:  # noqa: BLE001 - metrics are optional (e.g. disabled in the server)
            log.warning("metrics unavailable: %s", e)
            self.close()

    def _family(self, name: str, description: str, kind):
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def close(self) -> None:
        self._families = []


class LLMMetrics(MetricsBase):
    def __init__(self, stats: Optional[Callable[[], object]] = None, model: str = "llm", enabled: bool = True,
                 lora=None, lora_slots=None, lora_info: Optional[Callable[[], object]] = None, memory=None,
                 prefix_cache: Optional[Callable[[], object]] = None, weights: Optional[dict] = None):
        """Create once per process: Triton keys families by name, so a second LLMMetrics would share (and, when
        the first is dropped, free) the first one's families. `lora`: the host `AdapterCache`; `lora_slots`: the
        engine's `DeviceAdapters`; `lora_info`: the engine's `lora_info` (all None without adapters); `memory`: the
        engine's `profile.MemoryPlan` (None for a backend without one); `prefix_cache`: the engine's
        `prefix_cache_stats` (None for a backend without a prefix cache); `weights`: the engine's `weights_info`
        ({"weights": ..., "held": ...}; None for a backend that does not say)."""
        super().__init__()
        self._prefix_stats = prefix_cache
        self._prefix: dict = {}  # "queries" / "hits" -> counter
        self._prefix_seen: dict = {}  # -> the cumulative count already added
        self._stats = stats
        self._memory_plan = memory
        self._memory: dict = {}  # part -> gauge (set once)
        self._weights_info, self._weights = weights, None
        self._lora_levels = {k: v for k, v in (("host", lora), ("device", lora_slots)) if v is not None}
        self._lora_info = lora_info
        self._lora_counters: dict = {}  # (field, level) -> counter
        self._lora_seen: dict = {}
        self._lora_gauges: dict = {}  # (field, level) -> gauge
        self._info_family, self._info_metric, self._info_labels = None, None, None
        self._gauges: dict = {}
        self._preemptions, self._preemptions_seen = None, 0
        self._kv_usage = self._kv_reserved = None
        self._outcomes: dict = {}
        self._hist: dict = {}
        self._tokens: dict = {}
        if enabled:
            self._start(self._create, model)

    def _create(self, model: str) -> None:
        F = pb_utils.MetricFamily
        labels = {"model": model}
        if self._stats is not None:
            fields = self._stats().__dataclass_fields__
            for name in fields:
                fam = self._family(f"triton_vlm_engine_{name}", f"generation engine: {name.replace('_', ' ')}",
                                   F.GAUGE)
                self._gauges[name] = fam.Metric(labels=labels)
            if "kv_blocks_total" in fields:
                fam = self._family(KV_USAGE, "generation engine: KV-cache blocks in use, a 0-1 fraction", F.GAUGE)
                self._kv_usage = fam.Metric(labels=labels)
                fam = self._family(KV_RESERVED, "generation engine: KV-cache blocks reserved by admitted requests "
                                   "(their worst case, what admission sees), a 0-1 fraction", F.GAUGE)
                self._kv_reserved = fam.Metric(labels=labels)
            if "preemptions" in fields:
                fam = self._family("triton_vlm_preemptions_total", "running requests preempted (their KV blocks "
                                   "freed, recomputed when they run again)", F.COUNTER)
                self._preemptions = fam.Metric(labels=labels)
        fam = self._family("triton_vlm_requests_total", "llm requests by outcome", F.COUNTER)
        self._outcomes = {o: fam.Metric(labels={**labels, "outcome": o}) for o in OUTCOMES}
        for kind in ("prompt", "generated"):
            fam = self._family(f"triton_vlm_{kind}_tokens_total", f"{kind} tokens of finished requests", F.COUNTER)
            self._tokens[kind] = fam.Metric(labels=labels)
        for name, (description, buckets, attr) in HISTOGRAMS.items():
            fam = self._family(name, description, F.HISTOGRAM)
            self._hist[attr] = fam.Metric(labels=labels, buckets=buckets)
        if self._lora_levels:
            self._create_lora(labels)
        if self._memory_plan is not None:
            self._create_memory(labels)
        if self._weights_info is not None:
            fam = self._family("triton_vlm_engine_weights_info", "llm weights served: what the checkpoint holds and "
                               "what it is computed as (weights), how the weight matrices are kept in memory (held)",
                               F.GAUGE)
            self._weights = fam.Metric(labels={**labels, **{k: str(v) for k, v in self._weights_info.items()}})
            self._weights.set(1.0)
        if self._prefix_stats is not None:
            for field, what in (("queries", "prompt tokens looked up"), ("hits", "prompt tokens found cached")):
                fam = self._family(f"triton_vlm_prefix_cache_{field}_total", f"prefix cache: {what}", F.COUNTER)
                self._prefix[field] = fam.Metric(labels=labels)

    def _create_memory(self, labels: dict) -> None:
        F, plan = pb_utils.MetricFamily, self._memory_plan
        fam = self._family("triton_vlm_engine_memory_bytes", "llm memory plan made at start, bytes by part", F.GAUGE)
        for part, value in (("limit", plan.limit_bytes), ("weights", plan.weights_bytes),
                            ("activations", plan.activation_bytes), ("other", plan.other_bytes),
                            ("kv_cache", plan.kv_bytes), ("state_slots", plan.state_bytes),
                            ("cuda_graphs", plan.graph_bytes)):
            self._memory[part] = fam.Metric(labels={**labels, "part": part})
            self._memory[part].set(float(value))
        fam = self._family("triton_vlm_engine_kv_cache_tokens", "llm KV cache size in tokens (planned at start)",
                           F.GAUGE)
        self._memory["tokens"] = fam.Metric(labels=labels)
        self._memory["tokens"].set(float(plan.kv_tokens))

    def _create_lora(self, labels: dict) -> None:
        F = pb_utils.MetricFamily
        for field in ("hits", "misses", "evictions", "registry_loads"):
            fam = self._family(f"triton_vlm_lora_cache_{field}_total", f"LoRA adapter cache {field}", F.COUNTER)
            for level, cache in self._lora_levels.items():
                if hasattr(cache.stats, field):
                    self._lora_counters[(field, level)] = fam.Metric(labels={**labels, "level": level})
        for field, what in (("adapters", "adapters held"), ("bytes", "bytes held")):
            fam = self._family(f"triton_vlm_lora_cache_{field}", f"LoRA adapter cache: {what}", F.GAUGE)
            for level in self._lora_levels:
                self._lora_gauges[(field, level)] = fam.Metric(labels={**labels, "level": level})

    def update_gauges(self) -> None:
        """Set the gauges from the engine's state now. Call on a clock of its own (the llm responder's tick), not
        when results arrive: a call made as a final response is sent sees the engine between requests, so
        back-to-back requests shorter than the interval would never be seen running."""
        if self._gauges:
            snap = self._stats()
            for name, gauge in self._gauges.items():
                gauge.set(float(getattr(snap, name)))
            if self._kv_usage is not None:
                self._kv_usage.set(kv_cache_usage(snap))
                self._kv_reserved.set(kv_cache_reserved(snap))
            if self._preemptions is not None and snap.preemptions > self._preemptions_seen:
                self._preemptions.increment(snap.preemptions - self._preemptions_seen)  # cumulative -> increments
                self._preemptions_seen = snap.preemptions
        if self._lora_levels and self._lora_counters:
            self._update_lora()
        if self._prefix:
            snap = self._prefix_stats()
            for field, metric in self._prefix.items():  # cumulative counts -> counter increments
                now = getattr(snap, field)
                if now > self._prefix_seen.get(field, 0):
                    metric.increment(now - self._prefix_seen.get(field, 0))
                    self._prefix_seen[field] = now

    def _update_lora(self) -> None:
        for (field, level), metric in self._lora_counters.items():  # cumulative counts -> counter increments
            now = getattr(self._lora_levels[level].stats, field)
            if now > self._lora_seen.get((field, level), 0):
                metric.increment(now - self._lora_seen.get((field, level), 0))
                self._lora_seen[(field, level)] = now
        for level, cache in self._lora_levels.items():
            self._lora_gauges[("adapters", level)].set(float(len(cache)))
            self._lora_gauges[("bytes", level)].set(float(cache.used_bytes))
        if self._lora_info is not None:
            self._update_lora_info()

    def _update_lora_info(self) -> None:
        """One series at a time: the python backend frees a Metric only with its family, so a new label set
        replaces the whole family (the old one is deleted first: two live families of one name crash Triton)."""
        info = self._lora_info()
        labels = {"running_lora_adapters": ",".join(info.running), "waiting_lora_adapters": ",".join(info.waiting),
                  "max_lora": str(info.max_lora)}
        if labels != self._info_labels:
            self._info_metric, self._info_family, self._info_labels = None, None, labels  # deletes the old one
            self._info_family = pb_utils.MetricFamily(
                name="triton_vlm_lora_requests_info", kind=pb_utils.MetricFamily.GAUGE,
                description="LoRA adapters of running and waiting requests (Gateway API Inference Extension); "
                            "value: the time of the last update")
            self._info_metric = self._info_family.Metric(labels=labels)
        self._info_metric.set(time.time())

    def outcome(self, code: str) -> None:
        """One request answered: `code` is "success" or a `VLMError.code` (INVALID_ARG, ...)."""
        metric = self._outcomes.get(code.lower())
        if metric is not None:
            metric.increment(1)

    def finished(self, stats: Optional[RequestStats]) -> None:
        if stats is None or not self._hist:
            return
        self._tokens["prompt"].increment(stats.prompt_tokens)
        self._tokens["generated"].increment(stats.generated_tokens)
        for attr, metric in self._hist.items():
            value = getattr(stats, attr)
            if value is not None:
                metric.observe(float(value))

    def close(self) -> None:
        self._gauges, self._outcomes, self._hist, self._tokens = {}, {}, {}, {}  # metrics before their families
        self._kv_usage = self._kv_reserved = self._preemptions = None
        self._memory = {}
        self._prefix = {}
        self._lora_counters, self._lora_gauges, self._info_metric, self._info_family = {}, {}, None, None
        super().close()
