"""`vision.encode_batch`: the images of many requests in one forward, ragged, each bad request on its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_vlm.errors import InvalidArgument
from triton_vlm.vision import VisionEncoder, encode_batch


@pytest.fixture(scope="module")
def encoder(demo_model):
    return VisionEncoder(demo_model)


def test_ragged_batch_equals_one_request_at_a_time(encoder):
    s = encoder.image_size
    rng = np.random.default_rng(0)
    reqs = [rng.standard_normal((n, 3, s, s)).astype(np.float32) for n in (2, 0, 3)] + [None]
    reqs.insert(2, np.zeros((1, 3, s // 2, s), np.float32))  # a wrong size in the middle
    out = encode_batch(encoder, reqs, chunk=2)  # chunks cut across requests
    assert [o.shape[0] if not isinstance(o, Exception) else "err" for o in out] == [2, 0, "err", 3, 0]
    assert isinstance(out[2], InvalidArgument) and "pixel_values" in str(out[2])
    for pv, o in zip(reqs, out):
        if pv is not None and not isinstance(o, Exception) and len(pv):
            alone = encoder(torch.from_numpy(pv)).numpy()  # [n, T, hidden]
            np.testing.assert_allclose(o, alone, rtol=1e-5, atol=1e-5)
            assert o.shape[1:] == (encoder.tokens_per_image, encoder.hidden_size)


def test_non_finite_pixels_are_refused(encoder):
    s = encoder.image_size
    bad = np.full((1, 3, s, s), np.nan, np.float32)
    [res] = encode_batch(encoder, [bad])
    assert isinstance(res, InvalidArgument) and "NaN" in str(res)
