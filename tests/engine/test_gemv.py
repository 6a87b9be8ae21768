"""The decode-sized product kernel (`engine/cpu/gemv.py`): it reads oneDNN's packed weights, matches a dense product,
takes exactly the 1-4 row products, and steps aside (oneDNN runs everything) wherever it cannot be used."""
from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from triton_vlm.engine.cpu import gemm
from triton_vlm.engine.cpu import cbuild, gemv

NO_KERNEL = ("C kernel not built here: no gemv (it needs a C compiler and oneDNN's [N/64][Kp][64] packing: x86-64 "
             "with AVX2 or AVX-512); oneDNN runs every product")


def _machine_can_build() -> bool:
    """A C compiler, and oneDNN packing in the layout (`[N/64][Kp][64]`) the kernel reads: on x86-64 with AVX2 or
    AVX-512 it does (any other packing keeps the kernel off, tested below)."""
    return shutil.which("cc") is not None and platform.machine() in ("x86_64", "AMD64") and _has_avx2()


def _has_avx2() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return " avx2" in flags


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as if nothing had been built in this process, with its own build folder, switch "auto"."""
    monkeypatch.setattr(gemv, "_once", cbuild.Once(gemv.ENV, gemv._load))
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path))
    monkeypatch.delenv(gemv.ENV, raising=False)
    return tmp_path


def test_the_kernel_is_on_where_it_can_be():
    kernel = gemm.decode_kernel()
    assert (kernel is not None) == _machine_can_build()


@pytest.mark.parametrize("n,k", [(96, 64), (100, 60), (8192, 512), (512, 1408), (40, 24)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_a_dense_product(n, k, rows, with_bias):
    kernel = gemm.decode_kernel()
    if kernel is None:
        assert not _machine_can_build()
        pytest.skip(NO_KERNEL)
    g = torch.Generator().manual_seed(n * 7 + k + rows)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if with_bias else None
    packed = gemm.pack(w)
    lay = kernel.layout(packed)
    assert lay is not None and (lay.n, lay.k) == (n, k) and lay.kp >= k
    x = torch.randn(rows, k + 5, generator=g)[:, 2:k + 2]  # rows further apart than k: the row stride is used
    y = kernel.run(x, lay, b)
    assert y.shape == (rows, n) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_linear_takes_one_to_four_rows_to_the_kernel(monkeypatch):
    kernel = gemm.decode_kernel()
    if kernel is None:
        assert not _machine_can_build()
        pytest.skip(NO_KERNEL)
    seen = []
    run = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, x, lay, bias: seen.append(x.shape[0]) or run(self, x, lay, bias))
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(72, 32, generator=g), torch.randn(72, generator=g)
    packed = gemm.pack(w)
    for shape in [(1, 1, 32), (4, 1, 32), (2, 2, 32), (5, 1, 32), (1, 8, 32), (64, 32)]:
        x = torch.randn(*shape, generator=g)
        y = gemm.linear(x, packed, b)
        assert y.shape == (*shape[:-1], 72)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert seen == [1, 4, 4]  # [1,1], [4,1] and [2,2] rows; 5, 8 and 64 rows went to oneDNN


def test_a_layout_the_kernel_cannot_read_keeps_it_off():
    kernel = gemm.decode_kernel()
    if kernel is None:
        assert not _machine_can_build()
        pytest.skip(NO_KERNEL)
    # a "pack" that stores the matrix upside down: the probe's values are not where [N/64][Kp][64] puts them
    assert "another layout" in kernel.check(lambda w: gemm.pack(w.flip(0)))


def test_no_compiler_means_onednn_everywhere(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert gemv.kernel(gemm.pack) is None
    assert not list(fresh.glob("kernels/*.so"))
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 16, generator=g)
    x = torch.randn(1, 16, generator=g)
    torch.testing.assert_close(gemm.linear(x, gemm.pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_switch_turns_the_kernel_off_and_another_value_keeps_it_off(fresh, monkeypatch, caplog):
    monkeypatch.setenv(gemv.ENV, "0")
    assert gemv.kernel(gemm.pack) is None
    gemv._once.reset()
    monkeypatch.setenv(gemv.ENV, "yes")  # a typo never stops a model from loading: logged, and off
    assert gemv.kernel(gemm.pack) is None
    assert "TRITON_VLM_CPU_GEMV must be auto, 1 or 0, got 'yes'" in caplog.text


def test_a_build_is_cached_per_machine(fresh):
    if shutil.which("cc") is None:
        assert gemv.kernel(gemm.pack) is None
        pytest.skip(NO_KERNEL)
    built = gemv._build()  # any machine with a C compiler builds it, whatever oneDNN's layout
    assert list(fresh.glob("kernels/gemv-*.so")) == [built]
    stamp = built.stat().st_mtime_ns
    assert gemv._build() == built and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert not [p for p in (fresh / "kernels").iterdir() if p.suffix != ".so"]  # no temporary left behind


def test_a_check_that_raises_keeps_the_kernel_off(fresh, monkeypatch):
    """e.g. a torch build without `torch.ops.mkldnn.data_ptr`: the engine still loads, oneDNN runs every product."""

    def no_data_ptr(self, pack):
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute 'data_ptr'")

    monkeypatch.setattr(gemv.Kernel, "check", no_data_ptr)
    assert gemv.kernel(gemm.pack) is None


def test_a_weight_whose_product_disagrees_with_onednn_stays_with_onednn(monkeypatch):
    """`gemm.prepare` (at load) compares the kernel with oneDNN once per weight: a weight oneDNN laid out some other
    way (here: a reference that disagrees) never reaches the kernel."""
    kernel = gemm.decode_kernel()
    if kernel is None:
        assert not _machine_can_build()
        pytest.skip(NO_KERNEL)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(80, 48, generator=g)
    good, bad = gemm.pack(w), gemm.pack(w)
    gemm.prepare(good)
    assert kernel.layout(good) is not None
    assert kernel.layout(bad, lambda x: -F.linear(x, w)) is None
    seen = []
    run = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, x, lay, bias: seen.append(lay.n) or run(self, x, lay, bias))
    x = torch.randn(2, 48, generator=g)
    torch.testing.assert_close(gemm.linear(x, bad), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert seen == []  # oneDNN computed it
    torch.testing.assert_close(gemm.linear(x, good), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert seen == [80]
