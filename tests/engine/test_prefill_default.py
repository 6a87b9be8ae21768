"""`prefill_chunk` 0 (the shipped default): 512 on a CPU, and on a GPU vLLM's OpenAI-server token budget by the
device's memory (`policy.default_prefill_chunk`); resolved before the KV profile, which prefills in those chunks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_vlm.engine import policy
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.errors import InvalidArgument

GIB = 1 << 30


@pytest.mark.parametrize("name, gib, want", [("NVIDIA H200", 139.8, 8192), ("NVIDIA H100 80GB HBM3", 79.1, 8192),
                                             ("NVIDIA A100-SXM4-80GB", 79.2, 2048), ("NVIDIA L4", 22.0, 2048),
                                             ("NVIDIA B200", 178.4, 16384)])
def test_a_gpu_gets_vllms_budget_for_its_memory(monkeypatch, name, gib, want):
    props = SimpleNamespace(name=name, total_memory=int(gib * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    assert policy.default_prefill_chunk(torch.device("cuda", 0)) == want


def test_a_cpu_engine_resolves_zero_to_512_and_negative_is_refused(tmp_path):
    from triton_vlm.demo.checkpoint import build_random_llava

    assert policy.default_prefill_chunk(torch.device("cpu")) == 512
    with pytest.raises(InvalidArgument, match="prefill_chunk must be >= 0"):
        EngineConfig(prefill_chunk=-1).validate()
    path = build_random_llava(tmp_path / "llava", seed=3)
    eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=4))
    try:
        assert EngineConfig().prefill_chunk == 0 and eng.config.prefill_chunk == 512
        assert eng.scheduler.policy.prefill_chunk == 512
    finally:
        eng.shutdown()
