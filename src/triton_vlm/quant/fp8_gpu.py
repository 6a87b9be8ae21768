"""Block-wise FP8 products on a Hopper GPU: the weights stay e4m3 on the device, the activations are quantized per
token and 128-column group as the checkpoint's scheme says (`activation_scheme: "dynamic"`, DeepSeek / Qwen
`-FP8` style), and cuBLAS multiplies the two with their scales (`torch.nn.functional.scaled_mm`,
`BlockWise1x128` x `BlockWise128x128`).

Chosen at load, once per device, with the reason logged (`choose`):
- the engine is on a CUDA device of compute capability 9.0 (torch's 128x128 block scaling runs on Hopper only)
  and its dtype is bf16 / fp16 (the products' output dtype);
- this torch has `scaled_mm` and its `ScalingType`s;
- the checkpoint's `weight_block_size` is [128, 128] and the weight's rows and columns are multiples of 128
  (per weight: `usable`);
- a trial product on this device (a random 256 x 384 weight in 128 x 128 blocks, 16 rows) runs and agrees with
  the product on the dequantized weight (relative Frobenius error < `TRIAL_TOLERANCE`; activation quantization
  costs ~1-3%), trying the scale layouts cuBLAS may want for the weight's scales (`GpuFp8Weight.layout`).
Anything else keeps the path before this module: the weights dequantized at load to the engine's dtype
(`quant/dequant.py`, then cast), with the reason in the log. `TRITON_VLM_GPU_FP8`: "auto" (default) or "0"
(always dequantize). A CPU engine never asks (it has the FP8 gemv, `engine/cpu/gemv_fp8.py`), so nothing here can
stop a CPU server from starting.

Numerics: not `dequantize=True`'s. The activations lose bits to e4m3 (as transformers' own FP8 kernels and vLLM
do on these GPUs): tokens agree with `transformers` FP8 where the logits are not near ties; the GPU check
measures the agreement (docs/families.md).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_GPU_FP8"
GROUP = 128  # activation columns per scale; the weight's block is GROUP x GROUP
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
TRIAL_TOLERANCE = 0.05
ROW_ALIGN = 16  # activation rows padded to a multiple of this (zeros) for the product
_chosen: dict[str, tuple[Optional[str], Optional[str]]] = {}  # device -> (scale layout or None, reason)


LAYOUTS = ("p4", "p4c", "t", "tc", "n")  # tried in this order at load (`_decide`)


@dataclass(frozen=True)
class GpuFp8Weight:
    """An [N, K] e4m3 weight on the device and its decode scales [N / 128, K / 128] fp32 (`weight_scale_inv`)."""

    q: torch.Tensor
    scale: torch.Tensor
    # how this torch's cuBLAS path reads the scales of mat_b = q^T (the trial at load finds which): "p4" (mat_b's
    # blocks [K/128, N/128] with K's blocks padded to a multiple of 4, column-major: torch 2.9+'s check,
    # L4 = round_up(K/128, 4), stride [1, L4]), "p4c" (the same, row-major), "t" (mat_b's blocks, a [K/128, N/128]
    # view), "tc" (the same, contiguous) or "n" (as stored, [N/128, K/128])
    layout: str
    b_scale: torch.Tensor = field(init=False, repr=False)  # the scales as the product reads them, made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "b_scale", scale_b(self.scale, self.layout))


def scale_b(scale: torch.Tensor, layout: str) -> torch.Tensor:
    """A weight's [N/128, K/128] decode scales laid out as `layout` says (GpuFp8Weight.layout)."""
    if layout == "n":
        return scale
    if layout in ("p4", "p4c"):
        nb, kb = scale.shape
        padded = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=scale.device)  # [N/128, L4]
        padded[:, :kb] = scale
        return padded.t() if layout == "p4" else padded.t().contiguous()  # [L4, N/128], stride (1, L4) / (N/128, 1)
    s = scale.t()  # [K / 128, N / 128]: mat_b's blocks
    return s.contiguous() if layout == "tc" else s


def usable(n: int, k: int, block: Optional[tuple[int, int]]) -> bool:
    """Whether an [n, k] weight in `block` blocks is one the scaled product reads as it is stored."""
    return block == (GROUP, GROUP) and n % GROUP == 0 and k % GROUP == 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], decode scales [M, K / 128] fp32 laid out M-major (stride
    (1, M)), as cuBLAS's 1x128 scaling reads them): each 128-column group of a row scaled to e4m3's range."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    scale = (g.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)  # [M, K / 128]
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(m, k)
    return q, scale.t().contiguous().t()


def product(x: torch.Tensor, w: GpuFp8Weight, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] -> [..., N] in `out_dtype`: x quantized per token and 128-column group, times the e4m3 weight."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    padded = -(-rows // ROW_ALIGN) * ROW_ALIGN
    if padded != rows:  # cuBLAS's block-scaled heuristics refuse other row counts (CUBLAS_STATUS_NOT_SUPPORTED at 7)
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[-1])])
    xq, sa = quantize_rows(x2)
    y = F.scaled_mm(xq, w.q.t(), sa, F.ScalingType.BlockWise1x128, w.b_scale, F.ScalingType.BlockWise128x128,
                    output_dtype=out_dtype)[:rows]
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def choose(device: torch.device, dtype: torch.dtype) -> tuple[Optional[str], str]:
    """(the weight-scale layout to use, or None: dequantize at load; why), decided once per device and logged."""
    key = f"{device}/{dtype}"
    if key not in _chosen:
        try:
            layout, reason = _decide(torch.device(device), dtype)
        except Exception as e:  # noqa: BLE001 - asking the device must never stop a server from starting
            layout, reason = None, f"the device could not be asked: {type(e).__name__}: {e}"
        _chosen[key] = (layout, reason)
        if layout is not None:
            log.info("FP8 GPU products on (%s): weights stay e4m3, activations quantized per token and 128 columns",
                     reason)
        else:
            log.info("FP8 GPU products not used: %s; FP8 weights are dequantized to %s at load", reason,
                     str(dtype).removeprefix("torch."))
    return _chosen[key]


def _decide(device: torch.device, dtype: torch.dtype) -> tuple[Optional[str], str]:
    if os.environ.get(ENV, "auto").strip().lower() == "0":
        return None, f"{ENV}=0"
    if device.type != "cuda":
        return None, f"the engine runs on {device.type}, not a CUDA device"
    if not torch.cuda.is_available():
        return None, "CUDA is not available to this torch"
    if dtype not in (torch.bfloat16, torch.float16):
        return None, f"the engine's dtype is {dtype}, not bfloat16 / float16"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return None, f"compute capability {cap[0]}.{cap[1]}: torch's 128x128 block-scaled FP8 products need 9.0 " \
                     "(Hopper)"
    if not hasattr(F, "scaled_mm") or not all(hasattr(getattr(F, "ScalingType", None), n)
                                              for n in ("BlockWise1x128", "BlockWise128x128")):
        return None, f"torch {torch.__version__} has no block-scaled scaled_mm"
    failures = []
    for layout in LAYOUTS:
        try:
            err = _trial(device, dtype, layout)
        except Exception as e:  # noqa: BLE001 - any failure keeps the dequantized path
            failures.append(f"{layout}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if err < TRIAL_TOLERANCE:
            return layout, f"compute capability 9.0, torch {torch.__version__}, weight scales laid out {layout!r}, " \
                           f"trial relative error {err:.4f}"
        failures.append(f"{layout}: relative error {err:.4f} >= {TRIAL_TOLERANCE}")
    return None, "the trial product failed (" + "; ".join(failures) + ")"


def _trial(device: torch.device, dtype: torch.dtype, layout: str) -> float:
    """Relative error of the scaled product against the dequantized weight's, on a random 256 x 384 weight."""
    g = torch.Generator().manual_seed(38)
    n, k = 2 * GROUP, 3 * GROUP
    w = torch.randn(n, k, generator=g) * torch.rand(n // GROUP, 1, k // GROUP, 1, generator=g).add(0.1).repeat(
        1, GROUP, 1, GROUP).reshape(n, k)
    blocks = w.reshape(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / 128, K / 128]
    q = (blocks / scale[:, None, :, None]).to(E4M3).reshape(n, k)
    dense = (q.float().reshape(blocks.shape) * scale[:, None, :, None]).reshape(n, k)
    x = torch.randn(16, k, generator=g)
    want = x @ dense.T
    got = product(x.to(device, dtype), GpuFp8Weight(q.to(device), scale.to(device), layout), None, dtype)
    return float((got.float().cpu() - want).norm() / want.norm())
