"""The vision encoder's ONNX artifact (the file onnxruntime runs here and TensorRT compiles on a GPU), checked on
the CPU: onnxruntime against torch in fp32, the truncated tower against `transformers`, the fp16 graph's
precision layout, the export cache and the command line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_vlm.vision import VisionEncoder
from triton_vlm.vision.export import export_onnx


def ort_run(path, pixels: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": pixels})[0]


def random_clip(tmp_path_factory, strategy: str):
    """A random LLaVA whose CLIP has 4 layers and feature layer -2 (the top layer is never run)."""
    from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint

    model, processor = build_random_llava_objects(seed=21, vision_layers=4, vision_feature_layer=-2,
                                                  vision_feature_select_strategy=strategy)
    return save_checkpoint(model, processor, tmp_path_factory.mktemp(f"clip-{strategy}"))


@pytest.fixture(scope="module")
def clip_full(tmp_path_factory):
    return random_clip(tmp_path_factory, "full")  # CLS kept


@pytest.fixture(scope="module")
def clip_default(tmp_path_factory):
    return random_clip(tmp_path_factory, "default")  # CLS dropped


@pytest.mark.parametrize("which", ["demo", "clip_default", "clip_full"])
def test_onnxruntime_matches_torch_and_transformers(which, request, tmp_path):
    from transformers import LlavaForConditionalGeneration

    model_dir = request.getfixturevalue("demo_model" if which == "demo" else which)
    enc = VisionEncoder(model_dir)
    path = export_onnx(model_dir, tmp_path / "v.onnx")
    rng = np.random.default_rng(0)
    for n in (1, 5):  # the batch axis is dynamic
        pixels = rng.standard_normal((n, 3, enc.image_size, enc.image_size)).astype(np.float32)
        ref = enc(torch.from_numpy(pixels)).numpy()  # [n, T, hidden]
        out = ort_run(path, pixels)
        assert out.shape == ref.shape == (n, enc.tokens_per_image, enc.hidden_size)
        assert np.abs(out - ref).max() <= 1e-4
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():  # the layers above the feature layer are dropped: still transformers' features
        feats = hf.get_image_features(pixel_values=torch.from_numpy(pixels))
    feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats
    np.testing.assert_allclose(ref.reshape(feats.shape), feats.numpy(), atol=1e-5)
    if which == "clip_full":
        assert enc.tokens_per_image == (enc.image_size // 8) ** 2 + 1  # CLS kept


def test_fp16_graph_keeps_layernorm_and_softmax_in_fp32(demo_model, tmp_path):
    """What TensorRT builds strongly typed: fp16 input and weights, LayerNorm and softmax computed in fp32; it
    runs here on onnxruntime, close to the fp32 encoder."""
    import onnx

    path = export_onnx(demo_model, tmp_path / "v16.onnx", "float16")
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.value_info) + list(graph.input)}
    assert types["input"] == onnx.TensorProto.FLOAT16
    sensitive = [n for n in graph.node if n.op_type in ("LayerNormalization", "Softmax")]
    assert {n.op_type for n in sensitive} == {"LayerNormalization", "Softmax"}
    assert all(types[n.input[0]] == onnx.TensorProto.FLOAT for n in sensitive)
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in graph.initializer)
    enc = VisionEncoder(demo_model)
    pixels = np.random.default_rng(1).standard_normal((4, 3, enc.image_size, enc.image_size)).astype(np.float32)
    ref = enc(torch.from_numpy(pixels)).numpy().reshape(4 * enc.tokens_per_image, -1)
    out = ort_run(path, pixels.astype(np.float16)).astype(np.float32).reshape(ref.shape)
    cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999


def test_export_is_cached_by_checkpoint_content(demo_model, clip_full, tmp_path):
    from triton_vlm.vision.export import cached_onnx, checkpoint_key

    first = cached_onnx(demo_model, cache=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cached_onnx(demo_model, cache=tmp_path) == first and first.stat().st_mtime_ns == stamp  # not again
    assert checkpoint_key(clip_full, "float32") != checkpoint_key(demo_model, "float32")
    assert checkpoint_key(demo_model, "float16") != checkpoint_key(demo_model, "float32")


def test_command_line(demo_model, tmp_path, capsys):
    from triton_vlm.vision.__main__ import main

    assert main(["export", str(demo_model), str(tmp_path / "cli.onnx")]) == 0
    assert (tmp_path / "cli.onnx").is_file()
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert main(["build-trt", str(tmp_path / "cli.onnx"), str(tmp_path / "x.plan"), "--max-batch", "8"]) == 2
        assert "needs TensorRT" in capsys.readouterr().err


def test_backend_settings_the_backend_ignores_are_refused(demo_model):
    from triton_vlm.errors import InvalidArgument
    from triton_vlm.vision.backends import BackendSettings, check_settings

    with pytest.raises(InvalidArgument, match="vision_bits apply to the torch backend only"):
        check_settings(BackendSettings(backend="onnxruntime"), {"vision_bits"})
    with pytest.raises(InvalidArgument, match="vision_backend must be one of torch, onnxruntime, tensorrt"):
        check_settings(BackendSettings(backend="openvino"), set())
