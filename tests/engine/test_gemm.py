"""The CPU GEMM choice (`engine/cpu/gemm.py`) and fused projections (`model.Linear.fused`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_vlm.engine.cpu import gemm
from triton_vlm.engine.model.model import Linear

@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 64), (64, 1, 64), (2, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(*shape, generator=g)
    packed = gemm.pack(w)
    assert gemm.is_packed(packed) and not gemm.is_packed(w)
    y = gemm.linear(x, packed, b)
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.float32 and y.is_contiguous()
    # the same fp32 dot products, summed in another order: equal up to rounding
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm.dense(packed), w)
    assert gemm.nbytes(packed) == w.numel() * 4


def test_packing_only_where_it_pays(monkeypatch):
    monkeypatch.delenv(gemm.ENV, raising=False)
    assert gemm.packing_enabled(torch.device("cpu"), torch.float32)
    assert not gemm.packing_enabled(torch.device("cpu"), torch.bfloat16)
    assert not gemm.packing_enabled(torch.device("cuda"), torch.float32)
    monkeypatch.setenv(gemm.ENV, "default")
    assert not gemm.packing_enabled(torch.device("cpu"), torch.float32)
    monkeypatch.setenv(gemm.ENV, "mkl")
    with pytest.raises(ValueError, match="TRITON_VLM_CPU_GEMM must be 'onednn' or 'default', got 'mkl'"):
        gemm.packing_enabled(torch.device("cpu"), torch.float32)


class _AddOne:
    """Stand-in adapter batch: adds (module index + 1) to the columns of the modules it adapts."""

    def __init__(self, modules, in_place=True):
        self.modules, self.in_place, self.calls = modules, in_place, []

    def add(self, x, y, layer, module):
        self.calls.append((layer, module, tuple(y.shape)))
        if module not in self.modules:
            return y
        delta = float(self.modules.index(module) + 1)
        return y.add_(delta) if self.in_place else y + delta


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_projection_is_its_parts_side_by_side(packed, in_place):
    g = torch.Generator().manual_seed(1)
    w = {"layers.3.q_proj": torch.randn(8, 16, generator=g), "layers.3.k_proj": torch.randn(4, 16, generator=g),
         "layers.3.v_proj": torch.randn(4, 16, generator=g), "layers.3.k_proj.bias": torch.randn(4, generator=g)}
    lin = Linear.fused(w, 3, "qkv_proj", ("q_proj", "k_proj", "v_proj"), packed)
    assert lin.parts == (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))
    x = torch.randn(2, 3, 16, generator=g)
    want = torch.cat([F.linear(x, w["layers.3.q_proj"]), F.linear(x, w["layers.3.k_proj"], w["layers.3.k_proj.bias"]),
                      F.linear(x, w["layers.3.v_proj"])], dim=-1)  # [2, 3, 16]
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    adapters = _AddOne(["q_proj", "v_proj"], in_place)
    got = lin(x, adapters)
    assert adapters.calls == [(3, "q_proj", (2, 3, 8)), (3, "k_proj", (2, 3, 4)), (3, "v_proj", (2, 3, 4))]
    want[..., :8] += 1.0  # q_proj is the adapter batch's module 0
    want[..., 12:] += 2.0  # v_proj its module 1; k_proj untouched
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_gemm_row_counts_come_from_a_bounded_set():
    """oneDNN caches a compiled primitive per input shape (~570 KiB each): the row counts a server sees (every
    prefill chunk length, every decode row count) are padded up to a bounded set, so that cache stays small."""
    buckets = {gemm.padded_rows(m) for m in range(1, 8193)}
    assert len(buckets) <= 60
    for m in range(1, 8193):
        p = gemm.padded_rows(m)
        assert m <= p <= max(4, m + m // 8 + 7) or m > 128  # decode sizes: at most 1/8 more rows (+ rounding)
        assert p < 2 * m or m <= 2
    assert [gemm.padded_rows(m) for m in (1, 2, 3, 5, 64, 65, 129, 513, 2049)] == [1, 2, 4, 8, 64, 72, 160, 640, 2560]


@pytest.mark.parametrize("rows", [3, 5, 17, 65, 130, 515])
def test_padded_rows_give_the_unpadded_product(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(rows, 1, 24, generator=g)
    y = gemm.linear(x, gemm.pack(w), b)
    assert y.shape == (rows, 1, 40) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
