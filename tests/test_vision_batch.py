"""`vision.service.VisionService`: the images of many requests in one encoder call, ragged, each bad request on
its own, each image encoded at most once, cached embeddings equal to fresh ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_vlm.errors import InvalidArgument
from triton_vlm.vision import VisionEncoder
from triton_vlm.vision.backends import BackendSettings, TorchBackend
from triton_vlm.vision.cache import EmbeddingCache
from triton_vlm.vision.service import VisionService


@pytest.fixture(scope="module")
def encoder(demo_model):
    return VisionEncoder(demo_model)


def service(demo_model, encoder, cache_bytes=0, max_batch=2):
    backend = TorchBackend(demo_model, BackendSettings(max_batch=max_batch))
    cache = EmbeddingCache(cache_bytes, "test") if cache_bytes else None
    return VisionService(backend, encoder.image_size, encoder.tokens_per_image, encoder.hidden_size, cache)


def test_ragged_batch_equals_one_request_at_a_time(demo_model, encoder):
    s = encoder.image_size
    rng = np.random.default_rng(0)
    reqs = [rng.standard_normal((n, 3, s, s)).astype(np.float32) for n in (2, 0, 3)] + [None]
    reqs.insert(2, np.zeros((1, 3, s // 2, s), np.float32))  # a wrong size in the middle
    svc = service(demo_model, encoder)
    out = svc.encode([(r,) for r in reqs])  # calls of 2 images cut across requests
    assert [o.shape[0] if not isinstance(o, Exception) else "err" for o in out] == [2, 0, "err", 3, 0]
    assert isinstance(out[2], InvalidArgument) and "pixel_values" in str(out[2])
    assert svc.stats.take_batches() == [2, 2, 1]
    for pv, o in zip(reqs, out):
        if pv is not None and not isinstance(o, Exception) and len(pv):
            alone = encoder(torch.from_numpy(pv))  # [n, T, hidden]
            torch.testing.assert_close(o, alone, rtol=1e-5, atol=1e-5)
            assert o.shape[1:] == (encoder.tokens_per_image, encoder.hidden_size)


def test_non_finite_pixels_are_refused(demo_model, encoder):
    s = encoder.image_size
    bad = np.full((1, 3, s, s), np.nan, np.float32)
    good = np.zeros((1, 3, s, s), np.float32)
    svc = service(demo_model, encoder, cache_bytes=2**20)
    res = svc.encode([(bad,), (good,)])
    assert isinstance(res[0], InvalidArgument) and "NaN" in str(res[0])
    assert res[1].shape[0] == 1  # the valid request is unaffected


def test_cache_hits_skip_the_encoder_and_equal_fresh_embeddings(demo_model, encoder):
    s = encoder.image_size
    rng = np.random.default_rng(1)
    imgs = rng.standard_normal((3, 3, s, s)).astype(np.float32)
    one = encoder.tokens_per_image * encoder.hidden_size * 4  # bytes of one image's fp32 embeddings
    svc = service(demo_model, encoder, cache_bytes=2 * one, max_batch=8)
    first = svc.encode([(imgs[:2],), (imgs[:1],)])  # image 0 twice: encoded once
    assert svc.stats.images_encoded == 2
    again = svc.encode([(imgs[:2],)])
    assert svc.stats.images_encoded == 2 and svc.cache.stats.hits == 2  # no encoder run at all
    torch.testing.assert_close(again[0], first[0], rtol=0, atol=0)
    torch.testing.assert_close(first[1][0], first[0][0], rtol=0, atol=0)
    svc.encode([(imgs[2:],)])  # a third image: the cache holds two, the oldest goes
    assert svc.cache.stats.evictions == 1 and len(svc.cache) == 2 and svc.cache.used_bytes == 2 * one
    svc.encode([(imgs[:1],)])
    assert svc.stats.images_encoded == 4  # image 0 was evicted: encoded again


def test_auto_falls_back_to_torch_when_the_export_fails(demo_model, monkeypatch, caplog):
    """`vision_backend` auto prefers onnxruntime on a CPU; a tower that cannot be exported still serves (torch),
    with a warning. An explicit onnxruntime fails loudly instead."""
    from triton_vlm.vision import export, service as S

    def broken(*a, **kw):
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr(export, "cached_onnx", broken)
    svc = S.build(demo_model, {"embedding_cache_mb": "0"})
    assert svc.backend.name == "torch" and "falling back to torch" in caplog.text
    with pytest.raises(RuntimeError, match="unsupported operator"):
        S.build(demo_model, {"vision_backend": "onnxruntime"})
