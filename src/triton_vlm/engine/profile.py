"""The KV-cache budget from a worst-case profile: what is left after the weights and the largest activations.

At start the engine runs, on a scratch cache, the forwards that need the most memory (vLLM's memory profiling
with dummy worst-case inputs), `profile_forward`:
- the prefill of the longest prompt the context allows (context - 1 tokens: one new token must fit), filled with
  as many images as fit at the size with the most features (the family's `ImageLayout.max_tokens`); their
  features arrive as the float32 `image_embeds` tensor the llm receives; prefilled in `prefill_chunk` chunks;
- then one decode step of `max_rows` rows at the full context (a beam request of `max_rows` beams: the key
  gather grows with rows x context), with the beam search's log-softmax and top-k over the logits.
It measures the activation peak of those forwards above what was held before them, and sizes the cache:
- `kv_cache_tokens` > 0: that many tokens; else `kv_cache_mb` > 0: what fits in that many MiB (at most 1M
  tokens); else
- on a GPU, vLLM's rule: `gpu_memory_utilization` (default 0.9) x the device's memory, shared between the
  `instances` of the model on the device, less the weights, the activation peak, memory the process holds
  outside torch's allocator, the LoRA device level (`lora_cache_device_mb`) and, when decode steps run as CUDA
  graphs, the graphs' part (`cuda_graphs`): their pool, estimated as the peak of the profile's decode step alone
  (`max_rows` rows at the full context, measured apart from the prefill's: the pool holds about the largest
  graph's activations and is kept apart from the allocator's other memory) + 128 MiB (`GRAPH_POOL_SLACK`: the
  allocator's segment rounding, the capture stream's cuBLAS workspaces), plus their buffers outside the pool
  (`cuda_graph.static_bytes`: the shared logits [max B, vocab] fp32 and every bucket's int64 inputs) and the
  LoRA slot buffers (`graph_slots.buffer_bytes`: max_loras x cuda_graph_lora_rank x the sum over layers and
  projections of (in + out + 1) x 4 bytes). Refused when the device's free memory at start is below that share
  (other processes hold it), as vLLM does;
- on a CPU: `cpu_memory_utilization` (default 0.5) x the memory available at start (MemAvailable, bounded by the
  cgroup's limit), shared between the instances, less the same terms, and at most what `max_rows` rows at the
  full context can hold at once (more could only keep idle prefix-cache blocks, in memory the host shares).
Measurements: CUDA through torch's allocator (`max_memory_allocated` after `reset_peak_memory_stats`) and
`cudaMemGetInfo`; a CPU through the process's resident-set high-water mark (`VmHWM`, reset by writing 5 to
`/proc/self/clear_refs`, after glibc's `malloc_trim` so that memory freed earlier is not silently reused; where
the reset is refused the lifetime mark is used, which can only overstate the peak).
Weights are the bytes of the model's tensors.
Then it refuses to start, naming the numbers, when the cache cannot hold one request at the full context.
The plan (`MemoryPlan`) is logged and exported as gauges by the llm model.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import InvalidArgument
from .cpu import gemm
from .kv.kv_cache import KVCache, blocks_needed
from .model.merge import merge_image_embeds
from .policy import default_prefill_chunk

log = logging.getLogger(__name__)

MAX_MB_TOKENS = 1 << 20  # kv_cache_mb: at most this many tokens
# the CUDA graphs' pool beyond the decode step's peak: the allocator's segments (2 MiB for small blocks, 20 MiB for
# mid-size ones, large ones rounded to 2 MiB) and the capture stream's cuBLAS / cuBLASLt workspaces (up to 32 MiB each)
GRAPH_POOL_SLACK = 128 * 2**20
GiB, MiB = float(2**30), float(2**20)


class KVBudgetError(InvalidArgument):
    """The KV cache cannot hold one worst-case request (or the device lacks the memory asked for)."""


@dataclass(frozen=True)
class WorstCase:
    """The request that needs the most memory: the longest prompt, as many largest images as fit in it."""

    prompt_tokens: int  # context - 1
    images: int
    image_tokens: int  # placeholders per image at the size with the most features
    rows: int  # max_rows, decoded at the full context
    context: int


@dataclass(frozen=True)
class MemoryPlan:
    """What the KV budget was sized from (bytes), for the log and the gauges."""

    device: str
    rule: str  # gpu_memory_utilization | cpu_memory_utilization | kv_cache_mb | kv_cache_tokens
    limit_bytes: int  # this instance's share of memory (0 when the budget was given)
    weights_bytes: int
    activation_bytes: int  # the worst-case forwards' peak above weights and cache
    other_bytes: int  # LoRA device level + (GPU) memory outside torch's allocator
    kv_bytes: int
    kv_tokens: int
    token_bytes: int  # K and V of every layer for one token
    worst: WorstCase
    state_slots: int = 0  # hybrid models: sequences whose linear-layer states are preallocated (max_rows)
    state_bytes: int = 0  # their bytes (taken before the KV cache is sized)
    graph_bytes: int = 0  # CUDA graphs of decode steps: their pool's estimate + their static buffers (0: no graphs)
    graph_pool_bytes: int = 0  # the pool's estimate alone: the profile's decode step's own peak + GRAPH_POOL_SLACK

    @property
    def sequences(self) -> int:
        """Sequences at the full context that fit at once, KV and (hybrid models) state slots both counted."""
        kv = self.kv_tokens // max(1, self.worst.context)
        return min(kv, self.state_slots) if self.state_slots else kv

    def summary(self) -> str:
        w = self.worst
        return (f"KV cache {self.kv_tokens} tokens ({self.kv_bytes / MiB:.1f} MiB, {self.token_bytes} B/token) by "
                f"{self.rule}; limit {self.limit_bytes / MiB:.1f} MiB, weights {self.weights_bytes / MiB:.1f} MiB, "
                f"activations {self.activation_bytes / MiB:.1f} MiB, other {self.other_bytes / MiB:.1f} MiB, "
                f"CUDA graphs {self.graph_bytes / MiB:.1f} MiB (pool {self.graph_pool_bytes / MiB:.1f} MiB); "
                f"worst case: a {w.prompt_tokens}-token prompt with {w.images} images of {w.image_tokens} tokens, "
                f"{w.rows} rows at context {w.context} ({self.device})"
                + (f"; {self.state_slots} state slots ({self.state_bytes / MiB:.2f} MiB): {self.sequences} "
                   "full-context sequences fit" if self.state_slots else ""))


# --- memory readings ---------------------------------------------------------------------------------------
def _proc_kib(path: str, key: str) -> Optional[int]:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", Path(path).read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cpu_available() -> int:
    """Bytes this process may still take: MemAvailable, bounded by the cgroup's limit less its usage."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is None:
        raise KVBudgetError("cannot read MemAvailable from /proc/meminfo to size the KV cache; set the llm "
                           "parameter kv_cache_mb or kv_cache_tokens")
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < 1 << 60:
            avail = min(avail, max(0, limit - usage))
    return avail


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): memory freed earlier but still resident would otherwise be reused by the profile
    without raising the resident set, hiding activations from the high-water mark."""
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim that way
        pass


class MemoryProbe:
    """Memory readings of one device: taken once before the weights load (`start`), then around the profile."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.resettable = True
        if self.cuda:
            self.free_at_start, self.total = torch.cuda.mem_get_info(self.device)
        else:
            self.total = cpu_available()
            self.free_at_start = self.total

    def held(self) -> int:
        """Bytes held now: torch's allocated bytes on a GPU, the resident set on a CPU."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _proc_kib("/proc/self/status", "VmRSS") or 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _malloc_trim()  # freed heap memory back to the OS: the profile's allocations must fault in new pages
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resettable = False  # the lifetime high-water mark: an overstatement, never an understatement

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _proc_kib("/proc/self/status", "VmHWM") or 0

    def outside_allocator(self) -> int:
        """GPU bytes this process holds beyond torch's reserved pool (CUDA context, libraries); 0 on a CPU."""
        if not self.cuda:
            return 0
        free_now, _ = torch.cuda.mem_get_info(self.device)
        return max(0, (self.free_at_start - free_now) - torch.cuda.memory_reserved(self.device))


# --- the worst case ----------------------------------------------------------------------------------------
def worst_case(context: int, image_tokens: Optional[int], max_rows: int) -> WorstCase:
    """`image_tokens`: the most placeholders one image takes (None for a model without images). One prompt
    position is kept for text (a BOS or a question)."""
    prompt = context - 1
    images = (prompt - 1) // image_tokens if image_tokens else 0
    return WorstCase(prompt_tokens=prompt, images=images, image_tokens=image_tokens or 0, rows=max_rows,
                     context=context)


def scratch_cache(model, worst: WorstCase, block_size: int) -> KVCache:
    """A cache for the profile: one row at the full context, then `rows` forks each copying its last block."""
    return model.new_cache(-(-worst.context // block_size) + worst.rows + 1, block_size)


@torch.inference_mode()
def profile_forward(model, cache: KVCache, worst: WorstCase, *, prefill_chunk: int, between=None) -> None:
    """Run the worst-case prefill and decode step (module doc) on `model`, in the scratch `cache`; `between()`, if
    given, is called after the prefill, before the decode step (a second reading of the peak)."""
    c, dev = model.config, model.device
    levels = getattr(model, "deepstack_levels", 0)
    ids = torch.zeros(worst.prompt_tokens, dtype=torch.long, device=dev)  # [P]
    n_img = worst.images * worst.image_tokens
    feats = None
    if n_img and c.image_token_id is not None:
        ids[1:1 + n_img] = c.image_token_id
        feats = torch.zeros(worst.images, worst.image_tokens, c.hidden_size * (1 + levels), dtype=torch.float32,
                            device=dev)  # DeepStack: each token's levels too
    embeds = merge_image_embeds(ids, model.embed(ids), feats, c.image_token_id, levels)  # [P, hidden * (1 + levels)]
    row = cache.new_row(worst.prompt_tokens)  # then decode steps (hybrid models: the recurrent rule)
    for start in range(0, worst.prompt_tokens, prefill_chunk):
        n = min(prefill_chunk, worst.prompt_tokens - start)
        x = embeds[None, start:start + n]
        stack = x[..., c.hidden_size:].unflatten(-1, (levels, c.hidden_size)).movedim(-2, 0) if levels else None
        model.forward(x[..., :c.hidden_size], cache.plan([row], n), cache, deepstack=stack)
    del embeds, feats
    if between is not None:
        between()
    rows = [row] + [cache.fork(row) for _ in range(worst.rows - 1)]
    tokens = torch.zeros(worst.rows, dtype=torch.long, device=dev)
    logits = model.forward(model.embed(tokens)[:, None], cache.plan(rows, 1), cache)  # [rows, vocab]
    scores = torch.log_softmax(logits, dim=-1).reshape(-1)  # the beam search's view of one step
    scores.topk(min(scores.numel(), 2 * worst.rows))


def measure_activations(model, probe: MemoryProbe, worst: WorstCase, *, block_size: int,
                        prefill_chunk: int, decode_apart: bool = False) -> tuple[int, int]:
    """(peak bytes of `profile_forward` above what was held before it (the weights and its scratch cache), and with
    `decode_apart` the peak of its decode step alone above what was held before that step (else 0): the estimate
    of the CUDA graphs' pool, which holds about the largest graphed decode step's activations)."""
    import gc  # noqa: PLC0415

    cache = scratch_cache(model, worst, block_size)
    collecting = gc.isenabled()
    gc.disable()  # garbage freed by a collection during the profile would lower the peak below the truth
    readings: list[int] = []

    def between() -> None:  # the prefill's peak, then the decode step's alone
        readings.append(probe.peak())
        probe.reset_peak()
        readings.append(probe.held())
    try:
        probe.reset_peak()
        before = probe.held()
        profile_forward(model, cache, worst, prefill_chunk=prefill_chunk, between=between if decode_apart else None)
        peak = probe.peak()
    finally:
        if collecting:
            gc.enable()
    del cache  # the forwards' tensors are freed by reference counting when they return
    if probe.cuda:
        torch.cuda.empty_cache()
    if not readings:
        return max(0, peak - before), 0
    prefill_peak, held = readings
    return max(0, max(prefill_peak, peak) - before), max(0, peak - held)


def token_bytes(model) -> int:
    """K and V of one token in every layer that keeps KV (a hybrid model's full-attention layers only)."""
    c = model.config
    return 2 * getattr(model, "kv_layers", c.num_layers) * c.num_kv_heads * c.head_dim * model.dtype.itemsize


def state_bytes(model) -> tuple[int, int]:
    """(slots, bytes of all of them): a hybrid model's state slots (one per row, `kv/hybrid_cache.py`); (0, 0)
    for a model without linear-attention layers."""
    spec = getattr(model, "state_spec", None)
    if spec is None:
        return 0, 0
    return model.state_slots, model.state_slots * spec.slot_bytes()


def model_bytes(model) -> int:
    """Bytes of the model's tensors, each storage once (a tied lm_head is the embedding, or its packed copy)."""
    seen, total = set(), 0
    for t in model.tensors():
        key = id(t) if gemm.is_packed(t) else (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += gemm.nbytes(t)
    return total


# --- the plan ------------------------------------------------------------------------------------------------
def plan_kv_cache(model, config, probe: MemoryProbe, worst: WorstCase, graphs: Optional[int] = None) -> MemoryPlan:
    """Size the KV cache (module doc) for `config` (an `EngineConfig`); raise `KVBudgetError` naming the numbers
    when it cannot hold one request at the full context. `graphs`: the bytes of the CUDA graphs' static buffers when
    decode steps will run as graphs (None: they will not); their pool is estimated here (module doc)."""
    per_token, bs = token_bytes(model), config.block_size
    weights = model_bytes(model)
    chunk = config.prefill_chunk or default_prefill_chunk(model.device)  # 0: by device (the engine resolves it too)
    activations, pool = measure_activations(model, probe, worst, block_size=bs, prefill_chunk=chunk,
                                            decode_apart=graphs is not None)
    pool = 0 if graphs is None else pool + GRAPH_POOL_SLACK
    graph_bytes = 0 if graphs is None else pool + graphs
    other = config.lora_cache_device_mb * 2**20 + probe.outside_allocator()
    slots, states = state_bytes(model)
    limit, left = 0, 0
    if config.kv_cache_tokens > 0:
        rule, kv_tokens = "kv_cache_tokens", config.kv_cache_tokens
    elif config.kv_cache_mb > 0:  # a hybrid model's state slots come out of this budget too
        rule, budget = "kv_cache_mb", config.kv_cache_mb * 2**20 - states
        if budget < 0:
            raise KVBudgetError(f"the state slots do not fit: {slots} slots (max_rows) x {states // slots} B = "
                                f"{states / MiB:.2f} MiB, more than kv_cache_mb {config.kv_cache_mb}; raise "
                                "kv_cache_mb or lower max_rows")
        kv_tokens = min(MAX_MB_TOKENS, budget // per_token)
    else:
        rule = "gpu_memory_utilization" if probe.cuda else "cpu_memory_utilization"
        util = getattr(config, rule)
        limit = int(probe.total * util / config.instances)
        if probe.cuda and probe.free_at_start < limit:
            raise KVBudgetError(
                f"free memory on {probe.device} at start ({probe.free_at_start / GiB:.2f} GiB of "
                f"{probe.total / GiB:.2f} GiB) is less than gpu_memory_utilization {util} x the device / "
                f"{config.instances} instance(s) = {limit / GiB:.2f} GiB; lower gpu_memory_utilization or free "
                "the device")
        left = limit - weights - activations - other - graph_bytes - states
        if states and left < 0 <= left + states:
            raise KVBudgetError(
                f"the state slots do not fit: {slots} slots (max_rows) x {states // slots} B = {states / MiB:.2f} "
                f"MiB, but {rule} {util} x {probe.total / MiB:.1f} MiB / {config.instances} instance(s) less "
                f"weights {weights / MiB:.1f} MiB, activations {activations / MiB:.1f} MiB and other "
                f"{other / MiB:.1f} MiB leaves {(left + states) / MiB:.2f} MiB; lower max_rows or raise {rule}")
        kv_tokens = max(0, left) // per_token
        if not probe.cuda:  # more than max_rows full-context rows could never be held at once
            kv_tokens = min(kv_tokens, config.max_rows * -(-worst.context // bs) * bs)
    kv_tokens = kv_tokens // bs * bs
    plan = MemoryPlan(device=str(probe.device), rule=rule, limit_bytes=limit, weights_bytes=weights,
                      activation_bytes=activations, other_bytes=other, kv_bytes=kv_tokens * per_token,
                      kv_tokens=kv_tokens, token_bytes=per_token, worst=worst, state_slots=slots,
                      state_bytes=states, graph_bytes=graph_bytes, graph_pool_bytes=pool)
    need = blocks_needed(worst.prompt_tokens, 1, 1, bs) * bs
    if kv_tokens < need:
        raise KVBudgetError(_refusal(plan, config, probe, need, left))
    log.info("llm memory: %s", plan.summary())
    return plan


def _refusal(plan: MemoryPlan, config, probe: MemoryProbe, need: int, left: int) -> str:
    head = (f"the KV cache cannot hold one request at the context length ({plan.worst.context} tokens): it needs "
            f"{need} tokens ({need * plan.token_bytes / MiB:.2f} MiB at {plan.token_bytes} B/token) but ")
    if plan.rule == "kv_cache_tokens":
        return head + f"kv_cache_tokens is {config.kv_cache_tokens}; raise it or lower context_length"
    if plan.rule == "kv_cache_mb":
        return head + (f"kv_cache_mb {config.kv_cache_mb} holds {plan.kv_tokens} tokens; raise it or lower "
                       "context_length")
    where = "device memory" if probe.cuda else "memory available at start"
    return head + (
        f"{plan.rule} {getattr(config, plan.rule)} x {probe.total / MiB:.1f} MiB {where} / {config.instances} "
        f"instance(s) = {plan.limit_bytes / MiB:.1f} MiB, less weights {plan.weights_bytes / MiB:.1f} MiB, "
        f"activations {plan.activation_bytes / MiB:.1f} MiB (the worst case: {plan.worst.prompt_tokens} prompt "
        f"tokens with {plan.worst.images} images, {plan.worst.rows} rows), other {plan.other_bytes / MiB:.1f} MiB "
        f"(LoRA device level {config.lora_cache_device_mb} MiB), CUDA graphs {plan.graph_bytes / MiB:.1f} MiB, "
        f"leaves {left / MiB:.2f} MiB = {plan.kv_tokens} tokens; raise {plan.rule}, lower context_length, "
        "max_rows or lora_cache_device_mb, or set kv_cache_mb")


def max_image_tokens(model_dir: str | Path) -> Optional[int]:
    """The most placeholder tokens one image takes in this checkpoint (its family's image layout at the size
    with the most features); None for a checkpoint without a vision tower."""
    from ..families import family_of  # noqa: PLC0415
    from ..spec import CheckpointSpec, read_json  # noqa: PLC0415

    spec = CheckpointSpec.load(model_dir)
    if spec.vision is None or spec.image_token_id is None:
        return None
    extra = read_json(Path(model_dir) / "processor_config.json").get("num_additional_image_tokens")
    return family_of(spec).layout(spec, extra).max_tokens


def text_rules_of(model_dir: str | Path):
    """What the checkpoint's family does differently in the text model (`families.TextRules`: M-RoPE's rule,
    DeepStack levels), as data: the engine's one question to `families/` besides `max_image_tokens`."""
    from ..families import text_rules  # noqa: PLC0415
    from ..spec import CheckpointSpec  # noqa: PLC0415

    return text_rules(CheckpointSpec.load(model_dir))
