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
