"""The whole decode forward as one C call (`engine/cpu/cpu_forward.py`): bit for bit the layer-by-layer path (logits
and cache writes) for Llama, Qwen2 (q/k/v biases) and Mistral (a sliding window), taken only by small decode
steps without adapters, and layer by layer wherever it cannot run."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

from triton_vlm.engine.cpu import cbuild, cpu_forward, gemv
from triton_vlm.engine.lora.lora import LoraBatch, StackCache
from triton_vlm.engine.model.model import LlamaModel
from triton_vlm.lora.format import Adapter, LoraModule

NO_KERNEL = ("C kernel not built here: no C forward (no C compiler, or no packed layout for its gemv); the model "
             "runs layer by layer")
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 3}),
}


def _model(tmp_path, family: str) -> LlamaModel:
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    hf = model_cls(cfg_cls(**SMALL, **extra)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases: nonzero, so a dropped bias would show
    hf.save_pretrained(tmp_path)
    return LlamaModel.from_pretrained(tmp_path)


def _available(m: LlamaModel) -> bool:
    """The C forward exists wherever the kernels it is made of do (a C compiler, the AVX-512 packed layout)."""
    return (m.c_forward() is not None) == (gemv.kernel(_pack) is not None)


def _pack(w):
    from triton_vlm.engine.cpu.gemm import pack
    return pack(w)


def _decode_both(m: LlamaModel, rows: int, steps: int) -> None:
    """Prefill `rows` prompts of different lengths on two caches, then decode `steps` steps both ways."""
    caches = [m.new_cache(32, 4) for _ in range(2)]
    row_kv = [[c.new_row() for _ in range(rows)] for c in caches]
    g = torch.Generator().manual_seed(rows)
    for r in range(rows):  # prompts of 3, 6, 9, ... tokens: rows of different lengths (padding in the masks)
        ids = torch.randint(3, 90, (1, 3 * (r + 1)), generator=g)
        for c, kv in zip(caches, row_kv):
            m.forward(m.embed(ids), c.plan([kv[r]], ids.shape[1]), c)
    for _ in range(steps):
        x = m.embed(torch.randint(3, 90, (rows, 1), generator=g))  # [rows, 1, hidden]
        whole = m.forward(x, caches[0].plan(row_kv[0], 1), caches[0])
        per_layer = m.forward(x, caches[1].plan(row_kv[1], 1), caches[1], whole=False)
        assert torch.equal(whole, per_layer)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_one_call_equals_layer_by_layer_bit_for_bit(tmp_path, family, rows):
    m = _model(tmp_path, family)
    assert _available(m)
    if m.c_forward() is None:
        pytest.skip(NO_KERNEL)
    calls = []
    run = cpu_forward.Forward.run
    m.c_forward().run = lambda *a: calls.append(a[1].shape[0]) or run(m.c_forward(), *a)
    _decode_both(m, rows, steps=5)  # crosses a block boundary (block size 4)
    assert calls == [rows] * 5


def test_what_it_does_not_take_runs_layer_by_layer(tmp_path):
    """5 rows (above the gemv's 4), every position's logits, a prefill, an adapter batch: not the C forward."""
    m = _model(tmp_path, "llama")
    if m.c_forward() is None:
        assert gemv.kernel(_pack) is None
        pytest.skip(NO_KERNEL)
    taken = []
    run = cpu_forward.Forward.run
    m.c_forward().run = lambda *a: taken.append(1) or run(m.c_forward(), *a)
    cache = m.new_cache(32, 4)
    rows = [cache.new_row() for _ in range(5)]
    m.forward(m.embed(torch.tensor([[5, 6]] * 5)), cache.plan(rows, 2), cache)  # prefill
    m.forward(m.embed(torch.tensor([[7]] * 5)), cache.plan(rows, 1), cache)  # 5 rows
    m.forward(m.embed(torch.tensor([[7]] * 4)), cache.plan(rows[:4], 1), cache, all_logits=True)

    class NoDelta:
        def add(self, x, y, layer, module):
            return y

    m.forward(m.embed(torch.tensor([[7]] * 4)), cache.plan(rows[:4], 1), cache, adapters=NoDelta())
    assert taken == []
    m.forward(m.embed(torch.tensor([[8]] * 4)), cache.plan(rows[:4], 1), cache)
    assert taken == [1]


def test_a_weight_outside_the_gemv_layout_keeps_the_model_layer_by_layer(tmp_path, monkeypatch):
    m = _model(tmp_path, "llama")
    kernel = gemv.kernel(_pack)
    if kernel is None:
        assert m.c_forward() is None
        pytest.skip(NO_KERNEL)
    layout = gemv.Kernel.layout
    odd = m.layers[1].o_proj.weight
    monkeypatch.setattr(gemv.Kernel, "layout", lambda self, w, ref=None: None if w is odd else layout(self, w, ref))
    assert cpu_forward.Forward.for_model(m) is None


def test_a_forward_that_disagrees_is_not_used(tmp_path, monkeypatch, caplog):
    m = _model(tmp_path, "llama")
    if cpu_forward.Forward.for_model(m) is None:
        assert m.c_forward() is None
        pytest.skip(NO_KERNEL)
    run = cpu_forward.Forward.run
    monkeypatch.setattr(cpu_forward.Forward, "run", lambda self, *a: run(self, *a) + 1e-6)
    m._c_forward = False  # built at load: build and check it again, now disagreeing
    with caplog.at_level(logging.WARNING):
        assert m.c_forward() is None
    assert "C decode forward not used: its logits or cache writes differ" in caplog.text


def test_more_rows_than_the_gemv_takes_are_refused(tmp_path):
    m = _model(tmp_path, "llama")
    whole = m.c_forward()
    if whole is None:
        pytest.skip(NO_KERNEL)
    with pytest.raises(ValueError, match="C decode forward: 5 rows, 1 to 4"):
        whole.run(None, torch.zeros(5, 1, 64), m.new_cache(2, 4).k, m.new_cache(2, 4).v)


def test_inputs_that_do_not_fit_the_checked_step_are_refused(tmp_path):
    """The step's slots were checked against one pool shape and row count: anything else would read or write
    outside the buffers, so it raises instead."""
    m = _model(tmp_path, "llama")
    whole = m.c_forward()
    if whole is None:
        pytest.skip(NO_KERNEL)
    cache = m.new_cache(8, 4)
    rows = [cache.new_row() for _ in range(2)]
    batch = cache.plan(rows, 1)
    kernel = m.attention.kernel_for(1)
    from triton_vlm.engine.model.model import window_masks
    step = m._decode_step(kernel, batch, window_masks(batch, {0}), cache)
    x = m.embed(torch.tensor([[3], [4]]))  # [2, 1, 64]
    small = m.new_cache(4, 4)
    with pytest.raises(ValueError, match=r"k_pool must be a contiguous fp32 \[3, 33, 2, 16\] pool"):
        whole.run(step, x, small.k, small.v)
    with pytest.raises(ValueError, match=r"x must be \[2, 1, 64\] fp32"):
        whole.run(step, x[:1], cache.k, cache.v)
    with pytest.raises(ValueError, match=r"x must be \[2, 1, 64\] fp32"):
        whole.run(step, x[..., :32], cache.k, cache.v)
    assert whole.run(step, x, cache.k, cache.v).shape == (2, 96)


def test_switch_turns_it_off_and_another_value_keeps_it_off(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_forward, "_once", cbuild.Once(cpu_forward.ENV, cpu_forward._load))
    monkeypatch.setenv(cpu_forward.ENV, "0")
    assert cpu_forward.Forward.for_model(_model(tmp_path, "llama")) is None
    cpu_forward._once.reset()
    monkeypatch.setenv(cpu_forward.ENV, "2")
    assert cpu_forward.Forward.for_model(_model(tmp_path, "llama")) is None
    assert "TRITON_VLM_CPU_FORWARD must be auto, 1 or 0, got '2'" in caplog.text


# --- LoRA rows in the one call --------------------------------------------------------------------------------
MODULE_DIMS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
               "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # (in, out) of SMALL


def _adapter(name: str, rank: int, seed: int, modules=tuple(MODULE_DIMS)) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    mods = {(layer, m): LoraModule(torch.randn(rank, MODULE_DIMS[m][0], generator=g) * 0.3,
                                   torch.randn(MODULE_DIMS[m][1], rank, generator=g) * 0.3, 1.5)
            for layer in range(3) for m in modules}
    return Adapter(name, mods)


TOKENS = torch.randint(3, 90, (4, 3), generator=torch.Generator().manual_seed(7))  # [steps, rows]


def _lora_decode_both(m: LlamaModel, row_adapters: list, steps: int = 4, tokens=None) -> list[torch.Tensor]:
    """Decode `steps` steps with these rows' adapters (row i fed tokens[:, i], default TOKENS), one call and
    layer by layer, on two caches; -> the one call's logits per step (checked close to the layer-by-layer
    path's, caches too)."""
    rows = len(row_adapters)
    tokens = TOKENS[:, :rows] if tokens is None else tokens  # [steps, rows]
    caches = [m.new_cache(32, 4) for _ in range(2)]
    row_kv = [[c.new_row() for _ in range(rows)] for c in caches]
    stacks = StackCache()
    out = []
    for step in range(steps):
        x = m.embed(tokens[step][:, None])  # [rows, 1, hidden]
        batch = LoraBatch.build(row_adapters, stacks, "cpu")
        whole = m.forward(x, caches[0].plan(row_kv[0], 1), caches[0], batch)
        per_layer = m.forward(x, caches[1].plan(row_kv[1], 1), caches[1], batch, whole=False)
        torch.testing.assert_close(whole, per_layer, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[0].k, caches[1].k, rtol=1e-4, atol=1e-4)  # fp32 sums in other orders
        out.append(whole)
    return out


def test_lora_rows_run_in_the_one_call_as_layer_by_layer(tmp_path):
    m = _model(tmp_path, "qwen2")  # q/k/v biases: the delta lands after the bias, as in Python
    if m.c_forward() is None:
        pytest.skip(NO_KERNEL)
    taken = []
    run = cpu_forward.Forward.run
    m.c_forward().run = lambda *a: taken.append(a[-1] is not None) or run(m.c_forward(), *a)
    french, other = _adapter("french", 8, 1), _adapter("other", 16, 2, ("q_proj", "v_proj", "down_proj"))
    _lora_decode_both(m, [french, None, other, french], tokens=torch.cat([TOKENS, TOKENS[:, :1]], dim=1))
    assert taken == [True] * 4  # every step in one call, adapters included


def test_a_tenants_rows_do_not_depend_on_their_batch_mates(tmp_path):
    """A row's logits in a batch mixing adapters equal that row decoded alone with its own adapter; a row without
    an adapter in such a batch equals the base model's, bit for bit (its mask is 0: its delta is exactly 0)."""
    m = _model(tmp_path, "llama")
    if m.c_forward() is None:
        pytest.skip(NO_KERNEL)
    french, other = _adapter("french", 8, 1), _adapter("other", 16, 2)
    mixed = _lora_decode_both(m, [french, None, other])
    alone_french = _lora_decode_both(m, [french], tokens=TOKENS[:, 0:1])
    alone_other = _lora_decode_both(m, [other], tokens=TOKENS[:, 2:3])
    base = []  # row 1's tokens decoded with no adapter at all
    caches = m.new_cache(32, 4)
    row = caches.new_row()
    for step in range(4):
        base.append(m.forward(m.embed(TOKENS[step, 1:2][:, None]), caches.plan([row], 1), caches))
    for step in range(4):
        torch.testing.assert_close(mixed[step][0], alone_french[step][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[step][2], alone_other[step][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(mixed[step][1], base[step][0])
        assert not torch.allclose(mixed[step][0], base[step][0], atol=1e-3)  # the adapter does change the row


def test_adapter_tensors_the_c_side_cannot_read_run_layer_by_layer(tmp_path):
    m = _model(tmp_path, "llama")
    whole = m.c_forward()
    if whole is None:
        pytest.skip(NO_KERNEL)
    odd = _adapter("odd", 8, 3)
    mod = odd.modules[(1, "o_proj")]
    odd.modules[(1, "o_proj")] = LoraModule(mod.a, mod.b.t().contiguous().t(), mod.scale)  # B column-major
    batch = LoraBatch.build([odd], StackCache(), "cpu")
    assert whole.lora_table(batch, 1)[0] is None
    _lora_decode_both(m, [odd], steps=2)  # still right: those steps ran layer by layer


def test_a_lost_gemv_race_does_not_turn_the_one_call_off(tmp_path, monkeypatch, caplog):
    """The gemv kernel's own race against oneDNN (one product) is within a few percent either way; lost, it used
    to make the layer-by-layer path's products oneDNN's, so the C forward (whose products are the kernel's) failed
    its bit check and every one-stream step ran layer by layer. Now the kernel is taken for 1-4 row products
    wherever the C forward is used, and both paths give the same bits."""
    kernel = gemv.kernel(_pack)
    if kernel is None:
        pytest.skip(NO_KERNEL)
    monkeypatch.setattr(kernel, "chosen", False)  # as after a lost race (restored by monkeypatch)
    monkeypatch.setenv(cpu_forward.ENV, "1")  # the one call's own race is not what this tests
    with caplog.at_level(logging.INFO, logger="triton_vlm.engine.model.model"):
        m = _model(tmp_path, "llama")
        assert m.c_forward() is not None, caplog.text
    assert kernel.chosen and "decode gemv kernel on for products of 1-4 rows" in caplog.text
    _decode_both(m, rows=2, steps=2)
