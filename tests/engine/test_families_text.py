"""Other text models and vision towers in `LlavaForConditionalGeneration`, token for token against transformers.

Tiny random checkpoints built offline (`demo/variants.py`), CPU fp32: Qwen2 text (q/k/v biases, rope theta 1e6,
tied embeddings, its own tokenizer without BOS) with a CLIP tower; Llama with a SigLIP tower (no class token,
SiglipImageProcessor, strategy "full" at layer -1 and "default" at -2); Mistral with a `sliding_window` shorter
than the prompt. For each: the prompt ids and pixels as the checkpoint's own processor makes them (ours must
give the same), the image features from our vision encoder, then the engine's greedy and beam-3 tokens and beam
scores must equal `generate()` with `pixel_values`.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from triton_vlm.demo.checkpoint import save_checkpoint
from triton_vlm.demo.variants import build_variant_objects
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.params import GenerationParams, GenerationRequest
from triton_vlm.spec import CheckpointSpec

TOL = 1e-4
PROMPT = "USER: <image>\nWhat is in the picture and what color is it? ASSISTANT:"
QWEN_PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture and what color is it?<|im_end|>\n" \
              "<|im_start|>assistant\n"


def _spread(model) -> None:
    """Spread the logits so greedy paths are varied and near-ties rare: the lm_head (untied), else every
    projection of the language model (tied: a larger lm_head would also scale the input embeddings)."""
    with torch.no_grad():
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.mul_(30.0)
            return
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(6.0)


def _build(tmp_path_factory, name: str, **kw):
    torch.set_num_threads(1)
    model, processor = build_variant_objects(max_position_embeddings=160, **kw)
    _spread(model)
    return model, processor, save_checkpoint(model, processor, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def qwen2_clip(tmp_path_factory):
    return _build(tmp_path_factory, "qwen2-clip", text="qwen2", vision="clip", seed=2,
                  vision_feature_select_strategy="default", vision_feature_layer=-2)


@pytest.fixture(scope="module")
def llama_siglip(tmp_path_factory):
    return _build(tmp_path_factory, "llama-siglip", text="llama", vision="siglip", seed=3)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    return _build(tmp_path_factory, "mistral-window", text="mistral", vision="clip", seed=4, sliding_window=8,
                  vision_feature_select_strategy="default", vision_feature_layer=-2)


def _image(seed: int, size=(40, 28)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _inputs(processor, path, prompt: str, images):
    """(ids, pixel_values, image features) as transformers' processor and our vision encoder compute them; our
    preprocess must give the same ids and pixels."""
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.vision.encoder import VisionEncoder

    hf = processor(text=prompt, images=images, return_tensors="pt")
    ours = Preprocessor(path)(prompt, images=[_png(i) for i in images], max_tokens=8)
    assert ours.input_ids == hf["input_ids"][0].tolist()
    np.testing.assert_array_equal(ours.pixel_values, hf["pixel_values"].numpy())
    feats = VisionEncoder(path)(hf["pixel_values"])  # [images, T, hidden]
    return hf["input_ids"][0].tolist(), hf["pixel_values"], feats


def _engine_run(path, ids, feats, beam: int, max_tokens: int = 10):
    eng = Engine(path, EngineConfig(max_rows=8, kv_cache_tokens=1024, block_size=4, prefill_chunk=8))
    req = GenerationRequest(request_id=f"b{beam}", input_ids=ids, image_embeds=feats,
                            params=GenerationParams(max_tokens=max_tokens, beam_width=beam, num_return_sequences=beam))
    last = eng.generate([req])[req.request_id][-1]
    assert last.final and last.error is None, last.error
    return [(s.token_ids, s.cum_log_prob) for s in last.sequences], eng


def _hf_run(model, ids, pixel_values, beam: int, eos, max_tokens: int = 10):
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=pixel_values,
                             max_new_tokens=max_tokens, do_sample=False, num_beams=beam, num_return_sequences=beam,
                             eos_token_id=list(eos), output_scores=True, return_dict_in_generate=True)
    rows = []
    for i, row in enumerate(out.sequences[:, len(ids):].tolist()):
        cut = next((j + 1 for j, x in enumerate(row) if x in eos), len(row))
        score = float(out.sequences_scores[i]) if beam > 1 else 0.0
        rows.append((row[:cut], score))
    return rows


def _check_equal(got, want, beam: int) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    if beam > 1:
        for (_, a), (_, b) in zip(got, want):
            assert abs(a - b) < TOL, (a, b)


@pytest.mark.parametrize("beam", [1, 3])
def test_qwen2_text_with_clip_matches_generate(qwen2_clip, beam):
    model, processor, path = qwen2_clip
    spec = CheckpointSpec.load(path)
    assert spec.text.tie_word_embeddings and spec.text.rope["rope_theta"] == 1e6
    assert processor.tokenizer.bos_token_id is None  # Qwen2 adds no BOS; our preprocess must not either
    ids, pv, feats = _inputs(processor, path, QWEN_PROMPT, [_image(1)])
    got, eng = _engine_run(path, ids, feats, beam)
    want = _hf_run(model, ids, pv, beam, eng.eos_ids)
    _check_equal(got, want, beam)
    assert len(set(got[0][0])) > 2, "a degenerate path would hide differences"


def test_qwen2_biases_matter(qwen2_clip):
    """The q/k/v biases change the logits: dropping them would be caught by the comparisons above."""
    model, _, path = qwen2_clip
    eng = Engine(path, EngineConfig(max_rows=1, kv_cache_tokens=256, block_size=4))
    layer = eng.model.layers[0]
    # q/k/v run as one fused projection: its bias is theirs side by side; o_proj has none
    assert [m for m, _ in layer.qkv_proj.parts] == ["q_proj", "k_proj", "v_proj"]
    assert layer.qkv_proj.bias is not None and layer.qkv_proj.bias.abs().sum() > 0 and layer.o_proj.bias is None
    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        with_bias = model(input_ids=ids).logits[0, -1]
        saved = {n: p.clone() for n, p in model.named_parameters() if n.endswith("proj.bias")}
        for n, p in model.named_parameters():
            if n in saved:
                p.zero_()
        without = model(input_ids=ids).logits[0, -1]
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    assert (with_bias - without).abs().max() > 0.1


@pytest.mark.parametrize("beam", [1, 3])
def test_llama_with_siglip_matches_generate(llama_siglip, beam):
    model, processor, path = llama_siglip
    spec = CheckpointSpec.load(path)
    assert spec.vision.model_type == "siglip_vision_model" and spec.vision.select_strategy == "full"
    assert type(processor.image_processor).__name__.startswith("SiglipImageProcessor")
    prompt = "USER: <image>\nand <image>\nWhat is in the pictures? ASSISTANT:"
    ids, pv, feats = _inputs(processor, path, prompt, [_image(2), _image(3, (20, 50))])
    assert feats.shape[1] == (32 // 8) ** 2  # no class token: every patch is a feature
    got, eng = _engine_run(path, ids, feats, beam)
    _check_equal(got, _hf_run(model, ids, pv, beam, eng.eos_ids), beam)
    assert len(set(got[0][0])) > 2


def test_siglip_default_strategy_features_equal_transformers(tmp_path_factory):
    """"default" on a tower without a class token drops the first patch, as transformers' LLaVA does; the
    processor's placeholder count follows (num_additional_image_tokens 0)."""
    model, processor, path = _build(tmp_path_factory, "siglip-default", text="llama", vision="siglip", seed=6,
                                    vision_feature_select_strategy="default", vision_feature_layer=-2)
    ids, pv, feats = _inputs(processor, path, PROMPT, [_image(4)])
    with torch.no_grad():
        out = model.model.get_image_features(pv, vision_feature_layer=-2, vision_feature_select_strategy="default")
        want = torch.stack(list(out.pooler_output))
    assert feats.shape == want.shape and feats.shape[1] == (32 // 8) ** 2 - 1
    torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)
    assert ids.count(model.config.image_token_id) == feats.shape[1]


@pytest.mark.parametrize("beam", [1, 3])
def test_mistral_sliding_window_matches_generate(mistral_window, beam):
    model, processor, path = mistral_window
    spec = CheckpointSpec.load(path)
    assert spec.context_length == 160 and spec.text.layer_windows == (8, 8)  # the window masks, not shortens
    ids, pv, feats = _inputs(processor, path, PROMPT, [_image(5)])
    assert len(ids) > 3 * 8
    got, eng = _engine_run(path, ids, feats, beam, max_tokens=12)
    assert len(set(got[0][0])) > 2
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        _check_equal(got, _hf_run(model, ids, pv, beam, eng.eos_ids, max_tokens=12), beam)
    model.set_attn_implementation("sdpa")
    model.config.text_config.sliding_window = None  # the same weights without the window answer otherwise
    try:
        unwindowed = _hf_run(model, ids, pv, beam, eng.eos_ids, max_tokens=12)
    finally:
        model.config.text_config.sliding_window = 8
    assert [u[0] for u in unwindowed] != [g[0] for g in got]


def test_siglip_tower_through_onnxruntime(llama_siglip, tmp_path):
    """The exported vision graph (onnxruntime here, TensorRT's input on a GPU) equals the torch backend."""
    import onnxruntime as ort

    from triton_vlm.vision.encoder import VisionEncoder
    from triton_vlm.vision.export import export_onnx

    _, _, path = llama_siglip
    enc = VisionEncoder(path)
    session = ort.InferenceSession(str(export_onnx(path, tmp_path / "siglip.onnx")),
                                   providers=["CPUExecutionProvider"])
    pixels = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    out = session.run(None, {session.get_inputs()[0].name: pixels})[0]
    ref = enc(torch.from_numpy(pixels)).numpy()  # [3, 16, hidden]
    assert out.shape == ref.shape == (3, 16, 64) and np.abs(out - ref).max() <= 1e-4


def test_qwen2_sliding_layers_match_generate(tmp_path_factory):
    """Qwen2 with use_sliding_window: only the layers from max_window_layers on slide (layer_types)."""
    model, processor, path = _build(tmp_path_factory, "qwen2-window", text="qwen2", vision="clip", seed=8,
                                    sliding_window=8, vision_feature_select_strategy="default",
                                    vision_feature_layer=-2)
    assert CheckpointSpec.load(path).text.layer_windows == (0, 8)
    ids, pv, feats = _inputs(processor, path, QWEN_PROMPT, [_image(6)])
    got, eng = _engine_run(path, ids, feats, 1, max_tokens=12)
    _check_equal(got, _hf_run(model, ids, pv, 1, eng.eos_ids, max_tokens=12), 1)
    assert len(set(got[0][0])) > 2
    full = Engine(path, EngineConfig(max_rows=1, kv_cache_tokens=1024, block_size=4))
    for layer in full.model.layers:  # the same weights without the window answer otherwise: the window mattered
        layer.window = 0
    req = GenerationRequest(request_id="full", input_ids=ids, image_embeds=feats,
                            params=GenerationParams(max_tokens=12))
    assert full.generate([req])["full"][-1].sequences[0].token_ids != got[0][0]
