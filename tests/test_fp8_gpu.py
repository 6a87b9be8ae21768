"""Block-FP8 products on a Hopper GPU (`quant/fp8_gpu.py`): chosen at load with the reason logged, never on a CPU.

CPU (always run): the choice says why it is not taken on a CPU or when switched off, a CPU engine in bf16 loads an
FP8 checkpoint dequantized as before, and the activations' per-token 128-column quantization has the layout and
the precision cuBLAS's 1x128 scaling reads. GPU (marked `gpu`: deselected where CUDA is missing, conftest): on a
compute capability 9.0 device the projections stay e4m3 on the device and the logits agree with the dequantized
model's; elsewhere the reason is logged and the weights are dequantized to bf16.
"""
from __future__ import annotations

import logging

import pytest
import torch

from triton_vlm.quant import fp8_gpu


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fp8_gpu, "_chosen", {})


def test_a_cpu_engine_never_takes_the_gpu_products_and_says_why(fresh, monkeypatch, caplog):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.engine.model.weights import load_config, load_weights
    from triton_vlm.quant.fp8_weight import Fp8Weight

    with caplog.at_level(logging.INFO, logger=fp8_gpu.__name__):
        assert fp8_gpu.choose(torch.device("cpu"), torch.bfloat16) == (None, "the engine runs on cpu, not a CUDA "
                                                                             "device")
    assert "FP8 GPU products not used: the engine runs on cpu" in caplog.text
    monkeypatch.setenv(fp8_gpu.ENV, "0")
    monkeypatch.setattr(fp8_gpu, "_chosen", {})
    assert fp8_gpu.choose(torch.device("cuda"), torch.bfloat16) == (None, f"{fp8_gpu.ENV}=0")
    path = ensure_fp8_checkpoint("qwen2_5_vl", "fp8-block")
    w = load_weights(path, load_config(path), torch.bfloat16, "cpu")  # dequantized at load, then cast, as before
    assert not [k for k, t in w.items() if isinstance(t, Fp8Weight) or t.dtype != torch.bfloat16]


def test_activation_quantization_layout_and_precision():
    x = torch.randn(5, 256) * torch.tensor([1.0, 100.0]).repeat_interleave(128)  # groups of other ranges
    q, s = fp8_gpu.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.stride() == (1, 5)  # M-major scales
    back = q.float().reshape(5, 2, 128) * s[..., None]
    groups = x.reshape(5, 2, 128)
    assert torch.equal(q.float().reshape(5, 2, 128).abs().amax(-1), torch.full((5, 2), 448.0))
    assert ((back - groups).abs() <= groups.abs().amax(-1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("layout", ["p4", "t"])
def test_fused_gpu_linear_plumbing_with_cublas_semantics_emulated(monkeypatch, layout):
    """The model's FP8 GPU Linear (fused q/k/v with biases) on the CPU, `scaled_mm` replaced by its documented
    math (mat_a [M, K] with 1x128 scales [M, K / 128]; mat_b [K, N] with 128x128 scales [K / 128, N / 128]): the
    parts, scales and biases are wired so that the product is the dequantized weight's, up to the activations'
    e4m3 rounding. (The real kernel is checked on the device at load, `fp8_gpu._trial`, and by the gpu test.)"""
    import torch.nn.functional as F

    from triton_vlm.engine.model.model import Linear
    from triton_vlm.quant.fp8_weight import Fp8Weight

    def emulated(a, b, sa, ra, sb, rb, output_dtype):
        assert (ra, rb) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
        (m, k), n = a.shape, b.shape[1]
        if layout == "p4":  # torch 2.9+'s check: K's blocks padded to 4, column-major
            l4 = -(-(k // 128) // 4) * 4
            assert sb.shape == (l4, n // 128) and sb.stride() == (1, l4) and not sb[k // 128:].any()
            sb = sb[:k // 128]
        assert b.shape[0] == k and sa.shape == (m, k // 128) and sb.shape == (k // 128, n // 128)
        wide = sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return ((a.float() * sa.repeat_interleave(128, 1)) @ (b.float() * wide)).to(output_dtype)

    monkeypatch.setattr(F, "scaled_mm", emulated)
    g = torch.Generator().manual_seed(5)
    w, dense = {}, []
    for m, n in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
        q = (torch.randn(n, 384, generator=g) * 60).clamp(-440, 440).to(torch.float8_e4m3fn)
        s = torch.rand(n // 128, 3, generator=g) + 0.01
        w[f"layers.0.{m}"] = Fp8Weight(q, s, (128, 128)).to_gpu(torch.device("cpu"), layout, torch.float32)
        w[f"layers.0.{m}.bias"] = torch.randn(n, generator=g)
        dense.append(Fp8Weight(q, s, (128, 128)).dequantize())
    lin = Linear.fused(w, 0, "qkv_proj", ("q_proj", "k_proj", "v_proj"), packed=False)
    assert lin.fp8_device is not None and lin.parts == (("q_proj", 256), ("k_proj", 128), ("v_proj", 128))
    assert torch.equal(lin.dense_weight(), torch.cat(dense))
    x = torch.randn(2, 3, 384, generator=g)
    want = F.linear(x, torch.cat(dense), torch.cat([w[f"layers.0.{m}.bias"] for m in ("q_proj", "k_proj", "v_proj")]))
    got = lin(x)
    assert got.shape == (2, 3, 512) and float((got - want).norm() / want.norm()) < 0.05


@pytest.fixture(scope="module")
def fp8_128(tmp_path_factory):
    """A random LLaVA whose language model's dims are multiples of 128, quantized in [128, 128] blocks."""
    from triton_vlm.demo.checkpoint import build_random_llava
    from triton_vlm.demo.fp8_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8-gpu")
    src = build_random_llava(root / "llava", text_hidden=256, heads=4, kv_heads=2, intermediate=512, seed=3)
    return quantize_checkpoint(src, root / "fp8", "fp8-block", (128, 128))


@pytest.mark.gpu
def test_hopper_keeps_fp8_on_the_device_and_agrees_with_the_dequantized_model(fp8_128, fresh, monkeypatch, caplog):
    from triton_vlm.engine.model.model import LlamaModel

    with caplog.at_level(logging.INFO, logger=fp8_gpu.__name__):
        fp8 = LlamaModel.from_pretrained(fp8_128, "bfloat16", "cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        assert "FP8 GPU products not used: compute capability" in caplog.text and fp8.weights_held() == "bfloat16"
        return
    assert "FP8 GPU products on" in caplog.text, caplog.text
    assert fp8.weights_held() == "float8_e4m3fn"
    for lin in [lin for layer in fp8.layers for lin in layer.linears()]:
        assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight.is_cuda
        x = torch.randn(7, lin.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), lin.dense_weight().float(),
                                          None if lin.bias is None else lin.bias.float())
        assert float((lin(x).float() - want).norm() / want.norm()) < 0.05, lin.module
    monkeypatch.setenv(fp8_gpu.ENV, "0")
    monkeypatch.setattr(fp8_gpu, "_chosen", {})
    dense = LlamaModel.from_pretrained(fp8_128, "bfloat16", "cuda")
    assert dense.weights_held() == "bfloat16"
    ids = torch.randint(5, fp8.embed_tokens.shape[0], (1, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    for m in (fp8, dense):
        cache = m.new_cache(8, 16)
        row = cache.new_row()
        logits.append(m.forward(m.embed(ids), cache.plan([row], ids.shape[1]), cache, all_logits=True)[0].float())
    rel = float((logits[0] - logits[1]).norm() / logits[1].norm())
    agree = float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean())
    assert rel < 0.1 and agree >= 0.8, (rel, agree)
