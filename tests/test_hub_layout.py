"""Checkpoints in the hub's layout (llava-hf's transformers-4 saves: `language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`, `image_newline`, in shards
with `model.safetensors.index.json`) load as transformers loads them: for both families (llava-1.5, LLaVA-NeXT),
both towers (CLIP, SigLIP) and the text models (Llama, Mistral, Qwen2 with tied embeddings).

In process: `demo.hub_layout.to_hub_layout` writes a copy that transformers loads bit for bit equal; the loader
names every tensor as transformers does in memory; the engine's and the vision tower's weights from the copy equal
those from the transformers-5 save; broken shards and ambiguous keys are refused clearly. Live: a server on a
hub-layout copy answers with transformers' `generate()` tokens on the same files: a LLaVA-NeXT with SigLIP, and
the demo model's copy quantized as Qwen's `-FP8` releases are laid out (block-wise e4m3 with `weight_scale_inv`,
the rest bf16, two shards: the hub renames apply to the scales across shards), against transformers loading it
with `FineGrainedFP8Config(dequantize=True)` in float32 (issue 38's live LLaVA-1.5 FP8 server): greedy, beams,
seeded sampling, a LoRA sent on the wire against PEFT on the dequantized model, the scales-ignored control, and
the precision its metrics and OpenAI `/v1/models` card say.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from llava_next_cases import pil, png
from triton_vlm_client import VLMClient

# name -> how the transformers-5 checkpoint is built
CASES = {
    "llava-mistral-clip": ("variant", dict(text="mistral", vision="clip", seed=3, vision_feature_layer=-2,
                                           vision_feature_select_strategy="default")),
    "llava-qwen2-siglip": ("variant", dict(text="qwen2", vision="siglip", seed=4)),  # tied, no lm_head saved
    "next-llama-clip": ("next", "llama"),
    "next-llama-siglip": ("next", "siglip"),
}


def _build(root: Path, name: str) -> Path:
    kind, arg = CASES[name]
    torch.set_num_threads(1)
    if kind == "variant":
        from triton_vlm.demo.variants import build_variant_llava

        return build_variant_llava(root / name, **arg)
    from llava_next_cases import build

    return build(root, arg)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (transformers-5 save, its hub-layout copy in 2 shards)."""
    from triton_vlm.demo.hub_layout import to_hub_layout

    root = tmp_path_factory.mktemp("hub-layout")
    out = {}
    for name in CASES:
        t5 = _build(root / "t5", name)
        out[name] = (t5, to_hub_layout(t5, root / "hub" / name, shards=2))
    return out


def _model_class(path: Path):
    import transformers

    return getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])


def _safetensors_keys(path: Path) -> list[str]:
    return list(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_loads_the_hub_copy_bit_for_bit(pairs, name):
    t5, hub = pairs[name]
    keys = _safetensors_keys(hub)
    assert not (hub / "model.safetensors").exists() and len(list(hub.glob("model-*-of-00002.safetensors"))) == 2
    assert any(k.startswith("vision_tower.vision_model.embeddings.") for k in keys)
    assert any(k.startswith("language_model.model.layers.") for k in keys)
    assert all(k.split(".")[0] in ("language_model", "vision_tower", "multi_modal_projector", "image_newline")
               for k in keys)
    cls = _model_class(t5)
    want = cls.from_pretrained(str(t5)).state_dict()
    model, info = cls.from_pretrained(str(hub), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", ["t5", "hub"])
@pytest.mark.parametrize("name", list(CASES))
def test_loader_names_every_tensor_as_transformers(pairs, name, layout):
    from triton_vlm.weight_source import TensorSource

    path = pairs[name][0 if layout == "t5" else 1]
    state = _model_class(path).from_pretrained(str(path)).state_dict()
    src = TensorSource(path)
    assert set(src.keys()) <= set(state), set(src.keys()) - set(state)
    tied = {"lm_head.weight"} if "lm_head.weight" not in src else set()
    assert set(state) - set(src.keys()) == tied
    assert all(torch.equal(src.get(k), state[k]) for k in src.keys())


# keys of every layout a LLaVA checkpoint has been saved in: the hub's (transformers 4), transformers 5's save,
# the in-memory names, LlavaModel's, the duplicate `.model.model` of some 5.x saves, a stray key
LAYOUT_KEYS = [
    "language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight",
    "language_model.model.embed_tokens.weight", "language_model.model.model.norm.weight",
    "vision_tower.vision_model.embeddings.patch_embedding.weight", "vision_tower.vision_model.post_layernorm.bias",
    "vision_tower.embeddings.patch_embedding.weight", "model.vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight",
    "model.vision_tower.embeddings.position_embedding.weight", "multi_modal_projector.linear_1.weight",
    "model.multi_modal_projector.linear_2.bias", "language_model.layers.1.self_attn.q_proj.bias",
    "model.language_model.model.layers.0.input_layernorm.weight", "model.language_model.norm.weight",
    "lm_head.weight", "image_newline", "model.image_newline", "vision_tower.vision_model.head.probe",
    "something.else",
]


@pytest.mark.parametrize("name", list(CASES))
def test_renames_are_transformers_own(pairs, name):
    """Every key layout is renamed exactly as transformers' own conversion mapping renames it for this model."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    from triton_vlm.weight_source import canonical_key, renames_for

    path = pairs[name][0]
    cls = _model_class(path)
    with torch.device("meta"):
        model = cls(cls.config_class.from_pretrained(str(path)))
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    rules = renames_for(json.loads((path / "config.json").read_text()))
    meta = model.state_dict()
    for key in LAYOUT_KEYS:
        want, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        assert canonical_key(key, rules) == want, key


@pytest.mark.parametrize("name", list(CASES))
def test_engine_and_vision_weights_equal_the_transformers5_save(pairs, name):
    from triton_vlm.engine.model.weights import load_config, load_weights
    from triton_vlm.families import family_of
    from triton_vlm.spec import CheckpointSpec
    from triton_vlm.vision.encoder import VisionEncoder
    from triton_vlm.vision.export import checkpoint_key
    from triton_vlm.weight_source import TensorSource

    t5, hub = pairs[name]
    cfg = load_config(hub)
    a, b = load_weights(t5, cfg), load_weights(hub, cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    enc_t5, enc_hub = VisionEncoder(t5), VisionEncoder(hub)
    pv = torch.randn(3, 3, enc_t5.image_size, enc_t5.image_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(enc_t5(pv), enc_hub(pv))
    family = family_of(CheckpointSpec.load(hub))
    if family.name == "llava_next":  # the row separator, `image_newline` in the hub's layout
        t5_packer, hub_packer = (family.packer(CheckpointSpec.load(p), TensorSource(p)) for p in (t5, hub))
        assert torch.equal(t5_packer.newline, hub_packer.newline)
    assert checkpoint_key(t5, "float32") == checkpoint_key(hub, "float32")  # one ONNX export serves both


@pytest.mark.parametrize("shards", [1, 3, 7])
def test_any_shard_count_reads_the_same_tensors(pairs, tmp_path, shards):
    from triton_vlm.demo.hub_layout import to_hub_layout
    from triton_vlm.weight_source import TensorSource

    t5 = pairs["next-llama-clip"][0]
    d = to_hub_layout(t5, tmp_path / "h", shards=shards)
    files = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert files == {f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)}
    a, b = TensorSource(t5), TensorSource(d)
    assert sorted(a.keys()) == sorted(b.keys()) and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_missing_shard_is_refused_by_name(pairs, tmp_path):
    from triton_vlm.spec import CheckpointError
    from triton_vlm.weight_source import TensorSource

    d = _copy(pairs["llava-mistral-clip"][1], tmp_path / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002.safetensors' named by "
                                              r"model.safetensors.index.json is missing"):
        TensorSource(d)


def test_an_index_key_its_shard_lacks_is_refused(pairs, tmp_path):
    from triton_vlm.spec import CheckpointError
    from triton_vlm.weight_source import TensorSource

    d = _copy(pairs["llava-mistral-clip"][1], tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = next(k for k, f in index["weight_map"].items() if f.startswith("model-00001"))
    index["weight_map"][key] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"puts tensor '{key}' in 'model-00002-of-00002.safetensors', "
                                              "which does not hold it"):
        TensorSource(d)


def test_two_keys_for_one_tensor_are_refused(pairs, tmp_path):
    from safetensors.torch import load_file, save_file

    from triton_vlm.spec import CheckpointError
    from triton_vlm.weight_source import TensorSource

    d = _copy(pairs["llava-mistral-clip"][0], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["language_model.lm_head.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'language_model.lm_head.weight' and 'lm_head.weight' both load as "
                                              "'lm_head.weight'"):
        TensorSource(d)


def test_no_lm_head_without_tied_embeddings_is_refused(pairs, tmp_path):
    """transformers would start such an lm_head from random values; the engine refuses instead of guessing."""
    from safetensors.torch import load_file, save_file

    from triton_vlm.engine.model.weights import load_config, load_weights
    from triton_vlm.spec import CheckpointError

    d = _copy(pairs["llava-mistral-clip"][0], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["language_model.lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no lm_head.weight and tie_word_embeddings is false"):
        load_weights(d, load_config(d))


# --- live: a server on hub-layout copies ---------------------------------------------------------------------
PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"
TWO = "USER: <image>\nWhat is this? <image>\nAnd this? ASSISTANT:"
# llava-1.5 with CLIP (the trained demo, in block-wise FP8 as Qwen's releases), LLaVA-NeXT with SigLIP
LIVE = ["demo-fp8", "next-llama-siglip"]
FP8_ENVS = ("TRITON_VLM_CPU_GEMV_FP8", "TRITON_VLM_CPU_GEMV_BF16")  # e4m3 and bf16 kept as stored wherever built


@pytest.fixture(scope="module", params=LIVE)
def hub_server(request, tmp_path_factory):
    from conftest import _start_server, _stop_server

    from triton_vlm.demo.fp8_checkpoint import ensure_fp8_checkpoint

    if request.param == "demo-fp8":
        path = ensure_fp8_checkpoint("llava", "fp8-block", shards=2)
    else:
        path = request.getfixturevalue("pairs")[request.param][1]
    old = {env: os.environ.get(env) for env in (FP8_ENVS if request.param == "demo-fp8" else ())}
    os.environ.update({env: "1" for env in old})  # (no race on a loaded machine decides what the test serves)
    try:
        server = _start_server(tmp_path_factory, path, {}, f"hub-{request.param}")
    finally:
        for env, value in old.items():
            os.environ.pop(env) if value is None else os.environ.__setitem__(env, value)
    yield request.param, path, server
    _stop_server(server)


def _reference(name: str, path: Path):
    """transformers' model of the same files (an FP8 checkpoint: dequantized at load, in float32)."""
    if name == "demo-fp8":
        from test_quant_fp8 import _reference as fp8_reference

        return fp8_reference(path, "fp8-block")
    return _model_class(path).from_pretrained(str(path)).eval()


@torch.no_grad()
def _generate(model, processor, prompt: str, images: list[bytes], beams: int) -> list[list[int]]:
    """transformers' new tokens of each returned sequence, cut after the first eos (as the server returns them)."""
    x = processor(text=prompt, images=[pil(b) for b in images], return_tensors="pt")
    out = model.generate(**x, max_new_tokens=8, do_sample=False, num_beams=beams, num_return_sequences=beams)
    eos = model.generation_config.eos_token_id
    rows = out[:, x["input_ids"].shape[1]:].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


@pytest.mark.server
def test_server_on_a_hub_checkpoint_equals_generate(hub_server):
    from transformers import AutoProcessor

    from triton_vlm.demo.shapes import draw

    name, path, server = hub_server
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    processor = AutoProcessor.from_pretrained(str(path))
    model = _reference(name, path)
    cases = [(PROMPT, [png((48, 40), 1)], 1), (PROMPT, [png((30, 70), 2)], 3),
             (TWO, [png((64, 64), 3), png((90, 20), 4)], 2)]
    with VLMClient(server.grpc_url, protocol="grpc", timeout=120) as c:
        for prompt, images, beams in cases:
            res = c.generate(prompt, images, max_tokens=8, beam_width=beams, num_return_sequences=beams)
            assert res.output_ids == _generate(model, processor, prompt, images, beams), (name, prompt[:20], beams)
        if name == "demo-fp8":  # the trained model still sees through its hub-layout FP8 weights
            buf = io.BytesIO()
            draw("circle", "red", rng=1).save(buf, "PNG")
            assert c.generate(PROMPT, [buf.getvalue()], max_tokens=6).text.strip() == "a red circle"


@pytest.mark.server
@pytest.mark.parametrize("hub_server", ["demo-fp8"], indirect=True)  # (the module's one FP8 server)
def test_fp8_server_samples_adapts_and_says_its_precision_as_transformers_dequantized(hub_server, tmp_path):
    """Seeded sampling and a LoRA sent on the wire (adapters fp32 on the FP8 base) equal transformers / PEFT on the
    dequantized model; the same files with their scales ignored give other tokens; the metrics and the OpenAI
    card (official client) say the weights are e4m3 block-wise, computed in float32, held as stored."""
    import urllib.request

    from peft import PeftModel
    from test_openai import Running
    from test_quant_fp8 import PROMPT as Q, _hf, _image, expected_held, random_adapter, scales_ignored
    from transformers import AutoProcessor

    from triton_vlm.openai import FrontendConfig

    name, path, server = hub_server
    model, processor = _reference(name, path), AutoProcessor.from_pretrained(str(path))
    adapter = random_adapter(path, tmp_path / "adapter")
    img = _image(1)
    with VLMClient(server.grpc_url, protocol="grpc", timeout=120) as c:
        greedy = c.generate(Q, [img], max_tokens=8).output_ids
        sampled = c.generate(Q, [img], max_tokens=8, temperature=1.3, top_k=20, seed=4321).output_ids
        lora = c.generate(Q, [img], max_tokens=8, lora_task_id=38, lora_dir=str(adapter)).output_ids
    assert greedy == _hf(model, processor, img, do_sample=False)
    assert sampled == _hf(model, processor, img, do_sample=True, temperature=1.3, top_k=20, top_p=1.0, seed=4321)
    adapted = PeftModel.from_pretrained(_reference(name, path), str(adapter)).eval()
    want = _hf(adapted, processor, img, do_sample=False)
    assert want != greedy and lora == want
    assert _hf(scales_ignored(model, path), processor, img, do_sample=False) != greedy, "the scales must matter"

    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    [info] = [line for line in metrics.splitlines() if line.startswith("triton_vlm_engine_weights_info{")]
    weights = "fp8-e4m3 (block 32x32 weight_scale_inv), computed as its float32 dequantization"
    held = expected_held(Path(server.log_file).read_text(errors="replace"))
    assert f'weights="{weights}"' in info and f'held="{held}"' in info and info.endswith(" 1"), (info, held)
    fe = Running(FrontendConfig(triton=server.grpc_url, triton_metrics_url=server.metrics_url))
    try:
        client = fe.client()
        [card] = [m for m in client.models.list().data if m.model_extra["parent"] is None]
        assert card.id == path.name and card.model_extra["weights"] == weights and card.model_extra["held"] == held
        assert client.models.retrieve(path.name).model_extra["held"] == held
    finally:
        fe.stop()
