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
NATIVE_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
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

    def __init__(self, model_dir: Path, **load):
        """`load`: more `from_pretrained` arguments (an FP8 checkpoint's `quantization_config`, `dtype`)."""
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer  # noqa: PLC0415

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), **load).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.model_dir = model_dir

    def inputs(self, prompt: str, images: list[bytes], videos: tuple = ()) -> dict:
        """`videos`: video files, sampled and turned into pixels by the server's own video path (`videos.py`:
        transformers' video processor needs torchvision), so both sides see the same frames and pixels."""
        text, kw = prompt.replace("<image>", NATIVE).replace("<video>", NATIVE_VIDEO), {}
        if images:
            px = self.image_processor([pil(b) for b in images], return_tensors="pt")
            kw = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
            text = _expand(text, "<|image_pad|>", px["image_grid_thw"].tolist())
        if videos:
            rows, grids, seconds = zip(*(self.video(v) for v in videos))
            kw |= {"pixel_values_videos": torch.from_numpy(np.concatenate(rows).reshape(sum(len(r) for r in rows),
                                                                                        -1)),
                   "video_grid_thw": torch.tensor(grids)}
            if self.model.config.model_type == "qwen2_5_vl":
                kw["second_per_grid_ts"] = torch.tensor(seconds)
            text = self.expand_videos(text, videos, grids)
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        cfg = self.model.config
        kw["mm_token_type_ids"] = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kw}

    def expand_videos(self, text: str, videos, grids) -> str:
        """Each `<|video_pad|>` in turn -> the processor's placeholders for that video (Qwen2-VL: t*h*w/4 pads)."""
        return _expand(text, "<|video_pad|>", grids)

    def video(self, data: bytes):
        """(rows, grid, seconds) of a video by the server's own path, under the checkpoint's family's plan."""
        return self.decoded(data)[1]

    def decoded(self, data: bytes):
        """(the decoded `videos.Video`, its (rows, grid, seconds)) by the server's own path."""
        from triton_vlm.families import family_for_config  # noqa: PLC0415
        from triton_vlm.preprocess.videos import VideoProcessor, decode_video, video_config  # noqa: PLC0415

        family = family_for_config(self.model.config.to_dict())
        cfg = video_config(self.model_dir, family.video_defaults)
        video = decode_video(data, "video", cfg, 1 << 24, planner=family.video_plan)
        return video, VideoProcessor(cfg, family.video_plan)(video)

    @torch.no_grad()
    def generate(self, prompt: str, images: list[bytes], max_new_tokens: int, beams: int = 1,
                 num_return_sequences: int = 1, model=None, videos: tuple = (), **gen) -> list[list[int]]:
        """New token ids of each returned sequence, cut after the first eos (as the server returns them)."""
        x = self.inputs(prompt, images, videos)
        out = (model or self.model).generate(**x, max_new_tokens=max_new_tokens, do_sample=False, num_beams=beams,
                                             num_return_sequences=num_return_sequences, pad_token_id=0, **gen)
        seqs = []
        for row in out[:, x["input_ids"].shape[1]:].tolist():
            seqs.append(row[:row.index(self.eos) + 1] if self.eos in row else row)
        return seqs


def _expand(text: str, pad: str, grids) -> str:
    """Each `pad` in turn -> t*h*w/4 copies (the processor's expansion)."""
    for t, h, w in grids:
        text = text.replace(pad, "<|placeholder|>" * (t * h * w // 4), 1)
    return text.replace("<|placeholder|>", pad)


def mp4(frames: int, size: tuple[int, int], seed: int, fps: int = 4) -> bytes:
    """A video of random frames of PIL size (width, height)."""
    from triton_vlm.preprocess.videos import encode_mp4  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    return encode_mp4(rng.integers(0, 256, (frames, size[1], size[0], 3), dtype=np.uint8), fps=fps)
