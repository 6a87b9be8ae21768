"""Video payloads: PyAV decoding, the checkpoint's frame sampling, patches in Qwen2VLVideoProcessor's order, limits."""
from __future__ import annotations

import numpy as np
import pytest

from triton_vlm.errors import InvalidArgument
from triton_vlm.families.qwen2_vl import sample_indices, video_plan
from triton_vlm.preprocess import videos as V

CFG = V.VideoConfig(fps=2.0, min_frames=4, max_frames=16, min_pixels=3136, max_pixels=28 * 28 * 64)


def _mp4(frames: int, h: int = 48, w: int = 64, fps: int = 4) -> bytes:
    rng = np.random.default_rng(frames)
    return V.encode_mp4(rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8), fps=fps)


@pytest.mark.parametrize("total,fps,want", [
    (10, 4.0, [0, 2, 5, 7]),  # 2.5 s at 2 fps = 5 -> 4 (whole temporal patches)
    (30, 8.0, [0, 5, 10, 15, 20, 25]),  # 3.75 s -> 7.5 -> 6
    (3, 1.0, [0, 1]),  # fewer frames than min_frames: as many as the file has, floored to a patch
    (400, 2.0, list(range(0, 400, 25))),  # capped at max_frames
])
def test_sample_indices(total, fps, want):
    assert sample_indices(total, fps, CFG) == want


def test_decode_samples_the_frames_and_patches_them_in_order():
    video = V.decode_video(_mp4(10), "videos[0]", CFG, 1 << 24, planner=video_plan)
    assert (len(video.frames), video.size, video.total_frames, video.fps) == (4, (48, 64), 10, 4.0)
    rows, grid, seconds = V.VideoProcessor(CFG, video_plan)(video)
    assert grid == (2, 4, 4) and rows.shape == (32, 3, 28, 14) and seconds == 2 / video.sampled_fps
    # patchify's order: the first row is frame pair 0, the top-left 14x14 patch of the first 2x2 merge unit
    frames = np.arange(4 * 3 * 56 * 56, dtype=np.float32).reshape(4, 3, 56, 56)
    flat, g = V.patchify(frames, CFG)
    assert g == (2, 4, 4)
    assert np.array_equal(flat[0].reshape(3, 2, 14, 14), frames[0:2, :, :14, :14].transpose(1, 0, 2, 3))
    assert np.array_equal(flat[1].reshape(3, 2, 14, 14), frames[0:2, :, :14, 14:28].transpose(1, 0, 2, 3))
    assert np.array_equal(flat[2].reshape(3, 2, 14, 14), frames[0:2, :, 14:28, :14].transpose(1, 0, 2, 3))


def test_bad_and_oversized_videos_are_refused_by_name(monkeypatch):
    with pytest.raises(InvalidArgument, match=r"videos\[1\]: not a video file"):
        V.decode_video(b"\x00\x01 not a video", "videos[1]", CFG, 1 << 24, planner=video_plan)
    with pytest.raises(InvalidArgument, match="pixels per frame"):
        V.decode_video(_mp4(6), "videos[0]", CFG, 1000, planner=video_plan)
    monkeypatch.setattr(V, "MAX_DECODED_PIXELS", 6 * 48 * 64 - 1)
    with pytest.raises(InvalidArgument, match="pixels in all"):
        V.decode_video(_mp4(6), "videos[0]", CFG, 1 << 24, planner=video_plan)
    with pytest.raises(InvalidArgument, match="bytes"):
        V.decode_video(_mp4(6), "videos[0]", CFG, 1 << 24, max_bytes=100, planner=video_plan)
