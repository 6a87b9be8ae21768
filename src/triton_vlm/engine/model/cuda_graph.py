"""Decode steps on static, bucketed shapes: replayed as CUDA graphs on a GPU (vLLM's / gpt-fast's design).

A decode step of `n` rows whose longest row holds `t` keys (after this step's token) runs on the buffers of the
bucket (B, T): B the smallest rows bucket >= n, T the smallest keys bucket >= t. Per bucket one int64 device
buffer holds every input of the step, `[B * (4 + NB)]` (NB = ceil(T / block_size)), viewed as

    ids [B]  positions [B, 1]  rope [B, 1]  write slots [B]  block tables [B, NB]

(`rope`: the rotary positions, the cache positions + each row's M-RoPE delta, so Qwen2-VL's steps after an image
prompt replay the same graphs)
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
count: rows buckets x keys buckets, e.g. 11 x 5 = 55 for 64 rows and a 4096 context. A graph is captured on
the first step that needs its bucket and kept for the engine's life (a fixed, bounded set; no eviction).
Memory: all graphs share one memory pool (`torch.cuda.graph_pool_handle()`), and each graph's intermediates
are dead once it returns (its logits are copied to the shared output), so the pool holds about the largest
graph's activations, not their sum; graphs replay one at a time on one stream, which makes that reuse safe.

Capture (`_capture`): the bucket's buffers are first set to all padding rows (so warm-up writes only the
scratch slot), two warm-up runs on a side stream (lazy initialisation: cuBLAS workspaces, kernel choices), then
`torch.cuda.graph(g, pool=...)` records one run; everything in `torch.inference_mode()`. A capture that fails
(an operation that cannot be captured) is logged and leaves that bucket eager; the other buckets keep their graphs
(a CUDA fault is the engine's to report, as anywhere).

Known limits: a step with any LoRA adapter, or with more rows than the largest bucket, runs the eager forward
(`ModelRunner.decode`); prefill always runs eager. The graphs' pool is not part of the KV cache's memory profile
(`profile.py`): it comes out of the headroom `gpu_memory_utilization` leaves.

At start (`capture_all`, called by the engine) every bucket is captured, the largest first: a capture in the
middle of serving stalls every stream for its warm-up runs (the GPU check on an H200 measured a 7B model's one
stream at 142 tok/s with the capture inside the request). A bucket whose capture fails runs eager; the others
keep their graphs.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .faults import is_device_fault
from ..kv.kv_cache import AttentionBatch, KVCache, RowKV
from .model import LlamaModel

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (as torch.cuda.make_graphed_callables)


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


@dataclass(eq=False)
class Bucket:
    """The static inputs (and the graph, once captured) of decode steps of shape (rows, keys)."""

    rows: int  # B
    keys: int  # T
    blocks: int  # NB = ceil(T / block_size)
    inputs: torch.Tensor  # [B * (4 + NB)] int64 on the device: ids | positions | rope | write slots | block tables
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    failed: bool = False  # its capture failed: its steps run eager (the other buckets keep their graphs)

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
    def tables(self) -> torch.Tensor:
        return self.inputs[4 * self.rows:].view(self.rows, self.blocks)  # [B, NB]


class DecodeGraphs:
    """Bucketed static-shape decode steps for one model and its KV cache; `decode` or None (not applicable)."""

    def __init__(self, model: LlamaModel, cache: KVCache, *, max_rows: int, context: int, min_keys: int = 256,
                 capture: bool = True):
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.rows_buckets = rows_buckets(max_rows)
        self.keys_buckets = keys_buckets(context, min(min_keys, context))
        self.device = model.device
        self.pad_token = 0  # what padding rows feed (any id: their results are dropped)
        self._buckets: dict[tuple[int, int], Bucket] = {}
        self._out = torch.empty(self.rows_buckets[-1], model.config.vocab_size, dtype=torch.float32,
                                device=self.device)  # [max B, vocab]: every graph's logits land here
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.enabled = True
        # counters (tests, monitoring): graphs captured, replays, uncaptured static steps, eager fallbacks
        self.captures = self.replays = self.static_steps = self.fallbacks = 0

    def bucket_shape(self, rows: int, keys: int) -> Optional[tuple[int, int]]:
        """(B, T) for a step of `rows` rows reading up to `keys` keys; None beyond the largest bucket."""
        i, j = bisect.bisect_left(self.rows_buckets, rows), bisect.bisect_left(self.keys_buckets, keys)
        if i == len(self.rows_buckets) or j == len(self.keys_buckets):
            return None
        return self.rows_buckets[i], self.keys_buckets[j]

    @property
    def captured(self) -> int:
        return sum(b.graph is not None for b in self._buckets.values())

    def decode(self, rows: list[RowKV], tokens: Sequence[int], row_adapters: Sequence[Any] = (),
               deltas: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
        """Append one token to every row and run the step on its bucket: fp32 logits [rows, vocab]. None (rows
        untouched) where the step must run eager: an adapter on some row, too many rows or keys, graphs off.
        `deltas`: each row's rotary position - cache position (M-RoPE rows after an image prompt; None: 0)."""
        shape = self.bucket_shape(len(rows), max(r.length for r in rows) + 1)
        if not self.enabled or shape is None or any(a is not None for a in row_adapters):
            self.fallbacks += 1
            return None
        b = self._bucket(*shape)
        if self.capture and b.graph is None and (b.failed or not self._capture(b)):
            self.fallbacks += 1
            return None
        write = [s for r in rows for s in self.cache.append(r, 1)]
        host = self._host_inputs(b, rows, tokens, write, deltas)  # [B * (4 + NB)]
        if self.device.type == "cuda":
            host = host.pin_memory()
        b.inputs.copy_(host, non_blocking=True)  # from pinned memory: asynchronous, no sync
        n = len(rows)
        if b.graph is not None:
            b.graph.replay()
            self.replays += 1
            return self._out[:n].clone()  # [n, vocab]; the next replay overwrites _out
        self._run(b)
        self.static_steps += 1
        return self._out[:n].clone()

    # --- buffers -------------------------------------------------------------------------------------------
    def _bucket(self, rows: int, keys: int) -> Bucket:
        b = self._buckets.get((rows, keys))
        if b is None:
            nb = -(-keys // self.cache.block_size)
            inputs = torch.zeros(rows * (4 + nb), dtype=torch.long, device=self.device)
            b = self._buckets[(rows, keys)] = Bucket(rows, keys, nb, inputs)
        return b

    def _host_inputs(self, b: Bucket, rows: list[RowKV], tokens: Sequence[int], write: list[int],
                     deltas: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The step's inputs as one host int64 tensor in the bucket's layout; rows past len(rows) are padding."""
        pad = b.rows - len(rows)
        ids = list(tokens) + [self.pad_token] * pad
        positions = [r.length - 1 for r in rows] + [0] * pad  # after append: the new token's position
        rope = [p + d for p, d in zip(positions, deltas)] + [0] * pad if deltas is not None else positions
        slots = write + [self.cache.scratch_slot] * pad
        tables = [x for r in rows for x in r.blocks[:b.blocks] + [0] * (b.blocks - len(r.blocks))]  # pad: block 0
        return torch.tensor(ids + positions + rope + slots + tables + [0] * (pad * b.blocks), dtype=torch.long)

    def _set_padding(self, b: Bucket) -> None:
        """Every row of the bucket a padding row (capture and warm-up write only the scratch slot)."""
        b.inputs.zero_()
        b.ids.fill_(self.pad_token)
        b.write_slots.fill_(self.cache.scratch_slot)

    # --- the step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, b: Bucket) -> None:
        """The forward on the bucket's buffers, logits into `_out[:B]` (the code a graph records)."""
        bs, dev = self.cache.block_size, self.device
        offsets = torch.arange(bs, device=dev)  # [bs]
        read = (b.tables[:, :, None] * bs + offsets).reshape(b.rows, b.blocks * bs)[:, :b.keys]  # [B, T]
        mask = torch.arange(b.keys, device=dev)[None, :] <= b.positions  # [B, T]; hides columns past the row
        batch = AttentionBatch(positions=b.positions, write_slots=b.write_slots, read_slots=read,
                               mask=mask[:, None, None, :])  # mask [B, 1, 1, T]
        x = self.model.embed(b.ids)[:, None]  # [B, 1, hidden]
        logits = self.model.forward(x, batch, self.cache, None, rope=b.rope)  # [B, vocab] fp32
        self._out[:b.rows].copy_(logits)

    def capture_all(self) -> int:
        """Capture every bucket's graph now (at engine start, not in the middle of serving: a capture stalls every
        stream for its warm-up runs), the largest first so the shared pool is sized once -> graphs captured. A
        bucket whose capture fails runs eager; the others keep theirs."""
        if not self.capture:
            return 0
        for rows in reversed(self.rows_buckets):
            for keys in reversed(self.keys_buckets):
                b = self._bucket(rows, keys)
                if b.graph is None and not b.failed:
                    self._capture(b)
        return self.captured

    @torch.inference_mode()
    def _capture(self, b: Bucket) -> bool:
        """Record the bucket's graph (module doc); False, and that bucket eager from then on, when capture fails
        (one failure never turns the other buckets' graphs off)."""
        try:
            self._set_padding(b)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._run(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._run(b)
        except Exception as e:  # noqa: BLE001
            if is_device_fault(e):
                raise
            log.exception("CUDA graph capture of a decode step (%d rows, %d keys) failed; steps of that shape run "
                          "eager", b.rows, b.keys)
            b.failed = True
            torch.cuda.synchronize(self.device)  # a capture that raised may leave work queued on the side stream
            return False
        b.graph = graph
        self.captures += 1
        log.info("captured the CUDA graph of decode steps of %d rows x %d keys (%d graphs)", b.rows, b.keys,
                 self.captured)
        return True

