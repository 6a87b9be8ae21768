"""The Qwen2-VL / Qwen2.5-VL vision tower graph (`vision/qwen_tower.py`) against transformers on tiny random models.

Each model is saved with `save_pretrained` and its tower read back through `TensorSource` (the real loader). The
graph must equal transformers' `get_image_features` for one image and for several images and a video in one call
(each image exactly what it gets alone), with 2.5-VL's windows partial at the edges; its host-side layout must
equal transformers' own; the ONNX export must run in onnxruntime on grids other than the export's example.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_vlm.spec import CheckpointError
from triton_vlm.vision.qwen_tower import (ATTN_INDEX, ATTN_SLOT, AUX_NAMES, OUTPUT, PATCHES, POSITION_IDS,
                                          WINDOW_INDEX, WINDOW_SLOT, QwenTowerGraph, example_inputs,
                                          export_tower_onnx, is_qwen_vision, tower_aux)
from triton_vlm.weight_source import TensorSource

TEXT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
            vocab_size=128, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0})
VISION = {
    "qwen2_vl": dict(depth=3, embed_dim=48, hidden_size=64, num_heads=3, mlp_ratio=2),
    # window 56 px = 2x2 merged tokens: grids of 8x8 patches have 4 windows, 10x6 has partial ones
    "qwen2_5_vl": dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       window_size=56, fullatt_block_indexes=[1]),
}
# images of different sizes and a 3-frame video; 2.5-VL windows partial in (1, 10, 6), (1, 6, 14) and (3, 4, 6)
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 2), (3, 4, 6), (1, 10, 6), (1, 6, 14)]
ATOL = 2e-5


def _randomize(visual: torch.nn.Module) -> None:
    """Weights at a unit-activation scale (transformers' 0.02 init leaves a tiny tower's outputs near zero)."""
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)


@pytest.fixture(scope="module", params=sorted(VISION))
def tower(request, tmp_path_factory):
    """(transformers model, our graph, the saved checkpoint's tower weights) for one family."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    kind = request.param
    config_cls, model_cls = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
                             "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)}[kind]
    torch.manual_seed(0)
    config = config_cls(vision_config=VISION[kind], text_config=TEXT)
    model = model_cls(config).eval()
    _randomize(model.model.visual)
    d = tmp_path_factory.mktemp(kind)
    model.save_pretrained(d)
    # transformers saves the hub layout (`visual.*`); the loader renames it to `model.visual.*` as transformers does
    weights = TensorSource(d).with_prefixes(("model.visual.",))
    assert "merger.mlp.0.weight" in weights and not any(k.startswith("model.") for k in weights)
    return model, QwenTowerGraph(model.config.vision_config, weights), weights


def _reference(model, patches: torch.Tensor, grids) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(patches, torch.tensor(grids)).pooler_output
    return torch.cat(list(out))


def _run(graph, inputs) -> torch.Tensor:
    with torch.no_grad():
        return graph(*inputs)


def test_is_qwen_vision(tower):
    from transformers import CLIPVisionConfig

    model, graph, _ = tower
    assert is_qwen_vision(model.config.vision_config)
    assert is_qwen_vision(model.config.vision_config.to_dict())
    assert not is_qwen_vision(CLIPVisionConfig())
    assert graph.aux_names == (AUX_NAMES if graph.config.windowed else AUX_NAMES[:3])


def test_one_image_matches_transformers(tower):
    model, graph, _ = tower
    inputs = example_inputs(graph, [(1, 8, 10)], seed=1)
    out, ref = _run(graph, inputs), _reference(model, inputs[0], [(1, 8, 10)])
    assert out.shape == ref.shape == (20, 64)
    assert ref.abs().mean() > 0.1  # not a degenerate tower
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_batch_matches_transformers_and_each_image_alone(tower):
    model, graph, _ = tower
    inputs = example_inputs(graph, GRIDS, seed=2)
    out = _run(graph, inputs)
    torch.testing.assert_close(out, _reference(model, inputs[0], GRIDS), atol=ATOL, rtol=0)
    start, token = 0, 0
    for grid in GRIDS:
        n = int(np.prod(grid))
        alone = inputs[0][start:start + n]
        aux = tower_aux([grid], graph.config)
        one = _run(graph, (alone,) + tuple(torch.from_numpy(aux[name]) for name in graph.aux_names))
        torch.testing.assert_close(out[token:token + n // 4], one, atol=ATOL, rtol=0)
        torch.testing.assert_close(one, _reference(model, alone, [grid]), atol=ATOL, rtol=0)
        start, token = start + n, token + n // 4
    assert (start, token) == (inputs[0].shape[0], out.shape[0])


def test_eager_attention_matches_sdpa(tower):
    """The exported form (explicit fp32 softmax) and torch's fused attention agree."""
    model, graph, weights = tower
    eager = QwenTowerGraph(model.config.vision_config, weights, attention="eager")
    inputs = example_inputs(graph, GRIDS, seed=6)
    torch.testing.assert_close(_run(eager, inputs), _run(graph, inputs), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="attention must be one of"):
        eager.set_attention("flash")


def test_groups_matter(tower):
    """The batch's frames and (2.5-VL) windows change the result: attending across them is not the tower."""
    _, graph, _ = tower
    names = (PATCHES,) + graph.aux_names
    inputs = dict(zip(names, example_inputs(graph, GRIDS, seed=3)))
    out = _run(graph, inputs.values())
    n = len(inputs[PATCHES])
    one_group = dict(inputs, **{ATTN_INDEX: torch.arange(n)[None], ATTN_SLOT: torch.arange(n)})
    assert (_run(graph, one_group.values()) - out).abs().max() > 1e-2
    if graph.config.windowed:  # windowed blocks attending to the whole frame
        unwindowed = dict(inputs, **{WINDOW_INDEX: inputs[ATTN_INDEX], WINDOW_SLOT: inputs[ATTN_SLOT]})
        assert (_run(graph, unwindowed.values()) - out).abs().max() > 1e-2


def test_layout_matches_transformers(tower):
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    _, graph, _ = tower
    cfg = graph.config
    aux = tower_aux(GRIDS, cfg)
    n = sum(t * h * w for t, h, w in GRIDS)
    assert list(aux) == list(graph.aux_names) and all(v.dtype == np.int64 for v in aux.values())
    assert aux[POSITION_IDS].shape == (n, 2)
    thw = torch.tensor(GRIDS)
    np.testing.assert_array_equal(aux[POSITION_IDS], get_vision_position_ids(thw, cfg.merge).numpy())
    _check_groups(aux[ATTN_INDEX], aux[ATTN_SLOT], np.arange(n), get_vision_cu_seqlens(thw).numpy())
    assert aux[ATTN_INDEX].shape == (5 + 3, 84)  # 5 images and a 3-frame video; the longest is 6 x 14 patches
    if cfg.windowed:
        units, cu = get_vision_window_index(thw, cfg.merge, cfg.window_size, cfg.patch)
        unit = cfg.merge ** 2  # transformers permutes merge units; its window order of the patches:
        order = (units.numpy()[:, None] * unit + np.arange(unit)).reshape(-1)
        _check_groups(aux[WINDOW_INDEX], aux[WINDOW_SLOT], order, cu.numpy())
        assert aux[WINDOW_INDEX].shape[1] == 16  # 56 px windows: 2 x 2 merge units of 2 x 2 patches


def _check_groups(index: np.ndarray, slot: np.ndarray, order: np.ndarray, cu: np.ndarray) -> None:
    """index's groups are transformers' (patches `order`, split at `cu`), in its order; slot is their inverse."""
    lengths = (index >= 0).sum(1)
    np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(lengths)]), cu)
    assert all((row[:k] >= 0).all() and (row[k:] == -1).all() for row, k in zip(index, lengths))
    np.testing.assert_array_equal(index[index >= 0], order)
    np.testing.assert_array_equal(index.reshape(-1)[slot], np.arange(len(slot)))


@pytest.mark.parametrize("grid", [(1, 3, 4), (0, 4, 4), (1, 4)])
def test_bad_grid_is_refused(tower, grid):
    with pytest.raises(ValueError, match=r"grid 1 is .*(multiples of spatial_merge_size 2|expected \(t, h, w\))"):
        tower_aux([(1, 2, 2), grid], tower[1].config)


def test_missing_or_misshapen_tensor_is_refused(tower):
    model, _, weights = tower
    partial = {k: v for k, v in weights.items() if k != "blocks.1.attn.qkv.weight"}
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*blocks\.1\.attn\.qkv\.weight"):
        QwenTowerGraph(model.config.vision_config, partial)
    bad = dict(weights, **{"merger.ln_q.weight": torch.ones(7)})
    with pytest.raises(CheckpointError, match=r"merger\.ln_q\.weight \(7,\)"):
        QwenTowerGraph(model.config.vision_config, bad)


@pytest.mark.parametrize("external_data", [False, True])
def test_onnx_dynamic_batch_matches_torch(tower, tmp_path, external_data):
    import onnxruntime as ort

    _, graph, _ = tower
    path = export_tower_onnx(graph, tmp_path / "tower.onnx", [(1, 4, 4), (1, 2, 6)], external_data=external_data)
    # the private work directory is gone; the weights are in the graph or in one file beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tower.onnx"] + ["tower.onnx.data"] * external_data
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = (PATCHES,) + graph.aux_names
    assert [i.name for i in session.get_inputs()] == list(names)
    assert [o.name for o in session.get_outputs()] == [OUTPUT]
    for grids in (GRIDS, [(2, 6, 4)]):
        inputs = example_inputs(graph, grids, seed=4)
        got = session.run([OUTPUT], {n: t.numpy() for n, t in zip(names, inputs)})[0]
        np.testing.assert_allclose(got, _run(graph, inputs).numpy(), atol=1e-4, rtol=0)


def test_onnx_fp16_close_to_fp32(tower, tmp_path):
    import onnxruntime as ort

    _, graph, _ = tower
    path = export_tower_onnx(graph, tmp_path / "tower16.onnx", [(1, 4, 4)], dtype="float16")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = example_inputs(graph, GRIDS, seed=5)
    feeds = {n: t.numpy() for n, t in zip((PATCHES,) + graph.aux_names, inputs)}
    feeds[PATCHES] = feeds[PATCHES].astype(np.float16)
    got = session.run([OUTPUT], feeds)[0]
    assert got.dtype == np.float16
    ref = _run(graph, inputs).numpy()
    assert np.abs(got.astype(np.float32) - ref).max() < 0.02 * np.abs(ref).max()
