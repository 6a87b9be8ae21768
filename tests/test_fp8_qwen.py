"""Block-wise FP8 (Qwen's `-FP8` layout) on the Qwen families, against transformers loading the same files with
`FineGrainedFP8Config(dequantize=True)` in float32 (tiny random checkpoints quantized offline,
`demo.fp8_checkpoint`):
- through one live tritonserver on a dense Qwen3-VL (QK-norm, DeepStack, interleaved M-RoPE; its projections
  kept in e4m3 and read by the FP8 gemv and the C decode forward): greedy, beam 3 with 3 sequences and seeded
  sampling equal `generate()`; the server's metrics say which weights it serves and how it holds them;
- in process, the engine without Triton (one server for the two shapes keeps the suite's time), on a block-wise
  Qwen2.5-VL (q/k/v biases, M-RoPE): the same three on transformers' own image features; and the KV profile counts
  the FP8 projections' real bytes (e4m3 + scales), not fp32's. (A live Qwen2.5-VL FP8 server, compressed-tensors
  per-channel, is test_qwen_vl_openai.py's.)
"""
from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest
import torch

from qwen_vl_cases import NATIVE, Reference, pil, png

FP8_ENV = "TRITON_VLM_CPU_GEMV_FP8"
BF16_ENV = "TRITON_VLM_CPU_GEMV_BF16"  # the unquantized bf16 embedding / lm_head kept bf16 (`gemv_bf16.py`)
NEW = 8
PROMPT = f"<|im_start|>user\n{NATIVE}What is this?<|im_end|>\n<|im_start|>assistant\n"
IMAGES = [png((100, 60), seed=301), png((40, 120), seed=302)]


def _reference(base: str) -> Reference:
    from transformers import FineGrainedFP8Config

    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint

    torch.set_num_threads(1)
    return Reference(ensure_fp8_checkpoint(base, "fp8-block"), dtype=torch.float32,
                     quantization_config=FineGrainedFP8Config(dequantize=True))


def _sampled(ref: Reference, image: bytes, seed: int) -> list[list[int]]:
    x = ref.inputs(PROMPT, [image])
    torch.manual_seed(seed)  # as the engine seeds its rows
    with torch.no_grad():
        out = ref.model.generate(**x, max_new_tokens=NEW, do_sample=True, temperature=1.3, top_k=20, top_p=1.0,
                                 pad_token_id=0)
    return [row[:row.index(ref.eos) + 1] if ref.eos in row else row
            for row in out[:, x["input_ids"].shape[1]:].tolist()]


@pytest.fixture
def fp8_kernel_on(monkeypatch):
    """The FP8 gemv wherever it builds and checks, whatever a race on a loaded machine says."""
    from triton_vlm.engine.cpu import gemv_fp8

    monkeypatch.setenv(FP8_ENV, "1")
    gemv_fp8._once.reset()
    yield
    gemv_fp8._once.reset()


# --- live: one server on the block-FP8 Qwen3-VL ----------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    from conftest import _start_server, _stop_server

    ref = _reference("qwen3_vl")
    old = {env: os.environ.get(env) for env in (FP8_ENV, BF16_ENV)}
    os.environ.update({env: "1" for env in old})
    try:
        server = _start_server(tmp_path_factory, ref.model_dir, {}, "fp8-qwen3")
    finally:
        for env, value in old.items():
            os.environ.pop(env) if value is None else os.environ.__setitem__(env, value)
    yield server, ref
    _stop_server(server)


@pytest.mark.server
def test_live_qwen3_vl_fp8_equals_transformers_dequantized(qwen3_fp8, tmp_path):
    """... and a LoRA sent on the wire equals PEFT on the dequantized model (adapters stay fp32 on FP8 bases)."""
    from peft import PeftModel
    from test_quant_fp8 import random_adapter
    from triton_vlm_client import VLMClient

    server, ref = qwen3_fp8
    adapter = random_adapter(ref.model_dir, tmp_path / "adapter")
    with VLMClient(server.grpc_url, protocol="grpc", timeout=120) as c:
        greedy = c.generate(PROMPT, [IMAGES[0]], max_tokens=NEW).output_ids
        beams = c.generate(PROMPT, [IMAGES[1]], max_tokens=NEW, beam_width=3, num_return_sequences=3).output_ids
        sampled = c.generate(PROMPT, [IMAGES[0]], max_tokens=NEW, temperature=1.3, top_k=20, seed=4321).output_ids
        lora = c.generate(PROMPT, [IMAGES[0]], max_tokens=NEW, lora_task_id=38, lora_dir=str(adapter)).output_ids
    assert greedy == ref.generate(PROMPT, [IMAGES[0]], NEW)
    assert beams == ref.generate(PROMPT, [IMAGES[1]], NEW, beams=3, num_return_sequences=3)
    assert sampled == _sampled(ref, IMAGES[0], 4321)
    adapted = PeftModel.from_pretrained(_reference("qwen3_vl").model, str(adapter)).eval()
    want = ref.generate(PROMPT, [IMAGES[0]], NEW, model=adapted)
    assert want != greedy and lora == want
    log = Path(server.log_file).read_text(errors="replace")
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    info = [line for line in metrics.splitlines() if line.startswith("triton_vlm_engine_weights_info{")]
    assert len(info) == 1 and 'weights="fp8-e4m3 (block 16x16 weight_scale_inv), computed as its float32 ' \
        'dequantization"' in info[0] and info[0].endswith(" 1"), info
    if "fp8 decode gemv kernel not used" not in log:  # (a machine without it serves the dequantized weights)
        assert "kept in e4m3" in log and 'held="float8_e4m3fn' in info[0], (info, log[-3000:])
    if "bf16 decode gemv kernel not used" not in log:  # the file's bf16 embedding and lm_head held as stored
        assert "kept as stored" in log and '+bfloat16"' in info[0], (info, log[-3000:])


# --- in process: the engine on the block-FP8 Qwen2.5-VL ---------------------------------------------------------
def test_engine_on_qwen2_5_vl_fp8_equals_transformers_and_profiles_e4m3_bytes(fp8_kernel_on):
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.engine.profile import model_bytes
    from triton_vlm.params import GenerationParams, GenerationRequest

    ref = _reference("qwen2_5_vl")
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=8, prefill_chunk=16,
                                             enable_prefix_caching=False))
    try:
        lins = [lin for layer in eng.model.layers for lin in layer.linears()]
        held = eng.weights_info["held"]  # (+bfloat16: the embedding and lm_head, where the 16-bit gemv won its race)
        assert all(lin.fp8_packed is not None for lin in lins) and held in ("float8_e4m3fn+bfloat16",
                                                                           "float8_e4m3fn"), held
        fp32_bytes = sum(4 * lin.fp8_packed.n * lin.fp8_packed.k for lin in lins)
        fp8_bytes = sum(lin.fp8_packed.nbytes for lin in lins)  # e4m3 (outputs padded to 64) + fp32 scales
        assert eng.memory.weights_bytes == model_bytes(eng.model)
        others = model_bytes(eng.model) - fp8_bytes - sum(lin.bias.numel() * 4 for lin in lins if lin.bias is not None)
        assert others > 0 and fp8_bytes < 0.5 * fp32_bytes  # (64-row padding on these tiny rows: not 0.25x)

        def run(rid: str, image: bytes, **params) -> list[list[int]]:
            x = ref.inputs(PROMPT, [image])
            with torch.no_grad():
                feats = ref.model.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output
            feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
            ids = x["input_ids"][0].tolist()
            sizes = [pil(image).size[::-1]]
            req = GenerationRequest(request_id=rid, input_ids=ids, image_embeds=feats[None].float(),
                                    image_sizes=sizes, params=GenerationParams(max_tokens=NEW, **params))
            req.rope = eng.rope(ids, sizes)
            last = eng.generate([req])[rid][-1]
            assert last.error is None, last.error
            return [s.token_ids for s in last.sequences]

        greedy = run("greedy", IMAGES[0])
        beams = run("beams", IMAGES[1], beam_width=3, num_return_sequences=3)
        sampled = run("sampled", IMAGES[0], temperature=1.3, top_k=20, seed=4321, do_sample=True)
    finally:
        eng.shutdown()
    assert greedy == ref.generate(PROMPT, [IMAGES[0]], NEW)
    assert beams == ref.generate(PROMPT, [IMAGES[1]], NEW, beams=3, num_return_sequences=3)
    assert sampled == _sampled(ref, IMAGES[0], 4321)


def test_weights_info_gauge_carries_the_engines_labels(monkeypatch):
    """The llm's metrics hold one `triton_vlm_engine_weights_info` series with the engine's labels, value 1 (an
    unquantized engine's here; the live test above reads an FP8 server's)."""
    from metrics_support import fake_llm_metrics

    from triton_vlm.triton import metrics as M

    fake = fake_llm_metrics(monkeypatch)
    assert "triton_vlm_engine_weights_info" not in fake.series  # a backend that does not say: no series
    M.LLMMetrics(lambda: fake.now["stats"], weights={"weights": "unquantized", "held": "float32"})
    series = fake.series["triton_vlm_engine_weights_info"]
    assert series.labels == {"model": "llm", "weights": "unquantized", "held": "float32"} and series.value == 1.0
