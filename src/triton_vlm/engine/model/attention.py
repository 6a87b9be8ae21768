"""One layer's attention core over the paged KV cache: rotary embeddings, the new tokens' K/V written to the
cache, grouped-query attention over each row's own slots. The projections around it are `model.py`'s.

Two implementations of the same computation:
- `attend_torch`: torch ops, any device, any q_len (prefill chunks and decode steps). The keys a row reads
  are gathered from its slots (`AttentionBatch.read_slots`; column j is position j) and attended with
  `scaled_dot_product_attention` under the batch's mask.
- `cpu_decode.DecodeStep.attend`: one C call per layer for a decode step (q_len 1) on a CPU in fp32, reading
  the keys in place (`cpu_decode.Kernel.decode` is the same for one layer, in `decode_torch`'s arguments).
  `Attention.kernel_for` decides per forward; the kernel's results are checked against `decode_torch` at
  first use.
- `flex_paged.attend`: PyTorch's FlexAttention over the whole pool under a paged block mask (no K/V gather),
  compiled on CUDA.

The backend is chosen at load (`Attention.__init__`, logged with its reason) by `TRITON_VLM_ATTENTION`:
`auto` (default): SDPA, on every device. On an H200 (bench/gpu/runs/2026-11-27-h200.md) the paged flex
path, though its kernel won a one-layer decode race (`race`: 0.247 vs 0.274 ms, 32 rows x 512 keys), served the
7B-shaped model slower end to end: greedy at 64 concurrent 421 vs 755 tok/s, TTFT 98 vs 54 ms, one stream 145 vs
151 tok/s (the race leaves out the per-forward block mask, compiles at new shapes and the prefill kernel; which
of them costs what is not measured yet). `auto` takes flex again once the GPU check's `flex_vs_sdpa_*` rows put
it ahead; `flex`: flex on
any device (on a CPU eager FlexAttention, slow: for tests), still SDPA where it cannot run; `sdpa`: SDPA (and the
C decode kernel on a CPU). Under flex, a layer with a sliding window, and a cache whose block size the kernel
cannot tile, run SDPA. A flex call that fails at run time (other than a CUDA fault, which poisons the context and
is the engine's to report) is logged, that layer recomputed with SDPA, and SDPA used for good in this process.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch
import torch.nn.functional as F

from . import flex_paged
from ..cpu import cpu_decode
from ..kv.kv_cache import AttentionBatch, KVCache
from .faults import is_device_fault

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_ATTENTION"
BACKENDS = ("auto", "flex", "sdpa")
MAX_PLANS = 64  # block masks kept: a ragged forward builds one per segment (at most a step's prefill chunks)
CHECK_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}  # flex vs SDPA at load
AUTO_CUDA = ("on cuda: SDPA, measured ahead of paged flex end to end on an H200 (greedy 64 at 1.8x flex's tok/s, "
             "TTFT 54 vs 98 ms); TRITON_VLM_ATTENTION=flex to serve with flex")
flex_failed: Optional[str] = None  # why flex failed at run time: SDPA for good in this process


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` (rotate_half(x) = [-x_2, x_1]) in 4 ops instead of 7, bit for
    bit: rotate_half(x) is roll(x, half) with its first half negated, and that sign moves exactly onto sin
    (`sin_rot` = [-sin_1, sin_2])."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_rot


def write_new(qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, write_slots: torch.Tensor,
              kc: torch.Tensor, vc: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The rotary embeddings on q and k, the new K/V written to the pool (`attend_torch`'s arguments) -> the
    rotated queries [rows, heads, q_len, hd]."""
    rows, q_len, _ = qkv.shape
    hd = cos.shape[-1]
    qkv = qkv.view(rows, q_len, heads + 2 * kv_heads, hd)
    qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin_rot)  # [rows, q_len, heads + kv_heads, hd]
    k = qk[:, :, heads:]  # [rows, q_len, kv_heads, hd]
    v = qkv[:, :, heads + kv_heads:]  # [rows, q_len, kv_heads, hd]
    kc.index_copy_(0, write_slots, k.reshape(-1, kv_heads, hd))
    vc.index_copy_(0, write_slots, v.reshape(-1, kv_heads, hd))
    return qk[:, :, :heads].transpose(1, 2)


def attend_torch(qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, write_slots: torch.Tensor,
                 read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                 heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [rows, q_len, (heads + 2 kv_heads) * hd]; cos, sin_rot [rows, q_len, 1, hd] (each token's own rows of
    the tables); write_slots [rows * q_len]; read_slots [rows, T]; mask [rows, 1, q_len, T]; kc, vc [slots,
    kv_heads, hd] (the new K/V are written) -> [rows, q_len, heads * hd]."""
    rows, q_len, _ = qkv.shape
    hd = cos.shape[-1]
    q = write_new(qkv, cos, sin_rot, write_slots, kc, vc, heads, kv_heads)  # [rows, heads, q_len, hd]
    flat = read_slots.reshape(-1)  # index_select: ~1.5x faster than advanced indexing on CPU
    T = read_slots.shape[1]
    keys = kc.index_select(0, flat).view(rows, T, kv_heads, hd).transpose(1, 2)
    values = vc.index_select(0, flat).view(rows, T, kv_heads, hd).transpose(1, 2)
    # keys / values: [rows, kv_heads, T, head_dim]
    # grouped-query attention without materialising repeated K/V (the repeat was 40% of a beam step)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                         enable_gqa=heads != kv_heads)  # [rows, heads, q_len, hd]
    return out.transpose(1, 2).reshape(rows, q_len, heads * hd)


def decode_torch(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor,
                 write_slots: torch.Tensor, read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """`attend_torch` for a decode step in the kernel's arguments (`cpu_decode.Kernel.decode`): qkv [rows,
    width], positions [rows], the full tables cos, sin_rot [max_pos, hd], mask [rows, T] -> [rows, heads * hd]."""
    rows = qkv.shape[0]
    out = attend_torch(qkv[:, None], cos[positions][:, None, None], sin_rot[positions][:, None, None],
                       write_slots, read_slots, mask[:, None, None], kc, vc, heads, kv_heads)
    return out.view(rows, -1)


class Attention:
    """A model's attention core: the rotary tables and the choice of implementation (module doc)."""

    def __init__(self, cos: torch.Tensor, sin_rot: torch.Tensor, heads: int, kv_heads: int):
        self.cos, self.sin_rot = cos, sin_rot  # [max_pos, head_dim] each
        self.heads, self.kv_heads = heads, kv_heads
        # the block masks of the last forward's batches (one, or a ragged forward's segments), built at layer 0
        self._plans: list[tuple[AttentionBatch, int, int, flex_paged.PagedMask]] = []
        self._unsupported: dict[int, Optional[str]] = {}  # block size -> why flex cannot tile it (None: it can)
        self.backend, self.reason = self._choose(os.environ.get(ENV, "auto").strip().lower() or "auto")
        (log.warning if "cannot run" in self.reason else log.info)(
            "attention: %s (%s)", "FlexAttention, paged" if self.backend == "flex" else "torch SDPA", self.reason)

    def _choose(self, wanted: str) -> tuple[str, str]:
        """(backend, why) at load, for the value of TRITON_VLM_ATTENTION."""
        if wanted not in BACKENDS:
            raise ValueError(f"{ENV}={wanted!r}: expected one of {', '.join(BACKENDS)}")
        device = self.cos.device
        if wanted == "sdpa":
            return "sdpa", f"{ENV}=sdpa"
        if wanted == "auto":
            why = AUTO_CUDA if device.type == "cuda" else f"on {device.type}: SDPA and the C decode kernel"
            return "sdpa", f"{ENV}=auto {why}"
        why = flex_paged.unsupported(flex_paged.KERNEL_BLOCK_N, device)
        if why is None:
            why = self._self_check()
        if why is not None:
            return "sdpa", f"{ENV}={wanted} but flex cannot run: {why}"
        return "flex", f"{ENV}=flex: self-check against SDPA passed on {device.type} {self.cos.dtype}"

    @torch.inference_mode()
    def race(self, rows: int = 32, keys: int = 512, reps: int = 10) -> tuple[float, float]:
        """(flex ms, SDPA ms) of one layer's decode step of `rows` rows holding `keys` keys each, on this device, in
        this model's heads and dtype (the GPU check reports it beside the end-to-end rows): the block mask built
        once (as a forward shares it across layers), each backend warmed up, then the mean of `reps` calls between
        device syncs."""
        hd, dev, dtype = self.cos.shape[-1], self.cos.device, self.cos.dtype
        bs = flex_paged.KERNEL_BLOCK_N
        cache = KVCache(num_layers=1, num_kv_heads=self.kv_heads, head_dim=hd,
                        num_blocks=rows * -(-keys // bs) + 1, block_size=bs, dtype=dtype, device=dev)
        held = []
        for _ in range(rows):
            held.append(cache.new_row())
            cache.append(held[-1], keys - 1)
        batch = cache.plan(held, 1)
        tables, kc, vc = self.tables(batch.positions), cache.k[0], cache.v[0]
        qkv = torch.randn(rows, 1, (self.heads + 2 * self.kv_heads) * hd, device=dev, dtype=dtype)
        paged = flex_paged.plan(batch, bs, cache.num_blocks)
        calls = (lambda: self._flex(qkv, tables, batch, kc, vc, paged),
                 lambda: attend_torch(qkv, *tables, batch.write_slots, batch.read_slots, batch.mask, kc, vc,
                                      self.heads, self.kv_heads))
        out = []
        for call in calls:
            for _ in range(3):
                call()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            _sync(dev)
            out.append(1e3 * (time.perf_counter() - t0) / reps)
        return out[0], out[1]

    @torch.inference_mode()  # as the forward: the graphs compiled here serve it
    def _self_check(self) -> Optional[str]:
        """Why flex must not be used here (None: it may): a prefill chunk and a decode step of three ragged rows,
        two sharing a block, in a scratch cache of 16-slot blocks, flex (compiled on CUDA) against SDPA."""
        t0 = time.perf_counter()
        hd, dev, dtype = self.cos.shape[-1], self.cos.device, self.cos.dtype
        try:
            pair = [KVCache(num_layers=1, num_kv_heads=self.kv_heads, head_dim=hd, num_blocks=12,
                            block_size=flex_paged.KERNEL_BLOCK_N, dtype=dtype, device=dev) for _ in range(2)]
            g = torch.Generator(device="cpu").manual_seed(0)
            stale = torch.randn((2,) + pair[0].k.shape, generator=g)  # whatever no row wrote: must not count
            rows = []
            for c in pair:  # rows of 21 and 22 tokens after the chunk, the second forked from the first's 16
                c.k.copy_(stale[0])
                c.v.copy_(stale[1])
                first = c.new_row()
                c.append(first, 16)
                rs = [first, c.fork(first), c.new_row()]
                c.append(rs[1], 1)
                rows.append(rs)
            width = (self.heads + 2 * self.kv_heads) * hd
            for q_len in (5, 1):
                qkv = torch.randn(3, q_len, width, generator=g).to(dev, dtype)
                got, want = (self.attend(qkv, c.plan(rs, q_len), c, 0, use_flex=flex)
                             for c, rs, flex in ((pair[0], rows[0], True), (pair[1], rows[1], False)))
                err = float((got.float() - want.float()).abs().max())
                if not err <= CHECK_ATOL.get(dtype, 4e-2):
                    return f"self-check: q_len {q_len} differs from SDPA by {err:.3g}"
        except Exception as e:  # noqa: BLE001 - any failure leaves SDPA
            if is_device_fault(e):
                raise
            return f"self-check failed: {type(e).__name__}: {e}"[:500]
        log.info("attention: the FlexAttention self-check took %.1f s", time.perf_counter() - t0)
        return None

    def kernel_for(self, q_len: int) -> Optional[cpu_decode.Kernel]:
        """The C decode kernel when it applies to a forward of `q_len` new tokens per row (a decode step, fp32
        on a CPU, this machine has it, the backend is not flex), else None."""
        if q_len != 1 or self.cos.device.type != "cpu" or self.cos.dtype != torch.float32 or self.backend == "flex":
            return None
        return cpu_decode.kernel(decode_torch)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_rot rows of each token [rows, q_len, 1, hd], for `attend_torch`."""
        return self.cos[positions][:, :, None], self.sin_rot[positions][:, :, None]

    def attend(self, qkv: torch.Tensor, batch: AttentionBatch, cache: KVCache, layer: int,
               tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None, mask: Optional[torch.Tensor] = None,
               window: int = 0, use_flex: Optional[bool] = None) -> torch.Tensor:
        """One layer's attention core: qkv [rows, q_len, width] -> [rows, q_len, heads * hd], the new K/V written
        into `cache` layer `layer`. `tables`: cos, sin_rot [rows, q_len, 1, hd] (default: at the cache
        positions); `mask` [rows, 1, q_len, T] (default: the batch's); `window` > 0: a sliding-window layer
        (SDPA). `use_flex`: force the choice (the self-check), else the backend's."""
        tables = tables if tables is not None else self.tables(batch.positions)
        mask = mask if mask is not None else batch.mask
        kc, vc = cache.k[layer], cache.v[layer]  # [slots, kv_heads, hd]
        if use_flex:  # the self-check: strict, any failure propagates
            return self._flex(qkv, tables, batch, kc, vc, flex_paged.plan(batch, cache.block_size, cache.num_blocks))
        paged = None
        if use_flex is None and self.backend == "flex" and flex_failed is None and window == 0:
            paged = self._paged(batch, cache)
        if paged is not None:
            try:
                return self._flex(qkv, tables, batch, kc, vc, paged)
            except Exception as e:  # noqa: BLE001
                if is_device_fault(e):
                    raise
                _flex_fails(e)
        return attend_torch(qkv, *tables, batch.write_slots, batch.read_slots, mask, kc, vc, self.heads,
                            self.kv_heads)

    def _flex(self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
              kc: torch.Tensor, vc: torch.Tensor, paged: flex_paged.PagedMask) -> torch.Tensor:
        rows, q_len, _ = qkv.shape
        q = write_new(qkv, *tables, batch.write_slots, kc, vc, self.heads, self.kv_heads)  # [rows, heads, q_len, hd]
        return flex_paged.attend(q, kc, vc, paged).transpose(1, 2).reshape(rows, q_len, -1)

    def _paged(self, batch: AttentionBatch, cache: KVCache) -> Optional[flex_paged.PagedMask]:
        """The forward's block mask, built at its first layer (None: flex cannot tile this cache)."""
        bs, slots = cache.block_size, cache.k.shape[1]
        for planned, *shape, paged in self._plans:
            if planned is batch and tuple(shape) == (bs, slots):
                return paged
        if bs not in self._unsupported:
            self._unsupported[bs] = why = flex_paged.unsupported(bs, self.cos.device)
            if why is not None:
                log.warning("attention: FlexAttention cannot tile this cache (%s); it runs SDPA", why)
        if self._unsupported[bs] is not None:
            return None
        try:
            paged = flex_paged.plan(batch, bs, cache.num_blocks)
        except Exception as e:  # noqa: BLE001
            if is_device_fault(e):
                raise
            _flex_fails(e)
            return None
        if len(self._plans) >= MAX_PLANS:  # a new forward: its segments replace the last one's
            self._plans.clear()
        self._plans.append((batch, bs, slots, paged))
        return paged


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flex_fails(e: Exception) -> None:
    """A run-time failure of the flex path: logged, SDPA from now on in this process."""
    global flex_failed
    flex_failed = f"{type(e).__name__}: {e}"[:500]
    log.error("attention: FlexAttention failed (%s); this layer is recomputed with SDPA and every later one uses "
              "SDPA", flex_failed, exc_info=e)
