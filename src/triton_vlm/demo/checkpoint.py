"""Offline builders for tiny Hugging Face LLaVA checkpoints (tokenizer, processor, random weights).

Nothing here touches the network: the tokenizer is a byte-level BPE trained on the given texts, the image
processor is a `CLIPImageProcessorPil` (torchvision is not installed), the model is randomly initialised
from a fixed seed.

Image processor choice: `size={"height": S, "width": S}` with `do_center_crop=False`, i.e. every image is
squashed to S x S whatever its aspect ratio. Nothing is ever cropped away (a shape near an edge survives),
and the number of image tokens is fixed: (S // patch) ** 2 (+1 CLS, -1 with the "default" strategy).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from triton_vlm.errors import InvalidArgument
from triton_vlm.spec import image_token_count

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IMAGE]  # ids 0..4 in this order

# A little default text so a tokenizer trained without vocab_texts still has sensible merges.
DEFAULT_TEXTS = [
    "USER: <image>\nWhat is in the picture? ASSISTANT: a cat sitting on a mat.",
    "USER: Say hello. ASSISTANT: hello",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "red green blue yellow circle square triangle shape color image describe",
]

# llava-1.5's chat template (llava-hf/llava-1.5-7b-hf chat_template.json), the format the demo model is trained on:
# [image, "What color is the shape?"] + generation prompt -> "USER: <image>\nWhat color is the shape? ASSISTANT:".
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tokenizer(texts: list[str] | None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained offline on `texts`; encoding adds `<s>` first; `<image>` is special.

    Any unicode text round-trips (the 256 byte symbols are always in the alphabet).
    """
    texts = list(texts) if texts else list(DEFAULT_TEXTS)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return fast


def _set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def make_llava_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    text_hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    image_size: int,
    patch_size: int,
    vision_hidden: int,
    vision_layers: int,
    vision_heads: int,
    vision_intermediate: int,
    max_position_embeddings: int,
    vision_feature_select_strategy: str,
    vision_feature_layer: int,
    tie_word_embeddings: bool,
) -> LlavaConfig:
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    n_tokens = (image_size // patch_size) ** 2 + (0 if vision_feature_select_strategy == "default" else 1)
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=vision_intermediate,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        image_seq_length=n_tokens,
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer,
        tie_word_embeddings=tie_word_embeddings,
    )


def make_processor(tokenizer: PreTrainedTokenizerFast, *, image_size: int, patch_size: int,
                   vision_feature_select_strategy: str) -> LlavaProcessor:
    image_processor = CLIPImageProcessorPil(
        size={"height": image_size, "width": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=False,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS token
        chat_template=CHAT_TEMPLATE,
    )


def save_checkpoint(model: LlavaForConditionalGeneration, processor: LlavaProcessor, out_dir: Path) -> Path:
    """save_pretrained the model, processor and a generation config with bos/eos/pad ids."""
    tok = processor.tokenizer
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False, max_new_tokens=16,
    )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_random_llava(
    out_dir: str | Path,
    *,
    text_hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    vision_intermediate: int = 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vision_feature_select_strategy: str = "default",
    vision_feature_layer: int = -2,
    tie_word_embeddings: bool = False,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build and save a randomly initialised (seeded, deterministic) LLaVA checkpoint; return its dir.
    `tokenizer` (default: a byte-level BPE trained on `vocab_texts`) must have the `SPECIAL_TOKENS`."""
    model, processor = build_random_llava_objects(
        text_hidden=text_hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vocab_texts=vocab_texts, vocab_size=vocab_size, image_size=image_size, patch_size=patch_size,
        vision_hidden=vision_hidden, vision_layers=vision_layers, vision_heads=vision_heads,
        vision_intermediate=vision_intermediate, max_position_embeddings=max_position_embeddings, seed=seed,
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer, tie_word_embeddings=tie_word_embeddings, tokenizer=tokenizer,
    )
    return save_checkpoint(model, processor, Path(out_dir))


def build_random_llava_objects(
    *,
    text_hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    vision_intermediate: int = 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vision_feature_select_strategy: str = "default",
    vision_feature_layer: int = -2,
    tie_word_embeddings: bool = False,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """Same as build_random_llava but returns the in-memory (model, processor) without saving."""
    if image_size % patch_size:
        raise InvalidArgument(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    if heads % kv_heads:
        raise InvalidArgument(f"heads {heads} must be a multiple of kv_heads {kv_heads}")
    if tokenizer is None:
        tokenizer = build_tokenizer(list(vocab_texts) if vocab_texts is not None else None, vocab_size)
    config = make_llava_config(
        tokenizer, text_hidden=text_hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, image_size=image_size, patch_size=patch_size, vision_hidden=vision_hidden,
        vision_layers=vision_layers, vision_heads=vision_heads, vision_intermediate=vision_intermediate,
        max_position_embeddings=max_position_embeddings,
        vision_feature_select_strategy=vision_feature_select_strategy,
        vision_feature_layer=vision_feature_layer, tie_word_embeddings=tie_word_embeddings,
    )
    _set_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    processor = make_processor(tokenizer, image_size=image_size, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy)
    return model, processor


def num_image_tokens(config: LlavaConfig) -> int:
    """Image placeholder tokens per image the model expects for `config` (`spec.image_token_count`; the demo's
    tower is CLIP, one CLS token)."""
    v = config.vision_config
    return image_token_count((v.image_size, v.image_size), v.patch_size, 1, config.vision_feature_select_strategy)


