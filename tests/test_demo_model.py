"""Tests of the offline checkpoint builders and the trained demo model (triton_vlm.demo)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from triton_vlm.demo.checkpoint import build_random_llava, build_tokenizer, num_image_tokens

torch.set_num_threads(1)


# ---------------------------------------------------------------- step 1: builders


def test_tokenizer_round_trips_unicode_and_adds_bos():
    tok = build_tokenizer(["hello world", "USER: <image>\nhi ASSISTANT: hello"], vocab_size=300)
    assert tok("hi").input_ids[0] == tok.bos_token_id
    assert tok("hi", add_special_tokens=False).input_ids[0] != tok.bos_token_id
    for text in ["héllo wörld", "日本語 🙂👍🏽 emoji", "tabs\tand\nnewlines  spaces", ""]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    image_id = tok.convert_tokens_to_ids("<image>")
    assert tok("a <image> b", add_special_tokens=False).input_ids.count(image_id) == 1
    assert {tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token} == {"<unk>", "<s>", "</s>", "<pad>"}


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    return build_random_llava(tmp_path_factory.mktemp("rl") / "ckpt", seed=7)


def test_random_llava_reloads_and_generates(random_ckpt):
    model = LlavaForConditionalGeneration.from_pretrained(random_ckpt).eval()
    processor = AutoProcessor.from_pretrained(random_ckpt)
    cfg = model.config
    assert cfg.text_config.num_key_value_heads < cfg.text_config.num_attention_heads  # GQA
    assert model.generation_config.eos_token_id == processor.tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == processor.tokenizer.pad_token_id
    for size in [(24, 24), (64, 48), (200, 120)]:
        img = Image.new("RGB", size, "white")
        enc = processor(text="USER: <image>\nHi ASSISTANT:", images=img, return_tensors="pt")
        assert enc.input_ids[0, 0].item() == processor.tokenizer.bos_token_id
        assert int((enc.input_ids == cfg.image_token_id).sum()) == num_image_tokens(cfg) == 16
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
        assert enc.input_ids.shape[1] < out.shape[1] <= enc.input_ids.shape[1] + 4
        assert torch.equal(out[0, : enc.input_ids.shape[1]], enc.input_ids[0])


def test_random_llava_is_deterministic(random_ckpt, tmp_path):
    again = build_random_llava(tmp_path / "again", seed=7)
    other = build_random_llava(tmp_path / "other", seed=8)
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(random_ckpt)
    assert digest(other) != digest(random_ckpt)


# ---------------------------------------------------------------- step 2: the trained demo model

from triton_vlm.demo import shapes  # noqa: E402
from triton_vlm.demo.build import (  # noqa: E402
    DEMO_VERSION, MIN_COLOR, MIN_DESCRIBE, MIN_SHAPE, ensure_demo_model, file_sha256, read_info)
from triton_vlm.demo.evaluate import (  # noqa: E402
    ask, ask_text, evaluate, evaluate_text_only, evaluate_two_images)
from triton_vlm.demo.train import Recipe, train  # noqa: E402

TEST_SIZES = [(24, 24), (64, 48), (200, 120), (32, 80), (100, 100), (48, 64)]


@pytest.fixture(scope="module")
def demo():
    path = ensure_demo_model()
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    return path, model, processor


def test_demo_info_matches_files(demo):
    path, model, _ = demo
    info = read_info(path)
    assert path.name == DEMO_VERSION == info["version"]
    assert info["weights_sha256"] == file_sha256(path / "model.safetensors")
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    acc = info["held_out_accuracy"]
    assert acc["color"] >= MIN_COLOR and acc["shape"] >= MIN_SHAPE and acc["describe"] >= MIN_DESCRIBE
    assert info["build_seconds"] > 0 and info["size_bytes"] > 0
    cfg = model.config.text_config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA


def test_demo_held_out_accuracy(demo):
    _, model, processor = demo
    acc = evaluate(model, processor, n=60, seed=2024, sizes=TEST_SIZES)
    assert acc.color >= 0.95, acc.failures
    assert acc.shape >= 0.90, acc.failures
    assert acc.describe >= 0.90, acc.failures


def test_demo_same_answers_at_different_sizes(demo):
    _, model, processor = demo
    rng = __import__("random").Random(77)
    base = [(shapes.draw(s, c, (120, 120), rng), s, c) for s in shapes.SHAPES for c in shapes.COLORS]
    consistent = correct = 0
    for q in shapes.QUESTIONS:
        per_size = [ask(model, processor, q, [img.resize(size) for img, _, _ in base]) for size in TEST_SIZES]
        for i, (_, s, c) in enumerate(base):
            answers = {per_size[k][i] for k in range(len(TEST_SIZES))}
            consistent += len(answers) == 1
            correct += answers == {shapes.answer(q, s, c)}
    total = len(base) * len(shapes.QUESTIONS)
    assert consistent >= 0.9 * total, (consistent, total)
    assert correct >= 0.9 * total, (correct, total)


def test_demo_answers_then_stops(demo):
    _, model, processor = demo
    img = shapes.draw("triangle", "blue", (64, 48), 5)
    enc = processor(text=shapes.prompt(shapes.QUESTION_DESCRIBE), images=img, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    new = out[0, enc.input_ids.shape[1]:].tolist()
    assert new[-1] == processor.tokenizer.eos_token_id and len(new) < 10
    assert processor.decode(new, skip_special_tokens=True) == " a blue triangle"


def test_demo_text_only_and_two_images(demo):
    _, model, processor = demo
    assert ask_text(model, processor, "Say hello.") == " hello"
    assert ask_text(model, processor, "What shapes do you know?") == " circle square triangle"
    assert evaluate_text_only(model, processor) == 1.0
    assert evaluate_two_images(model, processor, n=24, seed=99) >= 0.9
    # processor expands each <image> separately; two images -> two blocks of placeholders
    imgs = [shapes.draw("circle", "red", (64, 64), 1), shapes.draw("square", "blue", (48, 80), 2)]
    enc = processor(text=shapes.prompt("What color is the second shape?", 2), images=imgs, return_tensors="pt")
    assert int((enc.input_ids == model.config.image_token_id).sum()) == 2 * num_image_tokens(model.config)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert processor.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True) == " blue"


def test_draw_any_size_and_rejects_bad_input():
    from triton_vlm.errors import InvalidArgument

    for size in [(24, 24), (64, 48), (200, 120), (8, 300)]:
        img = shapes.draw("triangle", "green", size, 0)
        assert img.size == size and img.mode == "RGB"
        colors = {c for _, c in img.getcolors(1 << 16)}
        assert colors == {(255, 255, 255), shapes.COLORS["green"]}  # white + one filled shape, nothing else
    assert shapes.draw("circle", "red", (50, 40), 3).tobytes() == shapes.draw("circle", "red", (50, 40), 3).tobytes()
    for bad in [dict(shape="hexagon", color="red"), dict(shape="circle", color="pink")]:
        with pytest.raises(InvalidArgument):
            shapes.draw(size=(32, 32), **bad)
    with pytest.raises(InvalidArgument):
        shapes.draw("circle", "red", (4, 32))
    assert shapes.prompt(shapes.QUESTION_COLOR) == "USER: <image>\nWhat color is the shape? ASSISTANT:"
    assert shapes.answer(shapes.QUESTION_DESCRIBE, "circle", "red") == " a red circle"


def test_training_is_deterministic():
    """The full recipe is too slow to run twice here; a shortened one through the same code must repeat."""
    recipe = Recipe(vision_steps=8, steps=8, batch_size=8, warmup=2)

    def digest() -> str:
        model, _ = train(recipe, progress=False)
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    assert digest() == digest()
