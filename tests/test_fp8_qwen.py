"""Block-wise FP8 (Qwen's `-FP8` layout) on the Qwen families, against transformers loading the same files with
`FineGrainedFP8Config(dequantize=True)` in float32 (tiny random checkpoints quantized offline,
`demo.fp8_checkpoint`):
- through one live tritonserver on a dense Qwen3-VL (QK-norm, DeepStack, interleaved M-RoPE; its projections
  kept in e4m3 and read by the FP8 gemv and the C decode forward): greedy, beam 3 with 3 sequences and seeded
  sampling equal `generate()`; the server's metrics say which weights it serves and how it holds them;
- in process, the engine without Triton (one server for the two shapes keeps the suite's time), on a Qwen2.5-VL
  (q/k/v biases, M-RoPE): the same three on transformers' own image features; and the KV profile counts the FP8
  projections' real bytes (e4m3 + scales), not fp32's (a live Qwen2.5-VL FP8 server, compressed-tensors
  per-channel, is test_qwen_vl_openai.py's);
- in process, the hybrid Qwen3.5 and Qwen3.5-MoE laid out as Qwen's `-FP8` releases (bf16 weight_scale_inv; the
  linear layers' in_proj_a / in_proj_b, conv, norms, router, embedding and lm_head left bf16): every quantized
  projection (full attention, MLP, a linear layer's in_proj_qkv / in_proj_z / out_proj, shared and routed experts)
  held e4m3 and the bf16 ones as stored (`weights_info{held}`), the weights' bytes under half of fp32's; greedy (a
  prompt of two 64-token chunks and an image), beam 3 and seeded sampling equal `generate()`, a LoRA on FP8 bases
  equals PEFT on the dequantized model; the control: the scales ignored (read as 1) give other tokens.
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
TEXT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


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


@pytest.fixture
def kernels_on(monkeypatch):
    """The FP8 and 16-bit gemvs wherever they build and check (deterministic `held`, whatever a race says)."""
    from triton_vlm.engine.cpu import gemv_bf16, gemv_fp8

    for env in (FP8_ENV, BF16_ENV):
        monkeypatch.setenv(env, "1")
    gemv_fp8._once.reset()
    gemv_bf16._once.reset()
    yield
    gemv_fp8._once.reset()
    gemv_bf16._once.reset()


def _run(eng, ref: Reference, rid: str, prompt: str, images: list[bytes], adapter=None,
         **params) -> list[list[int]]:
    """The engine's sequences for `prompt` (+ transformers' own features of `images`; `adapter`: a loaded LoRA),
    no Triton."""
    from triton_vlm.params import GenerationParams, GenerationRequest

    x = ref.inputs(prompt, images)
    ids, feats, sizes = x["input_ids"][0].tolist(), None, [pil(b).size[::-1] for b in images]
    if images:
        with torch.no_grad():
            feats = ref.model.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output
        feats = (torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats)[None].float()
    req = GenerationRequest(request_id=rid, input_ids=ids, image_embeds=feats, image_sizes=sizes or None,
                            params=GenerationParams(max_tokens=NEW, **params), adapter=adapter)
    req.rope = eng.rope(ids, sizes) if images else None
    last = eng.generate([req])[rid][-1]
    assert last.error is None, last.error
    return [s.token_ids for s in last.sequences]


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

        greedy = _run(eng, ref, "greedy", PROMPT, [IMAGES[0]])
        beams = _run(eng, ref, "beams", PROMPT, [IMAGES[1]], beam_width=3, num_return_sequences=3)
        sampled = _run(eng, ref, "sampled", PROMPT, [IMAGES[0]], temperature=1.3, top_k=20, seed=4321,
                       do_sample=True)
    finally:
        eng.shutdown()
    assert greedy == ref.generate(PROMPT, [IMAGES[0]], NEW)
    assert beams == ref.generate(PROMPT, [IMAGES[1]], NEW, beams=3, num_return_sequences=3)
    assert sampled == _sampled(ref, IMAGES[0], 4321)


# --- in process: the hybrid Qwen3.5 / Qwen3.5-MoE in Qwen's -FP8 layout ----------------------------------------
LONG = "<|im_start|>user\n" + " ".join(f"word{i} and more" for i in range(12)) + "<|im_end|>\n<|im_start|>assistant\n"


def _hybrid_held(eng) -> tuple[list, list]:
    """(the FP8 Linears, the bf16 ones) of a hybrid engine's model; asserts nothing else is held fp32."""
    from triton_vlm.engine.model.model import Experts

    model = eng.model
    lins = model.linears() + [e for m in model.mlps if isinstance(m, Experts) for e in (*m.gate_up, *m.down)]
    fp8 = [lin for lin in lins if lin.fp8_packed is not None]
    half = [lin for lin in lins if lin.half_packed is not None]
    assert len(fp8) + len(half) == len(lins) and model.lm_head.half_packed is not None
    assert {lin.module for lin in half} == {"linear_attn.in_proj_b", "linear_attn.in_proj_a"}, \
        sorted({lin.module for lin in half})  # what Qwen's -FP8 leaves bf16
    assert model.embed_tokens.dtype == torch.bfloat16 and eng.weights_info["held"] == "float8_e4m3fn+bfloat16"
    return fp8, half


def test_engine_on_qwen3_5_fp8_holds_e4m3_and_equals_transformers(kernels_on, tmp_path):
    """... and a LoRA on the FP8 full-attention q/v_proj and down_proj of a linear and a full layer equals PEFT on
    the dequantized model (adapters fp32 beside e4m3 bases)."""
    from peft import LoraConfig, get_peft_model
    from transformers import FineGrainedFP8Config

    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.engine.profile import model_bytes
    from triton_vlm.lora.peft import load_peft

    ref = _reference("qwen3_5")
    torch.manual_seed(2)
    peft = get_peft_model(type(ref.model).from_pretrained(
        str(ref.model_dir), dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)),
        LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                   target_modules=r".*language_model\.layers\.(3\.self_attn\.(q_proj|v_proj)|[13]\.mlp\.down_proj)"))
    peft.save_pretrained(tmp_path / "adapter")
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, prefill_chunk=64))
    try:
        fp8, _ = _hybrid_held(eng)
        assert {lin.module for lin in fp8} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                               "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                                               "linear_attn.out_proj"}
        fp32 = 4 * sum(p.numel() for n, p in ref.model.model.language_model.named_parameters()) + \
            4 * ref.model.lm_head.weight.numel()
        assert eng.memory.weights_bytes == model_bytes(eng.model) < 0.5 * fp32, (eng.memory.weights_bytes, fp32)
        assert len(ref.inputs(LONG, [])["input_ids"][0]) > 64  # two chunks: the FP8 prefill products too
        greedy = _run(eng, ref, "greedy", LONG, [])
        image = _run(eng, ref, "image", PROMPT, [IMAGES[0]])
        beams = _run(eng, ref, "beams", PROMPT, [IMAGES[1]], beam_width=3, num_return_sequences=3)
        sampled = _run(eng, ref, "sampled", PROMPT, [IMAGES[0]], temperature=1.3, top_k=20, seed=4321,
                       do_sample=True)
        adapted = _run(eng, ref, "lora", LONG, [], adapter=load_peft(tmp_path / "adapter", eng.model_config, "a"))
        for lin in fp8:  # the control: the e4m3 codes read as numbers, their scales ignored
            lin.fp8_packed.scale.fill_(1.0)
        ignored = _run(eng, ref, "ignored", LONG, [])
    finally:
        eng.shutdown()
    assert greedy == ref.generate(LONG, [], NEW) and ignored != greedy
    assert adapted == ref.generate(LONG, [], NEW, model=peft.eval()) != greedy
    assert image == ref.generate(PROMPT, [IMAGES[0]], NEW)
    assert beams == ref.generate(PROMPT, [IMAGES[1]], NEW, beams=3, num_return_sequences=3)
    assert sampled == _sampled(ref, IMAGES[0], 4321)


def test_engine_on_qwen3_5_moe_fp8_holds_e4m3_experts_and_equals_transformers(kernels_on):
    from triton_vlm.engine.engine import Engine, EngineConfig

    ref = _reference("qwen3_5_moe")
    eng = Engine(ref.model_dir, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, prefill_chunk=64))
    try:
        fp8, _ = _hybrid_held(eng)
        modules = {lin.module for lin in fp8}
        assert {"experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_up_proj"} <= modules, modules
        assert sum(lin.module == "experts.gate_up_proj" for lin in fp8) == 4 * 4  # 4 experts in each of 4 layers
        greedy = _run(eng, ref, "greedy", LONG, [])
        beams = _run(eng, ref, "beams", TEXT, [], beam_width=2, num_return_sequences=2)
    finally:
        eng.shutdown()
    assert greedy == ref.generate(LONG, [], NEW)
    assert beams == ref.generate(TEXT, [], NEW, beams=2, num_return_sequences=2)


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
