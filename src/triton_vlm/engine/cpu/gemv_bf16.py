"""Products on a checkpoint's bfloat16 / float16 weights kept as they are stored, where the engine computes in fp32
on a CPU: half fp32's bytes in memory and read per decode product, the weight widened to fp32 in registers.

Which weights (`weights.load_weights`): the embedding (its rows gathered, then `.float()`: exact), the lm_head and
the decoder's projections of a checkpoint that stores them in bf16 / fp16 (a plain bf16 release served in fp32,
or what an FP8 release leaves unquantized: Qwen's `-FP8` checkpoints keep embed_tokens and lm_head in bf16).
bf16 -> fp32 and fp16 -> fp32 are exact, so the values are those of the weight upcast once at load, which is
what `transformers` computes with in fp32.

The layout (`pack`): the 16-bit codes as `[ceil(N / 64)][K][64]` (outputs past N zero), the layout `gemv.c`
reads in floats. Numerics: each output is `gemv.c`'s multiply-add chain over k ascending from 0 on the widened
weight, so the result has the bits of `gemv.c` on the upcast fp32 weight (tests/test_gemv_bf16.py checks it
bitwise). Prefill (more rows than 4): `Kernel.matmul` widens a chunk of 64-output blocks at a time into a
scratch buffer kept per thread (`gemv_fp8.chunked_matmul`), each chunk's product by torch: the fp32 matrix is
never whole in memory. The C whole-step decode forward (`cpu_forward.py`) calls `triton_vlm_gemv16` itself.

Build, check and fallback as `gemv_fp8.py` (`cbuild.py`): `csrc/gemv_bf16.c`, built once per machine; `check`
compares its conversion of all 65536 codes of both dtypes with torch's and its products with a dense product;
any failure logs why and the weights are upcast to fp32 once at load (the server starts either way). Chosen by
measurement (`race`): bf16 products against `gemv.c` on the upcast weights.
`TRITON_VLM_CPU_GEMV_BF16`: "auto" (default, measured), "1" (wherever it checks), "0" (never: upcast at load).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from . import cbuild
from .gemv_fp8 import BLOCK, MAX_ROWS, chunked_matmul

ENV = "TRITON_VLM_CPU_GEMV_BF16"
KINDS = {torch.bfloat16: 0, torch.float16: 1}  # the C side's `kind`
HALF = tuple(KINDS)


@dataclass(frozen=True)
class PackedHalf:
    """An [N, K] bf16 / fp16 weight as the kernel reads it: `data` [ceil(N / 64), K, 64] in its dtype."""
    data: torch.Tensor
    n: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def kind(self) -> int:
        return KINDS[self.data.dtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 2

    def widen(self) -> torch.Tensor:
        """[N, K] fp32: the weight upcast (exact)."""
        return self.data.transpose(1, 2).reshape(-1, self.k)[: self.n].float()


def pack(w: torch.Tensor) -> PackedHalf:
    """w [N, K] bfloat16 or float16 -> the packed weight (ValueError for anything else)."""
    if w.dtype not in KINDS or w.dim() != 2:
        raise ValueError(f"an [N, K] bfloat16 / float16 weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    n_pad = -(-n // BLOCK) * BLOCK
    data = torch.zeros(n_pad, k, dtype=w.dtype)
    data[:n] = w
    return PackedHalf(data.reshape(n_pad // BLOCK, BLOCK, k).transpose(1, 2).contiguous(), n, k)  # [N/64, K, 64]


class Kernel(cbuild.Chosen):
    """The compiled kernel, checked on this machine: `run(x, packed, bias)`, `matmul`; `chosen` as in `gemv.py`."""

    def __init__(self, lib: ctypes.CDLL):
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.triton_vlm_gemv16
        self._fn.argtypes = [p, i64, i64, i64, p, i64, i64, p, p, i64]
        self._fn.restype = ctypes.c_int
        self._widen_t = lib.triton_vlm_widen16_t
        self._widen_t.argtypes = [p, i64, i64, i64, i64, p]
        self._widen_t.restype = None
        self._widen = lib.triton_vlm_widen16
        self._widen.argtypes = [p, i64, i64, p]
        self._widen.restype = None

    def run(self, x: torch.Tensor, w: PackedHalf, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows <= 4, K] fp32 (rows contiguous) -> [rows, N] fp32."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.shape[1] != w.k or x.stride(1) != 1:
            raise ValueError(f"x must be fp32 [rows, {w.k}] with contiguous rows")
        y = torch.empty(rows, w.n, dtype=torch.float32)  # [rows, N]
        rc = self._fn(x.data_ptr(), rows, x.stride(0), w.k, w.data.data_ptr(), w.n, w.kind,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), w.n)
        if rc != 0:
            raise ValueError(f"16-bit gemv kernel: {rows} rows, 1 to {MAX_ROWS}")
        return y

    def widen_t(self, w: PackedHalf, nb0: int = 0, nb1: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The widened weight's outputs of 64-row blocks nb0 <= nb < nb1 (default: all), transposed: [K,
        (nb1 - nb0) * 64] fp32 (outputs past N zero), written into `out` (flat, large enough) when given."""
        nb1 = w.data.shape[0] if nb1 is None else nb1
        if not 0 <= nb0 < nb1 <= w.data.shape[0]:
            raise ValueError(f"row blocks [{nb0}, {nb1}) of {w.data.shape[0]}")
        size = w.k * (nb1 - nb0) * BLOCK
        buf = torch.empty(size, dtype=torch.float32) if out is None else out[:size]
        self._widen_t(w.data.data_ptr(), w.k, w.kind, nb0, nb1, buf.data_ptr())
        return buf.view(w.k, (nb1 - nb0) * BLOCK)

    def matmul(self, x: torch.Tensor, w: PackedHalf, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows, K] fp32 (any rows) -> [rows, N]: x @ W^T (+ bias) by torch on the widened weight, a chunk of
        output blocks at a time (`gemv_fp8.chunked_matmul`)."""
        return chunked_matmul(x, w.n, w.k, w.data.shape[0], lambda nb0, nb1, out: self.widen_t(w, nb0, nb1, out),
                              bias)

    def check(self) -> Optional[str]:
        """Why the kernel must not be used here (None: it may)."""
        codes = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # every code (wraps to the int16 pattern)
        for dtype, kind in KINDS.items():
            want = codes.view(dtype).float()
            got = torch.empty(65536, dtype=torch.float32)
            self._widen(codes.data_ptr(), 65536, kind, got.data_ptr())
            real = ~torch.isnan(want)
            if not (torch.equal(got[real], want[real]) and bool(torch.isnan(got[~real]).all())):
                return f"its {dtype} -> fp32 conversion differs from torch's"
        for n, k in ((64, 16), (100, 60), (200, 512), (40, 24)):
            g = torch.Generator().manual_seed(n * k)
            for dtype in HALF:
                w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
                packed = pack(w)
                for rows in range(1, MAX_ROWS + 1):
                    x = torch.randn(rows, k, generator=g)
                    want = x.double() @ w.double().T + b.double()
                    if not torch.allclose(self.run(x, packed, b).double(), want, rtol=1e-4, atol=1e-3):
                        return f"results differ from a dense product ({rows}x{k} @ {k}x{n}, {dtype})"
                if not torch.equal(self.widen_t(packed)[:, :n], w.float().T):
                    return f"its widened {n}x{k} {dtype} weight differs from torch's"
        return None


SPEC = cbuild.Spec(ENV, "bf16 decode gemv kernel", "bf16 / fp16 weights are upcast to fp32 at load",
                   f"products of 1-{MAX_ROWS} rows read bf16 / fp16 weights as stored", "fp32 gemv")


def race(kernel: Kernel, n: int = 1536, k: int = 1024, count: int = 8) -> cbuild.Race:
    """One-row products over `count` [n, k] weights, bf16 by this kernel against fp32 by `gemv.c` (or oneDNN
    where that is off) on the upcast weights, alternating."""
    from . import gemm, gemv  # noqa: PLC0415

    g = torch.Generator().manual_seed(13)
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(count)]
    packed16 = [pack(w) for w in ws]
    dense = [gemm.pack(w.float()) for w in ws]
    fp32 = gemv.kernel(gemm.pack)
    lays = [fp32.layout(w) for w in dense] if fp32 is not None else []
    x = torch.randn(1, k, generator=g)  # [1, K]

    def by_kernel():
        for w in packed16:
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
    return cbuild.load_checked(lambda: cbuild.build("gemv_bf16", "gemv_bf16.c"), Kernel, lambda k: k.check(), SPEC,
                               race)


_once: cbuild.Once[Kernel] = cbuild.Once(ENV, _load)


def kernel() -> Optional[Kernel]:
    """The checked kernel, built on first use (None where it cannot run here: module doc)."""
    return _once.get()


def chosen() -> Optional[Kernel]:
    """The kernel where products are to take it (built, checked, and its switch "1" or its race won), else None."""
    k = kernel()
    return k if k is not None and k.chosen else None
