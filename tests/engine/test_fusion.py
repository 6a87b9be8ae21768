"""The decode step on compiled functions (`engine/model/fusion.py`, TRITON_VLM_DECODE_FUSION).

On the CPU: the attention core traced by dynamo (`aot_eager`: functionalised, the in-place K/V writes included)
equals the gather + SDPA path and writes the same cache; an engine with fusion on (the functions uncompiled here:
inductor's C++ compiles take minutes on 2 cores) gives the eager engine's tokens through the padded CUDA graph path
and the plain one, and really runs the fused attention; `auto` is off on a CPU without compiling anything; a bad value
is refused; a failing compile, a failing check and a call that fails while serving each keep the eager path with
the reason. On a GPU (`gpu`): inductor-compiled, under captured CUDA graphs, fp32 tokens equal eager's; fp16 /
bf16 logits within the dtype's tolerance, and `auto` races (replayed graphs) and reports both times.
"""
from __future__ import annotations

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.model import attention, fusion
from triton_vlm.params import GenerationParams, GenerationRequest

CONTEXT = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=7, max_position_embeddings=CONTEXT)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties are rare
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


@pytest.fixture
def uncompiled(monkeypatch):
    monkeypatch.setattr(fusion, "BACKEND", "none")


def engine(path, mode: str, monkeypatch, padded: bool = False, **kw) -> Engine:
    monkeypatch.setenv(fusion.ENV, mode)
    base = dict(max_rows=8, kv_cache_tokens=1024, block_size=4, prefill_chunk=8, cuda_graph_min_keys=8)
    eng = Engine(path, EngineConfig(**(base | kw)))
    if padded and eng.decode_graphs is None:
        eng.make_decode_graphs(capture=False)
    return eng


def generate(eng: Engine, n: int = 3, tokens: int = 10) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in range(n):  # prompts of different lengths: rows and keys cross buckets
        ids = [1] + list(range(5 + 7 * i, 10 + 10 * i))
        eng.submit(GenerationRequest(f"r{i}", ids, GenerationParams(max_tokens=tokens)),
                   lambda r: out.__setitem__(r.request_id, r) if r.final else None)
    steps = 0
    while len(out) < n:
        eng.step()
        steps += 1
        assert steps < 200
    assert all(r.error is None for r in out.values())
    return {k: r.sequences[0].token_ids for k, r in out.items()}


def attention_case(rows: int, keys: int, heads: int = 4, kv_heads: int = 2, hd: int = 16, seed: int = 0):
    """Arguments of `attend_torch` / `decode_attend` for a decode step of ragged rows over a 64-slot pool."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(64, kv_heads, hd, generator=g), torch.randn(64, kv_heads, hd, generator=g)
    qkv = torch.randn(rows, 1, (heads + 2 * kv_heads) * hd, generator=g)
    cos, sin = torch.randn(rows, 1, 1, hd, generator=g), torch.randn(rows, 1, 1, hd, generator=g)
    write = torch.arange(rows) * 7 + 3
    read = (torch.arange(keys)[None] + torch.arange(rows)[:, None] * 5) % 64  # [rows, keys]
    read[:, -1] = write  # each row reads its new token last
    lengths = torch.arange(rows) + keys - rows + 1  # ragged: columns past a row's length masked
    mask = (torch.arange(keys)[None] < lengths[:, None])[:, None, None]  # [rows, 1, 1, keys]
    return qkv, cos, sin, write, read, mask, kc, vc


@torch.inference_mode()
def test_the_traced_attention_core_equals_gather_and_sdpa_and_writes_the_same_cache():
    fns = fusion.Fused(lambda *a: None, lambda *a: None, heads=4, kv_heads=2, backend="aot_eager")
    qkv, cos, sin, write, read, mask, kc, vc = attention_case(rows=3, keys=12)
    read[1, -1], mask[1, ..., -1] = read[1, 0], True  # row 1 reads its new token... and an old one last
    k2, v2 = kc.clone(), vc.clone()
    got = fns.attend(qkv, (cos, sin), write, read, mask, kc, vc)  # writes kc, vc
    want = attention.attend_torch(qkv, cos, sin, write, read, mask, k2, v2, 4, 2)
    assert got.shape == want.shape == (3, 1, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, k2) and torch.equal(vc, v2)  # the new K (rotated) and V written in place, as eager
    assert not torch.equal(kc[write], torch.zeros_like(kc[write]))
    mask[0, ..., 0] = False  # control: one more masked key changes that row only
    other = fusion.decode_attend(qkv, cos, sin, write, read, mask, kc.clone(), vc.clone(), 4, 2)
    assert not torch.allclose(other[0], got[0]) and torch.allclose(other[1:], got[1:], atol=1e-6)


def test_fusion_on_gives_the_eager_tokens_and_runs_the_fused_core(ckpt, monkeypatch, uncompiled):
    calls = []
    real = fusion.decode_attend

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(fusion, "decode_attend", counted)
    want = generate(engine(ckpt, "off", monkeypatch))
    for padded in (False, True):  # the plain eager step, then the CUDA graphs' padded buffers (uncaptured)
        calls.clear()
        eng = engine(ckpt, "on", monkeypatch, padded=padded)
        assert eng.model.fusion.on and "check passed" in eng.model.fusion.reason
        assert generate(eng) == want
        assert calls and max(calls) > 1  # decode steps of several rows ran the fused core
        if padded:
            assert eng.decode_graphs.static_steps > 0


def test_auto_is_off_on_a_cpu_and_compiles_nothing(ckpt, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("torch.compile called at a CPU load")
    monkeypatch.setattr(torch, "compile", refuse)
    eng = engine(ckpt, "auto", monkeypatch)
    assert not eng.model.fusion.on and "auto on cpu" in eng.model.fusion.reason
    assert eng.model.fused is None


def test_a_bad_value_is_refused_naming_the_variable(ckpt, monkeypatch):
    with pytest.raises(ValueError, match=f"{fusion.ENV}='yes'.*auto, on, off"):
        engine(ckpt, "yes", monkeypatch)


def test_a_failing_compile_or_check_keeps_the_eager_path_with_the_reason(ckpt, monkeypatch, uncompiled):
    want = generate(engine(ckpt, "off", monkeypatch), n=1)

    def broken(*a, **kw):
        raise RuntimeError("no compiler here")
    with monkeypatch.context() as m:
        m.setattr(fusion.Fused, "__init__", broken)
        eng = engine(ckpt, "on", monkeypatch)
    assert not eng.model.fusion.on and "no compiler here" in eng.model.fusion.reason
    assert generate(eng, n=1) == want
    with monkeypatch.context() as m:  # a wrong result: the check refuses it
        m.setattr(fusion, "decode_attend", lambda qkv, cos, sin, w, r, mask, kc, vc, heads, kv_heads:
                  qkv.new_zeros(qkv.shape[0], 1, heads * kc.shape[-1]))
        eng = engine(ckpt, "on", monkeypatch)
    assert not eng.model.fusion.on and "check failed" in eng.model.fusion.reason
    assert generate(eng, n=1) == want


def test_a_fused_call_failing_while_serving_recomputes_the_step_eagerly(ckpt, monkeypatch, uncompiled):
    want = generate(engine(ckpt, "off", monkeypatch), n=2)
    eng = engine(ckpt, "on", monkeypatch)
    assert eng.model.fusion.on

    def fails(*a, **kw):
        raise RuntimeError("recompile limit")
    eng.model.fused._core = fails
    assert generate(eng, n=2) == want
    assert eng.model.fused is None and not eng.model.fusion.on
    assert "failed while serving: RuntimeError: recompile limit" in eng.model.fusion.reason


def test_the_race_times_both_sides_and_keeps_the_faster(ckpt, monkeypatch, uncompiled):
    eng = engine(ckpt, "off", monkeypatch)
    m = eng.model
    fns = fusion.Fused(fusion._model_fn("add_rms_norm"), fusion._model_fn("silu_mul"), m.config.num_heads,
                       m.config.num_kv_heads)
    times = fusion.race(m, fns, block_size=4, keys=32, graphs=False)
    assert set(times) == {"eager", "fused", "pointwise"} and min(times.values()) > 0
    assert m.fused is None and fns.core  # the model and the functions left as they were
    choice = fusion._decide(m, "auto", 4, 32, graphs=False)  # `auto` past its CUDA gate: check, race, keep
    assert "raced one row of 32 keys, uncaptured" in choice.reason
    best = min(("eager", choice.eager_ms), ("fused", choice.fused_ms), ("pointwise", choice.pointwise_ms),
               key=lambda t: t[1])[0]
    assert choice.on == (best != "eager") == (m.fused is not None) and choice.core == (best == "fused")
    assert f"{choice.fused_ms:.3f} ms fused vs {choice.eager_ms:.3f} ms eager" in choice.describe()
    calls = []  # the pointwise-only choice: the norms fused, the attention core eager
    monkeypatch.setattr(fusion, "decode_attend", lambda *a: calls.append(1))
    want = generate(engine(ckpt, "off", monkeypatch), n=2)
    m.fused, fns.core = fns, False
    assert generate(eng, n=2) == want and not calls


# --- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_compiled_under_cuda_graphs_gives_the_eager_fp32_tokens(ckpt, monkeypatch):
    """inductor on CUDA, every bucket captured, decode steps replayed: the eager engine's fp32 tokens."""
    kw = dict(device="cuda", cuda_graph_min_keys=16, block_size=16, kv_cache_tokens=2048)
    want = generate(engine(ckpt, "off", monkeypatch, **kw))
    on = engine(ckpt, "on", monkeypatch, **kw)
    assert on.model.fusion.on, on.model.fusion.reason
    assert on.decode_graphs is not None and on.decode_graphs.captured > 0
    assert generate(on) == want
    assert on.decode_graphs.replays > 0 and on.model.fusion.on  # replayed, and no fused call failed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compiled_16_bit_logits_agree_and_auto_races_under_graphs(ckpt, monkeypatch, dtype):
    """One decode step's logits fused vs eager within the dtype's tolerance (`fusion.check`), and `auto` on CUDA
    races one step both ways as replayed CUDA graphs and reports both times."""
    from triton_vlm.engine.model.model import LlamaModel

    model = LlamaModel.from_pretrained(ckpt, dtype, "cuda")
    monkeypatch.setenv(fusion.ENV, "auto")
    choice = model.choose_fusion(16, keys=64, graphs=True)
    assert choice.eager_ms is not None and min(choice.eager_ms, choice.fused_ms, choice.pointwise_ms) > 0, \
        choice.reason
    assert (model.fused is not None) == choice.on == (min(choice.fused_ms, choice.pointwise_ms) < choice.eager_ms)
    fns = model.fused or fusion.Fused(fusion._model_fn("add_rms_norm"), fusion._model_fn("silu_mul"),
                                      model.config.num_heads, model.config.num_kv_heads)
    err = fusion.check(model, fns, 16)
    assert 0 < err <= fusion.CHECK_RTOL[getattr(torch, dtype)], err


def test_the_default_is_off_until_a_gpu_has_measured_it(monkeypatch):
    monkeypatch.delenv(fusion.ENV, raising=False)
    assert fusion.mode() == "off" == fusion.DEFAULT
