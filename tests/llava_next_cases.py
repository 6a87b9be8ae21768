"""Tiny random LLaVA-NeXT checkpoints, images of many sizes and transformers' own answers for them: shared by
the in-process exactness tests (`test_llava_next.py`) and the live server's (`test_llava_next_server.py`)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# checkpoint variants: text model, tower / strategy, feature layer(s), tile and patch, pinpoints in tiles
VARIANTS = {
    # llava-v1.6-vicuna's shape: Llama, CLIP with the default strategy, layer -2, the v1.6 pinpoints
    "llama": dict(text_model="llama", tower="clip", strategy="default", feature_layer=-2),
    # llava-v1.6-mistral's text model; two feature layers concatenated; other tile, patch and pinpoints
    "mistral": dict(text_model="mistral", tower="clip", strategy="default", feature_layer=[-3, -1], tile=16,
                    patch=4, grid=((2, 2), (1, 3), (3, 1), (1, 4), (4, 1)), seed=1),
    # a tower without CLS and the "full" strategy (the combination transformers supports without CLS)
    "siglip": dict(text_model="llama", tower="siglip", strategy="full", feature_layer=-1,
                   grid=((1, 1), (1, 2), (2, 1), (2, 2)), seed=2),
}

# (width, height) as PIL sizes: square, wide, tall, tiny, a one-pixel sliver, larger than every pinpoint
SIZES = {"square": (48, 48), "wide": (120, 30), "tall": (25, 90), "tiny": (3, 2), "sliver": (200, 1),
         "large": (400, 260)}


def build(root: Path, name: str) -> Path:
    from triton_vlm.demo.next_checkpoint import build_random_llava_next

    torch.set_num_threads(1)
    return build_random_llava_next(root / name, **VARIANTS[name])


def png(size: tuple[int, int], seed: int) -> bytes:
    """A PNG of random pixels (every image its own features)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


class Reference:
    """transformers' processor and model of a checkpoint: the answers to match."""

    def __init__(self, model_dir: Path):
        from transformers import AutoProcessor, LlavaNextForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.model = LlavaNextForConditionalGeneration.from_pretrained(str(model_dir)).eval()

    def inputs(self, prompt: str, images: list[bytes]):
        return self.processor(text=prompt, images=[pil(b) for b in images] or None, return_tensors="pt")

    @torch.no_grad()
    def features(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each image's features [tokens, hidden] from `get_image_features`."""
        x = self.processor.image_processor([pil(b) for b in images], return_tensors="pt")
        cfg = self.model.config
        out = self.model.model.get_image_features(x["pixel_values"], x["image_sizes"],
                                                  vision_feature_layer=cfg.vision_feature_layer,
                                                  vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return list(out.pooler_output)

    @torch.no_grad()
    def generate(self, prompt: str, images: list[bytes], max_new_tokens: int, beams: int = 1,
                 num_return_sequences: int = 1, model=None) -> list[list[int]]:
        """New token ids of each returned sequence, cut after the first eos (as the server returns them)."""
        x = self.inputs(prompt, images)
        out = (model or self.model).generate(**x, max_new_tokens=max_new_tokens, do_sample=False, num_beams=beams,
                                             num_return_sequences=num_return_sequences)
        eos = self.model.generation_config.eos_token_id
        seqs = []
        for row in out[:, x["input_ids"].shape[1]:].tolist():
            seqs.append(row[:row.index(eos) + 1] if eos in row else row)
        return seqs
