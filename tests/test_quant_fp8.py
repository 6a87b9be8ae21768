"""FP8 checkpoints (block-wise as Qwen's `-FP8` releases, compressed-tensors FP8-Dynamic) served exactly on CPU.

Fixtures: tiny checkpoints quantized offline (`demo.fp8_checkpoint`): the trained LLaVA-1.5 demo in the hub's key
layout and a random Qwen2.5-VL. The reference is `transformers` loading the same files with
`FineGrainedFP8Config(dequantize=True)` / `CompressedTensorsConfig(dequantize=True)` in float32:
- every tensor the engine and the vision tower read equals that model's, bit for bit (each format, both bases);
- the engine on the block-wise LLaVA (in process; the live FP8 servers, LoRA on the wire included, are
  test_hub_layout.py's block-wise LLaVA-1.5, test_qwen_vl_openai.py's compressed-tensors Qwen2.5-VL and
  test_fp8_qwen.py's block-wise Qwen3-VL): greedy, beam 3, seeded sampling give transformers' tokens; the same
  weights with their scales ignored give other tokens;
- the OpenAI card's `held` is read from the llm's weights gauge;
- formats the engine does not read are refused at load, naming the field.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from triton_vlm.spec import CheckpointError, CheckpointSpec
from triton_vlm.weight_source import TensorSource

CASES = [("llava", "fp8-block"), ("llava", "ct-channel"), ("qwen2_5_vl", "fp8-block"), ("qwen2_5_vl", "ct-tensor")]


def _reference(path, fmt: str):
    """transformers' model of an FP8 checkpoint, dequantized at load in float32."""
    import transformers
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    from triton_vlm.families import family_for_config

    path = Path(path)
    arch = family_for_config(json.loads((path / "config.json").read_text())).model_class
    q = FineGrainedFP8Config(dequantize=True) if fmt == "fp8-block" else CompressedTensorsConfig(dequantize=True)
    return getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32, quantization_config=q).eval()


@pytest.mark.parametrize("base,fmt", CASES)
def test_dequantized_weights_equal_transformers(base, fmt):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint

    path = ensure_fp8_checkpoint(base, fmt)
    spec = CheckpointSpec.load(path)
    assert spec.quant is not None and spec.quant.method == ("fp8" if fmt == "fp8-block" else "compressed-tensors")
    src = TensorSource(path)
    state = _reference(path, fmt).state_dict()
    scale = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    assert not [k for k in src.keys() if k.endswith(scale)], "scales are no model tensors"
    quantized = [k for k in src.quant.scales]
    assert len(quantized) == 7 * spec.text.num_layers and all(".language_model.layers." in k for k in quantized)
    compared = 0
    for name in src.keys():
        if name in state:
            assert torch.equal(src.get(name).float(), state[name]), name
            compared += 1
    assert compared >= len(state) - 1  # all but a tied lm_head


@pytest.mark.parametrize("change,message", [
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme = 'static' is not supported; "
                                      "supported: 'dynamic'"),
    ({"weight_block_size": [128, 128]}, "shape (64, 64) is not a multiple of weight_block_size [128, 128]"),
    ({"scale_fmt": "ue8m0"}, "quantization_config.scale_fmt = 'ue8m0' is not supported"),
])
def test_fp8_variants_the_engine_does_not_read_are_refused(tmp_path, change, message):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.engine.model.weights import load_config, load_weights

    path = _copy(ensure_fp8_checkpoint("llava", "fp8-block"), tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] |= change
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=_re(message)):
        load_weights(path, load_config(path))


def test_compressed_tensors_int4_is_refused(tmp_path):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint

    path = _copy(ensure_fp8_checkpoint("llava", "ct-channel"), tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"] |= {"num_bits": 4, "type": "int"}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=_re("quantization_config.config_groups.group_0.weights = ")):
        CheckpointSpec.load(path)


def test_float8_weights_without_quantization_config_are_refused(tmp_path):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.engine.model.weights import load_config, load_weights

    path = _copy(ensure_fp8_checkpoint("llava", "fp8-block"), tmp_path)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"is torch.float8_e4m3fn but config.json has no quantization_config"):
        load_weights(path, load_config(path))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst / "ckpt")
    return dst / "ckpt"


def _re(text: str) -> str:
    import re

    return re.escape(text)


# --- in process: the engine on the block-wise FP8 LLaVA (its live server: test_hub_layout.py's demo-fp8) -------
# its projections kept in e4m3 and multiplied by the FP8 gemv (`engine/cpu/gemv_fp8.py`) where it builds here
FP8_ENV = "TRITON_VLM_CPU_GEMV_FP8"
PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"
NEW = 8


def _image(seed: int) -> bytes:
    import io

    from triton_vlm.demo.shapes import draw

    buf = io.BytesIO()
    draw(("circle", "square", "triangle")[seed % 3], ("red", "blue", "green")[seed % 3],
         rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


def _inputs(processor, image: bytes) -> dict:
    import io

    from PIL import Image

    return processor(text=PROMPT, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")


@torch.no_grad()
def _hf(model, processor, image: bytes, **kw) -> list[list[int]]:
    x = _inputs(processor, image)
    if kw.get("do_sample"):
        torch.manual_seed(kw.pop("seed"))
    out = model.generate(**x, max_new_tokens=NEW, **kw)
    eos = model.generation_config.eos_token_id
    rows = out[:, x["input_ids"].shape[1]:].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def test_engine_on_block_fp8_llava_equals_transformers_dequantized(monkeypatch):
    """Greedy, beam 3 with 3 sequences and seeded sampling on the engine (projections in e4m3; the embedding and
    lm_head, bf16 in the file as in Qwen's releases, kept bf16 by the 16-bit gemv) equal transformers on the
    dequantized model in fp32, fed transformers' own image features; the same files with their scales ignored
    (what main served before issue 38) give other tokens."""
    from transformers import AutoProcessor

    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.engine.cpu import gemv_bf16, gemv_fp8
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    path = ensure_fp8_checkpoint("llava", "fp8-block")
    model, processor = _reference(path, "fp8-block"), AutoProcessor.from_pretrained(str(path))
    monkeypatch.setenv(FP8_ENV, "1")  # the FP8 gemv wherever it builds and checks, whatever a race says
    monkeypatch.setenv(gemv_bf16.ENV, "1")  # and the 16-bit one
    gemv_fp8._once.reset()
    gemv_bf16._once.reset()
    try:
        eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=8, enable_prefix_caching=False))
    finally:
        gemv_fp8._once.reset()
        gemv_bf16._once.reset()

    def run(rid: str, image: bytes, **params) -> list[list[int]]:
        x = _inputs(processor, image)
        with torch.no_grad():
            feats = model.model.get_image_features(x["pixel_values"], vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default")
        feats = getattr(feats, "pooler_output", feats)
        feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats  # [1, T, hidden]
        req = GenerationRequest(request_id=rid, input_ids=x["input_ids"][0].tolist(), image_embeds=feats.float(),
                                params=GenerationParams(max_tokens=NEW, **params))
        last = eng.generate([req])[rid][-1]
        assert last.error is None, last.error
        return [seq.token_ids for seq in last.sequences]

    try:
        held = eng.weights_info["held"]
        assert held.startswith("float8_e4m3fn") or gemv_fp8.kernel() is None  # (else: the dequantized weights)
        if gemv_bf16.kernel() is not None:  # the unquantized bf16 matrices kept as stored, in the label too
            assert held.endswith("+bfloat16") and eng.model.embed_tokens.dtype == torch.bfloat16, held
            assert eng.model.lm_head.half_packed is not None and eng.model.lm_head.weight.dtype == torch.bfloat16
        img = _image(1)
        greedy = run("greedy", img)
        beams = run("beams", _image(2), beam_width=3, num_return_sequences=3)
        sampled = run("sampled", img, temperature=1.3, top_k=20, seed=4321, do_sample=True)
    finally:
        eng.shutdown()
    assert greedy == _hf(model, processor, img, do_sample=False)
    assert beams == _hf(model, processor, _image(2), num_beams=3, num_return_sequences=3, do_sample=False)
    assert sampled == _hf(model, processor, img, do_sample=True, temperature=1.3, top_k=20, top_p=1.0, seed=4321)
    assert _ignoring_scales(model, path, processor, img) != greedy, "the scales must matter"


def random_adapter(path, out, pattern: str = r".*language_model.*\.(q_proj|v_proj|down_proj)",
                   fmt: str = "fp8-block"):
    """A PEFT LoRA on the language model of the FP8 checkpoint at `path` (on its dequantized reference;
    fp16-exact numbers: the wire carries FP16), saved to `out` (the live FP8 servers' tests send it)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(38)
    peft_model = get_peft_model(_reference(path, fmt), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=pattern))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_((p * (8.0 if "lora_B" in n else 1.0)).half().float())
    peft_model.save_pretrained(out)
    return out


@torch.no_grad()
def _ignoring_scales(model, path, processor, img) -> list[list[int]]:
    """The control: the same model with each quantized weight read as its raw e4m3 numbers (scales ignored)."""
    return _hf(scales_ignored(model, path), processor, img, do_sample=False)


def expected_held(server_log: str) -> str:
    """How an fp32 server on one of our FP8 fixtures holds its weights, as its log says the load went: the
    projections in e4m3 where all were kept so (the FP8 gemv used; not for bf16 compressed-tensors scales, whose
    product rounds in bf16), else their float32 dequantization; then the file's bf16 embedding and lm_head where
    the 16-bit gemv keeps them as stored."""
    import re

    [(kept, total)] = re.findall(r"FP8 checkpoint: (\d+) of (\d+) quantized projection weights kept", server_log)
    assert kept in ("0", total), (kept, total)  # (all or none, for these fixtures)
    held = "float8_e4m3fn" if kept == total else "float32"
    return held + ("+bfloat16" if "matrices kept as stored" in server_log else "")  # (the fixtures store bf16)


@torch.no_grad()
def scales_ignored(model, path):
    """A copy of transformers' `model` of the FP8 checkpoint at `path` with each quantized weight replaced by
    its raw e4m3 numbers: what a loader ignoring the scales would serve (every shard of the checkpoint read)."""
    import copy

    from safetensors import safe_open

    from triton_vlm.weight_source import canonical_key, renames_for

    path, raw = Path(path), copy.deepcopy(model)
    rules = renames_for(json.loads((path / "config.json").read_text()))
    state, replaced = raw.state_dict(), 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if f.get_slice(key).get_dtype() == "F8_E4M3":
                    state[canonical_key(key, rules)].copy_(f.get_tensor(key).float())
                    replaced += 1
    assert replaced > 0, f"no e4m3 weights in {path}"
    return raw


def test_models_card_says_which_weights_are_served(demo_model):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.openai.served import ServedModel

    card = ServedModel(ensure_fp8_checkpoint("llava", "fp8-block")).cards()[0]
    assert card["weights"] == "fp8-e4m3 (block 32x32 weight_scale_inv), computed as its float32 dequantization"
    assert ServedModel(ensure_fp8_checkpoint("qwen2_5_vl", "ct-tensor")).cards()[0]["weights"] == \
        "fp8-e4m3 (compressed-tensors, per-tensor weight_scale), computed as its float32 dequantization"
    assert ServedModel(demo_model).cards()[0]["weights"] == "unquantized"


def test_held_label_is_read_from_the_llms_weights_gauge():
    """The front end's `held` (the card's) is the llm model's `triton_vlm_engine_weights_info{held}` in Triton's
    metrics text; another model's series, none, or a text the parser refuses say nothing."""
    from triton_vlm.openai.metrics import held_label

    text = ('# HELP triton_vlm_engine_weights_info llm weights served\n# TYPE triton_vlm_engine_weights_info gauge\n'
            'triton_vlm_engine_weights_info{held="float32",model="tensorrt_llm",weights="unquantized"} 1\n'
            'triton_vlm_engine_weights_info{held="float8_e4m3fn+bfloat16",model="llm",weights="fp8-e4m3 (block '
            '128x128 weight_scale_inv), computed as its float32 dequantization"} 1\n')
    assert held_label(text) == "float8_e4m3fn+bfloat16" and held_label(text, "tensorrt_llm") == "float32"
    assert held_label("nv_inference_count{model=\"llm\"} 3\n") is None
    assert held_label("# Triton metrics unavailable (URLError)\n") is None
    assert held_label("triton_vlm_engine_weights_info{held=\"float32\" broken\n") is None


def test_held_is_read_once_a_minute_not_per_models_call(monkeypatch):
    """`/v1/models` asks for `held` on every call: Triton's metrics are scraped again only after HELD_TTL_S (an
    unknown value after HELD_RETRY_S), so a client listing models in a loop does not scrape Triton each time."""
    import asyncio

    from triton_vlm.openai import metrics

    m = metrics.FrontendMetrics("http://127.0.0.1:1/metrics")
    texts = iter(['triton_vlm_engine_weights_info{held="float8_e4m3fn",model="llm",weights="fp8"} 1\n',
                  'triton_vlm_engine_weights_info{held="float32",model="llm",weights="none"} 1\n'])
    scrapes = []

    async def scrape():
        scrapes.append(1)
        return next(texts)

    monkeypatch.setattr(m, "scrape_triton", scrape)
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    assert [asyncio.run(m.weights_held()) for _ in range(5)] == ["float8_e4m3fn"] * 5 and len(scrapes) == 1
    clock[0] += metrics.HELD_TTL_S
    assert asyncio.run(m.weights_held()) == "float32" and len(scrapes) == 2
