"""FP8 checkpoints (block-wise as Qwen's `-FP8` releases, compressed-tensors FP8-Dynamic) served exactly on CPU.

Fixtures: tiny checkpoints quantized offline (`demo.fp8_checkpoint`): the trained LLaVA-1.5 demo in the hub's key
layout and a random Qwen2.5-VL. The reference is `transformers` loading the same files with
`FineGrainedFP8Config(dequantize=True)` / `CompressedTensorsConfig(dequantize=True)` in float32:
- every tensor the engine and the vision tower read equals that model's, bit for bit (each format, both bases);
- through a live server on the block-wise LLaVA: greedy, beam 3, seeded sampling and a LoRA adapter (PEFT on the
  dequantized model) give transformers' tokens; the same weights with their scales ignored give other tokens;
- formats the engine does not read are refused at load, naming the field.
"""
from __future__ import annotations

import json
import os
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


# --- live: a server on the block-wise FP8 LLaVA ----------------------------------------------------------------
# its projections kept in e4m3 and multiplied by the FP8 gemv (`engine/cpu/gemv_fp8.py`) where it builds here
FP8_ENV = "TRITON_VLM_CPU_GEMV_FP8"
PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"
NEW = 8


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    from conftest import _start_server, _stop_server

    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint

    path = ensure_fp8_checkpoint("llava", "fp8-block")
    old = os.environ.get(FP8_ENV)
    os.environ[FP8_ENV] = "1"  # the FP8 gemv wherever it builds and checks, whatever a race on a loaded box says
    try:
        server = _start_server(tmp_path_factory, path, {}, "fp8")
    finally:
        os.environ.pop(FP8_ENV) if old is None else os.environ.__setitem__(FP8_ENV, old)
    yield server
    _stop_server(server)


@pytest.fixture(scope="module")
def fp8_ref(fp8_server):
    from transformers import AutoProcessor

    return _reference(fp8_server.model_path, "fp8-block"), AutoProcessor.from_pretrained(str(fp8_server.model_path))


def _image(seed: int) -> bytes:
    import io

    from triton_vlm.demo.shapes import draw

    buf = io.BytesIO()
    draw(("circle", "square", "triangle")[seed % 3], ("red", "blue", "green")[seed % 3],
         rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


@torch.no_grad()
def _hf(model, processor, image: bytes, **kw) -> list[list[int]]:
    import io

    from PIL import Image

    x = processor(text=PROMPT, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    if kw.get("do_sample"):
        torch.manual_seed(kw.pop("seed"))
    out = model.generate(**x, max_new_tokens=NEW, **kw)
    eos = model.generation_config.eos_token_id
    rows = out[:, x["input_ids"].shape[1]:].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


@pytest.mark.server
def test_server_on_block_fp8_equals_transformers_dequantized(fp8_server, fp8_ref, tmp_path):
    from triton_vlm_client import VLMClient

    model, processor = fp8_ref
    img = _image(1)
    with VLMClient(fp8_server.grpc_url, protocol="grpc", timeout=120) as c:
        greedy = c.generate(PROMPT, [img], max_tokens=NEW).output_ids
        assert greedy == _hf(model, processor, img, do_sample=False)
        beams = c.generate(PROMPT, [_image(2)], max_tokens=NEW, beam_width=3, num_return_sequences=3).output_ids
        assert beams == _hf(model, processor, _image(2), num_beams=3, num_return_sequences=3, do_sample=False)
        sampled = c.generate(PROMPT, [img], max_tokens=NEW, temperature=1.3, top_k=20, seed=4321).output_ids
        assert sampled == _hf(model, processor, img, do_sample=True, temperature=1.3, top_k=20, top_p=1.0,
                              seed=4321)
        adapter = _random_adapter(fp8_server.model_path, tmp_path / "adapter")
        lora = c.generate(PROMPT, [img], max_tokens=NEW, lora_task_id=38, lora_dir=str(adapter)).output_ids
    assert _ignoring_scales(model, fp8_server.model_path, processor, img) != greedy, "the scales must matter"
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(_reference(fp8_server.model_path, "fp8-block"), str(adapter)).eval()
    want = _hf(adapted, processor, img, do_sample=False)
    assert want != greedy and lora == want
    log = Path(fp8_server.log_file).read_text(errors="replace")
    if "fp8 decode gemv kernel not used" not in log:  # (a machine without it serves the dequantized weights)
        assert "fp8 decode gemv kernel on" in log and "kept in e4m3" in log, log[-3000:]


def _random_adapter(path, out):
    """A PEFT LoRA on the language model (fp16-exact numbers: the wire carries FP16), saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(38)
    peft_model = get_peft_model(_reference(path, "fp8-block"), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_((p * (8.0 if "lora_B" in n else 1.0)).half().float())
    peft_model.save_pretrained(out)
    return out


@torch.no_grad()
def _ignoring_scales(model, path, processor, img) -> list[list[int]]:
    """The control: the same model with each quantized weight read as its raw e4m3 numbers (scales ignored)."""
    import copy

    from safetensors import safe_open

    from triton_vlm.weight_source import canonical_key, renames_for

    path, raw = Path(path), copy.deepcopy(model)
    rules = renames_for(json.loads((path / "config.json").read_text()))
    state = raw.state_dict()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            name = canonical_key(key, rules)
            if f.get_tensor(key).dtype == torch.float8_e4m3fn:
                state[name].copy_(f.get_tensor(key).float())
    return _hf(raw, processor, img, do_sample=False)


def test_models_card_says_which_weights_are_served(demo_model):
    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint
    from triton_vlm.openai.served import ServedModel

    card = ServedModel(ensure_fp8_checkpoint("llava", "fp8-block")).cards()[0]
    assert card["weights"] == "fp8-e4m3 (block 32x32 weight_scale_inv), computed as its float32 dequantization"
    assert ServedModel(ensure_fp8_checkpoint("qwen2_5_vl", "ct-tensor")).cards()[0]["weights"] == \
        "fp8-e4m3 (compressed-tensors, per-tensor weight_scale), computed as its float32 dequantization"
    assert ServedModel(demo_model).cards()[0]["weights"] == "unquantized"
