"""Decode attention straight over the paged KV cache on a CPU: one C call per layer instead of ~15 torch ops.

What one call does, for a decode step (every row gets one new token), exactly what `attention.attend_torch`
does with torch ops:
1. rotary embeddings on the new token's q and k heads (`model.apply_rotary`'s formula, same rounding: the
   source is compiled with `-ffp-contract=off`, so `x * cos + roll(x) * sin` is two rounded products and a
   rounded sum, as torch computes it: the K written to the cache is bit for bit torch's);
2. the new K and V into the cache at the row's write slot;
3. for each query head, softmax(q . k * scale) over the keys the row's mask allows, read through the row's
   slots (`AttentionBatch.read_slots`) from the pool, and the weighted sum of the values; grouped-query heads
   share their kv head (head h reads kv head h // (heads / kv_heads), as `enable_gqa`).

Why: a one-stream decode step spent ~0.5 ms of its ~4 ms in these ops (`bench.profile_engine`, "attn core"):
per layer a rotary lookup, two index_copy, two index_select gathers of the row's keys and values, the
attention and the transposes, each a few microseconds of dispatch on tensors of a few kilobytes. The kernel
also reads the keys where they are instead of gathering a copy first (the KV-gather-free attention of
vLLM's paged attention, on a CPU).

Numerics: the scores and the weighted sum are fp32 with another summation order than torch's
`scaled_dot_product_attention` (ulp-level, as a different batch size already gives: model.py "Batch
invariance"); the cache writes are exact. Every index (positions, write and read slots) is checked against
its table before any memory is touched; a bad one raises instead of writing outside the pool.

Build and fallback as `gemv.py` (`cbuild.py`): compiled once per machine, checked against the torch path at
first use; no compiler, a failed build or a failed check: logged once, torch runs the attention.
`TRITON_VLM_CPU_ATTENTION=0` turns the kernel off (for comparisons).
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import subprocess
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from . import cbuild

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_CPU_ATTENTION"  # "1" (default): the kernel for decode steps on a CPU; "0": torch ops

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* What a decode step's rows share across layers (built once per forward). */
typedef struct {
    int64_t rows, heads, kv_heads, hd, max_pos, T, slots;
    const int64_t *positions;   /* [rows] */
    const int64_t *write_slots; /* [rows] */
    const int64_t *read_slots;  /* [rows, T] */
    const float *cos, *sin_rot; /* [max_pos, hd] */
    float scale;
} Step;

/* out[d] = x[d] * c[d] + x[(d + hd/2) % hd] * s[d]: apply_rotary (x * cos + roll(x, hd/2) * sin_rot) */
static void rope(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    int64_t half = hd / 2;
    for (int64_t d = 0; d < hd; d++) {
        float a = x[d] * c[d];
        float b = x[(d + half) % hd] * s[d];
        out[d] = a + b;
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    v16 acc = (v16){0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        v16 x, y;
        memcpy(&x, a + d, sizeof(v16));
        memcpy(&y, b + d, sizeof(v16));
        acc += x * y;
    }
    float l[16];
    memcpy(l, &acc, sizeof(l));
    for (int w = 8; w >= 1; w /= 2) /* a tree over the lanes: 4 dependent adds, not 16 */
        for (int i = 0; i < w; i++) l[i] += l[i + w];
    float sum = l[0];
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* exp(x) for 16 lanes of x <= 0 (scores less their maximum): x = n ln2 + r, exp(r) by Cephes' expf polynomial
   (relative error ~1e-7), times 2^n built in the exponent bits. Below -87 (and -inf: a masked key) the result
   is exactly 0, where expf would return subnormals below 1e-37 (slow, and nothing next to the maximum's 1). */
static v16 vselect(v16i m, v16 a, v16 b) { /* a where m is all ones, else b */
    v16i ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof(a));
    return a;
}

static v16 vexp(v16 x) {
    v16i live = x >= -87.0f;
    x = vselect(live, x, (v16){0} - 87.0f);
    v16 t = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(t, v16i);          /* truncates toward 0 */
    v16 nf = __builtin_convertvector(n, v16);
    v16i above = nf > t;                                /* floor for negative t */
    n += above;                                         /* true lanes are -1 */
    nf = __builtin_convertvector(n, v16);
    x = x - nf * 0.693359375f;
    x = x - nf * -2.12194440e-4f;
    v16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v16i bits = (n + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof(scale));
    return vselect(live, y * scale, (v16){0});
}

/* 0 when every index is inside its table and every row has a key to attend to, else a negative code. */
int triton_vlm_decode_check(const Step *st, const uint8_t *mask) {
    if (st->rows < 0 || st->heads < 1 || st->kv_heads < 1 || st->heads % st->kv_heads || st->hd < 2 ||
        st->hd % 2 || st->T < 0)
        return -1;
    for (int64_t r = 0; r < st->rows; r++) {
        if (st->positions[r] < 0 || st->positions[r] >= st->max_pos) return -2;
        if (st->write_slots[r] < 0 || st->write_slots[r] >= st->slots) return -3;
        int any = 0;
        for (int64_t j = 0; j < st->T; j++) {
            if (!mask[r * st->T + j]) continue;
            if (st->read_slots[r * st->T + j] < 0 || st->read_slots[r * st->T + j] >= st->slots) return -4;
            any = 1;
        }
        if (!any) return -5;
    }
    return 0;
}

/* qkv [rows, (heads + 2 kv_heads) * hd]; mask [rows, T]; kc, vc [slots, kv_heads, hd] (the new K/V written);
   out [rows, heads * hd]. The caller ran triton_vlm_decode_check on this step and mask. */
int triton_vlm_decode_attention(const Step *st, const uint8_t *mask, const float *qkv, float *kc, float *vc,
                                float *out) {
    const int64_t H = st->heads, KV = st->kv_heads, hd = st->hd, T = st->T;
    const int64_t width = (H + 2 * KV) * hd, kvw = KV * hd, groups = H / KV;
    for (int64_t r = 0; r < st->rows; r++) { /* every row's new K and V first: a row reads its own new token */
        const float *src = qkv + r * width;
        const float *c = st->cos + st->positions[r] * hd, *s = st->sin_rot + st->positions[r] * hd;
        float *kdst = kc + st->write_slots[r] * kvw;
        for (int64_t g = 0; g < KV; g++) rope(src + (H + g) * hd, c, s, hd, kdst + g * hd);
        memcpy(vc + st->write_slots[r] * kvw, src + (H + KV) * hd, kvw * sizeof(float));
    }
    const int64_t Tp = (T + 15) / 16 * 16; /* scores padded to whole vectors of 16 */
    float *q = malloc(sizeof(float) * H * hd), *acc = malloc(sizeof(float) * H * hd);
    float *p = malloc(sizeof(float) * H * (Tp ? Tp : 16)), *mx = malloc(sizeof(float) * H * 2);
    if (!q || !acc || !p || !mx) { free(q); free(acc); free(p); free(mx); return -6; }
    float *sum = mx + H;
    for (int64_t r = 0; r < st->rows; r++) {
        const float *c = st->cos + st->positions[r] * hd, *s = st->sin_rot + st->positions[r] * hd;
        const int64_t *rs = st->read_slots + r * T;
        const uint8_t *mk = mask + r * T;
        for (int64_t h = 0; h < H; h++) {
            rope(qkv + r * width + h * hd, c, s, hd, q + h * hd);
            mx[h] = -INFINITY;
            for (int64_t j = T; j < Tp; j++) p[h * Tp + j] = -INFINITY;
        }
        for (int64_t j = 0; j < T; j++) { /* one slot's keys (all kv heads, contiguous) for every query head */
            if (!mk[j]) {
                for (int64_t h = 0; h < H; h++) p[h * Tp + j] = -INFINITY;
                continue;
            }
            const float *krow = kc + rs[j] * kvw;
            for (int64_t h = 0; h < H; h++) {
                float x = dot(q + h * hd, krow + (h / groups) * hd, hd) * st->scale;
                p[h * Tp + j] = x;
                if (x > mx[h]) mx[h] = x;
            }
        }
        for (int64_t h = 0; h < H; h++) { /* softmax numerators; masked keys get exactly 0 */
            v16 total = (v16){0};
            for (int64_t j = 0; j < Tp; j += 16) {
                v16 x;
                memcpy(&x, p + h * Tp + j, sizeof(x));
                x = vexp(x - mx[h]);
                memcpy(p + h * Tp + j, &x, sizeof(x));
                total += x;
            }
            float l[16];
            memcpy(l, &total, sizeof(l));
            for (int w = 8; w >= 1; w /= 2)
                for (int i = 0; i < w; i++) l[i] += l[i + w];
            sum[h] = l[0];
        }
        memset(acc, 0, sizeof(float) * H * hd);
        for (int64_t j = 0; j < T; j++) {
            if (!mk[j]) continue;
            const float *vrow = vc + rs[j] * kvw;
            for (int64_t h = 0; h < H; h++) {
                float w = p[h * Tp + j], *a = acc + h * hd;
                const float *v = vrow + (h / groups) * hd;
                for (int64_t d = 0; d < hd; d++) a[d] += w * v[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float inv = 1.0f / sum[h], *o = out + r * H * hd + h * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = acc[h * hd + d] * inv;
        }
    }
    free(q); free(acc); free(p); free(mx);
    return 0;
}
"""
FLAGS = ("-ffp-contract=off",)  # rotary rounding as torch's (module doc)

ERRORS = {-1: "bad shape", -2: "a position outside the rotary table", -3: "a write slot outside the pool",
          -4: "a read slot outside the pool", -5: "a row with no key to attend to", -6: "out of memory"}

Reference = Callable[..., torch.Tensor]  # attention.decode_torch's signature


def _expect(t: torch.Tensor, dtype: torch.dtype, shape, name: str) -> None:
    """The kernel reads raw memory: every tensor must be a contiguous CPU tensor of the shape it assumes."""
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"decode attention kernel: {name} must be a contiguous CPU {dtype} tensor of shape "
                         f"{tuple(shape)}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "heads", "kv_heads", "hd", "max_pos", "T", "slots")] + [
        (name, ctypes.c_void_p) for name in ("positions", "write_slots", "read_slots", "cos", "sin_rot")] + [
        ("scale", ctypes.c_float)]


class DecodeStep:
    """One decode forward's rows, checked once: `attend(qkv, window, kc, vc)` per layer. Holds the tensors the
    C side points into for as long as it lives."""

    def __init__(self, kernel: "Kernel", positions: torch.Tensor, write_slots: torch.Tensor,
                 read_slots: torch.Tensor, masks: dict[int, torch.Tensor], cos: torch.Tensor, sin_rot: torch.Tensor,
                 heads: int, kv_heads: int, slots: int):
        rows, T = read_slots.shape
        hd = cos.shape[1]
        _expect(positions, torch.int64, (rows,), "positions")
        _expect(write_slots, torch.int64, (rows,), "write_slots")
        _expect(read_slots, torch.int64, (rows, T), "read_slots")
        for w, m in masks.items():
            _expect(m, torch.bool, (rows, T), f"mask (window {w})")
        _expect(cos, torch.float32, cos.shape, "cos")
        _expect(sin_rot, torch.float32, cos.shape, "sin_rot")
        self._keep = (positions, write_slots, read_slots, masks, cos, sin_rot)
        self._st = _Step(rows, heads, kv_heads, hd, cos.shape[0], T, slots, positions.data_ptr(),
                         write_slots.data_ptr(), read_slots.data_ptr(), cos.data_ptr(), sin_rot.data_ptr(),
                         1.0 / math.sqrt(hd))
        self._ref = ctypes.byref(self._st)
        self._masks = {w: m.data_ptr() for w, m in masks.items()}
        for w, ptr in self._masks.items():
            rc = kernel._check(self._ref, ptr)
            if rc != 0:
                raise ValueError(f"decode attention kernel: {ERRORS.get(rc, rc)} (window {w})")
        self._fn = kernel._fn
        self._qkv_shape = torch.Size((rows, (heads + 2 * kv_heads) * hd))
        self._kv_shape = torch.Size((slots, kv_heads, hd))
        self._out_shape = (rows, heads * hd)

    def attend(self, qkv: torch.Tensor, window: int, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """qkv [rows, (heads + 2 kv_heads) * hd] fp32; kc, vc [slots, kv_heads, hd] fp32 (the new K/V are written)
        -> [rows, heads * hd] fp32. A tensor of another dtype, shape or memory layout raises."""
        for name, t, shape in (("qkv", qkv, self._qkv_shape), ("kc", kc, self._kv_shape), ("vc", vc, self._kv_shape)):
            if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                _expect(t, torch.float32, shape, name)
        out = torch.empty(self._out_shape, dtype=torch.float32)  # [rows, heads * hd]
        self._fn(self._ref, self._masks[window], qkv.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr())
        return out


class Kernel:
    """The compiled decode attention, checked on this machine: `step(...)` once per forward, then
    `DecodeStep.attend` per layer."""

    def __init__(self, lib: ctypes.CDLL):
        p = ctypes.c_void_p
        self._check = lib.triton_vlm_decode_check
        self._check.argtypes = [p, p]
        self._check.restype = ctypes.c_int
        self._fn = lib.triton_vlm_decode_attention
        self._fn.argtypes = [p, p, p, p, p, p]
        self._fn.restype = ctypes.c_int

    def step(self, positions: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor,
             masks: dict[int, torch.Tensor], cos: torch.Tensor, sin_rot: torch.Tensor, heads: int, kv_heads: int,
             slots: int) -> DecodeStep:
        """positions, write_slots [rows] int64; read_slots [rows, T] int64; masks: window -> [rows, T] bool;
        cos, sin_rot [max_pos, hd] fp32; the pool has `slots` slots. Every index is checked here (raises)."""
        return DecodeStep(self, positions, write_slots, read_slots, masks, cos, sin_rot, heads, kv_heads, slots)

    def decode(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor,
               write_slots: torch.Tensor, read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """One layer in `attention.decode_torch`'s arguments (the check and the tests)."""
        st = self.step(positions, write_slots, read_slots, {0: mask}, cos, sin_rot, heads, kv_heads, kc.shape[0])
        return st.attend(qkv, 0, kc, vc)

    def check(self, reference: Reference) -> Optional[str]:
        """Why the kernel must not be used here (None: it may): results and cache writes against `reference`
        (torch ops) on random batches: GQA, padding, a sliding window, several rows."""
        g = torch.Generator().manual_seed(0)
        for heads, kv_heads, hd, rows, T, window in ((4, 2, 16, 3, 9, 0), (8, 8, 64, 1, 40, 0),
                                                     (6, 2, 24, 2, 33, 5), (4, 1, 128, 4, 17, 0)):
            slots, max_pos = rows * T + 8, 80
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
            ang = torch.randn(max_pos, hd // 2, generator=g)
            cos, sin_rot = torch.cat([ang.cos()] * 2, -1), torch.cat([-ang.sin(), ang.sin()], -1)
            lengths = torch.randint(1, T + 1, (rows,), generator=g)
            positions = lengths - 1  # [rows]: the new token is the row's last key
            read = torch.randperm(slots, generator=g)[:rows * T].view(rows, T)  # [rows, T], distinct slots
            write = read[torch.arange(rows), positions].contiguous()  # [rows]
            col = torch.arange(T)[None]
            mask = (col <= positions[:, None]) & ((col > positions[:, None] - window) if window else True)
            caches = [torch.randn(slots, kv_heads, hd, generator=g) for _ in range(2)]
            mine = [t.clone() for t in caches]
            want = reference(qkv, positions, cos, sin_rot, write, read, mask, caches[0], caches[1], heads, kv_heads)
            got = self.decode(qkv, positions, cos, sin_rot, write, read, mask.contiguous(), mine[0], mine[1],
                              heads, kv_heads)
            if not (torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])):
                return f"its cache writes differ from torch's (heads {heads}, kv {kv_heads}, hd {hd})"
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return f"its attention differs from torch's (heads {heads}, kv {kv_heads}, hd {hd}, rows {rows})"
        return None


_lock = threading.Lock()
_kernel: Optional[Kernel] = None
_tried = False


def enabled() -> bool:
    choice = os.environ.get(ENV, "1").strip()
    if choice not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {choice!r}")
    return choice == "1"


def kernel(reference: Reference) -> Optional[Kernel]:
    """The checked kernel, built on first use (None where torch runs the attention: module doc)."""
    global _kernel, _tried
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            _kernel = _load(reference) if enabled() else None
            _tried = True
    return _kernel


def _load(reference: Reference) -> Optional[Kernel]:
    try:
        k = Kernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.info("decode attention kernel unavailable (%s); torch runs the attention", e)
        return None
    try:
        reason = k.check(reference)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot even be checked stays off
        reason = f"{type(e).__name__}: {e}"
    if reason is not None:
        log.warning("decode attention kernel not used: %s; torch runs the attention", reason)
        return None
    log.info("decode attention kernel on: decode steps attend over the paged cache in one call per layer")
    return k


def _build() -> Path:
    return cbuild.build("decode_attention", C_SOURCE, FLAGS)
