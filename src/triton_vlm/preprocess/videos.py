"""Video payloads -> sampled RGB frames -> Qwen2-VL's video patches, with the limits a server needs.

A payload is what a request carried for one video: the file itself (raw bytes, from the gRPC/binary `videos`
input) or base64 text of it, optionally as a `data:video/<subtype>;base64,` URL. The file is opened by PyAV
(FFmpeg's demuxers and decoders, in the wheel); the container's frame count and average rate are what transformers'
PyAV reader reports (`video_utils.read_video_pyav`), and the frames kept are those the checkpoint's video processor
samples (`Qwen2VLVideoProcessor.sample_frames` with `fps`: total / rate x fps frames, clamped to
[min_frames, max_frames] and to the file's frames, floored to a multiple of the temporal patch, taken at
`arange(0, total, total / n)`).

Two steps, so that a request's cost is known and bounded before it is paid (`preprocess/service.py`):
`probe_video` reads the header only and checks the file size (`max_bytes`), the frame count (`MAX_FRAMES` in the
file), each frame's pixels (`max_pixels`, the image cap) and frames x pixels (`MAX_DECODED_PIXELS`: decoding is linear
in it), then asks the family for its `VideoPlan` (`Family.video_plan`: the frames kept, their resized size, the
grid, the tokens and the bytes of pixels); `decode_frames` then decodes one frame at a time, checks each frame's real
size against the header's and resizes each kept frame as it arrives, so a full-size frame is never held beyond the
one being decoded. Every problem raises `InvalidArgument` naming the video (`what`).

Pixels (`VideoProcessor`): each sampled frame resized to `smart_resize` of its size (the video processor's
min / max pixels), bicubic as the checkpoint's image processor resizes (PIL: torchvision, which transformers' video
processor resizes with, is not installed here), rescaled and normalised with the processor's mean and std, then cut
into patches exactly as `Qwen2VLVideoProcessor.patchify` does: `[grid_t * grid_h * grid_w, 3 * 2 * 14 * 14]`
rows, carried as `[rows, 3, 28, 14]` like an image's, written one temporal patch at a time into the output (no
full-size float stack of all frames). Given these pixels, the model's answer is transformers' own.
"""
from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np
from PIL import Image

from ..errors import InvalidArgument
from ..families.base import VideoPlan
from .images import payload_to_bytes

__all__ = ["DEFAULT_MAX_VIDEO_BYTES", "MAX_DECODED_PIXELS", "MAX_FRAMES", "Video", "VideoConfig", "VideoHeader",
           "VideoProcessor", "decode_frames", "decode_video", "encode_mp4", "patchify", "probe_video",
           "video_config"]

DEFAULT_MAX_VIDEO_BYTES = 64 << 20
MAX_FRAMES = 4096  # frames a file may hold (each is decoded to be counted or kept)
MAX_DECODED_PIXELS = 1 << 31  # frames x pixels a file may ask the decoder for (about 1,000 frames of 1080p)


@dataclass(frozen=True)
class VideoConfig:
    """The checkpoint's video processor settings (`video_preprocessor_config.json`, else the image processor's), over
    the family's video processor class defaults (`Family.video_defaults`; these are Qwen2-VL's)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 56 * 56  # Qwen3-VL: of all the kept frames together
    max_pixels: int = 28 * 28 * 768
    patch: int = 14
    temporal: int = 2
    merge: int = 2
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale: float = 1 / 255
    cap_pixels_per_frame: bool = False  # Qwen3-VL: per-frame pixels capped (qwen-vl-utils' rule)
    max_video_tokens: int = 768  # Qwen3-VL: the per-frame cap in merged patches

    @classmethod
    def from_json(cls, cfg: dict, fallback: dict, defaults: Optional[dict] = None) -> "VideoConfig":
        """Fields that would change the pixels or the frames other than as read here are refused (ValueError)."""
        base = dataclasses.replace(cls(), **(defaults or {}))
        c = cfg or fallback
        for key in ("do_sample_frames", "do_resize", "do_rescale", "do_normalize"):
            if c.get(key) is False:
                raise ValueError(f"video processor config: {key} = false is not supported; supported: true (frames "
                                 "sampled at fps, resized, rescaled and normalised as the processor does)")
        if c.get("num_frames") is not None:
            raise ValueError(f"video processor config: num_frames = {c['num_frames']!r} is not supported; supported: "
                             "null (frames sampled at fps between min_frames and max_frames)")
        size = c.get("size") or {}
        pick = lambda *keys, default: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
        return cls(fps=float(pick("fps", default=base.fps)),
                   min_frames=int(pick("min_frames", default=base.min_frames)),
                   max_frames=int(pick("max_frames", default=base.max_frames)),
                   min_pixels=int(c.get("min_pixels") or size.get("shortest_edge") or base.min_pixels),
                   max_pixels=int(c.get("max_pixels") or size.get("longest_edge") or base.max_pixels),
                   patch=int(pick("patch_size", default=base.patch)),
                   temporal=int(pick("temporal_patch_size", default=base.temporal)),
                   merge=int(pick("merge_size", default=base.merge)), mean=tuple(pick("image_mean", default=base.mean)),
                   std=tuple(pick("image_std", default=base.std)),
                   rescale=float(pick("rescale_factor", default=base.rescale)),
                   cap_pixels_per_frame=bool(pick("cap_pixels_per_frame", default=base.cap_pixels_per_frame)),
                   max_video_tokens=int(pick("max_video_tokens", default=base.max_video_tokens)))


@dataclass
class Video:
    """A decoded video: its sampled frames, resized to the plan's size, and what the positions need."""

    frames: list[np.ndarray]  # the kept frames, each [plan.size[0], plan.size[1], 3] uint8 RGB
    size: tuple[int, int]  # (height, width) of a frame of the file
    total_frames: int
    fps: float
    plan: VideoPlan

    @property
    def sampled_fps(self) -> float:
        """transformers' `VideoMetadata.sampled_fps`."""
        return len(self.frames) / self.total_frames * self.fps if self.total_frames and self.fps else (self.fps or 24)


def _open(data: bytes, what: str):
    import av  # noqa: PLC0415

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # noqa: BLE001 - av raises its own error types for every demuxer failure
        raise InvalidArgument(f"{what}: not a video file PyAV can open ({type(e).__name__}: {e})") from None
    if not container.streams.video:
        container.close()
        raise InvalidArgument(f"{what}: the file holds no video stream")
    return container


Planner = Callable[[VideoConfig, tuple[int, int], int, float], VideoPlan]  # `Family.video_plan`


@dataclass(frozen=True)
class VideoHeader:
    """A video as its container's header describes it, and what it will cost (`Family.video_plan`): known before
    any frame is decoded."""

    data: bytes  # the file
    size: tuple[int, int]  # (height, width) of a frame, as the header says
    total_frames: int
    fps: float
    plan: VideoPlan

    def describe(self) -> str:
        (h, w), (ph, pw), (t, gh, gw) = self.size, self.plan.size, self.plan.grid
        return (f"{w}x{h} pixels, {self.total_frames} frames at {self.fps:g} fps: sampling keeps "
                f"{len(self.plan.keep)} frames, resized to {pw}x{ph}, {t}x{gh}x{gw} patches = {self.plan.tokens} "
                "tokens")


def probe_video(payload: Union[bytes, str], what: str, cfg: VideoConfig, max_pixels: int,
                max_bytes: int = DEFAULT_MAX_VIDEO_BYTES, *, planner: Planner) -> VideoHeader:
    """The header's frame count, rate and size checked against the limits, and the family's plan for them
    (`Family.video_plan`); nothing decoded."""
    data = payload_to_bytes(payload, what)
    if len(data) > max_bytes:
        raise InvalidArgument(f"{what}: {len(data)} bytes; at most {max_bytes} are accepted")
    container = _open(data, what)
    try:
        stream = container.streams.video[0]
        total, rate = int(stream.frames or 0), float(stream.average_rate or 0)
        w, h = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    finally:
        container.close()
    if not 0 < total <= MAX_FRAMES or rate <= 0:
        raise InvalidArgument(f"{what}: the container reports {total} frames at {rate:g} fps; 1 to {MAX_FRAMES} "
                              "frames at a known rate are accepted")
    if not 0 < w * h <= max_pixels:
        raise InvalidArgument(f"{what}: frames of {w}x{h} pixels; at most {max_pixels} pixels per frame")
    if total * w * h > MAX_DECODED_PIXELS:
        raise InvalidArgument(f"{what}: {total} frames of {w}x{h} pixels; at most {MAX_DECODED_PIXELS} pixels "
                              "in all are decoded (send a shorter or smaller video)")
    try:
        plan = planner(cfg, (h, w), total, rate)
    except ValueError as e:
        raise InvalidArgument(f"{what}: {e}") from None
    except InvalidArgument as e:
        raise InvalidArgument(f"{what}: frames of {w}x{h} pixels: {e.message}") from None
    return VideoHeader(data, (h, w), total, rate, plan)


def decode_frames(header: VideoHeader, what: str) -> Video:
    """The kept frames, decoded one at a time and each resized to the plan's size as it arrives (bicubic, as the
    checkpoint's processor resizes): never more than one full-size frame in memory. A frame whose size is not the
    header's is refused."""
    container = _open(header.data, what)
    try:
        frames = _frames(container, header, what)
    finally:
        container.close()
    if len(frames) != len(header.plan.keep):
        raise InvalidArgument(f"{what}: the container reports {header.total_frames} frames but only {len(frames)} "
                              f"of the {len(header.plan.keep)} sampled could be decoded")
    return Video(frames, header.size, header.total_frames, header.fps, header.plan)


def decode_video(payload: Union[bytes, str], what: str, cfg: VideoConfig, max_pixels: int,
                 max_bytes: int = DEFAULT_MAX_VIDEO_BYTES, *, planner: Planner) -> Video:
    return decode_frames(probe_video(payload, what, cfg, max_pixels, max_bytes, planner=planner), what)


def _frames(container, header: VideoHeader, what: str) -> list[np.ndarray]:
    keep, last = set(header.plan.keep), max(header.plan.keep)
    (h, w), (ph, pw) = header.size, header.plan.size
    out = []
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if (frame.height, frame.width) != (h, w):
                raise InvalidArgument(f"{what}: frame {i} is {frame.width}x{frame.height} pixels but the container's "
                                      f"header says {w}x{h}; every frame must have the header's size")
            if i in keep:
                out.append(np.asarray(frame.to_image().convert("RGB").resize((pw, ph), Image.BICUBIC)))
            if i >= last:
                break
    except InvalidArgument:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt stream raises from inside FFmpeg
        raise InvalidArgument(f"{what}: broken video stream ({type(e).__name__}: {e})") from None
    return out  # each [ph, pw, 3] uint8


def patchify(video: np.ndarray, cfg: VideoConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`Qwen2VLVideoProcessor.patchify` for one video [frames, C, H, W] -> rows [t*h*w, C*T*P*P], (t, h, w)."""
    if pad := -video.shape[0] % cfg.temporal:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    f, c, height, width = video.shape
    t, h, w, m, p = f // cfg.temporal, height // cfg.patch, width // cfg.patch, cfg.merge, cfg.patch
    x = video.reshape(t, cfg.temporal, c, h // m, m, p, w // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, c * cfg.temporal * p * p)), (t, h, w)


class VideoProcessor:
    """Decoded frames -> (patches [rows, 3, T*P, P] float32, grid (t, h, w), seconds per temporal patch), written
    one temporal patch at a time into the output (the only full-size float array); `plan` is the family's rule."""

    def __init__(self, cfg: VideoConfig, planner: Planner):
        self.cfg = cfg
        self.plan = planner  # the family's `video_plan`

    def grid(self, video: Video) -> tuple[int, int, int]:
        return video.plan.grid

    def __call__(self, video: Video) -> tuple[np.ndarray, tuple[int, int, int], float]:
        c, (t, gh, gw) = self.cfg, video.plan.grid
        frames = video.frames + video.frames[-1:] * (-len(video.frames) % c.temporal)  # the last repeated
        mean = np.asarray(c.mean, np.float32)[:, None, None]
        std = np.asarray(c.std, np.float32)[:, None, None]
        per = gh * gw
        rows = np.empty((t * per, 3 * c.temporal * c.patch * c.patch), np.float32)  # [t*h*w, C*T*P*P]
        for i in range(t):
            pair = np.stack(frames[i * c.temporal:(i + 1) * c.temporal]).astype(np.float32).transpose(0, 3, 1, 2)
            pair = (pair * np.float32(c.rescale) - mean) / std  # [T, 3, H, W]
            rows[i * per:(i + 1) * per] = patchify(pair, c)[0]
        return rows.reshape(-1, 3, c.temporal * c.patch, c.patch), (t, gh, gw), c.temporal / video.sampled_fps


def encode_mp4(frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> bytes:
    """[frames, H, W, 3] uint8 -> an MP4 file (tests and demos build their videos with it)."""
    import av  # noqa: PLC0415

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_config(model_dir: Any, defaults: Optional[dict] = None) -> VideoConfig:
    """`defaults`: the family's video processor class defaults (`Family.video_defaults`)."""
    from pathlib import Path  # noqa: PLC0415

    from ..spec import read_json  # noqa: PLC0415

    from ..spec import CheckpointError  # noqa: PLC0415

    d = Path(model_dir)
    try:
        return VideoConfig.from_json(read_json(d / "video_preprocessor_config.json"),
                                     read_json(d / "preprocessor_config.json"), defaults)
    except ValueError as e:
        raise CheckpointError(f"{d}: {e}") from None
