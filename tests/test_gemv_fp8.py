"""The FP8 decode gemv (`engine/cpu/gemv_fp8.py`): products of 1-4 rows on e4m3 bytes + fp32 scales have the
bits of the fp32 gemv (`gemv.py`) on the weight `quant/dequant.py` dequantizes; what it cannot read exactly is
refused by `pack`. A kernel that cannot build or check on this machine skips with the reason."""
from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import KERNEL_SKIP

from triton_vlm.engine.cpu import cbuild, gemm, gemv, gemv_fp8
from triton_vlm.quant.dequant import block_dequantize, channel_dequantize

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8k() -> gemv_fp8.Kernel:
    try:
        k = gemv_fp8.Kernel(ctypes.CDLL(str(cbuild.build("gemv_fp8", "gemv_fp8.c"))))
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the server keeps the dequantized path
        pytest.skip(f"{KERNEL_SKIP}: fp8 gemv: {type(e).__name__}: {e}")
    reason = k.check()
    if reason is not None:
        pytest.skip(f"{KERNEL_SKIP}: fp8 gemv fails its check here: {reason}")
    return k


@pytest.fixture(scope="module")
def fp32k() -> gemv.Kernel:
    k = gemv.kernel(gemm.pack)
    if k is None:
        pytest.skip(f"{KERNEL_SKIP}: the fp32 gemv does not run here: nothing to compare bits with")
    return k


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 80).clamp(-448, 448).to(E4M3)
    q.view(torch.uint8)[0, : min(k, 8)] = torch.arange(min(k, 8), dtype=torch.uint8)  # subnormal codes too
    return q


@pytest.mark.parametrize("n,k,block", [(256, 384, (128, 128)), (192, 128, (64, 32)), (96, 256, (32, 128))])
def test_block_fp8_equals_fp32_gemv_of_dequantized_weight_bitwise(fp8k, fp32k, n, k, block):
    q = _weight(n, k, n + k)
    g = torch.Generator().manual_seed(7)
    s = torch.rand(n // block[0], k // block[1], generator=g) * 1e-2 + 1e-4
    dense = block_dequantize("w", q, s, block)  # [n, k] fp32, as served today
    lay = fp32k.layout(packed32 := gemm.pack(dense))
    assert lay is not None
    w8 = gemv_fp8.pack(q, s, block)
    assert w8.data.numel() == -(-n // 64) * 64 * k and w8.data.dtype == torch.uint8  # 1 byte a weight
    assert torch.equal(fp8k.dequantize_t(w8)[:, :n], dense.T)  # prefill's weight, converted by the kernel
    bias = torch.randn(n, generator=g)
    for rows in range(1, gemv_fp8.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=g)
        for b in (None, bias):
            want, got = fp32k.run(x, lay, b), fp8k.run(x, w8, b)
            assert torch.equal(got, want), (rows, b is None, (got - want).abs().max())
    del packed32


def test_channel_and_tensor_scales_bitwise(fp8k, fp32k):
    n, k = 160, 96  # n not a multiple of 64: padded outputs
    q = _weight(n, k, 3)
    for scale in (torch.rand(n, 1) * 1e-2 + 1e-4, torch.tensor([3e-3])):
        dense = channel_dequantize("w", q, scale)
        lay = fp32k.layout(packed32 := gemm.pack(dense))
        x = torch.randn(2, k)
        assert torch.equal(fp8k.run(x, gemv_fp8.pack(q, scale, None)), fp32k.run(x, lay, None))
        del packed32


def test_scales_matter(fp8k):
    """A control: the same bytes with other scales give other products."""
    q = _weight(128, 128, 5)
    x = torch.randn(1, 128)
    one = fp8k.run(x, gemv_fp8.pack(q, torch.ones(1, 1), (128, 128)))
    assert not torch.equal(one, fp8k.run(x, gemv_fp8.pack(q, torch.full((1, 1), 0.5), (128, 128))))
    assert torch.allclose(one, x @ q.float().T, rtol=1e-5, atol=1e-3)


def test_pack_refuses_what_it_cannot_read_exactly():
    q = _weight(64, 64, 1)
    with pytest.raises(ValueError, match="fp32 scales"):
        gemv_fp8.pack(q, torch.ones(64, 1, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="expected"):
        gemv_fp8.pack(q, torch.ones(2, 3), (32, 32))
    bad = q.clone()
    bad.view(torch.uint8)[3, 3] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        gemv_fp8.pack(bad, torch.ones(1, 1), None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv_fp8.pack(q.float(), torch.ones(1, 1), None)


@pytest.mark.parametrize("base,fmt,kept", [("llava", "fp8-block", True), ("qwen2_5_vl", "fp8-block", True),
                                           ("llava", "ct-channel", False)])
def test_engine_keeps_fp8_projections_equal_to_the_dequantized_weights(fp8k, monkeypatch, base, fmt, kept):
    """The engine on a block-wise FP8 checkpoint holds its projections as e4m3 (1 byte a weight) whose values are
    the dequantized weights bit for bit, and products on them equal F.linear on those weights closely (the bits
    are `gemv.c`'s order, checked above). compressed-tensors with bf16 scales (the fixture's) is dequantized at
    load: its product is rounded in bf16, which `float(q) * s` in fp32 is not. Qwen2.5-VL: q/k/v with biases."""
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.engine.model.model import LlamaModel
    from triton_vlm.weight_source import TensorSource

    monkeypatch.setenv(gemv_fp8.ENV, "1")
    gemv_fp8._once.reset()
    try:
        path = ensure_fp8_checkpoint(base, fmt)
        model, src = LlamaModel.from_pretrained(path), TensorSource(path)
    finally:
        gemv_fp8._once.reset()
    prefix = next(k for k in src.quant.scales).split("layers.")[0]
    for i, layer in enumerate(model.layers):
        for lin in layer.linears():
            assert (lin.fp8_packed is not None and lin.weight.dtype == torch.uint8) == kept, (i, lin.module)
            group = "self_attn" if lin.module in ("qkv_proj", "o_proj") else "mlp"
            want = torch.cat([src.get(f"{prefix}layers.{i}.{group}.{m}.weight") for m, _ in lin.parts])
            assert torch.equal(lin.dense_weight(), want), (i, lin.module)
            x = torch.randn(1, 1, want.shape[1])
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, want, lin.bias), rtol=1e-5, atol=1e-5)
            x6 = torch.randn(6, 1, want.shape[1])  # more rows than the kernel takes: the dequantized weight
            torch.testing.assert_close(lin(x6), torch.nn.functional.linear(x6, want, lin.bias), rtol=1e-5, atol=1e-5)
