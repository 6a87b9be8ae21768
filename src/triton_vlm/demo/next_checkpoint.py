"""Offline builder for tiny random LLaVA-NeXT checkpoints (`LlavaNextForConditionalGeneration` + its processor).

Shaped like llava-hf's llava-v1.6 checkpoints, scaled down: a CLIP tower (or SigLIP, which has no CLS token)
of `tile` x `tile` pixels, a Llama or Mistral text model, `image_grid_pinpoints` in multiples of the tile, the
image processor of llava-v1.6 (`size` shortest edge = tile, centre crop to the tile, the pinpoints) and a
`LlavaNextProcessor` that counts the CLS token (`num_additional_image_tokens`) as the hub's processors do.
Nothing touches the network; the weights are random from a fixed seed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
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

from triton_vlm.demo.checkpoint import IMAGE, _set_seed, build_tokenizer, save_checkpoint
from triton_vlm.errors import InvalidArgument

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
    text = LlamaConfig(**text_kw) if text_model == "llama" else MistralConfig(sliding_window=sliding_window,
                                                                              **text_kw)
    return LlavaNextConfig(vision_config=vision, text_config=text,
                           image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
                           vision_feature_select_strategy=strategy, vision_feature_layer=feature_layer,
                           image_grid_pinpoints=grid_pinpoints, tie_word_embeddings=False)


def make_llava_next_processor(tokenizer: PreTrainedTokenizerFast, *, tower: str, tile: int, patch: int,
                              grid_pinpoints: list[list[int]], strategy: str) -> LlavaNextProcessor:
    from transformers.models.llava_next.image_processing_pil_llava_next import (  # noqa: PLC0415
        LlavaNextImageProcessorPil,
    )

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": tile},
                                                 crop_size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=grid_pinpoints)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                              vision_feature_select_strategy=strategy,
                              num_additional_image_tokens=1 if tower == "clip" else 0)


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
    vocab_texts: Iterable[str] | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build and save a random (seeded) LLaVA-NeXT checkpoint; return its directory. `grid` is the pinpoints in
    tiles ((rows, columns) each); `text_model` "llama" or "mistral"; `tower` "clip" or "siglip"."""
    if text_model not in ("llama", "mistral") or tower not in ("clip", "siglip"):
        raise InvalidArgument(f"text_model must be llama or mistral and tower clip or siglip, got {text_model!r}, "
                              f"{tower!r}")
    if tile % patch:
        raise InvalidArgument(f"tile {tile} must be a multiple of patch {patch}")
    tokenizer = tokenizer or build_tokenizer(list(vocab_texts) if vocab_texts is not None else None, 512)
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
    processor = make_llava_next_processor(tokenizer, tower=tower, tile=tile, patch=patch, grid_pinpoints=points,
                                          strategy=strategy)
    return save_checkpoint(model, processor, Path(out_dir))
