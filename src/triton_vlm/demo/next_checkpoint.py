"""Offline builder for tiny random LLaVA-NeXT checkpoints (`LlavaNextForConditionalGeneration` + its processor).

Shaped like llava-hf's llava-v1.6 checkpoints, scaled down: a CLIP tower (or SigLIP, which has no CLS token)
of `tile` x `tile` pixels, a text model, `image_grid_pinpoints` in multiples of the tile, the image processor of
llava-v1.6 (`size` shortest edge = tile, centre crop to the tile, the pinpoints) and a `LlavaNextProcessor` that
counts the CLS token (`num_additional_image_tokens`) as the hub's processors do, with the chat template its
hub checkpoint ships. Text models, each with its tokenizer's special tokens and chat template:
- "llama": llava-v1.6-vicuna (Llama, `<s>` / `</s>`, the vicuna "USER: ... ASSISTANT:" template);
- "mistral": llava-v1.6-mistral (Mistral, `<s>` / `</s>`, the "[INST] ... [/INST]" template);
- "llama3": llama3-llava-next-8b (Llama with `rope_scaling` type "llama3" and rope theta 5e5; a byte-level BPE
  with `<|begin_of_text|>` added first, `<|start_header_id|>` / `<|end_header_id|>` / `<|eot_id|>` headers and
  both `<|eot_id|>` and `<|end_of_text|>` ending generation);
- "yi": llava-v1.6-34b (Yi is `LlamaForCausalLM`; a SentencePiece-style BPE with "▁" spaces and byte
  fallback, `<|startoftext|>` / `<|endoftext|>`, no BOS added, ChatML turns ending in `<|im_end|>`, the eos).
`<image>` (and llama3's `<pad>`) are added after the trained vocabulary, as on the hub.
Nothing touches the network; the weights are random from a fixed seed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    MistralConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from triton_vlm.demo.checkpoint import CHAT_TEMPLATE, DEFAULT_TEXTS, IMAGE, _set_seed, build_tokenizer, \
    save_checkpoint
from triton_vlm.errors import InvalidArgument

TEXT_MODELS = ("llama", "mistral", "llama3", "yi")

# The chat templates of llava-hf's checkpoints (their processors' chat_template), rendering each message's image
# parts first, then its text. llava-v1.6-mistral-7b-hf:
MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'][0]['text'] + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'][0]['text'] + '</s> '}}"
    "{% endgeneration %}{% endif %}{% endfor %}")
# llama3-llava-next-8b-hf's turns (`<|begin_of_text|>` left to the tokenizer, which adds it):
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] | trim + '<|eot_id|>' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# llava-v1.6-34b-hf (ChatML):
YI_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_TEMPLATES = {"llama": CHAT_TEMPLATE, "mistral": MISTRAL_CHAT_TEMPLATE, "llama3": LLAMA3_CHAT_TEMPLATE,
                  "yi": YI_CHAT_TEMPLATE}

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
YI_SPECIALS = ["<unk>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama-3's rope: theta 5e5, "llama3" scaling (original context small here, so that the scaling bends most of
# the tiny model's frequencies)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _texts(texts: Optional[Iterable[str]], specials: list[str]) -> list[str]:
    return (list(texts) if texts else list(DEFAULT_TEXTS)) + [" ".join(specials) + " Hi"]


def build_llama3_tokenizer(texts: Optional[Iterable[str]] = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE as Llama-3's: `<|begin_of_text|>` added first, `<|eot_id|>` the eos, `<image>` and `<pad>`
    added after the vocabulary."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_texts(texts, LLAMA3_SPECIALS), trainer=trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(LLAMA3_SPECIALS)), special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   extra_special_tokens={"image_token": IMAGE}, clean_up_tokenization_spaces=False,
                                   padding_side="left")
    fast.add_special_tokens({"pad_token": "<pad>"})
    return fast


def build_yi_tokenizer(texts: Optional[Iterable[str]] = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE as Yi's: "▁" for spaces, byte fallback (`<0x00>`.. `<0xFF>` after the specials),
    no BOS added, `<|im_end|>` the eos, `<unk>` the pad, `<image>` added after the vocabulary."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(_texts(texts, YI_SPECIALS), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=YI_SPECIALS, show_progress=False))
    trained = json.loads(tok.to_str())["model"]
    ordered = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    words = YI_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + [w for w, _ in ordered if w not in YI_SPECIALS]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    bpe = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, merges, unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = tok.pre_tokenizer
    bpe.add_special_tokens(YI_SPECIALS)
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama's SentencePiece decoder
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<|startoftext|>",
                                   eos_token="<|im_end|>", pad_token="<unk>",
                                   extra_special_tokens={"image_token": IMAGE}, clean_up_tokenization_spaces=False,
                                   padding_side="left")


def build_next_tokenizer(text_model: str, texts: Optional[Iterable[str]] = None) -> PreTrainedTokenizerFast:
    """The tokenizer a `text_model` checkpoint ships (see the module doc)."""
    if text_model == "llama3":
        return build_llama3_tokenizer(texts)
    if text_model == "yi":
        return build_yi_tokenizer(texts)
    return build_tokenizer(list(texts) if texts is not None else None, 512)


def eos_ids(text_model: str, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """What ends generation (generation_config.json's eos_token_id): Llama-3 ends on either of two tokens."""
    if text_model == "llama3":
        return [tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>")]
    return [tokenizer.eos_token_id]

# (height, width) in tiles of llava-v1.6's pinpoints [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
V16_GRID = ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))


def pinpoints(tile: int, grid: Sequence[Sequence[int]] = V16_GRID) -> list[list[int]]:
    """Pinpoints in pixels from a grid in tiles."""
    return [[h * tile, w * tile] for h, w in grid]


def make_llava_next_config(tokenizer: PreTrainedTokenizerFast, *, text_model: str, tower: str, tile: int,
                           patch: int, grid_pinpoints: list[list[int]], strategy: str, feature_layer,
                           text_hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                           vision_hidden: int, vision_layers: int, vision_heads: int, vision_intermediate: int,
                           max_position_embeddings: int, sliding_window: Optional[int]) -> LlavaNextConfig:
    vision_kw = dict(hidden_size=vision_hidden, intermediate_size=vision_intermediate,
                     num_hidden_layers=vision_layers, num_attention_heads=vision_heads, image_size=tile,
                     patch_size=patch)
    vision = CLIPVisionConfig(projection_dim=vision_hidden, **vision_kw) if tower == "clip" else \
        SiglipVisionConfig(vision_use_head=False, **vision_kw)
    text_kw = dict(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=intermediate,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                   max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   tie_word_embeddings=False)
    if text_model == "mistral":
        text = MistralConfig(sliding_window=sliding_window, **text_kw)
    elif text_model == "llama3":
        text = LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0, **text_kw)
    else:  # llama (vicuna) and yi: LlamaForCausalLM
        text = LlamaConfig(rope_theta=5000000.0 if text_model == "yi" else 10000.0, **text_kw)
    return LlavaNextConfig(vision_config=vision, text_config=text,
                           image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
                           vision_feature_select_strategy=strategy, vision_feature_layer=feature_layer,
                           image_grid_pinpoints=grid_pinpoints, tie_word_embeddings=False)


def make_llava_next_processor(tokenizer: PreTrainedTokenizerFast, *, tower: str, tile: int, patch: int,
                              grid_pinpoints: list[list[int]], strategy: str,
                              chat_template: Optional[str] = None) -> LlavaNextProcessor:
    from transformers.models.llava_next.image_processing_pil_llava_next import (  # noqa: PLC0415
        LlavaNextImageProcessorPil,
    )

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": tile},
                                                 crop_size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=grid_pinpoints)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                              vision_feature_select_strategy=strategy,
                              num_additional_image_tokens=1 if tower == "clip" else 0,
                              chat_template=chat_template)


def build_random_llava_next(
    out_dir: str | Path,
    *,
    text_model: str = "llama",
    tower: str = "clip",
    tile: int = 32,
    patch: int = 8,
    grid: Sequence[Sequence[int]] = V16_GRID,
    strategy: str = "default",
    feature_layer=-2,
    text_hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vision_hidden: int = 32,
    vision_layers: int = 3,
    vision_heads: int = 2,
    vision_intermediate: int = 64,
    max_position_embeddings: int = 2048,
    sliding_window: Optional[int] = None,
    seed: int = 0,
    qk_scale: float = 1.0,
    vocab_texts: Iterable[str] | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build and save a random (seeded) LLaVA-NeXT checkpoint; return its directory. `grid` is the pinpoints in
    tiles ((rows, columns) each); `text_model` one of `TEXT_MODELS`; `tower` "clip" or "siglip"; `qk_scale`
    multiplies the text model's query and key weights (random attention is near uniform, blind to positions)."""
    if text_model not in TEXT_MODELS or tower not in ("clip", "siglip"):
        raise InvalidArgument(f"text_model must be one of {TEXT_MODELS} and tower clip or siglip, got "
                              f"{text_model!r}, {tower!r}")
    if tile % patch:
        raise InvalidArgument(f"tile {tile} must be a multiple of patch {patch}")
    tokenizer = tokenizer or build_next_tokenizer(text_model, vocab_texts)
    points = pinpoints(tile, grid)
    config = make_llava_next_config(
        tokenizer, text_model=text_model, tower=tower, tile=tile, patch=patch, grid_pinpoints=points,
        strategy=strategy, feature_layer=feature_layer, text_hidden=text_hidden, layers=layers, heads=heads,
        kv_heads=kv_heads, intermediate=intermediate, vision_hidden=vision_hidden, vision_layers=vision_layers,
        vision_heads=vision_heads, vision_intermediate=vision_intermediate,
        max_position_embeddings=max_position_embeddings, sliding_window=sliding_window)
    _set_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():  # a spread of logits: ties between tokens become vanishingly rare
        model.lm_head.weight.mul_(8.0)
        for name, w in model.named_parameters():  # qk_scale > 1: peaked attention, where positions (rope) matter
            if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                w.mul_(qk_scale)
    processor = make_llava_next_processor(tokenizer, tower=tower, tile=tile, patch=patch, grid_pinpoints=points,
                                          strategy=strategy, chat_template=CHAT_TEMPLATES[text_model])
    out = save_checkpoint(model, processor, Path(out_dir))
    ends = eos_ids(text_model, tokenizer)
    if len(ends) > 1:  # generation_config.json's eos_token_id as a list, as Llama-3 checkpoints ship it
        f = out / "generation_config.json"
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = ends
        f.write_text(json.dumps(cfg, indent=2))
    return out
