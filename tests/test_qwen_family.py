"""Qwen2-VL's patch layout against transformers' own `smart_resize`: every size's grid and token count, the bound
the vision model and the KV profile size themselves by, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

from triton_vlm.errors import InvalidArgument
from triton_vlm.families.qwen2_vl import PatchLayout

# the demo's, Qwen2-VL-7B-Instruct's (min 3136, max 12845056) and the image processor's defaults
SETTINGS = [(3136, 28 * 28 * 64), (3136, 12845056), (56 * 56, 28 * 28 * 1280), (3136, 448 * 448)]


@pytest.mark.parametrize("lo,hi", SETTINGS)
def test_grids_equal_transformers_and_stay_under_the_bound(lo, hi):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    layout = PatchLayout(14, 2, 2, lo, hi)
    bound = layout.max_tokens  # no size may take more (the vision model pads to it; the KV profile uses it)
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, (300, 2)) if max(h, w) / min(h, w) <= 200]
    sizes += [(1, 200), (200, 1), (28, 28), (5000, 5000), (int(hi ** 0.5) + 7, int(hi ** 0.5) - 3)]
    sizes += [(k, 200 * k) for k in (1, 3, 17, 40, 200)] + [(200 * k, k) for k in (2, 29, 150)]  # 200:1
    for h, w in sizes:
        rh, rw = smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
        assert layout.grid((h, w)) == (1, rh // 14, rw // 14)
        assert layout.tokens((h, w)) == rh * rw // (28 * 28) <= bound
    worst = max(layout.tokens((k, 200 * k)) for k in range(1, 400, 7))  # the widest sizes come near it
    assert bound - worst <= 2 or bound == hi // (28 * 28), (bound, worst)


def test_aspect_ratios_past_200_are_refused_with_the_ratio():
    layout = PatchLayout(14, 2, 2, 3136, 28 * 28 * 64)
    with pytest.raises(InvalidArgument, match=r"aspect ratio of 250:1; at most 200:1"):
        layout.tokens((2, 500))
    with pytest.raises(InvalidArgument, match="aspect ratio"):
        layout.tokens((0, 10))


def test_truncation_drops_whole_images_with_their_true_counts(tmp_path):
    """A prompt one image too long: that image goes whole (all its placeholders and its vision markers stay
    balanced), the later image keeps its own count."""
    import io

    from PIL import Image

    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl
    from triton_vlm.preprocess.service import Preprocessor

    def png(w, h):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(w).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    pre = Preprocessor(build_qwen_vl(tmp_path / "q", "qwen2_vl", max_position_embeddings=160))
    big, small = png(224, 224), png(100, 60)  # 64 and 8 tokens
    pad = pre.info.image_token_id
    full = pre("<image> first <image> second", [big, small], max_tokens=8)
    assert full.dropped_images == 0 and full.input_ids.count(pad) == 72
    cut = pre("<image> first <image> second", [big, small], max_tokens=100)  # 60 prompt tokens left
    assert cut.dropped_images == 1 and cut.input_ids.count(pad) == 8 and len(cut.input_ids) <= 60
    assert [tuple(s) for s in cut.image_sizes] == [(60, 100)] and len(cut.pixel_values) == 32
