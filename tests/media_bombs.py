"""Hostile media built at test time, small on disk and costly to decode: a long video of near-blank frames (its first
frame encoded once, its second, a frame that repeats the one before, muxed again and again: an encoder runs twice
whatever the length), many large near-blank images; and the hub's Qwen2-VL layout of a tiny checkpoint (no
`video_preprocessor_config.json`, so the image processor's `max_pixels` 12,845,056 and up to 768 frames a video)."""
from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

HUB_MAX_PIXELS = 12845056  # Qwen2-VL's preprocessor_config.json on the hub


def blank_video(frames: int, width: int, height: int, fps: int = 1) -> bytes:
    """An MP4 (MPEG-4 part 2) of `frames` near-blank frames of width x height at `fps`: a few KB per 100 frames."""
    import av  # noqa: PLC0415

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 1 << 30  # one key frame: every later packet may repeat the one before
        img = np.full((height, width, 3), 200, np.uint8)
        img[: height // 8, : width // 8] = 30  # near blank: one dark corner
        packets = []
        for i in range(2):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            packets += stream.encode(frame)
        packets += stream.encode()
        key, repeat = packets[0], bytes(packets[-1])
        out.mux(key)
        for i in range(1, frames):
            p = av.Packet(repeat)
            p.stream, p.time_base, p.pts, p.dts = stream, Fraction(1, fps), i, i
            out.mux(p)
    return buf.getvalue()


def blank_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 200, 200)).save(buf, "PNG")
    return buf.getvalue()


def hub_layout(model: Path) -> Path:
    """A tiny Qwen2-VL checkpoint laid out as the hub's: no video processor config, the hub's max_pixels."""
    (model / "video_preprocessor_config.json").unlink(missing_ok=True)
    cfg = json.loads((model / "preprocessor_config.json").read_text())
    cfg["max_pixels"] = HUB_MAX_PIXELS
    if isinstance(cfg.get("size"), dict) and "longest_edge" in cfg["size"]:
        cfg["size"]["longest_edge"] = HUB_MAX_PIXELS
    (model / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2))
    return model
