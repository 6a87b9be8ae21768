"""LLaVA-NeXT in-process against transformers, stage by stage, on tiny random checkpoints of three shapes (Llama /
Mistral, CLIP + "default" / SigLIP + "full", one or two feature layers, three sets of pinpoints): tiles and
tokens per image size, preprocess against `LlavaNextProcessor`, the vision service (torch and onnxruntime,
tiles of several requests in calls that cut across images) against `get_image_features`, the engine's tokens
against `generate()` for images of every shape and several per prompt in one engine batch, beams 1-4;
truncation, limits, and what is refused."""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from llava_next_cases import SIZES, VARIANTS, Reference, build, png
from triton_vlm.errors import InvalidArgument
from triton_vlm.spec import CheckpointError

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
MULTI = "USER: <image>\nand <image> then<image><image>\nCompare them. ASSISTANT:"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-next")
    return {name: build(root, name) for name in VARIANTS}


@pytest.fixture(scope="module")
def refs(ckpts):
    return {name: Reference(d) for name, d in ckpts.items()}


IMAGES = {name: png(size, seed=i) for i, (name, size) in enumerate(SIZES.items())}


def _sizes(n: int = 150) -> list[tuple[int, int]]:
    rng = random.Random(0)
    extremes = [(1, 1), (1, 500), (500, 1), (2, 3), (16, 16), (32, 32), (64, 64), (96, 32), (32, 96), (31, 97),
                (1000, 999), (7, 1000)]
    return extremes + [(rng.randint(1, 600), rng.randint(1, 600)) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiles_and_tokens_equal_transformers(ckpts, refs, name):
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    from triton_vlm.preprocess.checkpoint import ModelInfo
    from triton_vlm.families.llava_next import select_best_resolution as ours

    info = ModelInfo.load(ckpts[name])
    layout, proc = info.layout, refs[name].processor
    assert info.pipeline == "llava_next" and not layout.fixed
    points = [list(p) for p in layout.pinpoints]
    drop = 1 if layout.strategy == "default" else 0
    counts = set()
    for size in _sizes():
        assert ours(size, layout.pinpoints) == tuple(select_best_resolution(size, points))
        assert layout.tiles(size) == image_size_to_num_patches(size, points, layout.tile)
        n = proc._get_number_of_features(*size, layout.tile, layout.tile) - drop
        assert info.image_tokens(size) == n, size
        assert n <= info.num_image_tokens == layout.max_tokens
        counts.add(n)
    assert len(counts) > 10, "the count depends on the image's size"
    assert layout.tokens(layout.largest_image) == layout.max_tokens


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_preprocess_equals_the_processor(ckpts, refs, name):
    from triton_vlm.preprocess.service import Preprocessor

    pre = Preprocessor(ckpts[name])
    images = [IMAGES[k] for k in ("wide", "tall", "tiny", "large")]
    out = pre(MULTI, images, max_tokens=8)
    ref = refs[name].inputs(MULTI, images)
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert out.image_sizes.tolist() == ref["image_sizes"].tolist()
    tiles = [pre.info.layout.tiles(tuple(s)) for s in out.image_sizes.tolist()]
    want = np.concatenate([ref["pixel_values"][i, :t].numpy() for i, t in enumerate(tiles)])
    assert out.pixel_values.shape == want.shape and len(set(tiles)) > 1
    np.testing.assert_allclose(out.pixel_values, want, atol=1e-6, rtol=0)
    again = pre(MULTI, images, max_tokens=8)  # from the preprocessed-image cache
    assert again.input_ids == out.input_ids and np.array_equal(again.pixel_values, out.pixel_values)
    assert pre.cache.hits == 4


def _service(model_dir, backend: str, max_batch: int, cache_mb: int = 0):
    from triton_vlm.vision.service import build as build_service

    return build_service(model_dir, {"vision_backend": backend, "max_images_per_forward": str(max_batch),
                                     "embedding_cache_mb": str(cache_mb)})


def _rows(pre, groups):
    from triton_vlm.vision.service import VisionInput

    outs = [pre(PROMPT.replace("<image>", "<image>" * len(g)) if g else "USER: hi ASSISTANT:", g, max_tokens=4)
            for g in groups]
    return outs, [VisionInput(o.pixel_values, o.image_sizes) for o in outs]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_vision_features_equal_get_image_features(ckpts, refs, name, backend):
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.triton.llm import unpad_images

    pre = Preprocessor(ckpts[name])
    groups = [[IMAGES["wide"], IMAGES["large"]], [], [IMAGES["tall"], IMAGES["wide"], IMAGES["sliver"]],
              [IMAGES["square"], IMAGES["tiny"]]]
    outs, rows = _rows(pre, groups)
    svc = _service(ckpts[name], backend, max_batch=3, cache_mb=64)
    got = svc.encode_rows(rows)
    assert svc.stats.images_encoded == 6  # "wide" twice in the batch: encoded once
    assert all(b <= 3 for b in svc.stats.take_batches())  # calls of 3 tiles cut across images and rows
    tol = 1e-5 if backend == "torch" else 1e-4
    for g, o, e in zip(groups, outs, got):
        assert e.lens == [pre.info.image_tokens(tuple(s)) for s in o.image_sizes.tolist()]
        if not g:
            assert e.embeds.shape[0] == 0
            continue
        want = refs[name].features(g)
        for i, w in enumerate(want):
            assert e.lens[i] == w.shape[0]
            torch.testing.assert_close(e.embeds[i, :e.lens[i]], w, atol=tol, rtol=0)
            assert not e.embeds[i, e.lens[i]:].any()  # padding
        packed = unpad_images(e.embeds, np.array(e.lens))
        assert packed.shape[0] == sum(e.lens) == int((np.array(o.input_ids) == pre.info.image_token_id).sum())
    cached = svc.encode_rows(rows)  # every image from the embedding cache now
    assert svc.stats.images_encoded == 6 and svc.cache.stats.hits >= 7
    for a, b in zip(got, cached):
        assert a.lens == b.lens and torch.equal(a.embeds, b.embeds)


def _engine_answers(d, cases, new: int) -> list[list[list[int]]]:
    """Each case's (prompt, images, beams) through preprocess, vision and the engine, all in one engine batch:
    the token ids of its `beams` returned sequences."""
    from triton_vlm.engine.engine import Engine
    from triton_vlm.params import GenerationParams, GenerationRequest
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.triton.llm import unpad_images
    from triton_vlm.vision.service import VisionInput

    pre, svc, engine = Preprocessor(d), _service(d, "torch", max_batch=8), Engine(d)
    outs, rows = [], []
    for prompt, images, _ in cases:
        o = pre(prompt, images, max_tokens=new)
        outs.append(o)
        rows.append(VisionInput(o.pixel_values, o.image_sizes))
    reqs = []
    for i, ((prompt, images, beams), o, e) in enumerate(zip(cases, outs, svc.encode_rows(rows))):
        feats = unpad_images(e.embeds, np.array(e.lens)) if e.lens else None
        reqs.append(GenerationRequest(f"r{i}", o.input_ids, GenerationParams(
            max_tokens=new, beam_width=beams, num_return_sequences=beams), image_embeds=feats))
    results = engine.generate(reqs)
    return [[list(s.token_ids) for s in results[f"r{i}"][-1].sequences] for i in range(len(cases))]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_engine_tokens_equal_generate(ckpts, refs, name):
    """Requests of every image shape, several images per prompt and none, beams 1-4, in one engine batch."""
    cases = [(PROMPT, [IMAGES[k]], 1 + i % 4) for i, k in enumerate(SIZES)]
    cases += [(MULTI, [IMAGES[k] for k in ("large", "tiny", "tall", "square")], 2),
              ("USER: Say hello. ASSISTANT:", [], 3)]
    got = _engine_answers(ckpts[name], cases, 10)
    for i, (prompt, images, beams) in enumerate(cases):
        want = refs[name].generate(prompt, images, 10, beams=beams, num_return_sequences=beams)
        assert got[i] == want, (name, i, prompt[:20], beams)
    assert len({tuple(g[0]) for g in got[:len(SIZES)]}) > 1, "the answers depend on the image"


# Text models of llama3-llava-next-8b (Llama with rope_scaling "llama3", its tokenizer's special tokens and two
# end tokens) and llava-v1.6-34b (Yi: LlamaForCausalLM, its own vocabulary, no BOS, ChatML), with their chat
# templates rendering the prompts through transformers' processor; peaked attention (qk_scale): positions, and so
# the rope, change the answers
TEXT_VARIANTS = {
    "llama3": dict(text_model="llama3", tower="clip", strategy="default", feature_layer=-2, seed=3, qk_scale=4.0),
    "yi": dict(text_model="yi", tower="clip", strategy="default", feature_layer=[-3, -1], tile=16, patch=4,
               grid=((2, 2), (1, 3), (3, 1)), seed=4, qk_scale=4.0),
}


def _chat_prompt(processor, question: str, n_images: int) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)


def _cut(rows: list[list[int]], ends: set[int]) -> list[list[int]]:
    """Each row up to and including its first end token (the server returns no more)."""
    return [next((r[:i + 1] for i, t in enumerate(r) if t in ends), r) for r in rows]


@pytest.mark.parametrize("name", sorted(TEXT_VARIANTS))
def test_llama3_and_yi_text_models_equal_generate(tmp_path_factory, name):
    """Prompts from the checkpoint's chat template; images of every shape, several in one prompt; beams 1 and 3."""
    from triton_vlm.demo.next_checkpoint import build_random_llava_next
    from triton_vlm.engine.model.model import rope_inv_freq
    from triton_vlm.spec import CheckpointSpec

    d = build_random_llava_next(tmp_path_factory.mktemp("next-text") / name, **TEXT_VARIANTS[name])
    ref = Reference(d)
    tok, spec = ref.processor.tokenizer, CheckpointSpec.load(d)
    ends = set(spec.eos_ids)
    one, multi = _chat_prompt(ref.processor, "What is this?", 1), _chat_prompt(ref.processor, "Compare them.", 3)
    if name == "llama3":
        assert spec.text.rope["rope_type"] == "llama3"
        assert not torch.equal(rope_inv_freq(spec.text.rope, spec.text.head_dim),
                               rope_inv_freq({"rope_theta": 500000.0}, spec.text.head_dim)), "the scaling bites"
        assert ends == {tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")}
        assert one.startswith("<|start_header_id|>user<|end_header_id|>\n\n<image>\n")
        assert ref.inputs(one, [IMAGES["wide"]])["input_ids"][0, 0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    else:
        assert ends == {tok.convert_tokens_to_ids("<|im_end|>")} and one.startswith("<|im_start|>user\n<image>\n")
        assert ref.inputs(one, [IMAGES["wide"]])["input_ids"][0, 0] == tok.convert_tokens_to_ids("<|im_start|>")
    cases = [(one, [IMAGES[k]], 1 if i % 2 else 3) for i, k in enumerate(SIZES)]
    cases += [(multi, [IMAGES[k] for k in ("large", "tiny", "tall")], 3),
              (multi, [IMAGES[k] for k in ("sliver", "square", "wide")], 1)]
    got = _engine_answers(d, cases, 10)
    for i, (prompt, images, beams) in enumerate(cases):
        x = ref.inputs(prompt, images)
        with torch.no_grad():
            out = ref.model.generate(**x, max_new_tokens=10, do_sample=False, num_beams=beams,
                                     num_return_sequences=beams)
        want = _cut(out[:, x["input_ids"].shape[1]:].tolist(), ends)
        assert got[i] == want, (name, i, [len(b) for b in images], beams)
    assert len({tuple(g[0]) for g in got[:len(SIZES)]}) > 1, "the answers depend on the image"


def test_truncation_drops_whole_images_with_their_true_counts(ckpts, refs):
    from triton_vlm.preprocess.service import Preprocessor

    d = ckpts["llama"]
    images = [IMAGES["large"], IMAGES["tiny"], IMAGES["wide"]]
    prompt = "USER: <image> A <image> B <image> C ASSISTANT:"
    full = refs["llama"].inputs(prompt, images)["input_ids"][0].tolist()
    info = Preprocessor(d).info
    counts = [info.image_tokens((s[1], s[0])) for s in (SIZES["large"], SIZES["tiny"], SIZES["wide"])]
    assert len(set(counts)) == 3 and full.count(info.image_token_id) == sum(counts)
    starts = [i for i, t in enumerate(full) if t == info.image_token_id and full[i - 1] != t]
    tail_two = len(full) - starts[1]  # the second image and everything after it
    pre = Preprocessor(d, context_length=1 + tail_two + 8)  # BOS + that + max_tokens
    out = pre(prompt, images, max_tokens=8)
    assert out.dropped_images == 1 and out.input_ids == [full[0]] + full[-tail_two:]
    assert out.image_sizes.tolist() == [[2, 3], [30, 120]]
    assert out.pixel_values.shape[0] == sum(info.layout.tiles(tuple(s)) for s in out.image_sizes.tolist())
    with pytest.raises(InvalidArgument, match=f"the last image alone takes {counts[2]} tokens"):
        Preprocessor(d, context_length=counts[2] + 8)("USER: hi <image>", [IMAGES["wide"]], max_tokens=8)


def test_image_count_and_pixel_caps_hold(ckpts):
    from triton_vlm.preprocess.service import Preprocessor

    pre = Preprocessor(ckpts["llama"], max_images=2, max_pixels=300 * 300)
    with pytest.raises(InvalidArgument, match="at most 2"):
        pre(MULTI, [IMAGES["tiny"]] * 4, max_tokens=4)
    with pytest.raises(InvalidArgument, match="too large: 400x260"):
        pre(PROMPT, [IMAGES["large"]], max_tokens=4)


def _variant(src, tmp_path, config=None, processor=None):
    d = tmp_path / "variant"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    for file, edit in (("config.json", config), ("processor_config.json", processor)):
        if edit:
            cfg = json.loads((d / file).read_text())
            edit(cfg)
            (d / file).write_text(json.dumps(cfg))
    return d


def test_unservable_checkpoints_are_refused_at_load(ckpts, tmp_path):
    from triton_vlm.preprocess.checkpoint import ModelInfo

    def full(c):
        c["vision_feature_select_strategy"] = "full"

    with pytest.raises(CheckpointError, match="leave 17 features per tile.*LlavaNextModel fails on this too"):
        ModelInfo.load(_variant(ckpts["llama"], tmp_path, config=full))
    shutil.rmtree(tmp_path / "variant")

    def other_points(c):
        c["image_grid_pinpoints"] = [[32, 64], [64, 32]]

    with pytest.raises(CheckpointError, match="image_grid_pinpoints .* differ from config.json's"):
        ModelInfo.load(_variant(ckpts["llama"], tmp_path, config=other_points))
    shutil.rmtree(tmp_path / "variant")

    def odd_points(c):
        c["image_grid_pinpoints"] = [[32, 50]]

    with pytest.raises(CheckpointError, match=r"\[\(32, 50\)\] are not positive multiples of .* 32"):
        ModelInfo.load(_variant(ckpts["llama"], tmp_path, config=odd_points))


def test_bad_vision_inputs_are_refused_alone(ckpts):
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.vision.service import VisionInput

    pre = Preprocessor(ckpts["llama"])
    o = pre(PROMPT, [IMAGES["wide"]], max_tokens=4)
    svc = _service(ckpts["llama"], "torch", 8)
    res = svc.encode_rows([VisionInput(o.pixel_values, None),
                           VisionInput(o.pixel_values[:-1], o.image_sizes),
                           VisionInput(o.pixel_values, np.array([[0, 5]], np.int32)),
                           VisionInput(o.pixel_values, np.array([1.5, 2.0])),
                           VisionInput(o.pixel_values, o.image_sizes, num_images=2),
                           VisionInput(o.pixel_values, o.image_sizes)])
    msgs = [str(r) if isinstance(r, Exception) else None for r in res]
    assert "'image_sizes' ([images, 2] height, width) is required" in msgs[0]
    assert f"has {o.pixel_values.shape[0] - 1} tiles; image_sizes [[30, 120]] take {o.pixel_values.shape[0]}" \
        in msgs[1]
    assert "sizes in [1, 1048576]" in msgs[2] and "must be [images, 2] integers" in msgs[3]
    assert "num_images 2 is outside [0, 1] (image_sizes rows)" in msgs[4]
    assert msgs[5] is None and res[5].lens == [pre.info.image_tokens((30, 120))]


def test_llm_checks_image_counts_both_ways(ckpts):
    from triton_vlm.engine.model.merge import merge_image_embeds
    from triton_vlm.triton.llm import unpad_images

    emb = torch.randn(2, 10, 8)
    packed = unpad_images(emb, np.array([10, 7]))
    assert packed.shape == (17, 8) and torch.equal(packed[10:], emb[1, :7])
    assert unpad_images(emb, np.array([10, 10])) is emb  # every image full: no copy (llava-1.5)
    for bad in ([10, 11], [3], [-1, 2]):
        with pytest.raises(InvalidArgument, match="image_feature_lens"):
            unpad_images(emb, np.array(bad))
    text = torch.zeros(20, 8)
    for n_placeholders, needle in ((16, "tokens: 16, features: 17"), (18, "tokens: 18, features: 17")):
        ids = torch.tensor([4] * n_placeholders + [1] * (20 - n_placeholders))
        with pytest.raises(InvalidArgument, match=needle):
            merge_image_embeds(ids, text, packed, 4)
    merged = merge_image_embeds(torch.tensor([1] + [4] * 17 + [1, 1]), text, packed, 4)
    assert torch.equal(merged[1:18], packed)


def test_hf_baseline_backend_loads_the_family_model(ckpts, refs):
    """The `hf` llm backend (the benchmark's baseline) runs LLaVA-NeXT checkpoints with our image features."""
    from triton_vlm.baseline.generate import HFGenerator
    from triton_vlm.params import GenerationParams, GenerationRequest
    from triton_vlm.preprocess.service import Preprocessor
    from triton_vlm.triton.llm import unpad_images
    from triton_vlm.vision.service import VisionInput

    d = ckpts["llama"]
    images = [IMAGES["wide"], IMAGES["tiny"], IMAGES["large"], IMAGES["tall"]]
    o = Preprocessor(d)(MULTI, images, max_tokens=8)
    e = _service(d, "torch", 8).encode_rows([VisionInput(o.pixel_values, o.image_sizes)])[0]
    gen = HFGenerator(d)
    assert type(gen.model).__name__ == "LlavaNextForConditionalGeneration"
    got = []
    gen.run(GenerationRequest("h", o.input_ids, GenerationParams(max_tokens=8, beam_width=2, num_return_sequences=2),
                              image_embeds=unpad_images(e.embeds, np.array(e.lens))), got.append)
    assert [list(s.token_ids) for s in got[-1].sequences] == refs["llama"].generate(MULTI, images, 8, beams=2,
                                                                                     num_return_sequences=2)
