"""Decode-sized products (1 to 4 rows) on FP8 weights kept as float8_e4m3fn bytes: a quarter of fp32's bytes
read per product, the weight dequantized in registers (issue 38, CPU).

A one-stream decode step is a read of every projection weight (`gemv.py`): at 1 byte a weight instead of 4 the
read is a quarter, and the e4m3 -> fp32 conversion is a few vector integer operations per 16 weights, so the
product is bound by the memory for fewer bytes.

The layout (`pack`): the e4m3 bytes as `[ceil(N / 64)][K][64]` (outputs past N zero), the layout `gemv.c` reads
in floats, and the checkpoint's scales as fp32 `[ceil(N / bm)][ceil(K / bn)]`: block-wise FP8's
`weight_scale_inv` with `weight_block_size` [bm, bn]; compressed-tensors' per-channel scales are [N, 1] with
bm = 1, bn = K; a per-tensor scale is [1, 1] with bm = N, bn = K.

Numerics: each weight becomes `float(q) * s` in fp32, one rounding, exactly as `quant/dequant.py`'s
`block_dequantize` computes the dequantized weight, and each output is the multiply-add chain over k ascending
from 0 of `gemv.c`: the result has the bits of `gemv.c` on the dequantized fp32 weight (tests/test_gemv_fp8.py
checks it bitwise), so the tokens are those of the dequantized model the C gemv serves. compressed-tensors'
dequantization computes in the scale's dtype (bf16 scales round `q * s` to bf16): it equals this only for fp32
scales, so `pack` takes fp32 scales only and the caller keeps the dequantized path for the others. The two NaN
codes (0x7f, 0xff) are refused by `pack` (they would read as 480).

Prefill (more rows than 4): `Kernel.matmul` dequantizes `CHUNK_BYTES` (1 MiB) of fp32 at a time (a group of
64-output blocks, transposed, by `triton_vlm_fp8_dequantize_t`, row by row of the chunk with a table of its scales)
into a scratch buffer each thread keeps (`chunked_matmul`), and takes each chunk's product by torch while the chunk
is still in the core's L2, so the whole fp32 matrix never exists. Before (a fresh 4 MiB tensor per chunk, written
column strip by column strip) a 29-token prefill of the bench model took 63 ms against fp32's 44 ms
(docs/performance.md has the figures now). The C whole-step decode forward (`cpu_forward.py`) calls
`triton_vlm_gemv_fp8` itself.

Build, check and fallback as `gemv.py` (`cbuild.py`): `csrc/gemv_fp8.c`, built once per machine; `check`
compares its conversion of all 256 codes with torch's (a build that flushes denormals fails it) and its products
with the dequantized weight's dense product; any failure logs why and the dequantized fp32 weights are used.
Chosen by measurement (`race`): FP8 products against `gemv.c` on the dequantized weights.
`TRITON_VLM_CPU_GEMV_FP8`: "auto" (default, measured), "1" (wherever it checks), "0" (never).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import cbuild

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_CPU_GEMV_FP8"
MAX_ROWS = 4
BLOCK = 64
CHUNK_BYTES = 1 << 20  # a prefill product's weight is made this many fp32 bytes at a time (`chunked_matmul`: in L2)
E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class PackedFp8:
    """An [N, K] e4m3 weight as the kernel reads it: `data` uint8 [ceil(N / 64), K, 64], `scale` fp32
    [ceil(N / bm), ceil(K / bn)]."""
    data: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int
    bm: int
    bn: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32: float(q) * s, each scale over its block (`quant/dequant.py`'s values, bit for bit)."""
        q = self.data.transpose(1, 2).reshape(-1, self.k)[: self.n].view(E4M3)  # [N, K]
        s = self.scale.repeat_interleave(self.bm, 0)[: self.n].repeat_interleave(self.bn, 1)[:, : self.k]
        return q.to(torch.float32) * s


def pack(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]) -> PackedFp8:
    """q [N, K] float8_e4m3fn, scale fp32 ([N / bm, K / bn] blocks with `block` = (bm, bn); [N, 1] per channel;
    one per tensor) -> the packed weight. Raises ValueError for what the kernel cannot read exactly."""
    if q.dtype != E4M3 or q.dim() != 2:
        raise ValueError(f"an [N, K] float8_e4m3fn weight, got {q.dtype} {tuple(q.shape)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"fp32 scales only, got {scale.dtype}")
    n, k = q.shape
    if block is not None and scale.numel() > 1:
        bm, bn = block
    elif scale.numel() == n and n > 1:
        bm, bn = 1, k
    elif scale.numel() == 1:
        bm, bn = n, k
    else:
        raise ValueError(f"scale {tuple(scale.shape)} for a {n}x{k} weight")
    grid = (-(-n // bm), -(-k // bn))
    if scale.numel() != grid[0] * grid[1]:
        raise ValueError(f"scale {tuple(scale.shape)}: expected {grid} for {n}x{k} in [{bm}, {bn}] blocks")
    raw = q.view(torch.uint8)
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise ValueError("the weight holds NaN codes")
    n_pad = grid_n = -(-n // BLOCK) * BLOCK
    data = torch.zeros(grid_n, k, dtype=torch.uint8)
    data[:n] = raw
    data = data.reshape(n_pad // BLOCK, BLOCK, k).transpose(1, 2).contiguous()  # [N/64, K, 64]
    return PackedFp8(data, scale.reshape(grid).contiguous(), n, k, bm, bn)


class Kernel(cbuild.Chosen):
    """The compiled kernel, checked on this machine: `run(x, packed, bias)`; `chosen` as in `gemv.py`."""

    def __init__(self, lib: ctypes.CDLL):
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.triton_vlm_gemv_fp8
        self._fn.argtypes = [p, i64, i64, i64, p, i64, p, i64, i64, p, p, i64]
        self._fn.restype = ctypes.c_int
        self._deq = lib.triton_vlm_fp8_dequantize_t
        self._deq.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p]
        self._deq.restype = ctypes.c_int
        self._table = lib.triton_vlm_e4m3_table
        self._table.argtypes = [p]
        self._table.restype = None

    def run(self, x: torch.Tensor, w: PackedFp8, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows <= 4, K] fp32 (rows contiguous) -> [rows, N] fp32."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.shape[1] != w.k or x.stride(1) != 1:
            raise ValueError(f"x must be fp32 [rows, {w.k}] with contiguous rows")
        y = torch.empty(rows, w.n, dtype=torch.float32)  # [rows, N]
        rc = self._fn(x.data_ptr(), rows, x.stride(0), w.k, w.data.data_ptr(), w.n, w.scale.data_ptr(), w.bm,
                      w.bn, None if bias is None else bias.data_ptr(), y.data_ptr(), w.n)
        if rc != 0:
            raise ValueError(f"fp8 gemv kernel: {rows} rows, 1 to {MAX_ROWS}")
        return y

    def dequantize_t(self, w: PackedFp8, nb0: int = 0, nb1: Optional[int] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The dequantized weight's outputs of 64-row blocks nb0 <= nb < nb1 (default: all), transposed:
        [K, (nb1 - nb0) * 64] fp32 (outputs past N zero), its values `PackedFp8.dequantize()`'s bit for bit;
        written into `out` (flat fp32, large enough) when given."""
        nb1 = w.data.shape[0] if nb1 is None else nb1
        if not 0 <= nb0 < nb1 <= w.data.shape[0]:
            raise ValueError(f"row blocks [{nb0}, {nb1}) of {w.data.shape[0]}")
        size = w.k * (nb1 - nb0) * BLOCK
        buf = torch.empty(size, dtype=torch.float32) if out is None else out[:size]
        if self._deq(w.data.data_ptr(), w.k, w.n, w.scale.data_ptr(), w.bm, w.bn, nb0, nb1, buf.data_ptr()):
            raise MemoryError("fp8 dequantize: no memory for the chunk's scale table")
        return buf.view(w.k, (nb1 - nb0) * BLOCK)

    def matmul(self, x: torch.Tensor, w: PackedFp8, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows, K] fp32 (any rows) -> [rows, N]: x @ W^T (+ bias) by torch's product on the dequantized
        weight, a chunk of output blocks at a time (`chunked_matmul`): the fp32 matrix is never whole (prefill)."""
        return chunked_matmul(x, w.n, w.k, w.data.shape[0],
                              lambda nb0, nb1, out: self.dequantize_t(w, nb0, nb1, out), bias)

    def table(self) -> torch.Tensor:
        out = torch.empty(256, dtype=torch.float32)
        self._table(out.data_ptr())
        return out

    def check(self) -> Optional[str]:
        """Why the kernel must not be used here (None: it may)."""
        want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
        got, real = self.table(), ~torch.isnan(want)
        if not torch.equal(got[real], want[real]):
            return "its e4m3 -> fp32 conversion differs from torch's (denormals flushed?)"
        for n, k, block in ((64, 16, (16, 8)), (100, 60, (128, 128)), (200, 512, (128, 128)), (40, 24, None)):
            g = torch.Generator().manual_seed(n * k)
            q = (torch.randn(n, k, generator=g) * 50).clamp(-440, 440).to(E4M3)
            grid = (1, 1) if block is None else (-(-n // block[0]), -(-k // block[1]))
            s = torch.rand(grid, generator=g) + 0.01
            dense = q.float() * s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k] \
                if block is not None else q.float() * s
            b = torch.randn(n, generator=g)
            for rows in range(1, MAX_ROWS + 1):
                x = torch.randn(rows, k, generator=g)
                want = x.double() @ dense.double().T + b.double()
                if not torch.allclose(self.run(x, pack(q, s, block), b).double(), want, rtol=1e-4, atol=1e-3):
                    return f"results differ from a dense product ({rows}x{k} @ {k}x{n})"
            if not torch.equal(self.dequantize_t(pack(q, s, block))[:, :n], dense.T):
                return f"its dequantized {n}x{k} weight differs from torch's"
            if n > BLOCK and not torch.equal(self.dequantize_t(pack(q, s, block), 1, 2)[:, : min(n, 2 * BLOCK) - BLOCK],
                                             dense.T[:, BLOCK: 2 * BLOCK]):
                return f"its dequantized rows 64-127 of a {n}x{k} weight differ from torch's"
        return None


_scratch = threading.local()  # each thread's chunk buffer (`chunked_matmul`)


def _buffer(floats: int) -> torch.Tensor:
    """This thread's scratch of at least `floats` fp32, kept between calls (a fresh 4 MiB buffer a product is
    page faults and zeroing: `bench.engine.fp8`)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _scratch.buf = torch.empty(floats, dtype=torch.float32)
    return buf


def chunked_matmul(x: torch.Tensor, n: int, k: int, blocks: int, fill, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [rows, K] fp32 -> [rows, N] (+ bias): `fill(nb0, nb1, out)` writes the fp32 weight's 64-output blocks
    nb0 <= nb < nb1 transposed ([K, (nb1 - nb0) * 64]) into the flat scratch `out` and returns that view; each
    chunk of `CHUNK_BYTES` is multiplied by torch as it is made, in this thread's reused buffer."""
    step = max(1, CHUNK_BYTES // (k * BLOCK * 4))  # 64-output blocks a chunk
    buf = _buffer(min(step, blocks) * k * BLOCK)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)  # [rows, N]
    for nb0 in range(0, blocks, step):
        nb1 = min(nb0 + step, blocks)
        c0, c1 = nb0 * BLOCK, min(nb1 * BLOCK, n)
        wc = fill(nb0, nb1, buf)[:, : c1 - c0]  # [K, c1 - c0]
        y[:, c0:c1] = torch.mm(x, wc) if bias is None else torch.addmm(bias[c0:c1], x, wc)
    return y


SPEC = cbuild.Spec(ENV, "fp8 decode gemv kernel", "FP8 weights are dequantized to fp32 at load",
                   f"products of 1-{MAX_ROWS} rows read e4m3 weights and their scales", "fp32 gemv")


def race(kernel: Kernel, n: int = 1536, k: int = 1024, count: int = 8) -> cbuild.Race:
    """One-row products over `count` [n, k] weights, FP8 by this kernel against fp32 by `gemv.c` (or oneDNN
    where that is off) on the dequantized weights, alternating."""
    from . import gemm, gemv  # noqa: PLC0415

    g = torch.Generator().manual_seed(12)
    qs = [(torch.randn(n, k, generator=g) * 50).clamp(-440, 440).to(E4M3) for _ in range(count)]
    s = torch.rand(n // 128 + 1, k // 128 + 1, generator=g)[: -(-n // 128), : -(-k // 128)].contiguous()
    packed8 = [pack(q, s, (128, 128)) for q in qs]
    dense = [gemm.pack(q.float()) for q in qs]  # the values do not matter for the time
    fp32 = gemv.kernel(gemm.pack)
    lays = [fp32.layout(w) for w in dense] if fp32 is not None else []
    x = torch.randn(1, k, generator=g)  # [1, K]

    def by_kernel():
        for w in packed8:
            kernel.run(x, w)

    def by_fp32():
        if lays and all(lay is not None for lay in lays):
            for lay in lays:
                fp32.run(x, lay, None)
        else:
            for w in dense:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return cbuild.race(by_kernel, by_fp32)


def _load() -> Optional[Kernel]:
    return cbuild.load_checked(lambda: cbuild.build("gemv_fp8", "gemv_fp8.c"), Kernel, lambda k: k.check(), SPEC,
                               race)


_once: cbuild.Once[Kernel] = cbuild.Once(ENV, _load)


def kernel() -> Optional[Kernel]:
    """The checked kernel, built on first use (None where it cannot run here: module doc)."""
    return _once.get()
