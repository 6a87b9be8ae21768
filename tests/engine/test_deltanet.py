"""The Gated DeltaNet layer (engine/model/deltanet.py) against transformers' `Qwen3_5GatedDeltaNet` on the same
weights, and the state slots (engine/kv/state_cache.py) that carry its per-sequence state.

Exactness is token-level in the engine; here the layer's outputs are compared bit for bit (fp32, CPU) over a
prompt, then decode steps, then a prompt continued from a state (engine chunks of 64 positions), for beams that
reorder their states. Controls show the checks can fail: the delta rule's chunk size other than transformers' 64,
and a state not moved with its beam, each change the outputs.
"""
from __future__ import annotations

import pytest
import torch

from triton_vlm.engine.kv.state_cache import StateCache, StateCacheFull, StateSpec
from triton_vlm.engine.model import deltanet as dn

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402


def _config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, intermediate_size=96, vocab_size=64)


@pytest.fixture(scope="module")
def layer():
    """transformers' layer with random weights (all of them, A_log, dt_bias and the norm included) and ours."""
    torch.manual_seed(0)
    config = _config()
    ref = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    tensors = {f"layers.0.linear_attn.{k}": v.detach() for k, v in ref.state_dict().items()}
    ours = dn.GatedDeltaNet(dn.DeltaNetShape.from_config(config), dn.weights_from(tensors, "layers.0.linear_attn."))
    return config, ref, ours


def _reference(config, ref, x: torch.Tensor, steps: list[torch.Tensor]):
    """transformers: prompt x [B, T, H] in one call (a fresh cache), then each of `steps` [B, 1, H] decoded."""
    cache = DynamicCache(config=config)
    outs = [ref(x, cache=cache)]
    for s in steps:
        outs.append(ref(s, cache=cache))
    return outs, cache


def _reference_rows(config, ref, x: torch.Tensor, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """`_reference` one row at a time, the rows' outputs stacked: transformers' own chunked rule is not batch
    invariant (at 3+ chunks a batch of 2 differs from each row alone in the last ulp), and the engine computes a
    prompt one row at a time, so the bitwise reference is the row alone."""
    per_row = [_reference(config, ref, x[r:r + 1], [s[r:r + 1] for s in steps])[0] for r in range(x.shape[0])]
    return [torch.cat(outs) for outs in zip(*per_row)]


def _slots(ours, rows: int) -> StateCache:
    s = ours.shape
    spec = StateSpec(layers=1, states=(("conv", s.conv_shape(), torch.float32),
                                       ("recurrent", s.recurrent_shape(), torch.float32)))
    return StateCache(spec, slots=rows + 2)


def _ours(ours, x: torch.Tensor, steps: list[torch.Tensor], rows_per_call: int) -> list[torch.Tensor]:
    """Ours: each row's prompt alone (as the engine runs prompts), then the decode steps `rows_per_call` rows a call
    over the slots (gathered, computed, scattered back as the engine does)."""
    rows = x.shape[0]
    cache = _slots(ours, rows)
    slots = [cache.allocate() for _ in range(rows)]
    got = [torch.cat([ours.prompt(x[r:r + 1], cache.view("conv", 0, s), cache.view("recurrent", 0, s), fresh=True)
                      for r, s in enumerate(slots)])]
    for step in steps:
        outs = []
        for start in range(0, rows, rows_per_call):
            idx = torch.tensor(slots[start:start + rows_per_call])
            conv, rec = cache.gather("conv", 0, idx), cache.gather("recurrent", 0, idx)
            outs.append(ours.decode(step[start:start + rows_per_call], conv, rec))
            cache.scatter("conv", 0, idx, conv)
            cache.scatter("recurrent", 0, idx, rec)
        got.append(torch.cat(outs))
    return got


@torch.no_grad()
@pytest.mark.parametrize("length", [3, 64, 150])
def test_prompt_then_decode_equal(layer, length):
    config, ref, ours = layer
    torch.manual_seed(length)
    x = torch.randn(2, length, config.hidden_size)
    steps = [torch.randn(2, 1, config.hidden_size) for _ in range(4)]
    want = _reference_rows(config, ref, x, steps)
    for w, g in zip(want, _ours(ours, x, steps, rows_per_call=1)):
        assert torch.equal(w, g)
    # decode rows batched: the projections' GEMMs block differently for 2 rows (ulp-level, as in the engine's
    # attention layers); the rule itself is per row
    for w, g in zip(want, _ours(ours, x, steps, rows_per_call=2)):
        assert torch.allclose(w, g, atol=1e-5)


@torch.no_grad()
def test_prompt_in_engine_chunks_of_64_equals_one_pass(layer):
    """A 200-position prompt as engine chunks 64 + 128 + 8 continues the state exactly as one call."""
    config, ref, ours = layer
    torch.manual_seed(1)
    x = torch.randn(1, 200, config.hidden_size)
    want, _ = _reference(config, ref, x, [])
    cache = _slots(ours, 1)
    s = cache.allocate()
    conv, rec = cache.view("conv", 0, s), cache.view("recurrent", 0, s)
    parts, start = [], 0
    for n in (64, 128, 8):
        parts.append(ours.prompt(x[:, start:start + n], conv, rec, fresh=start == 0))
        start += n
    assert torch.equal(torch.cat(parts, dim=1), want[0])


@torch.no_grad()
def test_control_chunk_size_changes_the_sums(layer):
    """The delta rule's chunk size is part of the arithmetic: 32 instead of transformers' 64 gives other sums."""
    config, ref, ours = layer
    torch.manual_seed(2)
    x = torch.randn(1, 150, config.hidden_size)
    want, _ = _reference(config, ref, x, [])
    cache = _slots(ours, 1)
    s = cache.allocate()
    got = ours.prompt(x, cache.view("conv", 0, s), cache.view("recurrent", 0, s), fresh=True, chunk=32)
    assert torch.allclose(got, want[0], atol=1e-4)  # the same function of the inputs...
    assert not torch.equal(got, want[0])  # ...summed in another order


@torch.no_grad()
def test_beam_reorder_moves_states(layer):
    """Three beams decode, then swap parents (rows 0, 0, 2): copying the slots by index equals transformers'
    `reorder_cache`; not moving them (the control) gives other outputs."""
    config, ref, ours = layer
    torch.manual_seed(3)
    x = torch.randn(3, 20, config.hidden_size)
    step = torch.randn(3, 1, config.hidden_size)
    parents = torch.tensor([0, 0, 2])
    _, cache_ref = _reference(config, ref, x, [step])
    cache_ref.reorder_cache(parents)
    after = torch.randn(3, 1, config.hidden_size)
    want = ref(after, cache=cache_ref)

    def ours_run(move: bool) -> torch.Tensor:
        cache = _slots(ours, 3)
        slots = [cache.allocate() for _ in range(3)]
        for r, s in enumerate(slots):
            ours.prompt(x[r:r + 1], cache.view("conv", 0, s), cache.view("recurrent", 0, s), fresh=True)
        idx = torch.tensor(slots)
        for inp in (step,):
            conv, rec = cache.gather("conv", 0, idx), cache.gather("recurrent", 0, idx)
            ours.decode(inp, conv, rec)
            cache.scatter("conv", 0, idx, conv)
            cache.scatter("recurrent", 0, idx, rec)
        if move:
            cache.copy([slots[p] for p in parents.tolist()], slots)
        conv, rec = cache.gather("conv", 0, idx), cache.gather("recurrent", 0, idx)
        return ours.decode(after, conv, rec)

    assert torch.equal(ours_run(move=True), want)
    assert not torch.equal(ours_run(move=False), want)


def test_state_cache_slots():
    spec = StateSpec(layers=3, states=(("conv", (6, 4), torch.float32), ("recurrent", (2, 3, 5), torch.float32)))
    assert spec.slot_bytes() == 3 * (6 * 4 + 2 * 3 * 5) * 4
    cache = StateCache(spec, slots=2)
    a = cache.allocate()
    cache.tensors["conv"][:, a] = 7.0
    b = cache.allocate()
    assert cache.free == 0 and cache.used == 2
    with pytest.raises(StateCacheFull):
        cache.allocate()
    cache.release(a)
    with pytest.raises(ValueError):
        cache.release(a)
    again = cache.allocate()  # a reused slot starts from zeros: nothing leaks from the last sequence
    assert again == a and torch.count_nonzero(cache.tensors["conv"][:, again]) == 0
    cache.tensors["recurrent"][:, b] = 1.0
    cache.copy([b], [again])
    assert torch.equal(cache.tensors["recurrent"][:, again], cache.tensors["recurrent"][:, b])


def test_shape_refuses_other_activations():
    config = _config()
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        dn.DeltaNetShape.from_config(config)
