"""The 16-bit gemv (`engine/cpu/gemv_bf16.py`): products of 1-4 rows on bf16 / fp16 weights kept as stored have the
bits of the fp32 gemv (`gemv.py`) on the weight upcast once; prefill products widen a chunk at a time; a model
holding a bf16 checkpoint's matrices as stored gives the logits of the same model upcast at load, bit for bit;
with the kernel off the weights are upcast at load. A kernel that cannot build or check here skips with the
reason. (Tokens against transformers: tests/test_quant_fp8.py's engine test, whose embedding and lm_head are bf16.)"""
from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import KERNEL_SKIP

from triton_vlm.engine.cpu import cbuild, gemm, gemv, gemv_bf16, gemv_fp8


@pytest.fixture(scope="module")
def k16() -> gemv_bf16.Kernel:
    try:
        k = gemv_bf16.Kernel(ctypes.CDLL(str(cbuild.build("gemv_bf16", "gemv_bf16.c"))))
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the server upcasts at load
        pytest.skip(f"{KERNEL_SKIP}: 16-bit gemv: {type(e).__name__}: {e}")
    reason = k.check()
    if reason is not None:
        pytest.skip(f"{KERNEL_SKIP}: 16-bit gemv fails its check here: {reason}")
    return k


@pytest.fixture(scope="module")
def fp32k() -> gemv.Kernel:
    k = gemv.kernel(gemm.pack)
    if k is None:
        pytest.skip(f"{KERNEL_SKIP}: the fp32 gemv does not run here: nothing to compare bits with")
    return k


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 3).to(dtype)
    w.view(torch.int16)[0, : min(k, 4)] = torch.tensor([1, 0x8001, 0x0200, 0x8000][: min(k, 4)],
                                                       dtype=torch.int32).to(torch.int16)  # subnormals, -0
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(257, 130), (64, 1), (100, 60), (8, 520)])
def test_equals_fp32_gemv_of_the_upcast_weight_bitwise(k16, fp32k, dtype, n, k):
    w = _weight(n, k, dtype, n * k)
    lay = fp32k.layout(packed32 := gemm.pack(w.float()))
    assert lay is not None
    w16 = gemv_bf16.pack(w)
    assert w16.data.dtype == dtype and w16.nbytes == -(-n // 64) * 64 * k * 2  # 2 bytes a weight
    assert torch.equal(w16.widen(), w.float()) and torch.equal(k16.widen_t(w16)[:, :n], w.float().T)
    bias = torch.randn(n)
    for rows in range(1, gemv_bf16.MAX_ROWS + 1):
        x = torch.randn(rows, k)
        for b in (None, bias):
            want, got = fp32k.run(x, lay, b), k16.run(x, w16, b)
            assert torch.equal(got, want), (rows, b is None, (got - want).abs().max())
    del packed32


def test_every_code_widens_as_torch_and_pack_refuses_other_dtypes(k16):
    assert k16.check() is None  # all 65536 codes of both dtypes (NaNs stay NaN) and dense products
    for bad in (torch.randn(4, 4), torch.randn(4, 4).to(torch.float8_e4m3fn), torch.randn(4).bfloat16()):
        with pytest.raises(ValueError, match="bfloat16 / float16"):
            gemv_bf16.pack(bad)


def test_prefill_products_widen_a_chunk_at_a_time_in_a_reused_buffer(k16, monkeypatch):
    n, k = 300, 96  # 5 blocks of 64 outputs, the last one partial
    w = _weight(n, k, torch.bfloat16, 4)
    w16 = gemv_bf16.pack(w)
    monkeypatch.setattr(gemv_fp8, "CHUNK_BYTES", 2 * 64 * k * 4)
    widths, buffers = [], set()
    widen = k16.widen_t
    monkeypatch.setattr(k16, "widen_t", lambda p, a, b, out: widths.append(b - a) or buffers.add(out.data_ptr())
                        or widen(p, a, b, out))
    x, bias = torch.randn(9, k), torch.randn(n)
    for b in (None, bias):
        torch.testing.assert_close(k16.matmul(x, w16, b), torch.nn.functional.linear(x, w.float(), b), rtol=1e-5,
                                   atol=1e-5)
    assert widths == [2, 2, 1] * 2 and len(buffers) == 1  # one scratch for every chunk of every call


def _bf16_copy(src, tmp_path):
    """The demo LLaVA with every floating tensor in bf16 (a plain bf16 release)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "bf16"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*", "*.bin"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load(path, monkeypatch, mode: str):
    from triton_vlm.engine.cpu import cpu_forward
    from triton_vlm.engine.model.model import LlamaModel

    monkeypatch.setenv(gemv_bf16.ENV, mode)
    monkeypatch.setenv(cpu_forward.ENV, "1")
    gemv_bf16._once.reset()
    try:
        return LlamaModel.from_pretrained(path)
    finally:
        gemv_bf16._once.reset()


def test_bf16_checkpoint_held_as_stored_gives_the_upcast_models_logits(k16, demo_model, tmp_path, monkeypatch):
    """A bf16 checkpoint served in fp32: every matrix kept bf16 (half the bytes), the label says so, and prefill
    plus decode steps (the C whole-step forward and layer by layer) give the logits of the same checkpoint upcast
    at load (the kernel off: the fallback) bit for bit; the control: the upcast model holds fp32."""
    path = _bf16_copy(demo_model, tmp_path)
    held, upcast = _load(path, monkeypatch, "1"), _load(path, monkeypatch, "0")
    assert held.weights_held() == "bfloat16" and upcast.weights_held() == "float32"
    assert held.embed_tokens.dtype == torch.bfloat16 and upcast.embed_tokens.dtype == torch.float32
    lins = [held.lm_head] + [lin for layer in held.layers for lin in layer.linears()]
    assert all(lin.half_packed is not None and lin.weight.dtype == torch.bfloat16 for lin in lins)
    nbytes = [sum(gemm.nbytes(t) for t in {id(t): t for t in m.tensors()}.values()) for m in (held, upcast)]
    assert nbytes[0] < 0.6 * nbytes[1], nbytes
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 300, (1, 7), generator=g)
    caches = [m.new_cache(8, 4) for m in (held, upcast)]
    rows = [c.new_row() for c in caches]
    outs = [m.forward(m.embed(ids), c.plan([r], 7), c) for m, c, r in zip((held, upcast), caches, rows)]
    assert torch.equal(outs[0], outs[1])
    for whole in (True, False, True):
        step = torch.randint(3, 300, (1, 1), generator=g)
        outs = [m.forward(m.embed(step), c.plan([r], 1), c, whole=whole)
                for m, c, r in zip((held, upcast), caches, rows)]
        assert torch.equal(outs[0], outs[1]), whole
    assert held.c_forward() is not None or upcast.c_forward() is None
