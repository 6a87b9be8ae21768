"""The C decode attention (`engine/cpu/cpu_decode.py`): the same attention and the same cache writes as the torch
ops (`attention.decode_torch`), every index checked before memory is touched, decode steps routed to it, and
torch everywhere it cannot run."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from triton_vlm.engine.model import attention
from triton_vlm.engine.cpu import cbuild, cpu_decode
from triton_vlm.engine.model.model import LlamaModel


NO_CC = "C kernel not built here: no C compiler (cc) for the decode attention; torch runs it"


def _machine_can_build() -> bool:
    return shutil.which("cc") is not None


@pytest.fixture
def kernel():
    k = cpu_decode.kernel(attention.decode_torch)
    assert (k is not None) == _machine_can_build()
    if k is None:  # only without a C compiler: nothing to compare (torch runs the attention)
        pytest.skip(NO_CC)
    return k


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as if nothing had been built in this process, with its own build folder."""
    monkeypatch.setattr(cpu_decode, "_once", cbuild.Once(cpu_decode.ENV, cpu_decode._load))
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_decode.ENV, raising=False)
    return tmp_path


def decode_batch(seed: int, heads: int, kv_heads: int, hd: int, rows: int, T: int, window: int = 0,
                 shared: bool = False) -> dict:
    """A random decode step: each row's keys at distinct pool slots (or, with `shared`, the rows' first keys in
    the same slots, as forked beams share their prompt blocks), its new token the last key it sees."""
    g = torch.Generator().manual_seed(seed)
    slots, max_pos = rows * T + 16, T + 8
    ang = torch.randn(max_pos, hd // 2, generator=g)
    read = torch.randperm(slots, generator=g)[:rows * T].view(rows, T).clone()  # [rows, T]
    lengths = torch.randint(T // 2 if shared else 1, T + 1, (rows,), generator=g)
    lengths[0] = T  # one row without padding
    if shared:  # every row's keys before its new token's: row 0's slots
        common = int(lengths.min()) - 1
        assert common > 0
        read[1:, :common] = read[0, :common]
    positions = lengths - 1  # [rows]
    col = torch.arange(T)[None]
    mask = col <= positions[:, None]  # [rows, T]
    if window:
        mask &= col > positions[:, None] - window
    return dict(qkv=torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g), positions=positions,
                cos=torch.cat([ang.cos()] * 2, -1), sin_rot=torch.cat([-ang.sin(), ang.sin()], -1),
                write_slots=read[torch.arange(rows), positions].contiguous(), read_slots=read, mask=mask,
                kc=torch.randn(slots, kv_heads, hd, generator=g), vc=torch.randn(slots, kv_heads, hd, generator=g),
                heads=heads, kv_heads=kv_heads)


def run_both(kernel, b: dict) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    mine = dict(b, kc=b["kc"].clone(), vc=b["vc"].clone())
    want = attention.decode_torch(**b)
    got = kernel.decode(**mine)
    return got, want, (mine["kc"], mine["vc"]), (b["kc"], b["vc"])


@pytest.mark.parametrize("heads,kv_heads,hd", [(8, 4, 64), (4, 4, 32), (12, 2, 24), (4, 1, 128), (2, 1, 18)])
@pytest.mark.parametrize("rows,T", [(1, 1), (1, 45), (3, 17), (9, 70)])
def test_kernel_matches_torch_and_writes_the_same_cache(kernel, heads, kv_heads, hd, rows, T):
    b = decode_batch(heads * 100 + hd + rows * 7 + T, heads, kv_heads, hd, rows, T)
    got, want, cache_k, cache_t = run_both(kernel, b)
    assert got.shape == (rows, heads * hd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_k[0], cache_t[0]) and torch.equal(cache_k[1], cache_t[1])  # rotary bit for bit


@pytest.mark.parametrize("window", [1, 3, 16])
def test_sliding_window_and_shared_slots(kernel, window):
    b = decode_batch(window, 8, 2, 32, 5, 30, window=window, shared=True)
    got, want, cache_k, cache_t = run_both(kernel, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_k[0], cache_t[0]) and torch.equal(cache_k[1], cache_t[1])


def test_large_scores_stay_finite(kernel):
    """Softmax with the row's maximum subtracted: scores in the thousands neither overflow nor lose the winner."""
    b = decode_batch(3, 4, 2, 64, 2, 40)
    b["qkv"] = b["qkv"] * 60
    got, want, _, _ = run_both(kernel, b)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("field,value,message", [
    ("positions", 10_000, "a position outside the rotary table"),
    ("positions", -1, "a position outside the rotary table"),
    ("write_slots", 10_000, "a write slot outside the pool"),
    ("read_slots", -3, "a read slot outside the pool"),
    ("mask", False, "a row with no key to attend to"),
])
def test_a_bad_index_raises_before_anything_is_written(kernel, field, value, message):
    b = decode_batch(11, 4, 2, 16, 2, 6)
    if field == "mask":
        b["mask"][1] = False
    elif field == "read_slots":
        b["read_slots"][1, 0] = value
    else:
        b[field][1] = value
    before = b["kc"].clone(), b["vc"].clone()
    with pytest.raises(ValueError, match=message):
        kernel.decode(**b)
    assert torch.equal(b["kc"], before[0]) and torch.equal(b["vc"], before[1])


def test_a_masked_out_bad_slot_is_never_read(kernel):
    """Padding columns (mask False) may hold any slot: the kernel neither checks nor reads them."""
    b = decode_batch(12, 4, 2, 16, 2, 6)
    b["mask"][1, 4:] = False
    b["positions"][1] = 3
    b["write_slots"][1] = b["read_slots"][1, 3]
    b["read_slots"][1, 4:] = 10**9
    got = kernel.decode(**dict(b, kc=b["kc"].clone(), vc=b["vc"].clone()))
    b["read_slots"][1, 4:] = 0
    torch.testing.assert_close(got, attention.decode_torch(**b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field,bad", [
    ("qkv", lambda t: t.double()), ("kc", lambda t: t[:, :1]), ("vc", lambda t: t.transpose(1, 2)),
    ("read_slots", lambda t: t.int()), ("mask", lambda t: t.to(torch.uint8)), ("positions", lambda t: t[:1]),
])
def test_a_tensor_of_another_layout_raises(kernel, field, bad):
    b = decode_batch(13, 4, 2, 16, 2, 6)
    b[field] = bad(b[field])
    with pytest.raises(ValueError, match=f"decode attention kernel: {field}"):
        kernel.decode(**b)


def test_a_strided_qkv_is_copied_not_misread(kernel):
    b = decode_batch(14, 4, 2, 16, 3, 8)
    got, want, _, _ = run_both(kernel, dict(b, qkv=b["qkv"].t().contiguous().t()))  # same values, column-major
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 512), (4, 4096), (2, 40), (3, 1001)])
def test_residual_add_and_rms_norm_match_transformers(kernel, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x, d, w = torch.randn(rows, 1, n, generator=g), torch.randn(rows, 1, n, generator=g), torch.randn(n, generator=g)
    x_out, h = kernel.add_rms_norm(x, d, w, 1e-5)
    s = x + d
    assert torch.equal(x_out, s)  # the residual stream itself is exact
    torch.testing.assert_close(h, w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)), rtol=1e-5,
                               atol=1e-6)
    x_alone, h_alone = kernel.add_rms_norm(x[:, :, :], None, w, 1e-5)
    assert torch.equal(x_alone, x) and x_alone.data_ptr() != x.data_ptr()  # a copy: the caller's x is kept
    torch.testing.assert_close(h_alone, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 40.0, 200.0])
@pytest.mark.parametrize("n", [1408, 37])
def test_silu_gate_matches_torch_including_huge_gates(kernel, scale, n):
    gu = torch.randn(2, 1, 2 * n, generator=torch.Generator().manual_seed(n)) * scale
    out = kernel.silu_mul(gu)
    assert out.shape == (2, 1, n) and torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.nn.functional.silu(gu[..., :n]) * gu[..., n:], rtol=1e-5, atol=1e-5)


def _tiny_llama(tmp_path) -> tuple[LlamaForCausalLM, LlamaModel]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    return hf, LlamaModel.from_pretrained(tmp_path)


def test_decode_steps_take_the_kernel_and_prefill_takes_torch(kernel, tmp_path, monkeypatch):
    hf, m = _tiny_llama(tmp_path)
    calls = {"kernel": 0, "torch": 0}
    attend, torch_path = cpu_decode.DecodeStep.attend, attention.attend_torch
    monkeypatch.setattr(cpu_decode.DecodeStep, "attend",
                        lambda self, *a: calls.__setitem__("kernel", calls["kernel"] + 1) or attend(self, *a))
    monkeypatch.setattr(attention, "attend_torch",
                        lambda *a: calls.__setitem__("torch", calls["torch"] + 1) or torch_path(*a))
    cache = m.new_cache(16, 4)
    rows = [cache.new_row(), cache.new_row()]
    ids = [[1, 5, 9, 33, 7], [2, 8, 4, 60, 11]]
    m.forward(m.embed(torch.tensor(ids)), cache.plan(rows, 5), cache)
    assert calls == {"kernel": 0, "torch": 3}
    for t in ([17, 3], [4, 90], [55, 8]):
        # [2, vocab], layer by layer (the whole forward in one call: test_cpu_forward.py)
        out = m.forward(m.embed(torch.tensor([[x] for x in t])), cache.plan(rows, 1), cache, whole=False)
        for r in range(2):
            ids[r].append(t[r])
            with torch.no_grad():
                ref = hf(torch.tensor([ids[r]])).logits[0, -1]
            torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=0)
    assert calls == {"kernel": 9, "torch": 3}


def test_switch_turns_the_kernel_off_and_another_value_keeps_it_off(fresh, monkeypatch, caplog):
    monkeypatch.setenv(cpu_decode.ENV, "0")
    assert cpu_decode.kernel(attention.decode_torch) is None
    cpu_decode._once.reset()
    monkeypatch.setenv(cpu_decode.ENV, "on")
    assert cpu_decode.kernel(attention.decode_torch) is None
    assert "TRITON_VLM_CPU_DECODE must be auto, 1 or 0, got 'on'" in caplog.text


def test_no_compiler_means_torch(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_decode.kernel(attention.decode_torch) is None
    assert not list(fresh.glob("kernels/*.so"))


def test_a_kernel_that_disagrees_with_torch_stays_off(fresh, monkeypatch):
    if not _machine_can_build():
        pytest.skip(NO_CC)

    def wrong(*a, **kw):
        return attention.decode_torch(*a, **kw) + 1e-2

    assert cpu_decode.kernel(wrong) is None
    cpu_decode._once.reset()
    assert cpu_decode.kernel(attention.decode_torch) is not None
    assert len(list(fresh.glob("kernels/decode_attention-*.so"))) == 1
