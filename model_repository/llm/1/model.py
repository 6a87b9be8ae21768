"""llm (decoupled): merges image embeddings and generates with the configured backend.

`backend` parameter: "engine" (triton_vlm.engine: in-flight batching) or "hf" (transformers generate()).
execute() hands requests over and returns; responses are sent from the backend's thread.
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm.server import cpu_layout  # noqa: E402

# then onto the CPUs the launcher reserved for this stub (`cpu_layout`), before any import or thread pool: the
# imports below would otherwise share the one CPU the server's other processes load on
LLM_CPUS = cpu_layout.apply_llm_cpus()

import dataclasses  # noqa: E402

from triton_vlm.triton import config  # noqa: E402
from triton_vlm.triton.llm import LLMService  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        with lifeline.loading("llm"):  # a failed load ends this stub, whatever threads it started
            self._load(args)

    def _load(self, args):
        config.setup_logging()
        cpu_layout.announce()
        llm_cpus = LLM_CPUS
        p = config.model_parameters(args)
        model_dir = config.resolve_model_path(p.get("model_path", ""))
        device = p.get("device") or "cpu"
        dtype = p.get("dtype") or "float32"
        kind = p.get("backend") or "engine"
        if kind == "hf":
            from triton_vlm.baseline.generate import HFGenerator

            backend = HFGenerator(model_dir, device=device, dtype=dtype)
            tokenizer, image_token_id = backend.tokenizer, backend.image_token_id
            context = backend.model.config.text_config.max_position_embeddings
        elif kind == "engine":
            from triton_vlm.engine.engine import Engine, EngineConfig
            from triton_vlm.params import GuideLimits

            cfg = EngineConfig(device=device, dtype=dtype, max_rows=config.parse_int(p, "max_rows", 64),
                               kv_cache_tokens=config.parse_int(p, "kv_cache_tokens", 0),
                               kv_cache_mb=config.parse_int(p, "kv_cache_mb", 0),
                               gpu_memory_utilization=float(p.get("gpu_memory_utilization") or 0.9),
                               cpu_memory_utilization=float(p.get("cpu_memory_utilization") or 0.5),
                               instances=_instances(args), context_length=config.parse_int(p, "context_length", 0),
                               prefill_chunk=config.parse_int(p, "prefill_chunk", 0),
                               max_queue=config.parse_int(p, "max_queue", 1024),
                               max_loras=config.parse_int(p, "max_loras", 16),
                               lora_cache_device_mb=config.parse_int(p, "lora_cache_device_mb", 256),
                               enable_prefix_caching=config.parse_int(p, "enable_prefix_caching", 1) != 0,
                               cuda_graphs=config.parse_int(p, "cuda_graphs", 1) != 0,
                               cuda_graph_max_rows=config.parse_int(p, "cuda_graph_max_rows", 64),
                               cuda_graph_lora_rank=config.parse_int(p, "cuda_graph_lora_rank", 16),
                               async_scheduling=config.parse_int(p, "async_scheduling", 0) != 0,
                               scheduler_policy=p.get("scheduler_policy") or "guaranteed_no_evict",
                               spare_cpus=_spare_cpus(llm_cpus), guides=GuideLimits.from_parameters(p))
            backend = Engine(model_dir, cfg)  # sizes its KV cache from a worst-case profile (engine/profile.py)
            if p.get("kv_events_endpoint"):  # the prefix cache's events for llm-d's KV-cache indexer
                from triton_vlm.engine.kv import kv_events

                self.kv_events = kv_events.attach(
                    backend, p["kv_events_endpoint"], replay_endpoint=p.get("kv_events_replay_endpoint") or None,
                    topic=p.get("kv_events_topic") or kv_events.default_topic(model_dir.name),
                    layout=p.get("kv_events_layout") or "map")
            tokenizer, image_token_id, context = backend.tokenizer, backend.image_token_id, backend.max_context
        else:
            raise ValueError(f"llm parameter backend must be 'engine' or 'hf', got {kind!r}")
        adapters = _adapter_cache(model_dir, p, dtype)  # both backends: the same registry and wire tensors
        override = config.parse_int(p, "context_length", 0)
        if override:  # a shorter context than the checkpoint's (e.g. to bound KV memory per request)
            context = min(context, override)
            backend.limits = dataclasses.replace(backend.limits, context_length=context)
        self.service = LLMService(backend, tokenizer, image_token_id, context, adapters=adapters)
        self.service.start()
        if llm_cpus is not None and kind == "engine":  # the steps alone on the llm CPUs, the rest of us elsewhere
            cpu_layout.keep_only(backend.thread_id)
        lifeline.settle_heap()  # loaded: no full collection walks the import-time heap again

    def execute(self, requests):
        self.service.execute(requests)
        return None

    def finalize(self):
        self.service.shutdown()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
        lifeline.settle_heap()  # the interpreter's exit does not walk the heap (it took 7-10 s)


def _spare_cpus(llm_cpus) -> tuple:
    """The CPUs of the launcher's rest, lent to the engine's steps while idle (none without a layout)."""
    if llm_cpus is None:
        return ()
    from triton_vlm.server.cpu_layout import spare_cpus

    return spare_cpus(llm_cpus)


def _instances(args) -> int:
    """Instances of this model (instance_group counts): they share the memory the KV budget is drawn from."""
    return max(1, sum(int(g.get("count", 1)) for g in config.model_config(args).get("instance_group", [])))


def _adapter_cache(model_dir, p, dtype: str):
    """LoRA adapters by task id, with the registry of `lora_dir` (a folder of adapters, or none)."""
    from triton_vlm.lora.cache import AdapterCache
    from triton_vlm.lora.registry import Registry
    from triton_vlm.spec import CheckpointSpec

    spec = CheckpointSpec.load(model_dir).text

    registry = Registry(p.get("lora_dir") or None, spec)
    import torch

    from triton_vlm.lora.paths import parse_roots

    return AdapterCache(spec, registry, max_bytes=config.parse_int(p, "lora_cache_host_mb", 1024) * 2**20,
                        max_rank=config.parse_int(p, "max_lora_rank", 64), wire_dtype=getattr(torch, dtype),
                        path_roots=parse_roots(p.get("lora_root")))
