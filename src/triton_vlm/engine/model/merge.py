"""Merge image embeddings into a prompt's token embeddings at the image placeholder positions.

As Hugging Face LLaVA: every position whose id is the image token id takes the next image feature row, in
order (`masked_scatter`). With DeepStack (Qwen3-VL) a feature row is the token's embedding then one feature per
level, and the merged rows keep that width (`runner.py` splits them: the embedding goes in, the levels are added
after the first decoder layers). The counts must match in both directions (more placeholders than features, or more
features than placeholders, are both errors), and the message states both counts.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import InvalidArgument


def count_mismatch(tokens: int, features: int) -> InvalidArgument:
    return InvalidArgument(f"Image features and image tokens do not match: tokens: {tokens}, features: {features}")


def merge_image_embeds(input_ids: torch.Tensor, text_embeds: torch.Tensor, image_embeds: Optional[torch.Tensor],
                       image_token_id: Optional[int] | tuple[int, ...], levels: int = 0) -> torch.Tensor:
    """input_ids [P], text_embeds [P, hidden], image_embeds [images, T, width] (or [N, width]) or None, where
    width = hidden * (1 + levels): each media token's embedding, then (DeepStack, Qwen3-VL) one feature per level.

    Returns [P, width]: text_embeds (zeros beyond `hidden`) with the placeholder rows replaced by the features.
    """
    if levels:  # the text rows' DeepStack features are zeros: adding them after a layer changes nothing
        pad = text_embeds.new_zeros(text_embeds.shape[0], levels * text_embeds.shape[-1])
        text_embeds = torch.cat([text_embeds, pad], dim=-1)
    ids = () if image_token_id is None else (image_token_id,) if isinstance(image_token_id, int) else image_token_id
    if not ids:  # a plain Llama: no placeholders
        is_image = torch.zeros_like(input_ids, dtype=torch.bool)
    else:  # [P]: images' and (Qwen2-VL) videos' placeholders, their features in prompt order
        is_image = torch.isin(input_ids, torch.tensor(ids, dtype=input_ids.dtype, device=input_ids.device))
    tokens = int(is_image.sum())
    if image_embeds is None:
        if tokens:
            raise count_mismatch(tokens, 0)
        return text_embeds
    feats = torch.as_tensor(image_embeds)
    if feats.dim() == 3:
        feats = feats.reshape(-1, feats.shape[-1])  # [images * T, hidden]
    if feats.dim() != 2:
        raise InvalidArgument(f"image_embeds must be [images, tokens, hidden], got shape {tuple(image_embeds.shape)}")
    hidden = text_embeds.shape[-1]
    if feats.shape[0] and feats.shape[-1] != hidden:
        what = f" x (1 + {levels} DeepStack levels)" if levels else ""
        raise InvalidArgument(f"image_embeds hidden size {feats.shape[-1]} != the language model's "
                              f"{hidden // (1 + levels)}{what} = {hidden}")
    if tokens != feats.shape[0]:
        raise count_mismatch(tokens, feats.shape[0])
    if not tokens:
        return text_embeds
    if not torch.isfinite(feats).all():
        raise InvalidArgument("image_embeds contain NaN or infinite values")
    out = text_embeds.clone()
    out[is_image.to(out.device)] = feats.to(device=out.device, dtype=out.dtype)
    return out
