"""Offline builders for tiny Qwen2-VL / Qwen2.5-VL checkpoints (random weights), laid out as the hub's are.

`build_qwen_vl(out_dir, kind="qwen2_vl" | "qwen2_5_vl")` saves:
- `config.json` of `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` (M-RoPE's
  `mrope_section` in the text config's rope parameters; the vision tower with 14-px patches, temporal patches of 2,
  a 2x2 merger; Qwen2.5-VL's windowed attention with one full-attention layer);
- the weights in the hub's transformers-4 key layout (`model.layers.*`, `visual.*`, `lm_head`: what the hub's
  Qwen2-VL checkpoints hold), optionally in shards;
- a Qwen2 tokenizer (byte-level BPE trained offline) with the family's special tokens (`<|im_start|>`,
  `<|im_end|>`, `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`), its chat template (the
  real one's format: `<|vision_start|><|image_pad|><|vision_end|>` per image);
- `preprocessor_config.json` of `Qwen2VLImageProcessor` (the PIL one is used: torchvision is not installed) with
  small `min_pixels` / `max_pixels`, and `video_preprocessor_config.json` (fps 2, frames 4..16);
- `generation_config.json` with the eos ids.
Nothing touches the network; the weights are seeded and scaled so random activations stay informative.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from transformers import GenerationConfig

from .variants import build_qwen2_tokenizer

KINDS = ("qwen2_vl", "qwen2_5_vl")
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_VL_SPECIALS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Qwen2-VL-Instruct's chat template, shortened (no tools): a system turn when none is given, images and videos as
# the vision markers in the order of the content parts
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VL_TEXTS = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is this?<|im_end|>",
            "a red square on a blue circle, describe the picture and the video frames",
            "The quick brown fox jumps over the lazy dog. 0123456789"]
PATCH, TEMPORAL, MERGE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64  # 4 .. 64 placeholder tokens per image


def qwen_tokenizer(texts: Optional[Iterable[str]] = None, vocab_size: int = 512):
    tok = build_qwen2_tokenizer(list(texts) if texts is not None else VL_TEXTS, vocab_size, QWEN_VL_SPECIALS)
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tok


def _configs(kind: str, tok, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
             max_pos: int, vision_hidden: int, vision_layers: int, vision_heads: int, mrope_section: list[int]):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig  # noqa: PLC0415

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
                tie_word_embeddings=False)
    common = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                  vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
                  tie_word_embeddings=False)
    if kind == "qwen2_vl":
        vision = dict(depth=vision_layers, embed_dim=vision_hidden, hidden_size=hidden, num_heads=vision_heads,
                      mlp_ratio=2, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                      in_channels=3, hidden_act="quick_gelu")
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    vision = dict(depth=vision_layers, hidden_size=vision_hidden, out_hidden_size=hidden, num_heads=vision_heads,
                  intermediate_size=2 * vision_hidden, patch_size=PATCH, temporal_patch_size=TEMPORAL,
                  spatial_merge_size=MERGE, window_size=56, fullatt_block_indexes=[vision_layers - 1],
                  in_channels=3, hidden_act="silu", tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)


def build_qwen_vl_model(kind: str = "qwen2_vl", *, seed: int = 0, text_hidden: int = 64, layers: int = 2,
                        heads: int = 4, kv_heads: int = 2, intermediate: int = 128, max_position_embeddings: int = 1024,
                        vision_hidden: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                        mrope_section: Optional[list[int]] = None, vocab_texts: Optional[Iterable[str]] = None,
                        vocab_size: int = 512):
    """(model, tokenizer) of a random Qwen2-VL / Qwen2.5-VL (see the module doc)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration  # noqa: PLC0415

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    tok = qwen_tokenizer(vocab_texts, vocab_size)
    head_dim = text_hidden // heads
    section = mrope_section or [head_dim // 8, (head_dim // 2 - head_dim // 8) // 2,
                                head_dim // 2 - head_dim // 8 - (head_dim // 2 - head_dim // 8) // 2]
    config = _configs(kind, tok, hidden=text_hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                      intermediate=intermediate, max_pos=max_position_embeddings, vision_hidden=vision_hidden,
                      vision_layers=vision_layers, vision_heads=vision_heads, mrope_section=section)
    torch.manual_seed(seed)
    cls = Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = cls(config).eval()
    with torch.no_grad():  # random biases (initialised to zero) and a livelier tower: the tests must see them
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif "visual" in name and p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: positions (M-RoPE) matter
                p.normal_(0.0, 0.25)
    return model, tok


def image_processor_config(kind: str) -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": PATCH,
            "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
            "processor_class": "Qwen2_5_VLProcessor" if kind == "qwen2_5_vl" else "Qwen2VLProcessor"}


def video_processor_config(kind: str) -> dict:
    return {**image_processor_config(kind), "video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0,
            "min_frames": 4, "max_frames": 16, "do_sample_frames": True,
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}


def build_qwen_vl(out_dir: str | Path, kind: str = "qwen2_vl", shards: int = 1, **kw) -> Path:
    """Build and save a hub-layout checkpoint directory (see the module doc); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = build_qwen_vl_model(kind, **kw)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=16)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_hub_weights(model, out, shards)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor_config(kind), indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(kind), indent=2))
    return out


# transformers-5 in-memory prefixes -> the hub's Qwen2-VL keys (transformers' own mapping, reversed)
HUB_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def hub_key(name: str) -> str:
    for new, old in HUB_PREFIXES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def save_hub_weights(model, out: Path, shards: int = 1) -> None:
    """The model's tensors under the hub's keys, in `shards` safetensors files (with an index when > 1)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from .hub_layout import _split  # noqa: PLC0415

    tensors = {hub_key(k): v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    weight_map = {}
    runs = _split(names, sizes, shards)
    for i, run in enumerate(runs, 1):
        fname = f"model-{i:05d}-of-{len(runs):05d}.safetensors"
        save_file({n: tensors[n] for n in run}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in run}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
