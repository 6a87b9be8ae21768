"""A decode step's work besides the matrix products, in C on a CPU: attention straight over the paged KV cache,
the residual adds with RMSNorm, and the SiLU gate. One C call each instead of several torch ops.

The attention, one call per layer, for a decode step (every row gets one new token), computes what
`attention.attend_torch` computes with torch ops:
1. rotary embeddings on the new token's q and k heads (`model.apply_rotary`'s formula, same rounding: the
   source is compiled with `-ffp-contract=off`, so `x * cos + roll(x) * sin` is two rounded products and a
   rounded sum, as torch computes it: the K written to the cache is bit for bit torch's);
2. the new K and V into the cache at the row's write slot;
3. for each query head, softmax(q . k * scale) over the keys the row's mask allows, read through the row's
   slots (`AttentionBatch.read_slots`) from the pool, and the weighted sum of the values; grouped-query heads
   share their kv head (head h reads kv head h // (heads / kv_heads), as `enable_gqa`).
`add_rms_norm` is the residual add and transformers' LlamaRMSNorm in one pass (the sum itself exact);
`silu_mul` is the gated MLP's silu(gate) * up.

Why: per layer a decode step made ~15 torch calls of a few microseconds of dispatch each on tensors of a few
kilobytes (a rotary lookup, index_copy x 2, the index_select gathers of the row's keys and values, the
attention, transposes; `torch.rms_norm` x 2, itself ~8-17 us for 512 values; slices, silu, mul, adds). The
kernel also reads the keys where they are instead of gathering a copy first (the KV-gather-free attention of
vLLM's paged attention, on a CPU), so a decode step's activations no longer grow with rows x context
(`profile.py` measures this). `python -m bench.engine.profile_engine` shows the step.

Numerics: scores, the weighted sum, the norm's sum of squares and the exponentials (a Cephes polynomial,
relative error ~1e-7) are fp32 in another order than torch's (ulp-level, as a different batch size already
gives: model.py "Batch invariance"); the cache writes and the residual stream are exact. Every index
(positions, write and read slots) is checked against its table before any memory is touched; a bad one
raises instead of writing outside the pool.

Build and fallback as `gemv.py` (`cbuild.py`): `csrc/decode.c`, compiled once per machine, checked against torch
at first use; no compiler, a failed build, a failed check or any other exception: logged once, torch runs these
steps. Chosen by measurement (`race`: a decode step's attention, norm and gate of a mid-sized layer against the
torch ops): the layer-by-layer path uses the kernels only where they won; the whole-forward call
(`cpu_forward.py`) is built on them and races the layer-by-layer path itself.
`TRITON_VLM_CPU_DECODE`: "auto" (default, measured), "1" (wherever they check), "0" (torch ops).
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from . import cbuild


ENV = "TRITON_VLM_CPU_DECODE"  # "auto" (default): the C kernels where faster; "1": always; "0": torch ops

FLAGS = ("-ffp-contract=off",)  # rotary rounding as torch's (module doc)

ERRORS = {-1: "bad shape", -2: "a position outside the rotary table", -3: "a write slot outside the pool",
          -4: "a read slot outside the pool", -5: "a row with no key to attend to", -6: "out of memory",
          -7: "an FP8 or bf16 weight without its gemv"}

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

    @property
    def rows(self) -> int:
        return self._qkv_shape[0]

    @property
    def kv_shape(self) -> torch.Size:
        """[slots, kv_heads, head_dim]: one layer's K (or V) pool, as this step's indices were checked against."""
        return self._kv_shape

    @property
    def ref(self):
        """The checked step, by reference, for C callers (`cpu_forward.py`)."""
        return self._ref

    def mask_ptr(self, window: int) -> int:
        """Address of the [rows, T] mask of layers with this window (0: full causal)."""
        return self._masks[window]

    def attend(self, qkv: torch.Tensor, window: int, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """qkv [rows, (heads + 2 kv_heads) * hd] fp32 (copied if strided); kc, vc [slots, kv_heads, hd] fp32 (the
        new K/V are written) -> [rows, heads * hd] fp32. A tensor of another dtype or shape raises, as do strided
        kc / vc (they must be the cache itself)."""
        qkv = qkv.contiguous()
        for name, t, shape in (("qkv", qkv, self._qkv_shape), ("kc", kc, self._kv_shape), ("vc", vc, self._kv_shape)):
            if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                _expect(t, torch.float32, shape, name)
        out = torch.empty(self._out_shape, dtype=torch.float32)  # [rows, heads * hd]
        self._fn(self._ref, self._masks[window], qkv.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr())
        return out


class Kernel(cbuild.Chosen):
    """The compiled decode attention, checked on this machine: `step(...)` once per forward, then
    `DecodeStep.attend` per layer. `chosen`: whether the layer-by-layer path uses it (module doc: measured)."""
    def __init__(self, lib: ctypes.CDLL):
        p = ctypes.c_void_p
        self._check = lib.triton_vlm_decode_check
        self._check.argtypes = [p, p]
        self._check.restype = ctypes.c_int
        self._fn = lib.triton_vlm_decode_attention
        self._fn.argtypes = [p, p, p, p, p, p]
        self._fn.restype = ctypes.c_int
        i64 = ctypes.c_int64
        self._norm = lib.triton_vlm_add_rms_norm
        self._norm.argtypes = [p, p, p, ctypes.c_float, i64, i64, p, p]
        self._norm.restype = None
        self._silu = lib.triton_vlm_silu_mul
        self._silu.argtypes = [p, i64, i64, p]
        self._silu.restype = None

    def add_rms_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [..., n] fp32 (delta None: 0); weight [n] -> (x + delta, rms_norm(x + delta) * weight), both
        [..., n]: the residual add and the next RMSNorm in one pass."""
        n = x.shape[-1]
        x = x.contiguous()
        delta = None if delta is None else delta.contiguous()
        for name, t in (("x", x), ("delta", delta)):
            if t is not None and (t.dtype != torch.float32 or t.shape != x.shape or t.device.type != "cpu"):
                _expect(t, torch.float32, x.shape, name)
        if weight.dtype != torch.float32 or weight.shape != (n,) or not weight.is_contiguous():
            _expect(weight, torch.float32, (n,), "weight")
        x_out, h = torch.empty_like(x), torch.empty_like(x)  # [..., n] each
        self._norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                   x.numel() // n, n, x_out.data_ptr(), h.data_ptr())
        return x_out, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2n] fp32 (gate, then up) -> silu(gate) * up [..., n]."""
        two_n = gate_up.shape[-1]
        gate_up = gate_up.contiguous()
        if gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or two_n % 2:
            _expect(gate_up, torch.float32, gate_up.shape[:-1] + (two_n + two_n % 2,), "gate_up")
        out = gate_up.new_empty(gate_up.shape[:-1] + (two_n // 2,))  # [..., n]
        self._silu(gate_up.data_ptr(), gate_up.numel() // two_n, two_n // 2, out.data_ptr())
        return out

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
        return self._check_elementwise(g)

    def _check_elementwise(self, g: torch.Generator) -> Optional[str]:
        """add_rms_norm and silu_mul against torch (transformers' formulas) on odd and even widths."""
        for rows, n in ((1, 512), (3, 40), (2, 1000)):
            x, d, w = torch.randn(rows, 1, n, generator=g), torch.randn(rows, 1, n, generator=g), torch.randn(n, generator=g)
            s = x + d
            want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
            got_x, got_h = self.add_rms_norm(x, d, w, 1e-6)
            if not (torch.equal(got_x, s) and torch.allclose(got_h, want, rtol=1e-5, atol=1e-6)):
                return f"its residual add + RMSNorm differs from torch's (width {n})"
            gu = torch.randn(rows, 1, 2 * n, generator=g) * 30  # large gates: the exp's clamps
            want = torch.nn.functional.silu(gu[..., :n]) * gu[..., n:]
            if not torch.allclose(self.silu_mul(gu), want, rtol=1e-5, atol=1e-5):
                return f"its SiLU gate differs from torch's (width {n})"
        return None


def enabled() -> bool:
    return _once.enabled()


def kernel(reference: Reference) -> Optional[Kernel]:
    """The checked kernels, built on first use (None where torch runs decode steps: module doc)."""
    return _once.get(reference)


SPEC = cbuild.Spec(ENV, "CPU decode kernels", "torch runs decode steps",
                   "attention over the paged cache, RMSNorm and SiLU gate in C", "torch ops")


def _load(reference: Reference) -> Optional[Kernel]:
    return cbuild.load_checked(_build, Kernel, lambda k: k.check(reference), SPEC,
                               lambda k: race(k, reference))


def race(kernel: Kernel, reference: Reference, heads: int = 16, kv_heads: int = 4, hd: int = 64, T: int = 256,
         hidden: int = 1024, inter: int = 2816) -> cbuild.Race:
    """One decode row's attention over T keys, two residual add + RMSNorms and a SiLU gate: the kernels against
    `reference` and the torch formulas (`model.add_rms_norm`, `model.silu_mul`), alternating."""
    g = torch.Generator().manual_seed(5)
    slots, max_pos = T + 8, T + 8
    qkv = torch.randn(1, (heads + 2 * kv_heads) * hd, generator=g)
    ang = torch.randn(max_pos, hd // 2, generator=g)
    cos, sin_rot = torch.cat([ang.cos()] * 2, -1), torch.cat([-ang.sin(), ang.sin()], -1)
    positions = torch.tensor([T - 1])
    read = torch.arange(T)[None]  # [1, T]
    write, mask = read[:, T - 1].contiguous(), torch.ones(1, T, dtype=torch.bool)
    kc, vc = torch.randn(slots, kv_heads, hd, generator=g), torch.randn(slots, kv_heads, hd, generator=g)
    x, d, w = (torch.randn(1, 1, hidden, generator=g) for _ in range(3))
    w = w.reshape(hidden)
    gu = torch.randn(1, 1, 2 * inter, generator=g)

    def by_kernel():
        kernel.decode(qkv, positions, cos, sin_rot, write, read, mask, kc, vc, heads, kv_heads)
        for _ in range(2):
            kernel.add_rms_norm(x, d, w, 1e-6)
        kernel.silu_mul(gu)

    def by_torch():
        reference(qkv, positions, cos, sin_rot, write, read, mask, kc, vc, heads, kv_heads)
        for _ in range(2):
            s = x + d
            torch.rms_norm(s, (hidden,), w, 1e-6)
        torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]

    return cbuild.race(by_kernel, by_torch, rounds=20)


_once: cbuild.Once[Kernel] = cbuild.Once(ENV, _load)


def _build() -> Path:
    return cbuild.build("decode_attention", "decode.c", FLAGS)
