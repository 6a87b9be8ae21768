"""The llm model's side of a CUDA error in the engine: `LLMService` hands the engine an `on_fatal` that ends the
process (the python backend then starts a fresh stub), after its responder sent the final errors queued."""
from __future__ import annotations

import threading

import pytest

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.params import GenerationParams, GenerationRequest
from triton_vlm.triton import llm


class FakeCudaError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def test_a_cuda_error_ends_the_stub_after_sending_the_final_errors(path, monkeypatch):
    eng = Engine(path, EngineConfig(max_rows=8, kv_cache_tokens=512, block_size=4))
    exited = threading.Event()
    codes = []
    monkeypatch.setattr(llm.os, "_exit", lambda code: (codes.append(code), exited.set()))
    svc = llm.LLMService(eng, eng.tokenizer, eng.image_token_id, eng.max_context,
                         make_response=lambda outputs: outputs, make_error=lambda e: e)
    real = eng.model.forward

    def forward(*args, **kwargs):
        if len(eng.scheduler.running) and eng.scheduler.running[0].timing.steps >= 2:
            raise FakeCudaError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kwargs)

    eng.model.forward = forward
    svc.start()
    try:
        assert eng.on_fatal == svc._fatal
        results = []
        eng.submit(GenerationRequest("r0", [1, 20, 30], GenerationParams(max_tokens=20, min_tokens=20)),
                   results.append)
        assert exited.wait(20), "the stub exits"
    finally:
        svc.shutdown()
    assert codes == [1] and results[-1].final and "CUDA error" in str(results[-1].error)
