"""Decode-sized matrix products (1 to 4 rows) read straight from oneDNN's packed weights, by a small C kernel.

Why: a one-stream decode step makes 33 projection calls (q/k/v, o, gate/up, down per layer, the lm_head). oneDNN
runs each in ~11 us of fixed cost before it reads a byte (primitive lookup, memory descriptors: measured on a
16 x 16 weight) and reaches 23-33 GB/s on the small matrices (o: 1 MB, q/k/v: 2 MB), against ~37 GB/s one
core streams. For 1 to 4 rows a product is a pure read of the weight, so a kernel that streams the weight once
and calls in ~2 us gets closer to the memory: `python -m bench.engine.profile_engine` shows the step.

The layout. `gemm.pack` leaves each weight in the blocked layout oneDNN picks for the machine; on the AVX-512
machines this project runs on it is `[ceil(N / 64)][Kp][64]`: for each block of 64 outputs, K rows of 64
weights (Kp = K rounded up, zero padded, as are the outputs past N). That is the layout a GEMV wants: per input
element k, one contiguous 256-byte row of weights multiplied into 64 accumulators. The kernel reads the packed
buffer itself (`torch.ops.mkldnn.data_ptr`), so no second copy of the weights exists. The layout is not part of
oneDNN's API: `Kernel.check` packs a probe weight whose values are their own (n, k) and verifies the mapping
for several shapes before the kernel is used, then compares results with a dense product; on any mismatch (an
AVX2 machine's different block width, a future oneDNN) the kernel stays off and oneDNN runs every product.

Numerics: each output is one fp32 fused multiply-add chain over k in ascending order, starting from 0; the bias
is added at the end. oneDNN blocks the sum differently, so results differ from it (and from MKL) in the last
bits, as a different batch size already does (model.py "Batch invariance"); tests/engine checks generated
tokens against transformers.

Build: `csrc/gemv.c` is compiled once per machine with the system C compiler (`cc -O3 -march=native`,
`cbuild.py`: cached under a hash of the sources, the compiler and the CPU, so a build never runs on a CPU it was
not built for), and loaded with ctypes (the call releases the GIL, as a torch op does). No compiler, a failed
build, a failed check or any other exception: logged once, oneDNN everywhere. Chosen by measurement: at first
load on a machine the kernel races oneDNN on products of one row over weights that do not fit the caches
(`race`); it runs products only where it won, and the log line gives both figures, or where the model's C decode
forward is used (`cpu_forward.py`, whose products are this kernel's: the layer-by-layer path of the same steps
must give its bits, `model._take_gemv`; the one-product race is within a few percent either way).
`TRITON_VLM_CPU_GEMV`: "auto" (default, measured), "1" (wherever it checks), "0" (oneDNN for every product).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from . import cbuild

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_CPU_GEMV"  # "auto" (default): the kernel for 1-4 rows where it is faster; "1": always; "0": never
MAX_ROWS = 4  # products of up to this many rows run here
BLOCK = 64  # outputs per block of the packed layout the kernel reads
_ATTR = "_triton_vlm_gemv_layout"  # a packed weight's Layout (or None), set on first use
_UNSET = object()

@dataclass(frozen=True)
class Layout:
    """Where a packed [N, K] weight's elements are: `[ceil(N / 64)][kp][64]` floats from `ptr`."""
    ptr: int
    n: int
    k: int
    kp: int


class Kernel(cbuild.Chosen):
    """The compiled kernel, once checked on this machine; `layout(w)` / `run(x, w, bias)`. `chosen`: whether
    products take it (module doc: measured); the C decode forward calls it either way."""
    def __init__(self, lib: ctypes.CDLL):
        fn = lib.triton_vlm_gemv
        i64, p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [p, i64, i64, i64, p, i64, i64, p, p, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    def layout(self, weight: torch.Tensor, reference: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
               ) -> Optional[Layout]:
        """The packed weight's layout (kept on the tensor: weights live as long as their engine), or None if its
        buffer is not `[N/64][Kp][64]` floats. With `reference` (x [1, K] -> x @ W^T by oneDNN), the first call
        also compares the kernel's product with it on a random row: oneDNN may pick another layout for some
        shape than for the probes of `check`, and then this weight stays with oneDNN."""
        found = getattr(weight, _ATTR, _UNSET)
        if found is not _UNSET:
            return found
        n, k = weight.shape
        nbytes = torch.ops.mkldnn._nbytes(weight)
        n_pad = -(-n // BLOCK) * BLOCK
        kp, rest = divmod(nbytes // 4, n_pad)
        ok = rest == 0 and nbytes % 4 == 0 and kp >= k
        found = Layout(torch.ops.mkldnn.data_ptr(weight), n, k, kp) if ok else None
        if found is not None and reference is not None:
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(n * 31 + k))  # [1, K]
            want, got = reference(x), self.run(x, found, None)  # [1, N] each
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp(min=1.0))):
                log.warning("decode gemv kernel: a packed %dx%d weight is not in the layout it reads; oneDNN runs "
                            "its products", n, k)
                found = None
        setattr(weight, _ATTR, found)
        return found

    def run(self, x: torch.Tensor, lay: Layout, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [rows <= 4, K] fp32 (rows contiguous) -> [rows, N] fp32."""
        rows = x.shape[0]
        y = torch.empty(rows, lay.n, dtype=torch.float32)  # [rows, N]
        rc = self._fn(x.data_ptr(), rows, x.stride(0), lay.k, lay.ptr, lay.kp, lay.n,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), lay.n)
        if rc != 0:
            raise ValueError(f"gemv kernel: {rows} rows, at most {MAX_ROWS}")
        return y

    def check(self, pack) -> Optional[str]:
        """Why the kernel must not be used here (None: it may). `pack` is `gemm.pack`."""
        for n, k in ((64, 16), (100, 60), (200, 512), (40, 24)):
            probe = (torch.arange(n, dtype=torch.float32)[:, None] * 4096 + torch.arange(k)[None, :])  # [n, k]
            packed = pack(probe)
            lay = self.layout(packed)
            if lay is None:
                return f"the packed {n}x{k} weight's buffer is not [N/64][Kp][64] floats"
            buf = torch.frombuffer((ctypes.c_float * (-(-n // BLOCK) * BLOCK * lay.kp)).from_address(lay.ptr),
                                   dtype=torch.float32)
            nn, kk = torch.arange(n)[:, None], torch.arange(k)[None, :]
            if not torch.equal(buf[(nn // BLOCK) * lay.kp * BLOCK + kk * BLOCK + nn % BLOCK], probe):
                return f"oneDNN packed a {n}x{k} weight in another layout than [N/64][Kp][64]"
            g = torch.Generator().manual_seed(n * k)
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            lay = self.layout(packed := pack(w))
            for rows in range(1, MAX_ROWS + 1):
                x = torch.randn(rows, k, generator=g)
                want = x.double() @ w.double().T + b.double()
                got = self.run(x, lay, b).double()
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                    return f"results differ from a dense product ({rows}x{k} @ {k}x{n})"
            del packed
        return None


def enabled() -> bool:
    return _once.enabled()


def kernel(pack) -> Optional[Kernel]:
    """The checked kernel, built on first use (None where it cannot run: module doc)."""
    return _once.get(pack)


SPEC = cbuild.Spec(ENV, "decode gemv kernel", "oneDNN runs every product",
                   f"products of 1-{MAX_ROWS} rows read oneDNN's packed weights directly", "oneDNN")


def _load(pack) -> Optional[Kernel]:
    # e.g. a torch without mkldnn.data_ptr makes the check raise: the kernel stays off
    return cbuild.load_checked(_build, Kernel, lambda k: k.check(pack), SPEC,
                               lambda k: race(k, pack))


def race(kernel: Kernel, pack, n: int = 1536, k: int = 1024, count: int = 8) -> cbuild.Race:
    """One-row products over `count` [n, k] weights (48 MB: past the caches, as a model's weights are read),
    by the kernel and by oneDNN, alternating."""
    g = torch.Generator().manual_seed(11)
    packed = [pack(torch.randn(n, k, generator=g)) for _ in range(count)]
    lays = [kernel.layout(w) for w in packed]
    if any(lay is None for lay in lays):
        raise RuntimeError("a timing weight is not in the layout the kernel reads")
    x = torch.randn(1, k, generator=g)  # [1, K]

    def by_kernel():
        for lay in lays:
            kernel.run(x, lay, None)

    def by_onednn():
        for w in packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return cbuild.race(by_kernel, by_onednn)


_once: cbuild.Once[Kernel] = cbuild.Once(ENV, _load)


def _build() -> Path:
    """Compile csrc/gemv.c (once per sources, compiler and CPU: `cbuild.build`) -> the shared library's path."""
    return cbuild.build("gemv", "gemv.c")
