"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints, images of many sizes and transformers' own answers for them: shared
by the live server's tests (`test_qwen_vl_server.py`) and the OpenAI ones (`test_qwen_vl_openai.py`).

The reference builds a prompt's inputs as the checkpoint's processor does (`Qwen2VLProcessor` needs torchvision for
its video half, which is not installed; its image half is exactly this): `<image>` written as the checkpoint's
`<|vision_start|><|image_pad|><|vision_end|>`, the image processor's `pixel_values` / `image_grid_thw`, each
`<|image_pad|>` expanded to grid_t x grid_h x grid_w / merge^2 copies, `mm_token_type_ids` marking them."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

NATIVE = "<|vision_start|><|image_pad|><|vision_end|>"
# (width, height) as PIL sizes: small, wide, tall, tiny (below min_pixels), larger than max_pixels, 150:1
SIZES = {"small": (100, 60), "wide": (240, 50), "tall": (40, 300), "tiny": (5, 3), "large": (640, 480),
         "sliver": (600, 4)}


def build(root: Path, kind: str) -> Path:
    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl, save_hub_weights  # noqa: PLC0415
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    torch.set_num_threads(1)
    path = build_qwen_vl(root / kind, kind, seed=7, shards=2 if kind == "qwen2_vl" else 1)
    model = AutoModelForImageTextToText.from_pretrained(str(path))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # spread the logits: near-ties would make fp ulps decide tokens
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_hub_weights(model, path, shards=2 if kind == "qwen2_vl" else 1)
    return path


def png(size: tuple[int, int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


class Reference:
    """transformers' tokenizer, image processor and model of a checkpoint: the answers to match."""

    def __init__(self, model_dir: Path):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer  # noqa: PLC0415

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()
        self.eos = self.model.generation_config.eos_token_id

    def inputs(self, prompt: str, images: list[bytes]) -> dict:
        text, kw = prompt.replace("<image>", NATIVE), {}
        if images:
            px = self.image_processor([pil(b) for b in images], return_tensors="pt")
            kw = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
            for t, h, w in px["image_grid_thw"].tolist():
                text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        kw["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kw}

    @torch.no_grad()
    def generate(self, prompt: str, images: list[bytes], max_new_tokens: int, beams: int = 1,
                 num_return_sequences: int = 1, model=None, **gen) -> list[list[int]]:
        """New token ids of each returned sequence, cut after the first eos (as the server returns them)."""
        x = self.inputs(prompt, images)
        out = (model or self.model).generate(**x, max_new_tokens=max_new_tokens, do_sample=False, num_beams=beams,
                                             num_return_sequences=num_return_sequences, pad_token_id=0, **gen)
        seqs = []
        for row in out[:, x["input_ids"].shape[1]:].tolist():
            seqs.append(row[:row.index(self.eos) + 1] if self.eos in row else row)
        return seqs
