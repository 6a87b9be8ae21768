"""Decode steps on static, bucketed shapes: replayed as CUDA graphs on a GPU (vLLM's / gpt-fast's design).

A decode step of `n` rows whose longest row holds `t` keys (after this step's token) runs on the buffers of the
bucket (B, T): B the smallest rows bucket >= n, T the smallest keys bucket >= t. Per bucket one int64 device
buffer holds every input of the step, `[B * (5 + NB)]` (NB = ceil(T / block_size)), viewed as

    ids [B]  positions [B, 1]  rope [B, 1]  write slots [B]  LoRA slots [B]  block tables [B, NB]

(`rope`: the rotary positions, the cache positions + each row's M-RoPE delta, so Qwen2-VL's steps after an image
prompt replay the same graphs; `LoRA slots`: each row's adapter slot in the static LoRA buffers, -1 for none)
and is filled by one copy from a host tensor (pinned on a GPU: a non-blocking copy, no host-device sync; the
caching host allocator keeps it until the copy has run). What the forward needs beyond that is computed on the
device, inside the graph: read slots [B, T] = table * block_size + offset (column j is position j, as
`KVCache.plan`), the causal mask [B, 1, 1, T] = column <= position, the embeddings. The step then runs
`LlamaModel.forward` on those buffers: captured once as a `torch.cuda.CUDAGraph` and replayed (`capture=True`,
CUDA), or simply called (`capture=False`: the same code, runnable on a CPU, which is how tests/engine checks it).
The graph ends by copying the logits into one shared output buffer [max B, vocab]; the step returns a copy of its
first n rows (the next replay overwrites the buffer).

Padding. Rows n..B-1 feed token `pad_token` at position 0, write their K/V into the cache's `scratch_slot`
(a slot of no block, never read by a row) and read block 0 with only column 0 unmasked (finite values: no NaN);
their logits are dropped. Columns of a real row past its length are masked (weight exactly 0). A row's
logits depend only on its own inputs: padding content never changes them (tests: bit for bit); a different B or T
may change the floating-point blocking of the GEMMs / attention reductions in the last bits, as batching
already does (model.py "Batch invariance").

Buckets. Rows: vLLM's capture sizes, 1, 2, 4, then multiples of 8 up to `max_rows` (itself included). Keys:
`min_keys` doubling up to the context length (itself the last bucket). T is bucketed, not fixed at the context:
the gather of K/V and the attention read B x T keys per layer, so a fixed T = 4096 would make a 64-row step
move 64 x 4096 keys per layer even when rows hold 100 tokens; power-of-two buckets cost at most 2x the
attention part (the GEMMs, which dominate decode at short contexts, do not depend on T) for a small graph
count: rows buckets x keys buckets, e.g. 11 x 5 = 55 for 64 rows and a 4096 context (twice that with LoRA graphs).
A graph is kept for the engine's life (a fixed, bounded set; no eviction).
Memory: all graphs share one memory pool (`torch.cuda.graph_pool_handle()`), and each graph's intermediates
are dead once it returns (its logits are copied to the shared output), so the pool holds about the largest
graph's activations, not their sum; graphs replay one at a time on one stream, which makes that reuse safe.

LoRA (`lora/graph_slots.py`, vLLM's design): with `lora` (`GraphAdapters`, on a GPU when `cuda_graph_lora_rank` >
0) a bucket has a second graph that records the masked stacked deltas of every projection over static slot buffers
(`max_loras` slots of rank `cuda_graph_lora_rank`, zero-padded); the step's rows name their slot in the `LoRA
slots` column, and loading an adapter into a slot copies into those buffers (never reallocated: captured graphs stay
valid). Rows without an adapter add exactly 0 (their logits are the plain graph's, bit for bit). The math is
`lora.add_masked_delta`, the eager path's own function; only the GEMMs' width differs (every slot's columns),
so deltas agree with the eager ones to fp32 rounding. Steps without any adapter replay the plain graph (they
pay nothing for LoRA).

Capture (`_capture`, `_record`): the bucket's buffers are first set to all padding rows (so warm-up writes only the
scratch slot), two warm-up runs on a side stream (lazy initialisation: cuBLAS workspaces, kernel choices), then
`torch.cuda.graph(g, pool=...)` records one run; everything in `torch.inference_mode()`. Failures never turn the
graphs off for good: a capture that fails (an operation that cannot be captured, including CUDA's own capture
errors, "operation not permitted when stream is capturing") is logged, that graph's steps run
eager, and it is captured again after RETRY_STEPS decode steps, doubling after each failure, up to CAPTURE_TRIES
tries (`Recorded`); the other buckets keep their graphs. A replay that raises an error that is no CUDA fault is
counted (`replay_errors`), that step runs uncaptured on the same inputs (the same math), and the graph is dropped
and captured again after the same back-off. A CUDA fault is the engine's to report, as anywhere.

Memory (`profile.py`, part `cuda_graphs`): the pool is estimated before the KV cache is sized as the measured
activation peak of the profile's decode step (`max_rows` rows at the full context, an upper bound of the largest
bucket's) + `profile.GRAPH_POOL_SLACK` (segment rounding, the capture stream's cuBLAS workspaces), plus the buffers
outside the pool (`static_bytes`: the shared logits and the buckets' inputs) and the LoRA slot buffers
(`graph_slots.buffer_bytes`); the KV budget is what is left. `capture_all` measures what the captures reserved
(`pool_bytes`, logged beside the estimate).

Known limits: a step with more rows or keys than the largest bucket, or with adapters the LoRA slots cannot hold
(a rank above `cuda_graph_lora_rank`, more distinct adapters than slots), runs the eager forward (`ModelRunner.decode`);
prefill always runs eager. The LoRA graphs are captured at the first LoRA step that needs them (a deployment that
serves no adapter pays no capture for them), which stalls that one step.

At start (`capture_all`, called by the engine) every bucket's plain graph is captured, the largest first: a capture
in the middle of serving stalls every stream for its warm-up runs (the GPU check on an H200 measured a 7B model's
one stream at 142 tok/s with the capture inside the request).
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .faults import is_device_fault
from ..kv.kv_cache import AttentionBatch, KVCache, RowKV
from ..lora.graph_slots import GraphAdapters
from .model import LlamaModel

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (as torch.cuda.make_graphed_callables)
CAPTURE_TRIES = 4  # captures of one graph that failed before its steps stay eager for good
RETRY_STEPS = 64  # decode steps before a failed capture is tried again; doubled after each failure


def rows_buckets(max_rows: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then multiples of 8, up to max_rows (included)."""
    return sorted({s for s in (1, 2, 4) if s <= max_rows} | set(range(8, max_rows + 1, 8)) | {max_rows})


def keys_buckets(context: int, min_keys: int) -> list[int]:
    """min_keys, doubling, below the context; the context itself last."""
    out, t = [], min_keys
    while t < context:
        out.append(t)
        t *= 2
    return out + [context]


def static_bytes(vocab: int, max_rows: int, context: int, min_keys: int, block_size: int) -> int:
    """Bytes of the buffers outside the graphs' pool: the shared logits [max B, vocab] fp32 and every bucket's
    int64 inputs [B * (5 + NB)] (`profile.py` adds them to the pool's part)."""
    rows, keys = rows_buckets(max_rows), keys_buckets(context, min(min_keys, context))
    inputs = sum(b * (5 + -(-t // block_size)) for b in rows for t in keys)
    return rows[-1] * vocab * 4 + inputs * 8


@dataclass(eq=False)
class Recorded:
    """One graph of a bucket (plain, or with the LoRA slots) and its capture attempts."""

    graph: Any = None  # torch.cuda.CUDAGraph once captured
    failures: int = 0  # captures (or replays) that failed
    retry_at: int = 0  # the decode step from which a failed capture may be tried again

    def due(self, step: int) -> bool:
        return self.failures < CAPTURE_TRIES and step >= self.retry_at

    def failed(self, step: int) -> None:
        """Back off: the next capture after RETRY_STEPS x 2^(failures - 1) more steps (none after CAPTURE_TRIES)."""
        self.graph = None
        self.failures += 1
        self.retry_at = step + RETRY_STEPS * 2 ** (self.failures - 1)


@dataclass(eq=False)
class Bucket:
    """The static inputs (and the graphs, once captured) of decode steps of shape (rows, keys)."""

    rows: int  # B
    keys: int  # T
    blocks: int  # NB = ceil(T / block_size)
    inputs: torch.Tensor  # [B * (5 + NB)] int64 on the device: ids | positions | rope | write | LoRA slots | tables
    graphs: dict = field(default_factory=lambda: {False: Recorded(), True: Recorded()})  # with LoRA? -> its graph

    @property
    def graph(self) -> Any:
        """The graph of steps without LoRA (None: not captured)."""
        return self.graphs[False].graph

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs[:self.rows]  # [B]

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs[self.rows:2 * self.rows].view(self.rows, 1)  # [B, 1]

    @property
    def rope(self) -> torch.Tensor:
        """Rotary positions [B, 1]: the cache positions + each row's M-RoPE delta (0 without one)."""
        return self.inputs[2 * self.rows:3 * self.rows].view(self.rows, 1)

    @property
    def write_slots(self) -> torch.Tensor:
        return self.inputs[3 * self.rows:4 * self.rows]  # [B]

    @property
    def lora_slots(self) -> torch.Tensor:
        return self.inputs[4 * self.rows:5 * self.rows]  # [B]: each row's adapter slot, -1 for none

    @property
    def tables(self) -> torch.Tensor:
        return self.inputs[5 * self.rows:].view(self.rows, self.blocks)  # [B, NB]


class DecodeGraphs:
    """Bucketed static-shape decode steps for one model and its KV cache; `decode` or None (not applicable).
    `lora`: the static LoRA slot buffers (`lora/graph_slots.py`; None: steps with an adapter run eager)."""

    def __init__(self, model: LlamaModel, cache: KVCache, *, max_rows: int, context: int, min_keys: int = 256,
                 capture: bool = True, lora: Optional[GraphAdapters] = None):
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.cache, self.capture, self.lora = model, cache, capture, lora
        self.rows_buckets = rows_buckets(max_rows)
        self.keys_buckets = keys_buckets(context, min(min_keys, context))
        self.device = model.device
        self.pad_token = 0  # what padding rows feed (any id: their results are dropped)
        self._buckets: dict[tuple[int, int], Bucket] = {}
        self._out = torch.empty(self.rows_buckets[-1], model.config.vocab_size, dtype=torch.float32,
                                device=self.device)  # [max B, vocab]: every graph's logits land here
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._side: Any = None  # the one side stream of every capture's warm-up (one cuBLAS workspace, not one each)
        self.enabled = True
        self.steps = 0  # decode steps asked for (the clock of the capture retries)
        self.pool_bytes = 0  # measured on a GPU: the memory the captures reserved (`capture_all`, logged)
        # counters (tests, monitoring): graphs captured, replays (LoRA ones too), uncaptured static steps, eager
        # fallbacks, steps with LoRA rows taken, captures that failed, replays that raised (that step ran uncaptured)
        self.captures = self.replays = self.lora_replays = self.static_steps = self.fallbacks = 0
        self.lora_steps = self.capture_failures = self.replay_errors = 0

    def bucket_shape(self, rows: int, keys: int) -> Optional[tuple[int, int]]:
        """(B, T) for a step of `rows` rows reading up to `keys` keys; None beyond the largest bucket."""
        i, j = bisect.bisect_left(self.rows_buckets, rows), bisect.bisect_left(self.keys_buckets, keys)
        if i == len(self.rows_buckets) or j == len(self.keys_buckets):
            return None
        return self.rows_buckets[i], self.keys_buckets[j]

    @property
    def captured(self) -> int:
        return sum(r.graph is not None for b in self._buckets.values() for r in b.graphs.values())

    def decode(self, rows: list[RowKV], tokens: Sequence[int], row_adapters: Sequence[Any] = (),
               deltas: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
        """Append one token to every row and run the step on its bucket: fp32 logits [rows, vocab]. None (rows
        untouched) where the step must run eager: too many rows or keys, adapters the LoRA slots cannot hold, a
        graph not captured (failed, waiting for its retry), graphs off. `deltas`: each row's rotary position -
        cache position (M-RoPE rows after an image prompt; None: 0)."""
        self.steps += 1
        shape = self.bucket_shape(len(rows), max(r.length for r in rows) + 1)
        lora = any(a is not None for a in row_adapters)
        slots = None
        if self.enabled and shape is not None and lora and self.lora is not None:
            slots = self.lora.assign(row_adapters)  # [rows] slot or -1; None: they do not fit
        if not self.enabled or shape is None or (lora and slots is None):
            self.fallbacks += 1
            return None
        b = self._bucket(*shape)
        rec = b.graphs[lora]
        if self.capture and rec.graph is None and not (rec.due(self.steps) and self._capture(b, lora)):
            self.fallbacks += 1
            return None
        write = [s for r in rows for s in self.cache.append(r, 1)]
        host = self._host_inputs(b, rows, tokens, write, deltas, slots)  # [B * (5 + NB)]
        if self.device.type == "cuda":
            host = host.pin_memory()
        b.inputs.copy_(host, non_blocking=True)  # from pinned memory: asynchronous, no sync
        self.lora_steps += lora
        if rec.graph is not None and self._replay(b, lora):
            return self._out[:len(rows)].clone()  # [n, vocab]; the next replay overwrites _out
        self._run(b, lora)
        self.static_steps += 1
        return self._out[:len(rows)].clone()

    def _replay(self, b: Bucket, lora: bool) -> bool:
        """Replay the bucket's graph; False (the step then runs uncaptured on the same inputs) when the replay raised
        an error that is no CUDA fault: counted, the graph dropped and captured again after a back-off."""
        rec = b.graphs[lora]
        try:
            rec.graph.replay()
        except Exception as e:  # noqa: BLE001
            if is_device_fault(e):
                raise
            log.exception("replaying the CUDA graph of decode steps (%d rows, %d keys%s) failed; this step runs "
                          "uncaptured, the graph is captured again later", b.rows, b.keys, ", LoRA" if lora else "")
            self.replay_errors += 1
            rec.failed(self.steps)
            return False
        self.replays += 1
        self.lora_replays += lora
        return True

    # --- buffers -------------------------------------------------------------------------------------------
    def _bucket(self, rows: int, keys: int) -> Bucket:
        b = self._buckets.get((rows, keys))
        if b is None:
            nb = -(-keys // self.cache.block_size)
            inputs = torch.zeros(rows * (5 + nb), dtype=torch.long, device=self.device)
            b = self._buckets[(rows, keys)] = Bucket(rows, keys, nb, inputs)
        return b

    def _host_inputs(self, b: Bucket, rows: list[RowKV], tokens: Sequence[int], write: list[int],
                     deltas: Optional[Sequence[int]] = None, slots: Optional[list[int]] = None) -> torch.Tensor:
        """The step's inputs as one host int64 tensor in the bucket's layout; rows past len(rows) are padding."""
        pad = b.rows - len(rows)
        ids = list(tokens) + [self.pad_token] * pad
        positions = [r.length - 1 for r in rows] + [0] * pad  # after append: the new token's position
        rope = [p + d for p, d in zip(positions, deltas)] + [0] * pad if deltas is not None else positions
        write_slots = write + [self.cache.scratch_slot] * pad
        lora = (slots if slots is not None else [-1] * len(rows)) + [-1] * pad
        tables = [x for r in rows for x in r.blocks[:b.blocks] + [0] * (b.blocks - len(r.blocks))]  # pad: block 0
        return torch.tensor(ids + positions + rope + write_slots + lora + tables + [0] * (pad * b.blocks),
                            dtype=torch.long)

    def _set_padding(self, b: Bucket) -> None:
        """Every row of the bucket a padding row (capture and warm-up write only the scratch slot)."""
        b.inputs.zero_()
        b.ids.fill_(self.pad_token)
        b.write_slots.fill_(self.cache.scratch_slot)
        b.lora_slots.fill_(-1)

    # --- the step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, b: Bucket, lora: bool = False) -> None:
        """The forward on the bucket's buffers, logits into `_out[:B]` (the code a graph records); with `lora`,
        every projection adds the rows' deltas from the static LoRA slots (`graph_slots.GraphLoraBatch`)."""
        bs, dev = self.cache.block_size, self.device
        offsets = torch.arange(bs, device=dev)  # [bs]
        read = (b.tables[:, :, None] * bs + offsets).reshape(b.rows, b.blocks * bs)[:, :b.keys]  # [B, T]
        mask = torch.arange(b.keys, device=dev)[None, :] <= b.positions  # [B, T]; hides columns past the row
        batch = AttentionBatch(positions=b.positions, write_slots=b.write_slots, read_slots=read,
                               mask=mask[:, None, None, :])  # mask [B, 1, 1, T]
        x = self.model.embed(b.ids)[:, None]  # [B, 1, hidden]
        adapters = self.lora.batch(b.lora_slots) if lora else None
        logits = self.model.forward(x, batch, self.cache, adapters, rope=b.rope)  # [B, vocab] fp32
        self._out[:b.rows].copy_(logits)

    def capture_all(self, lora: bool = False) -> int:
        """Capture every bucket's graph now (at engine start, not in the middle of serving: a capture stalls every
        stream for its warm-up runs), the largest first so the shared pool is sized once -> graphs captured; with
        `lora` (and LoRA slots) the LoRA graphs too. A bucket whose capture fails runs eager until its retry; the
        others keep theirs. On a GPU the memory the captures reserved is kept in `pool_bytes` and logged."""
        if not self.capture:
            return 0
        reserved = _reserved(self.device)
        for variant in (False, True) if lora and self.lora is not None else (False,):
            for rows in reversed(self.rows_buckets):
                for keys in reversed(self.keys_buckets):
                    b = self._bucket(rows, keys)
                    if b.graphs[variant].graph is None and b.graphs[variant].due(self.steps):
                        self._capture(b, variant)
        self.pool_bytes += max(0, _reserved(self.device) - reserved)
        log.info("CUDA graphs of decode steps: %d captured, their pool reserved %.1f MiB", self.captured,
                 self.pool_bytes / 2**20)
        return self.captured

    def _capture(self, b: Bucket, lora: bool) -> bool:
        """Record the bucket's graph (module doc); False when capture fails: that graph's steps run eager and its
        capture is tried again after a back-off (`Recorded.failed`); the other buckets keep their graphs."""
        rec = b.graphs[lora]
        try:
            graph = self._record(b, lora)
        except Exception as e:  # noqa: BLE001
            if is_device_fault(e) and not _capture_error(e):
                raise
            rec.failed(self.steps)
            self.capture_failures += 1
            log.exception("CUDA graph capture of a decode step (%d rows, %d keys%s) failed (try %d of %d); steps of "
                          "that shape run eager%s", b.rows, b.keys, ", LoRA" if lora else "", rec.failures,
                          CAPTURE_TRIES, f" until step {rec.retry_at}" if rec.failures < CAPTURE_TRIES else "")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # a capture that raised may leave work queued on the side stream
            return False
        rec.graph = graph
        self.captures += 1
        log.info("captured the CUDA graph of decode steps of %d rows x %d keys%s (%d graphs)", b.rows, b.keys,
                 " with LoRA" if lora else "", self.captured)
        return True

    @torch.inference_mode()
    def _record(self, b: Bucket, lora: bool) -> Any:
        """Warm-up runs on a side stream, then one run recorded into a graph of the shared pool -> the graph."""
        self._set_padding(b)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(b, lora)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._run(b, lora)
        return graph


def _capture_error(e: BaseException) -> bool:
    """An error of the capture itself (cudaErrorStreamCaptureUnsupported / Invalidated: "operation not permitted
    when stream is capturing"): a CUDA error, but the context is intact (the capture, thread-local, was ended), so it
    is a failed capture, not a device fault."""
    while e is not None:
        if "captur" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _reserved(device: torch.device) -> int:
    """Bytes torch's allocator reserves on `device` once its unused cached blocks are returned (the warm-up runs'
    activations): what the graphs' pool and the capture stream's cuBLAS workspace hold."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
