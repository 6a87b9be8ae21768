"""Offline builders for tiny LLaVA checkpoints of other text models and vision towers (random weights).

`build_variant_llava(out_dir, text=..., vision=...)` saves a `LlavaForConditionalGeneration` checkpoint with:
- text "llama" (the demo's), "mistral" (optionally with `sliding_window`) or "qwen2" (q/k/v biases, rope theta
  1e6, tied embeddings by default, and a Qwen2 tokenizer as llava-interleave-qwen ships it: byte-level BPE with
  Qwen's pre-tokenizer, no BOS, `<|im_end|>` the end of a turn and the eos, `<|endoftext|>` the pad, `<image>`
  an added special token);
- vision "clip" (the demo's `CLIPImageProcessorPil`, squashed to a square) or "siglip" (no class token;
  `SiglipImageProcessorPil`: resize to the square size, rescale, normalise by 0.5).
Nothing touches the network; the weights are seeded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    MistralConfig,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from .checkpoint import DEFAULT_TEXTS, IMAGE, build_tokenizer, save_checkpoint

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2's, ids 0..2 here
# llava-interleave-qwen's chat template (its processor's), shortened to text and image parts
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
TEXT_MODELS = ("llama", "mistral", "qwen2")
VISION_TOWERS = ("clip", "siglip")


def build_qwen2_tokenizer(texts: Optional[Iterable[str]] = None, vocab_size: int = 512,
                          extra: Optional[list[str]] = None) -> Qwen2Tokenizer:
    """A Qwen2 tokenizer (the class llava-interleave-qwen ships) over a BPE trained offline on `texts`; `extra`:
    the added special tokens after Qwen's own (default: llava-interleave-qwen's `<image>`)."""
    extra = [IMAGE] if extra is None else extra
    texts = list(texts) if texts else list(DEFAULT_TEXTS) + ["<|im_start|>user\nHi<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 256 + len(QWEN_SPECIALS)), special_tokens=QWEN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    vocab = tok.get_vocab()
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    qwen = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>",
                          extra_special_tokens={"image_token": IMAGE} if IMAGE in extra else {},
                          clean_up_tokenization_spaces=False)
    qwen.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:] + extra})
    return qwen


def _text_config(text: str, tok, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 max_pos: int, sliding_window: Optional[int], tie: bool):
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_pos, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=tie)
    if text == "llama":
        return LlamaConfig(**common)
    if text == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    if text == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                           max_window_layers=layers // 2, rms_norm_eps=1e-6)
    raise ValueError(f"text must be one of {TEXT_MODELS}, got {text!r}")


def _vision(vision: str, *, image_size: int, patch_size: int, hidden: int, layers: int, heads: int,
            intermediate: int):
    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, image_size=image_size, patch_size=patch_size)
    square = {"height": image_size, "width": image_size}
    if vision == "clip":
        return (CLIPVisionConfig(**common, projection_dim=hidden),
                CLIPImageProcessorPil(size=square, crop_size=square, do_center_crop=False), 1)
    if vision == "siglip":
        return SiglipVisionConfig(**common), SiglipImageProcessorPil(size=square), 0
    raise ValueError(f"vision must be one of {VISION_TOWERS}, got {vision!r}")


def build_variant_objects(*, text: str = "qwen2", vision: str = "siglip", seed: int = 0, text_hidden: int = 64,
                          layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                          max_position_embeddings: int = 512, sliding_window: Optional[int] = None,
                          tie_word_embeddings: Optional[bool] = None, image_size: int = 32, patch_size: int = 8,
                          vision_hidden: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                          vision_intermediate: int = 64, vision_feature_select_strategy: str = "full",
                          vision_feature_layer: int = -1, vocab_texts: Optional[Iterable[str]] = None,
                          vocab_size: int = 512) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """(model, processor) of a random LLaVA with the given text model and vision tower (see the module doc)."""
    tok = build_qwen2_tokenizer(vocab_texts, vocab_size) if text == "qwen2" else \
        build_tokenizer(list(vocab_texts) if vocab_texts is not None else None, vocab_size)
    tie = (text == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    text_cfg = _text_config(text, tok, hidden=text_hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                            intermediate=intermediate, max_pos=max_position_embeddings,
                            sliding_window=sliding_window, tie=tie)
    vision_cfg, image_processor, extra = _vision(vision, image_size=image_size, patch_size=patch_size,
                                                 hidden=vision_hidden, layers=vision_layers, heads=vision_heads,
                                                 intermediate=vision_intermediate)
    n = (image_size // patch_size) ** 2 + extra - (1 if vision_feature_select_strategy == "default" else 0)
    config = LlavaConfig(vision_config=vision_cfg, text_config=text_cfg,
                         image_token_index=tok.convert_tokens_to_ids(IMAGE), image_seq_length=n,
                         vision_feature_select_strategy=vision_feature_select_strategy,
                         vision_feature_layer=vision_feature_layer, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random biases (transformers initialises them to zero): the test must see them
        for name, p in model.named_parameters():
            if name.endswith("proj.bias") and "language_model" in name:
                p.normal_(0.0, 0.05)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               num_additional_image_tokens=extra,
                               chat_template=QWEN_CHAT_TEMPLATE if text == "qwen2" else None)
    return model, processor


def build_variant_llava(out_dir: str | Path, **kw) -> Path:
    """Build and save (see `build_variant_objects`); returns the checkpoint directory."""
    model, processor = build_variant_objects(**kw)
    return save_checkpoint(model, processor, Path(out_dir))
