"""The projections' matrix products on a CPU: oneDNN with weights prepacked once, instead of MKL per call.

Every `Linear` of the decoder computes `y = x @ W^T (+ b)`. `F.linear` on a CPU calls MKL's sgemm, which on
the AMD EPYC machines this project runs on takes its generic (non-AVX-512) path: measured with one thread,
fp32, cold weights (`python -m bench.profile_engine`, and the microbenchmark in this module's test):

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

Used only where it is measured to pay: a CPU device, float32 weights, oneDNN present in the torch build.
Elsewhere (CUDA: cuBLAS; fp16 / bf16 on CPU) `F.linear` runs unchanged. `TRITON_VLM_CPU_GEMM=default`
turns packing off (for comparisons).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

ENV = "TRITON_VLM_CPU_GEMM"  # "onednn" (default) or "default" (F.linear everywhere)
BATCH_HINT = 16  # rows the packing is tuned for; any row count works (measured: best for 1..128 rows here)


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


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: x @ W^T (+ b), with `weight` dense [out, in] or packed by `pack`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] matrix of a dense or packed weight (a copy for a packed one)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a packed weight has no storage to ask: counted as its elements (the blocked layout
    may pad a little on top)."""
    return t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
