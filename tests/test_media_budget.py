"""A request's media cost is known from headers and bounded before any pixel is paid for (no server: the live half is
test_media_budget_live.py).

- the family's `video_plan` (frames kept, resized size, grid, tokens, bytes) is what decoding then produces, and the
  patches, decoded one frame at a time and written one temporal patch at a time, are bit-equal to the whole-stack
  computation (every frame resized, stacked, normalised, patchified at once);
- a frame whose size is not the header's is refused; a video that cannot fit the context, or a request past its
  media budget (tokens, bytes), is refused naming the medium, its size, frames, tokens and the limit, before a frame
  is decoded (the 768-frame 1080p bomb in milliseconds, its decoder never run);
- the OpenAI front end counts videos with images before fetching any."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from PIL import Image

from media_bombs import blank_png, blank_video, hub_layout
from triton_vlm.errors import InvalidArgument
from triton_vlm.families.qwen2_vl import video_plan
from triton_vlm.preprocess import videos as V

CFG = V.VideoConfig(fps=2.0, min_frames=4, max_frames=16, min_pixels=3136, max_pixels=28 * 28 * 64)


def _mp4(frames: int, h: int, w: int, fps: int = 4) -> bytes:
    rng = np.random.default_rng(frames + h)
    return V.encode_mp4(rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8), fps=fps)


def _whole_stack(data: bytes, cfg: V.VideoConfig) -> np.ndarray:
    """The patches as computed before frames were resized as they arrive: every kept frame decoded at full size,
    resized, stacked as float32, normalised and patchified at once."""
    import av

    from triton_vlm.families.qwen2_vl import sample_indices, smart_resize

    with av.open(__import__("io").BytesIO(data)) as c:
        s = c.streams.video[0]
        keep = sample_indices(int(s.frames), float(s.average_rate), cfg)
        frames = [f.to_image().convert("RGB") for i, f in enumerate(c.decode(video=0)) if i in set(keep)]
    h, w = smart_resize(frames[0].height, frames[0].width, cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels)
    arr = np.stack([np.asarray(f.resize((w, h), Image.BICUBIC), np.float32).transpose(2, 0, 1) for f in frames])
    arr = (arr * np.float32(cfg.rescale) - np.asarray(cfg.mean, np.float32)[:, None, None]) / np.asarray(
        cfg.std, np.float32)[:, None, None]
    return V.patchify(arr.astype(np.float32), cfg)[0].reshape(-1, 3, cfg.temporal * cfg.patch, cfg.patch)


@pytest.mark.parametrize("frames,h,w,fps", [(10, 48, 64, 4), (7, 90, 30, 3), (30, 50, 240, 8), (3, 28, 28, 1)])
def test_the_plan_is_what_decoding_gives_and_the_patches_equal_the_whole_stack(frames, h, w, fps):
    data = _mp4(frames, h, w, fps)
    header = V.probe_video(data, "videos[0]", CFG, 1 << 24, planner=video_plan)
    video = V.decode_frames(header, "videos[0]")
    rows, grid, _ = V.VideoProcessor(CFG, video_plan)(video)
    plan = header.plan
    assert video.size == (h, w) and len(video.frames) == len(plan.keep)
    assert {f.shape for f in video.frames} == {(*plan.size, 3)}
    assert grid == plan.grid and plan.tokens == grid[0] * grid[1] * grid[2] // 4
    assert rows.nbytes == plan.pixel_bytes
    assert np.array_equal(rows, _whole_stack(data, CFG))  # bit-equal


def test_a_frame_whose_size_is_not_the_headers_is_refused():
    header = V.probe_video(_mp4(6, 48, 64), "videos[1]", CFG, 1 << 24, planner=video_plan)
    lying = V.VideoHeader(header.data, (64, 64), header.total_frames, header.fps, header.plan)
    with pytest.raises(InvalidArgument, match=r"videos\[1\]: frame 0 is 64x48 pixels but the container's header "
                                              r"says 64x64"):
        V.decode_frames(lying, "videos[1]")


@pytest.fixture(scope="module")
def hub_pre(tmp_path_factory):
    """The preprocess service on a tiny Qwen2-VL checkpoint in the hub's layout (768 frames a video, 12.8 MP)."""
    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl
    from triton_vlm.preprocess.service import Preprocessor

    model = hub_layout(build_qwen_vl(tmp_path_factory.mktemp("hub-qwen") / "m", "qwen2_vl", seed=3))
    return lambda **kw: Preprocessor(model, **kw)


BOMB = blank_video(768, 1920, 1080)  # ~0.8 MB; sampled whole: ~1M tokens, ~19 GB of float32 pixels


def test_the_1080p_bomb_is_refused_from_its_header_in_milliseconds(hub_pre, monkeypatch):
    pre = hub_pre()
    decoded = []
    monkeypatch.setattr(V, "decode_frames", lambda *a: decoded.append(a))
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument) as ei:
        pre("<video> what happens?", videos=[BOMB], max_tokens=16)
    took = time.perf_counter() - t0
    msg = ei.value.message
    for needle in ("videos[0]", "1920x1080 pixels", "768 frames at 1 fps", "sampling keeps 768 frames",
                   "384x78x138 patches = 1033344 tokens", "the context leaves 1008 prompt tokens", "max_tokens 16"):
        assert needle in msg, msg
    assert not decoded and took < 0.5, took
    assert len(BOMB) < 1 << 20


def test_media_past_the_request_budget_is_refused_by_name(hub_pre):
    video = blank_video(40, 320, 240, fps=4)  # 20 frames kept at 308x252: 10 x 18 x 22 patches = 990 tokens
    pre = hub_pre(max_media_tokens=1000)
    with pytest.raises(InvalidArgument, match=r"videos\[1\] \(.*990 tokens\) brings the request's images and "
                                              r"videos to 1980 tokens; at most 1000 .*max_media_tokens"):
        pre("<video><video>", videos=[video, video], max_tokens=16)
    pre = hub_pre(max_media_bytes=700 << 20)  # 324 MB an image: 36 MB RGB and 288 MB of float32 patches
    with pytest.raises(InvalidArgument, match=r"images\[2\] \(4000x3000 pixels, \d+ tokens\) brings the request's "
                                              r"decoded pixels to \d+ bytes; at most 734003200 .*max_media_bytes"):
        pre("<image><image><image><image>", images=[blank_png(4000, 3000)] * 4, max_tokens=16)
    ids = hub_pre()("<video> and <image>", videos=[video], images=[blank_png(60, 40)], max_tokens=16).input_ids
    assert len(ids) > 990  # within budget: served


def test_the_front_end_counts_videos_before_fetching_anything(monkeypatch):
    from triton_vlm.openai import media
    from triton_vlm.openai.errors import APIError

    fetched = []

    async def fake_fetch(url, **kw):
        fetched.append(url)
        return b"x"

    monkeypatch.setattr(media, "fetch", fake_fetch)
    policy = media.MediaPolicy(("example.com",), max_images=2, max_videos=2)
    urls = [f"https://example.com/{i}.mp4" for i in range(3)]
    with pytest.raises(APIError, match="3 videos; at most 2"):
        asyncio.run(policy.load_media(["https://example.com/a.png"], urls))
    with pytest.raises(APIError, match="3 images; at most 2"):
        asyncio.run(policy.load_media(urls, []))
    assert fetched == []
    images, videos = asyncio.run(policy.load_media([], urls[:2]))
    assert videos == [b"x", b"x"] and images == [] and len(fetched) == 2


def test_the_front_end_takes_its_media_limits_from_the_preprocess_model():
    """The front end counts images and videos with the preprocess model's own `max_images` / `max_videos` (a server
    configured for 3 videos is not refused at 2 by its front end), and falls back to the defaults only when the
    server cannot say."""
    from triton_vlm.openai import app
    from triton_vlm.params import DEFAULT_MAX_VIDEOS
    from triton_vlm.preprocess.images import DEFAULT_MAX_IMAGES

    class Client:
        def __init__(self, params):
            self.params = params

        async def model_parameters(self, model):
            if isinstance(self.params, Exception):
                raise self.params
            return self.params

    assert asyncio.run(app._media_limits(Client({"max_images": "5", "max_videos": "3"}))) == (5, 3)
    assert asyncio.run(app._media_limits(Client({}))) == (DEFAULT_MAX_IMAGES, DEFAULT_MAX_VIDEOS)
    assert asyncio.run(app._media_limits(Client(ConnectionError("down")))) == (DEFAULT_MAX_IMAGES,
                                                                                 DEFAULT_MAX_VIDEOS)
