"""The KV budget from a worst-case profile (`engine/profile.py`): it follows the memory given, counts the
worst case's activations, and a budget short of one request at the full context refuses to start with the
numbers; through the server too (the llm's load failure names them)."""
from __future__ import annotations

import re

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.model import attention
from triton_vlm.engine import profile
from triton_vlm.engine.cpu import cpu_decode
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.kv.kv_cache import blocks_needed
from triton_vlm.engine.profile import KVBudgetError, MemoryProbe

MiB = 2**20
CONTEXT = 256

NO_KERNEL = "C kernel not built here: no C compiler for the decode attention; torch gathers the keys"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=7, max_position_embeddings=CONTEXT)
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("profiled"))


def engine_with_memory(monkeypatch, path, available: int, **kw) -> Engine:
    """An engine on a CPU that sees `available` bytes free at start."""
    monkeypatch.setattr(profile, "cpu_available", lambda: available)
    cfg = dict(max_rows=256, block_size=16, lora_cache_device_mb=1) | kw  # 256 rows: a cap above these budgets
    return Engine(path, EngineConfig(**cfg))


def test_budget_follows_the_memory_given(monkeypatch, ckpt):
    # 512 rows: a cap (131072 tokens) above both budgets, also where decode attention gathers no keys
    small = engine_with_memory(monkeypatch, ckpt, 64 * MiB, max_rows=512).memory
    large = engine_with_memory(monkeypatch, ckpt, 96 * MiB, max_rows=512).memory
    for plan in (small, large):
        assert plan.rule == "cpu_memory_utilization" and plan.weights_bytes > 0
        assert plan.graph_bytes == 0  # no CUDA graphs on a CPU
        left = plan.limit_bytes - plan.weights_bytes - plan.activation_bytes - plan.other_bytes
        assert plan.kv_tokens == left // plan.token_bytes // 16 * 16  # what is left, in whole blocks
        assert plan.other_bytes == 1 * MiB  # the LoRA device level is set aside
    assert (small.limit_bytes, large.limit_bytes) == (32 * MiB, 48 * MiB)  # 0.5 x available / 1 instance
    # 16 MiB more for this instance: 32768 more tokens of 512 B, less any change in the measured activations
    extra = large.limit_bytes - small.limit_bytes - (large.activation_bytes - small.activation_bytes)
    assert abs((large.kv_tokens - small.kv_tokens) - extra // small.token_bytes) <= 16
    assert large.kv_tokens - small.kv_tokens > 20000 and small.kv_tokens > 0


def test_instances_share_the_memory(monkeypatch, ckpt):
    one = engine_with_memory(monkeypatch, ckpt, 96 * MiB).memory
    two = engine_with_memory(monkeypatch, ckpt, 96 * MiB, instances=2).memory
    assert two.limit_bytes == one.limit_bytes // 2 and two.kv_tokens < one.kv_tokens


def test_the_cpu_budget_stops_at_what_max_rows_rows_can_hold(monkeypatch, ckpt):
    eng = engine_with_memory(monkeypatch, ckpt, 192 * MiB, max_rows=8)
    assert eng.memory.kv_tokens == 8 * CONTEXT and eng.cache.num_blocks == 8 * CONTEXT // 16


def test_activations_of_the_worst_case_are_measured(monkeypatch, ckpt):
    """max_rows rows decoded at the full context with torch's attention (a GPU's, or a CPU without the C decode
    kernel) gather their keys: 512 rows need far more than 8 rows."""
    monkeypatch.setattr(attention.Attention, "kernel_for", lambda self, q_len: None)
    few = engine_with_memory(monkeypatch, ckpt, 512 * MiB, max_rows=8).memory
    many = engine_with_memory(monkeypatch, ckpt, 512 * MiB, max_rows=512).memory
    assert few.worst.images == (CONTEXT - 2) // 16 and few.worst.image_tokens == 16  # 32x32 / patch 8, no CLS
    keys = 512 * CONTEXT * few.token_bytes // 4  # one layer's gathered keys of 512 rows (K, V x 2 layers)
    assert many.activation_bytes - few.activation_bytes > keys > few.activation_bytes


def test_the_cpu_decode_kernel_needs_no_gathered_keys(monkeypatch, ckpt):
    """The C decode attention reads the keys in place (`engine/cpu/cpu_decode.py`): the profile measures what it
    actually needs, and the cache gets the difference."""
    if cpu_decode.kernel(attention.decode_torch) is None:  # no C compiler here: torch gathers, as above
        pytest.skip(NO_KERNEL)
    in_place = engine_with_memory(monkeypatch, ckpt, 512 * MiB, max_rows=512).memory
    keys = 512 * CONTEXT * in_place.token_bytes // 4  # one layer's gathered keys of 512 rows
    assert in_place.activation_bytes < keys
    monkeypatch.setattr(attention.Attention, "kernel_for", lambda self, q_len: None)
    torch_path = engine_with_memory(monkeypatch, ckpt, 512 * MiB, max_rows=512).memory
    assert torch_path.activation_bytes - in_place.activation_bytes > keys // 2


def test_too_small_a_budget_is_refused_at_start_naming_the_numbers(monkeypatch, ckpt):
    with pytest.raises(KVBudgetError) as err:
        engine_with_memory(monkeypatch, ckpt, 4 * MiB)
    msg = str(err.value)
    assert "cannot hold one request at the context length (256 tokens)" in msg
    assert re.search(r"it needs 256 tokens \(0\.12 MiB at 512 B/token\)", msg), msg
    assert re.search(r"cpu_memory_utilization 0\.5 x 4\.0 MiB memory available at start / 1 instance\(s\) = "
                     r"2\.0 MiB, less weights [\d.]+ MiB, activations [\d.]+ MiB", msg), msg
    assert "other 1.0 MiB (LoRA device level 1 MiB)" in msg and "raise cpu_memory_utilization" in msg
    with pytest.raises(KVBudgetError, match=r"it needs 256 tokens .* kv_cache_tokens is 128"):
        Engine(ckpt, EngineConfig(kv_cache_tokens=128))
    Engine(ckpt, EngineConfig(kv_cache_tokens=128, context_length=128))  # a shorter context fits


def test_an_explicit_budget_wins(monkeypatch, ckpt):
    eng = engine_with_memory(monkeypatch, ckpt, 1 * MiB, kv_cache_mb=2)  # the profile would refuse 1 MiB
    assert eng.memory.rule == "kv_cache_mb" and eng.memory.kv_tokens == 2 * MiB // 512
    assert eng.cache.num_blocks * 16 == eng.memory.kv_tokens


class FakeGPU(MemoryProbe):
    """vLLM's rule with made-up device numbers (the model itself stays on the CPU)."""

    def __init__(self, total: int, free: int, peak_above: int, outside: int):
        self.device, self.cuda, self.resettable = torch.device("cpu"), True, True
        self.total, self.free_at_start, self.peak_above, self.outside = total, free, peak_above, outside
        self._held = 0

    def held(self) -> int:
        self._held = 1000
        return self._held

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return self._held + self.peak_above

    def outside_allocator(self) -> int:
        return self.outside


def test_gpu_rule_is_vllms(ckpt):
    eng = Engine(ckpt, EngineConfig(kv_cache_tokens=256))
    cfg = EngineConfig(gpu_memory_utilization=0.5, instances=2, lora_cache_device_mb=1)
    worst = eng.memory.worst
    plan = profile.plan_kv_cache(eng.model, cfg, FakeGPU(1000 * MiB, 900 * MiB, 30 * MiB, 5 * MiB), worst)
    assert plan.rule == "gpu_memory_utilization" and plan.limit_bytes == 250 * MiB
    assert plan.activation_bytes == 30 * MiB and plan.other_bytes == 6 * MiB
    left = 250 * MiB - plan.weights_bytes - 30 * MiB - 6 * MiB
    assert plan.kv_tokens == left // 512 // 16 * 16  # no cap on a GPU
    with pytest.raises(KVBudgetError, match=r"free memory on .* \(0\.20 GiB of 0\.98 GiB\) is less than "
                                            r"gpu_memory_utilization 0\.5"):
        profile.plan_kv_cache(eng.model, cfg, FakeGPU(1000 * MiB, 200 * MiB, 0, 0), worst)


def test_the_cuda_graphs_part_comes_out_of_the_kv_budget(ckpt):
    """With decode graphs (a GPU), their part (the decode step's own peak + slack as the pool, and their buffers)
    is taken from the budget before the KV cache is sized, and shown apart."""
    eng = Engine(ckpt, EngineConfig(kv_cache_tokens=256))
    cfg = EngineConfig(gpu_memory_utilization=0.5, lora_cache_device_mb=1)
    worst = eng.memory.worst
    off = profile.plan_kv_cache(eng.model, cfg, FakeGPU(1000 * MiB, 900 * MiB, 30 * MiB, 5 * MiB), worst)
    on = profile.plan_kv_cache(eng.model, cfg, FakeGPU(1000 * MiB, 900 * MiB, 30 * MiB, 5 * MiB), worst,
                               graphs=7 * MiB)
    assert off.graph_bytes == off.graph_pool_bytes == 0 and on.activation_bytes == off.activation_bytes == 30 * MiB
    assert on.graph_pool_bytes == 30 * MiB + profile.GRAPH_POOL_SLACK
    assert on.graph_bytes == on.graph_pool_bytes + 7 * MiB
    left = 500 * MiB - on.weights_bytes - 30 * MiB - on.other_bytes - on.graph_bytes
    assert on.kv_tokens == left // 512 // 16 * 16 < off.kv_tokens
    assert f"CUDA graphs {on.graph_bytes / MiB:.1f} MiB" in on.summary()


@pytest.mark.gpu
def test_gpu_budget_follows_gpu_memory_utilization(ckpt):
    """On a real device: the share is the fraction of its memory, the peak comes from torch's allocator."""
    total = torch.cuda.mem_get_info()[1]
    plans = []
    for util in (0.02, 0.04):
        eng = Engine(ckpt, EngineConfig(device="cuda", max_rows=64, gpu_memory_utilization=util))
        plan = eng.memory
        assert plan.rule == "gpu_memory_utilization" and plan.limit_bytes == int(total * util)
        assert plan.activation_bytes > 0 and plan.weights_bytes > 0
        assert plan.graph_bytes > 0  # CUDA graphs on by default: their part is taken too
        left = plan.limit_bytes - plan.weights_bytes - plan.activation_bytes - plan.other_bytes - plan.graph_bytes
        assert plan.kv_tokens == left // plan.token_bytes // 16 * 16
        assert eng.cache.k.device.type == "cuda" and eng.cache.num_blocks * 16 == plan.kv_tokens
        plans.append(plan)
        del eng
        torch.cuda.empty_cache()
    small, large = plans
    extra = large.limit_bytes - small.limit_bytes - (large.activation_bytes - small.activation_bytes) - \
        (large.other_bytes - small.other_bytes) - (large.graph_bytes - small.graph_bytes)
    assert abs((large.kv_tokens - small.kv_tokens) - extra // small.token_bytes) <= 16


def test_worst_case_prompt_fills_the_context():
    w = profile.worst_case(4096, 576, 64)
    assert (w.prompt_tokens, w.images, w.image_tokens, w.rows) == (4095, 7, 576, 64)
    assert profile.worst_case(512, None, 8).images == 0
    assert blocks_needed(w.prompt_tokens, 1, 1, 16) * 16 == 4096  # the one request the cache must hold


@pytest.mark.server
def test_the_server_refuses_to_start_naming_the_numbers(tmp_path_factory, ckpt):
    """The llm alone (the failure is its own): the start fails with the llm's load error, as the launcher shows."""
    from triton_vlm.server.process import TritonServer, free_port

    run_dir = tmp_path_factory.mktemp("refused")
    server = TritonServer(str(ckpt), free_port(), free_port(), free_port(), models=("llm",), run_dir=run_dir,
                          params={"llm": {"cpu_memory_utilization": "0.000001"}}, log_file=run_dir / "server.log",
                          exit_timeout=10)
    server.start()
    try:
        with pytest.raises(RuntimeError) as err:
            server.wait_ready(300)
    finally:
        server.stop()
    msg = str(err.value)
    assert "model 'llm' failed to load: KVBudgetError: the KV cache cannot hold one request at the context length " \
        "(256 tokens)" in msg, msg
    assert re.search(r"cpu_memory_utilization 1e-06 x [\d.]+ MiB memory available at start / 1 instance\(s\)", msg)
