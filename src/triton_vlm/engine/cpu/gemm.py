"""The projections' matrix products on a CPU: oneDNN with weights prepacked once, instead of MKL per call.

Every `Linear` of the decoder computes `y = x @ W^T (+ b)`. `F.linear` on a CPU calls MKL's sgemm, which on
the AMD EPYC machines this project runs on takes its generic (non-AVX-512) path: measured with one thread,
fp32, cold weights (a microbenchmark cycling through more weights than the L3 holds; in the engine,
`python -m bench.engine.profile_engine` shows the step):

    shape (rows x in -> out)      F.linear (MKL)         oneDNN, prepacked
    1 x 512 -> 1408               200 us  14 GB/s        93-127 us  23-31 GB/s   (a decode step of one stream)
    64 x 512 -> 1408              976 us  95 GFLOP/s     405 us   228 GFLOP/s     (beam 4 x 16 requests)
    64 x 512 -> 8192 (lm_head)    7957 us 68 GFLOP/s     2722 us  197 GFLOP/s

`pack(weight)` reorders a [out, in] weight once, at load, into oneDNN's blocked layout (the opaque `_mkldnn`
tensor `torch.ops.mkldnn._reorder_linear_weight` returns; the form PyTorch's own inductor uses for frozen
CPU linears), and `linear` runs `torch.ops.mkldnn._linear_pointwise` on it: one call, bias fused, any number of
leading dims, a dense fp32 result. The packed weight replaces the dense one (same bytes); a tied lm_head gets
its own packed copy (the embedding stays dense for the lookup).

Numerics: both compute each output as an fp32 sum over `in` products; the blocking (the order of the
partial sums) differs, so results differ from MKL's in the last bits (~1e-6 relative), as a different batch
size already does (model.py "Batch invariance"). Generated tokens are checked against transformers in
tests/engine (same logits up to that rounding).

Shapes: oneDNN builds (JIT-compiles) a primitive per input shape and caches it, ~570 KiB each (measured),
up to 1,024 of them (~570 MB): a server sees every prefill chunk length and every decode row count, so the
cache kept growing (the soak test caught it), and capping it only traded that for allocator churn (RSS grew
more, measured). The row
count of a packed GEMM is therefore padded up to a bounded set (`padded_rows`: 1, 2, 4, multiples of 8 up to
128 rows, of 32 up to 512, of 128 up to 2,048, then of 512): about 50 shapes per weight, zero rows appended and
their outputs dropped. A row's result does not depend on the padding rows; padding costs copying x (small)
and at most 1/8 more compute at the decode sizes, where one row's GEMM is memory-bound anyway.

Products of 1 to 4 rows (decode steps of up to 4 rows, the shortest prefill chunks) skip oneDNN: `gemv.py`'s
kernel reads the same packed buffer, with ~2 us instead of ~11 us of fixed cost per call and closer to the
memory's speed (a one-stream step's 33 products: 2.33 vs 2.96 ms, measured). Where it cannot run (no C
compiler, another packed layout) oneDNN takes them; `TRITON_VLM_CPU_GEMV=0` forces that.

Used only where it is measured to pay: a CPU device, float32 weights, oneDNN present in the torch build.
Elsewhere (CUDA: cuBLAS; fp16 / bf16 on CPU) `F.linear` runs unchanged. `TRITON_VLM_CPU_GEMM=default`
turns packing off (for comparisons).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import gemv

ENV = "TRITON_VLM_CPU_GEMM"  # "onednn" (default) or "default" (F.linear everywhere)
BATCH_HINT = 16  # rows the packing is tuned for; any row count works (measured: best for 1..128 rows here)
# row buckets of packed GEMMs: up to 128 rows (decode steps) multiples of 8, then of 32, 128, 512 (prefill chunks)
ROW_STEPS = ((128, 8), (512, 32), (2048, 128))
ROW_STEP_BEYOND = 512


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on `device` are packed for oneDNN (module doc: where it pays)."""
    choice = os.environ.get(ENV, "onednn").strip().lower()
    if choice not in ("onednn", "default"):
        raise ValueError(f"{ENV} must be 'onednn' or 'default', got {choice!r}")
    return (choice == "onednn" and device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense fp32 -> the same matrix in oneDNN's blocked layout (an opaque `_mkldnn` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def decode_kernel() -> Optional[gemv.Kernel]:
    """The kernel for products of 1-4 rows on packed weights (`gemv.py`), built and checked once; None where
    oneDNN runs them."""
    return gemv.kernel(pack)


def prepare(weight: torch.Tensor) -> None:
    """At load, for a packed weight: find (and check against oneDNN) the layout the decode kernel reads."""
    kernel = decode_kernel()
    if kernel is not None:
        kernel.layout(weight, lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn


def padded_rows(rows: int) -> int:
    """The row count a packed GEMM of `rows` rows runs with: one of a bounded set (module doc, "Shapes")."""
    if rows <= 4:
        return 1 << (rows - 1).bit_length()  # 1, 2, 4
    for limit, step in ROW_STEPS:
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // ROW_STEP_BEYOND) * ROW_STEP_BEYOND


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: x @ W^T (+ b), with `weight` dense [out, in] or packed by `pack` (1-4 rows of a
    packed weight: the decode kernel, when this machine has it)."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if 0 < rows <= gemv.MAX_ROWS and x.dtype == torch.float32 and (bias is None or bias.is_contiguous()):
        kernel = decode_kernel()
        lay = None if kernel is None or not kernel.chosen else kernel.layout(weight)
        if lay is not None:
            x2 = x.reshape(rows, x.shape[-1])  # [rows, in]
            y = kernel.run(x2 if x2.stride(-1) == 1 else x2.contiguous(), lay, bias)  # [rows, out]
            return y.view(*x.shape[:-1], y.shape[-1])
    pad = padded_rows(rows) - rows
    if not pad:  # called with 2-D input: the op's own flattening of [rows, q_len, in] costs ~6 us a call
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), weight, bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])
    x2 = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))  # [rows + pad, in], zero rows appended
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")[:rows]  # [rows, out]
    return y.view(*x.shape[:-1], y.shape[-1])


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] matrix of a dense or packed weight (a copy for a packed one)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a packed weight has no storage to ask: counted as its elements (the blocked layout
    may pad a little on top)."""
    return t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
