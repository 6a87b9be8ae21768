"""The generation engine: one Llama-family model, many concurrent requests, in-flight batching.

Threads: `submit()` and `cancel()` are thread-safe and return at once (Triton's python backend calls them from
`execute()`); requests land in an inbox. `start()` runs a background thread that calls `step()` whenever
there is work and otherwise sleeps on a condition variable (no busy spin), and a delivery thread
(`delivery.py`, `config.delivery_thread`) that makes the results' text (detokenization) and runs the callbacks,
in order, while the next step runs; callbacks must be quick (send a response, set an event). Tests drive `step()` directly instead of `start()`.
What one step does (admission, prefill, decode, results) is in `scheduler.py`; memory in `kv_cache.py`. The
KV cache's size is planned at start from a worst-case profile (`profile.py`; the plan is `Engine.memory`): a
budget that cannot hold one request at the full context refuses to start, naming the numbers.
Prefix caching (`enable_prefix_caching`, on by default; `prefix_cache.py`): `submit()` hashes the prompt's full
blocks (with its images' and adapter's identities), admission reuses the longest cached prefix, and every
result carries `cached_tokens`; `prefix_cache_stats()` counts lookups and hits in tokens.
Scheduler policy (`scheduler_policy`, TensorRT-LLM's names; `preempt.py`): `guaranteed_no_evict` (the default)
reserves each request's worst case at admission and never preempts; `max_utilization` gives one-row requests KV
blocks as they generate and preempts the latest arrived one (recompute) when the cache runs out; it resumes later
with the tokens it would have produced alone. `stats()` counts `preemptions` and `preempted_requests`.
Spare CPUs (`spare_cpus`, a CPU device): the loop's thread starts OpenMP workers on those CPUs, and each step takes
one extra intra-op thread per spare CPU while few requests are in flight and that CPU was not busy with others
(`cpu/spare.py`; chosen by a race at start). CUDA graphs (`cuda_graphs`, on by default, effective on a CUDA device only): decode steps of up to
`cuda_graph_max_rows` rows (LoRA rows too, from static adapter slots of rank <= `cuda_graph_lora_rank`) run on
bucketed static shapes, each bucket's step captured once as a CUDA graph and replayed (`cuda_graph.py`);
`decode_graphs` is None where they are off. Their memory is taken from the KV budget (`profile.py`, part `cuda_graphs`).
Async scheduling (`async_scheduling`, off by default; `overlap.py`): a steady decode step (greedy / one-row sampling
rows without grammars, context processors or LoRA) is launched before the previous step's results are processed.

Failures: a request's own failure ends that request (`scheduler.py`). A step that raises anyway (a bug) is
retried after a pause that doubles while it keeps failing (`faults.Backoff`, up to 2 s) and resets on success.
A CUDA error (`faults.is_device_fault`: the device context may be unusable for good) stops the engine: every
request it holds ends with `Unavailable`, later submits are refused, and `on_fatal(error)` is called on the
thread that saw it (the llm model ends its process there, so that Triton starts a fresh one).

Validation at `submit()` (raises `InvalidArgument` synchronously): `GenerationRequest.validate` (non-empty
prompt of in-vocabulary ids, prompt + max_tokens <= the context length, end ids, bad/stop words, beam width vs
vocabulary), then the engine's capacity: rows <= max_rows, worst-case KV blocks <= the whole cache, a LoRA
adapter that fits the device level (`adapter_slots`), a request id not in use.
Guided decoding (`params.guided`): `submit()` checks the guide and finds its canonical form on the caller's
thread (our own refusals raise `InvalidArgument` there); a grammar not in the cache is compiled on the compiler's
pool (`guide_compiler.GuideCompiler`) while the request waits outside the queue (`_compiling`, vLLM v1's
WAITING_FOR_FSM): other requests are admitted meanwhile. It enters the queue when its grammar is ready, or ends
with a final result carrying `InvalidArgument` when the library cannot compile the guide or the compile outlasts
`config.guides.compile_timeout_s`. Cancelling it, shutting down or a CUDA error end it there like a queued one.
A full queue (`max_queue`) or a shut-down engine raises `Unavailable`. Image placeholder/feature count
mismatches surface at prefill as a final result with `error=InvalidArgument`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import Cancelled, InvalidArgument, Unavailable
from ..spec import CheckpointSpec
from ..params import GenerationParams, GenerationRequest, GenerationResult, GuideLimits, ModelLimits
from .cpu import spare
from .delivery import Delivery
from .lora.adapter_slots import DeviceAdapters
from .lora import graph_slots
from .lora.graph_slots import GraphAdapters
from .model.cuda_graph import DecodeGraphs, static_bytes
from .policy import default_prefill_chunk
from .model.fusion import RACE_KEYS
from .search.decoder import Decoder
from .model.faults import Backoff, as_error, is_device_fault
from .search.guide_compiler import GuideCompiler
from .search.detok import IncrementalDetokenizer
from .kv.kv_cache import blocks_needed
from .model import mrope
from .kv.prefix_cache import PrefixStats, request_hasher
from .model.hybrid import load_model
from .model.model import DTYPES
from .profile import MemoryProbe, max_image_tokens, plan_kv_cache, text_rules_of, worst_case
from .overlap import Overlap
from .preempt import GUARANTEED_NO_EVICT, POLICIES
from .scheduler import Scheduler
from .state import Active, KVState, Output

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"  # float32 | float16 | bfloat16
    max_rows: int = 64  # rows (beams / samples) decoded per step
    # KV budget in tokens (each holds K and V of every layer: 2 * layers * kv_heads * head_dim values, 0.5 MiB
    # for a 7B Llama in fp16); num_blocks = kv_cache_tokens // block_size, preallocated at start. 0: from
    # kv_cache_mb, else from the worst-case profile (`profile.py`); set to the budget chosen at start
    kv_cache_tokens: int = 0
    kv_cache_mb: int = 0  # if > 0 (and no kv_cache_tokens): what fits in this many MiB (at most 1M tokens)
    gpu_memory_utilization: float = 0.9  # profile on a GPU: this fraction of device memory (vLLM's rule)
    cpu_memory_utilization: float = 0.5  # profile on a CPU: this fraction of the memory available at start
    instances: int = 1  # instances of the model sharing that memory (Triton's instance count)
    context_length: int = 0  # > 0: a shorter context than the checkpoint's (bounds KV per request)
    block_size: int = 16
    prefill_chunk: int = 0  # max prompt tokens prefilled per step; 0: by device (`policy.default_prefill_chunk`)
    max_queue: int = 1024  # waiting requests beyond this: submit() raises errors.Unavailable
    # LoRA device level: distinct adapters resident at once (vLLM's max_loras) and their bytes
    max_loras: int = 16
    lora_cache_device_mb: int = 256
    # reuse the KV of cached prompt prefixes (full blocks; vLLM's automatic prefix caching, `prefix_cache.py`)
    enable_prefix_caching: bool = True
    # CUDA graphs of decode steps (`cuda_graph.py`; no effect on a CPU): rows buckets 1, 2, 4, 8, 16, 24, ... up to
    # min(cuda_graph_max_rows, max_rows) (larger steps run eager), keys buckets from cuda_graph_min_keys doubling
    # up to the context
    cuda_graphs: bool = True
    cuda_graph_max_rows: int = 64
    cuda_graph_min_keys: int = 256
    # LoRA inside those graphs (`lora/graph_slots.py`): max_loras static slots of this rank (vLLM's max_lora_rank:
    # its default 16); steps with an adapter of a higher rank run eager; 0: every LoRA step eager, no slot buffers
    cuda_graph_lora_rank: int = 16
    # guaranteed_no_evict: worst-case KV reserved at admission, never preempted; max_utilization: KV on demand,
    # preemption by recompute (`preempt.py`)
    scheduler_policy: str = GUARANTEED_NO_EVICT
    # CPUs beside the engine's that lend the steps intra-op threads while idle (`cpu/spare.py`; the launcher's
    # layout passes its rest); () = none
    spare_cpus: tuple[int, ...] = ()
    # results' text (detokenization) made and their callbacks run on a thread of their own once started (False:
    # on the engine's thread, inside the step, as before; `delivery.py`)
    delivery_thread: bool = True
    # async scheduling (vLLM v1's, SGLang's overlap scheduler; `overlap.py`): a steady decode step (greedy / sampling
    # rows without grammars, context processors or LoRA) is launched before the previous one's results are
    # processed; tokens unchanged. Off by default: measured slower on a 2-core CPU through the real model
    async_scheduling: bool = False
    # guided decoding's compiles: time limit, workers, cache (llm parameters guide_*, `params.GuideLimits`)
    guides: GuideLimits = dataclasses.field(default_factory=GuideLimits)

    def validate(self) -> None:
        self.guides.validate()
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.scheduler_policy not in POLICIES:
            raise InvalidArgument(f"scheduler_policy must be one of {', '.join(POLICIES)}, "
                                  f"got {self.scheduler_policy!r}")
        for name in ("max_rows", "block_size", "max_queue", "max_loras", "lora_cache_device_mb",
                     "instances", "cuda_graph_max_rows", "cuda_graph_min_keys"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_lora_rank < 0:
            raise InvalidArgument("cuda_graph_lora_rank must be >= 0 (0: LoRA steps run eager), got "
                                  f"{self.cuda_graph_lora_rank}")
        if self.kv_cache_tokens < 0 or self.kv_cache_mb < 0 or self.context_length < 0 or self.prefill_chunk < 0:
            raise InvalidArgument("kv_cache_tokens, kv_cache_mb, context_length and prefill_chunk must be >= 0 "
                                  "(0: automatic)")
        for name in ("gpu_memory_utilization", "cpu_memory_utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise InvalidArgument(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for monitoring (exported as Prometheus gauges by the llm model)."""

    waiting_requests: int  # submitted, not admitted yet (queue)
    running_requests: int
    running_rows: int  # beams / samples decoded per step
    kv_blocks_used: int  # held by rows now
    kv_blocks_total: int
    kv_blocks_reserved: int  # promised to admitted requests (their worst case, or on demand): what admission sees
    steps: int  # scheduler iterations since start
    decoded_rows: int  # sum of running rows over all steps (tokens computed)
    lora_running_adapters: int  # distinct LoRA adapters of running requests
    lora_device_adapters: int  # adapters resident in device slots (running ones and idle ones)
    lora_device_bytes: int
    preemptions: int  # running requests preempted since start (max_utilization), cumulative
    preempted_requests: int  # requests waiting to run again after a preemption
    # where the steps' time goes, cumulative (`scheduler.StepTimes`)
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    decode_seconds: float = 0.0
    spare_steps: int = 0  # steps that ran with threads borrowed from the spare CPUs (`cpu/spare.py`)
    # guided decoding (`search/guide_compiler.py`): requests waiting for their grammar (also in waiting_requests),
    # compiles started and requests failed by the compile time limit (cumulative), compiled grammars' bytes cached
    grammar_waiting: int = 0
    guide_compiles: int = 0
    guide_compile_timeouts: int = 0
    guide_cache_bytes: int = 0
    # hybrid models (`kv/hybrid_cache.py`): state slots of the linear layers, all and free (0, 0: none)
    state_slots_total: int = 0
    state_slots_free: int = 0
    # CUDA graphs of decode steps (`model/cuda_graph.py`; all 0 without them), cumulative: graphs captured now,
    # replays (those with LoRA rows among them), decode steps that ran eager (no bucket, adapters the slots cannot
    # hold, a graph waiting for its retry), captures that failed, replays that raised (that step ran uncaptured)
    cuda_graphs_captured: int = 0
    cuda_graph_replays: int = 0
    cuda_graph_lora_replays: int = 0
    cuda_graph_fallbacks: int = 0
    cuda_graph_capture_failures: int = 0
    cuda_graph_replay_errors: int = 0
    prefix_caching: bool = True  # enable_prefix_caching as served (off for hybrid models)


@dataclass(frozen=True)
class LoraInfo:
    """Adapters of running and waiting requests, by name (the Gateway API Inference Extension's LoRA gauge)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int


class Engine:
    def __init__(self, model_dir: str | Path, config: Optional[EngineConfig] = None, *, tokenizer=None):
        self.config = config = config or EngineConfig()
        config.validate()
        probe = MemoryProbe(config.device)  # what this process may use, read before the weights load
        # the checkpoint's decoder (a hybrid model holds one state slot per row: `hybrid.load_model`)
        self.model = load_model(model_dir, config.dtype, config.device, config.max_rows)
        self.model_config = mc = self.model.config
        if config.enable_prefix_caching and getattr(self.model, "no_prefix_cache", None):
            log.info("prefix caching off for this model: %s", self.model.no_prefix_cache)
            config.enable_prefix_caching = False
        quant = CheckpointSpec.load(model_dir).quant  # what the metrics say is served (`/v1/models` says the same)
        self.weights_info = {"weights": quant.label if quant is not None else "unquantized",
                             "held": self.model.weights_held()}
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.tokenizer = tokenizer
        self.image_token_id = mc.image_token_id
        self.text_rules = text_rules_of(model_dir)  # what the family's text model does differently, as data
        self.rope = mrope.PromptRope.from_rules(self.text_rules)  # M-RoPE (Qwen2-VL), None for 1-D positions
        self.model.deepstack_levels = self.text_rules.deepstack_levels  # DeepStack (Qwen3-VL)
        self.eos_ids = mc.eos_token_ids
        self.max_context = min(mc.max_position_embeddings, config.context_length or mc.max_position_embeddings)
        self.limits = ModelLimits(vocab_size=mc.vocab_size, context_length=self.max_context,
                                  eos_ids=tuple(self.eos_ids))
        if not config.prefill_chunk:  # before the profile, which prefills its worst case in these chunks
            config.prefill_chunk = default_prefill_chunk(self.model.device)
        worst = worst_case(self.max_context, max_image_tokens(model_dir), config.max_rows)
        graphed = config.cuda_graphs and self.model.device.type == "cuda" and not (mc.sparse_layers or mc.layer_kinds)
        if hasattr(self.model, "choose_fusion"):  # compiled decode functions, chosen by measurement (`fusion.py`)
            self.model.choose_fusion(config.block_size, min(RACE_KEYS, self.max_context), graphs=graphed)
        self.memory = plan_kv_cache(self.model, config, probe, worst,  # refuses a cache short of one request
                                    self._graph_buffer_bytes() if graphed else None)
        config.kv_cache_tokens = self.memory.kv_tokens
        self.cache = self.model.new_cache(config.kv_cache_tokens // config.block_size, config.block_size)
        self.lora_slots = DeviceAdapters(config.max_loras, config.lora_cache_device_mb * 2**20, self.model.device)
        self.scheduler = Scheduler(self.model, self.cache, self.lora_slots, max_rows=config.max_rows,
                                   prefill_chunk=config.prefill_chunk, decode_text=self._decode_text,
                                   scheduler_policy=config.scheduler_policy)
        self.decode_graphs: Optional[DecodeGraphs] = None
        if graphed:  # (experts, hybrid layers: eager)
            self.decode_graphs = self.make_decode_graphs(capture=True)
            self._capture_graphs()
        if config.async_scheduling and mc.layer_kinds:  # a finished row's state slot could be handed on while the
            # launched step still writes it: hybrid models stay synchronous
            log.info("async scheduling off for this model: its rows hold state slots (hybrid layers)")
        elif config.async_scheduling:  # steady decode steps overlapped with the host (`overlap.py`)
            self.scheduler.overlap = Overlap(self.scheduler)
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._inbox: list[Active] = []
        self._compiling: dict[str, Active] = {}  # request id -> a request waiting for its grammar
        self._waits: dict = {}  # request id -> its wait in the compiler (`GuideCompiler.forget`)
        self.delivery = Delivery()  # runs the callbacks (on its thread once started)
        self._cancels: set[str] = set()
        self._ids: set[str] = set()  # submitted and not yet finished
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()  # the loop's thread set itself up (`_loop`)
        self.spare: Optional[spare.SpareThreads] = None  # set on the loop's thread, when spare CPUs pay
        self._closed = False
        self._steps = 0
        self._decoded_rows = 0
        self.backoff = Backoff()  # the loop's pause after a step that raised
        # called once with the CUDA error that stopped the engine; must not call shutdown() (it runs on the loop)
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        self._guides: Optional[GuideCompiler] = None  # built at the first guided request
        self._guides_lock = threading.Lock()

    def _capture_graphs(self) -> None:
        """Every decode bucket's CUDA graph, captured at start (`DecodeGraphs.capture_all`); timed and logged."""
        t0 = time.perf_counter()
        n = self.decode_graphs.capture_all()
        log.info("captured %d CUDA graphs of decode steps in %.1f s", n, time.perf_counter() - t0)

    def _graph_buffer_bytes(self) -> int:
        """Bytes of the CUDA graphs' buffers outside their pool (`cuda_graph.static_bytes`, the LoRA slots)."""
        c = self.config
        lora = graph_slots.buffer_bytes(self.model_config, self._graph_lora_slots(), c.cuda_graph_lora_rank)
        return lora + static_bytes(self.model_config.vocab_size, min(c.cuda_graph_max_rows, c.max_rows),
                                   self.max_context, c.cuda_graph_min_keys, c.block_size)

    def _graph_lora_slots(self) -> int:
        """The CUDA graphs' static LoRA slots (`graph_slots.slot_count`): max_loras, bounded by the LoRA device budget."""
        c = self.config
        if not c.cuda_graph_lora_rank:
            return 0
        return graph_slots.slot_count(self.model_config, c.max_loras, c.cuda_graph_lora_rank,
                                      c.lora_cache_device_mb * 2**20)

    def make_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Route decode steps through bucketed static shapes (`cuda_graph.py`), captured as CUDA graphs with
        `capture`; without, the same padded steps run uncaptured (any device: how tests check that path)."""
        c = self.config
        slots = self._graph_lora_slots()
        if c.cuda_graph_lora_rank and not slots:
            log.info("LoRA steps run eager: one static adapter slot of rank %d does not fit lora_cache_device_mb=%d",
                     c.cuda_graph_lora_rank, c.lora_cache_device_mb)
        lora = GraphAdapters(self.model_config, slots, c.cuda_graph_lora_rank, self.model.device) \
            if slots else None  # LoRA steps inside the graphs: static slots
        graphs = DecodeGraphs(self.model, self.cache, max_rows=min(c.cuda_graph_max_rows, c.max_rows),
                              context=self.max_context, min_keys=c.cuda_graph_min_keys, capture=capture, lora=lora)
        self.decode_graphs = self.scheduler.runner.graphs = graphs
        return graphs

    def stats(self) -> EngineStats:
        with self._cond:
            compiling = len(self._compiling)
            inbox = len(self._inbox) + compiling
        sched = self.scheduler
        guides = self._guides
        running = list(sched.running)
        preempted = sum(1 for a in list(sched.waiting) if a.preemptions)
        states = getattr(self.cache, "states", None)  # a hybrid model's state slots
        return EngineStats(
            waiting_requests=inbox + len(sched.waiting), running_requests=len(running),
            running_rows=sum(len(a.kv.rows) for a in running), kv_blocks_used=self.cache.used_blocks,
            kv_blocks_total=self.cache.num_blocks, kv_blocks_reserved=self.cache.reserved, steps=self._steps,
            decoded_rows=self._decoded_rows,
            lora_running_adapters=len({id(a.req.adapter) for a in running if a.req.adapter is not None}),
            lora_device_adapters=len(self.lora_slots), lora_device_bytes=self.lora_slots.used_bytes,
            preemptions=sched.preemptions, preempted_requests=preempted, **dataclasses.asdict(sched.times),
            spare_steps=self.spare.lent_steps if self.spare is not None else 0, grammar_waiting=compiling,
            guide_compiles=guides.compiles if guides is not None else 0,
            guide_compile_timeouts=guides.timeouts if guides is not None else 0,
            guide_cache_bytes=guides.cached_bytes if guides is not None else 0,
            state_slots_total=states.slots if states is not None else 0,
            state_slots_free=states.free if states is not None else 0,
            prefix_caching=self.config.enable_prefix_caching, **self._graph_stats())

    def _graph_stats(self) -> dict[str, int]:
        """The CUDA graphs' counters for `stats()` (EngineStats' `cuda_graph*` fields); {} without graphs."""
        g = self.decode_graphs
        if g is None:
            return {}
        return dict(cuda_graphs_captured=g.captured, cuda_graph_replays=g.replays, cuda_graph_lora_replays=g.lora_replays,
                    cuda_graph_fallbacks=g.fallbacks, cuda_graph_capture_failures=g.capture_failures,
                    cuda_graph_replay_errors=g.replay_errors)

    def prefix_cache_stats(self) -> PrefixStats:
        """Prefix-cache lookups so far, in tokens (cumulative; a copy)."""
        return dataclasses.replace(self.cache.prefix_stats)

    def lora_info(self) -> LoraInfo:
        with self._cond:
            inbox = [a.req.adapter for a in self._inbox + list(self._compiling.values())]
        running = [a.req.adapter for a in list(self.scheduler.running)]
        waiting = inbox + [a.req.adapter for a in list(self.scheduler.waiting)]
        return LoraInfo(running=tuple(sorted({x.name for x in running if x is not None})),
                        waiting=tuple(sorted({x.name for x in waiting if x is not None})),
                        max_lora=self.config.max_loras)

    def _make_detok(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- requests -----------------------------------------------------------------------------------------
    def rows_for(self, params: GenerationParams) -> int:
        return max(params.beam_width, params.num_return_sequences)

    def validate(self, req: GenerationRequest) -> int:
        """Raise InvalidArgument for a request this engine can never serve; return its KV block reservation.
        The request's own rules are `GenerationRequest.validate`; these are the engine's capacity."""
        req.validate(self.limits)
        p = req.params
        rows = self.rows_for(p)
        if rows > self.config.max_rows:
            raise InvalidArgument(
                f"the request needs {rows} rows (beam_width / num_return_sequences), "
                f"max_rows is {self.config.max_rows}")
        need = blocks_needed(len(req.input_ids), p.max_tokens, rows, self.config.block_size)
        if need > self.cache.num_blocks:
            raise InvalidArgument(
                f"the request needs up to {need} KV blocks of {self.config.block_size} tokens, the cache holds "
                f"{self.cache.num_blocks}; lower max_tokens, beam_width or the prompt length")
        return need

    def submit(self, req: GenerationRequest, on_result: Callable[[GenerationResult], None]) -> None:
        need = self.validate(req)
        if self.rope is not None:  # the prompt's 3-D positions, here on the caller's thread
            req.rope = self.rope(req.input_ids, req.image_sizes, req.media_grids, req.media_seconds)
        if req.adapter is not None:
            self.lora_slots.check(req.adapter)  # larger than the whole device level: it could never run
        p = req.params
        guide = grammar = None
        if p.guided is not None:  # checked and made canonical here; compiled off this thread when not cached
            compiler = self.guide_compiler()
            guide = compiler.key(p.guided)
            grammar = compiler.cached(guide)
        active = Active(req=req, on_result=on_result, decoder=None, width=self.rows_for(p), kv=KVState(worst=need),
                        make_detok=self._make_detok if p.stream else None)
        if grammar is not None or guide is None:
            active.decoder = self._decoder(req, grammar)
        if self.config.enable_prefix_caching:  # hashed here, on the caller's thread, not the engine's
            active.kv.hasher = request_hasher(req, self.config.block_size, self.model_config.placeholder_ids)
        with self._cond:
            if self._closed:
                raise Unavailable("the engine is shut down")
            if req.request_id in self._ids:
                raise InvalidArgument(f"request_id {req.request_id!r} is already in use")
            waiting = len(self._inbox) + len(self._compiling) + len(self.scheduler.waiting)
            if waiting >= self.config.max_queue:
                raise Unavailable(f"the request queue is full ({self.config.max_queue} waiting); retry later")
            self._ids.add(req.request_id)
            if active.decoder is not None:
                self._inbox.append(active)
                self._cond.notify_all()
            else:
                self._compiling[req.request_id] = active
        if active.decoder is None:
            wait = compiler.request(guide, lambda g, error: self._grammar_ready(active, g, error))
            with self._cond:
                if self._compiling.get(req.request_id) is active:
                    self._waits[req.request_id] = wait

    def _decoder(self, req: GenerationRequest, grammar) -> Decoder:
        return Decoder(req.params, list(req.input_ids), eos_ids=list(req.end_ids(self.limits)),
                       vocab_size=self.model_config.vocab_size, bad_words_ids=req.bad_words_ids,
                       stop_words_ids=req.stop_words_ids, grammar=grammar)

    def _grammar_ready(self, active: Active, grammar, error: Optional[Exception]) -> None:
        """(a compile worker or the time limit's thread) The request's grammar, or why there is none: into the
        queue, or its final result. Nothing when it was cancelled or ended meanwhile."""
        with self._cond:
            if self._compiling.get(active.id) is not active:
                return
        if error is None:
            try:
                active.decoder = self._decoder(active.req, grammar)
            except Exception as e:  # noqa: BLE001 - that request's failure only
                error = e if isinstance(e, InvalidArgument) else as_error(e, f"while setting up request {active.id}")
        with self._cond:
            if self._compiling.pop(active.id, None) is not active:
                return
            self._waits.pop(active.id, None)
            if error is None and self._closed:
                error = Unavailable("the engine is shut down")
            if error is None:
                self._inbox.append(active)
                self._cond.notify_all()
                return
        self._deliver(self.scheduler.output.fail(active, error))

    def _end_compiling(self, error_of: Callable[[Active], Exception], only: Optional[str] = None) -> list[Output]:
        """Take requests waiting for their grammar (all, or the one id `only`) out; -> their final results."""
        with self._cond:
            ids = [only] if only is not None else list(self._compiling)
            ended = [a for a in (self._compiling.pop(i, None) for i in ids) if a is not None]
            waits = [self._waits.pop(a.id, None) for a in ended]
        if self._guides is not None:
            for w in waits:
                self._guides.forget(w)
        return [o for a in ended for o in self.scheduler.output.fail(a, error_of(a))]

    def guide_compiler(self) -> GuideCompiler:
        """Guided decoding's grammar compiler for the checkpoint's tokenizer (built once, on first use)."""
        with self._guides_lock:
            if self._guides is None:
                self._guides = GuideCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_ids,
                                             limits=self.config.guides)
            return self._guides

    def cancel(self, request_id: str) -> None:
        """The request frees its rows and cache at the next step and gets a final result with errors.Cancelled."""
        ended = self._end_compiling(lambda a: Cancelled(f"request {a.id} was cancelled"), only=request_id)
        if ended:
            self._deliver(ended)
            return
        with self._cond:
            if request_id in self._ids:
                self._cancels.add(request_id)
                self._cond.notify_all()

    # --- the loop -------------------------------------------------------------------------------------------
    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._cancels) or self.scheduler.has_work()

    def step(self) -> bool:
        """One scheduler iteration; True if work remains. The results made before an exception escapes the step
        are still delivered; a CUDA error stops the engine (`_stop_on_fault`) and returns False."""
        fault: Optional[BaseException] = None
        with self._step_lock:
            with self._cond:
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
            for a in inbox:
                self.scheduler.add(a)
            outputs: list[Output] = []

            def flush() -> None:  # a prefill's first token goes out at once, not at the end of the step
                batch = outputs[:]
                outputs.clear()
                self._deliver(batch)

            try:
                in_flight = len(self.scheduler.waiting) + len(self.scheduler.running)
                with self.spare.step(in_flight) if self.spare is not None else contextlib.nullcontext():
                    self.scheduler.step(cancels, outputs, flush)
            except Exception as e:  # noqa: BLE001
                if not is_device_fault(e):
                    raise
                fault = e
            finally:
                self._steps += 1
                self._decoded_rows += sum(len(a.kv.rows) for a in self.scheduler.running)
                self._deliver(outputs)
            fault = fault or self.scheduler.fault
            if fault is not None:
                self._stop_on_fault(fault)
        if fault is not None:
            self._report_fatal(fault)
            return False
        with self._cond:
            return self._has_work_locked()

    def _stop_on_fault(self, error: BaseException) -> None:
        """(holding the step lock) Refuse new requests and end every request held with Unavailable."""
        log.critical("engine: CUDA error, the engine stops: %s", error, exc_info=error)
        with self._cond:
            self._closed = True
            inbox, self._inbox = self._inbox, []
            self._cancels.clear()
            self._cond.notify_all()
        for a in inbox:
            self.scheduler.add(a)
        down = Unavailable(f"the llm engine stopped after a CUDA error ({type(error).__name__}: {error}); it "
                           "restarts, retry")
        self._deliver(self.scheduler.fail_all(down) + self._end_compiling(lambda a: down))

    def _report_fatal(self, error: BaseException) -> None:
        if self.on_fatal is None:
            return
        self.delivery.wait_idle()  # every final result handed over before the caller ends the process
        try:
            self.on_fatal(error)
        except Exception:  # noqa: BLE001
            log.exception("on_fatal failed")

    def _deliver(self, outputs) -> None:
        with self._cond:
            for _, res in outputs:
                if res.final:
                    self._ids.discard(res.request_id)
        self.delivery.deliver(outputs)

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._closed = False
            self._started.clear()
            if self.config.delivery_thread:
                self.delivery.start()
            self._thread = threading.Thread(target=self._loop, name="triton-vlm-engine", daemon=True)
            self._thread.start()
        if not self._started.wait(60):  # its OpenMP workers exist once it returns (the launcher's layout moves
            log.warning("engine loop did not set up within 60 s")  # the stub's other threads after it)

    @property
    def thread_id(self) -> Optional[int]:
        """The native id of the thread that runs the steps (None before `start`)."""
        thread = self._thread
        return thread.native_id if thread is not None else None

    def _loop(self) -> None:
        try:
            if self.config.spare_cpus and self.model.device.type == "cpu":
                c = self.model_config
                self.spare = spare.SpareThreads.start(tuple(self.config.spare_cpus), c.hidden_size,
                                                      2 * (c.intermediate_size or c.shared_expert_size
                                                           or c.moe_intermediate_size))  # all-sparse: no dense MLP
        except Exception:  # noqa: BLE001 - a speed path never stops the engine (start() itself never raises)
            log.exception("spare CPUs not used")
        finally:
            self._started.set()
        while True:
            with self._cond:
                idle = self._wait_for_work()
                resume = time.monotonic() + self.backoff.delay  # new requests do not cut the pause short
                while idle is None and not self._closed and (left := resume - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    return
            if idle is not None:  # nothing to do for a while: the spare CPUs' race again
                idle()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - not a request's own failure (those end the request): a bug
                log.exception("engine step failed; next attempt in %.2f s", self.backoff.failed())
            else:
                self.backoff.reset()

    def _wait_for_work(self) -> Optional[Callable[[], None]]:
        """Under the lock: wait until there is work or the engine closes (None), or, while the spare CPUs' race
        is undecided, until `spare.RETRY_S` passed idle: then the race to run."""
        while not self._closed and not self._has_work_locked():
            pending = self.spare is not None and self.spare.pending()
            if not self._cond.wait(spare.RETRY_S if pending else None) and pending:
                if not self._closed and not self._has_work_locked():
                    return self.spare.retry
        return None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still queued or running get a final result with errors.Unavailable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("engine loop did not stop within %.1f s", timeout)
                return
        with self._step_lock:
            with self._cond:
                inbox, self._inbox = self._inbox, []
                self._cancels.clear()
            for a in inbox:
                self.scheduler.add(a)
            down = Unavailable("the engine was shut down")
            self._deliver(self.scheduler.fail_all(down) + self._end_compiling(lambda a: down))
            if self.scheduler.overlap is not None:
                self.scheduler.overlap.close()
        self.delivery.stop(timeout)  # what is queued is delivered first

    # --- convenience -----------------------------------------------------------------------------------------
    def generate(self, reqs: list[GenerationRequest]) -> dict[str, list[GenerationResult]]:
        """Submit `reqs` and wait for all of them; request_id -> every result sent (streamed pieces, final)."""
        results: dict[str, list[GenerationResult]] = {r.request_id: [] for r in reqs}
        remaining = set(results)
        done = threading.Event()
        lock = threading.Lock()

        def on_result(res: GenerationResult) -> None:
            with lock:
                results[res.request_id].append(res)
                if res.final:
                    remaining.discard(res.request_id)
                    if not remaining:
                        done.set()

        if not reqs:
            return results
        for r in reqs:
            self.submit(r, on_result)
        if self._thread is not None:
            done.wait()
        else:
            while not done.is_set():
                if not self.step() and not done.is_set():
                    with self._cond:
                        if self._compiling or self._inbox:  # grammars compiling: wait for one
                            self._cond.wait(0.05)
                            continue
                    raise RuntimeError("engine idle with requests unfinished")  # a bug, never expected
        return results
