"""The `vision_backend`s of a native-resolution tower (Qwen2-VL, Qwen2.5-VL): whole images, not tiles.

Interface (`VisionService` calls it for a `PatchLayout` family): `backend.encode(patches [N, 3, T*P, P] fp32 numpy,
grids [(t, h, w), ...]) -> features [N / merge^2, hidden]` (torch, on the backend's device), the images' features
in order; `max_patches` bounds N per call (attention runs per frame / window, padded to the call's longest:
frames x heads x L^2 scores, `qwen_tower.py`; images of similar sizes batch with the least padding).

- `torch`: `QwenTowerGraph` from the checkpoint's `model.visual.` tensors, in `vision_bits` on `vision_device`;
- `onnxruntime`: the same graph exported once per checkpoint content (`export.cached_onnx`), inputs `patches` +
  the host-side layout (`qwen_layout.tower_aux`), on onnxruntime's CPU provider.
TensorRT is not built for this tower yet (a GPU runs the torch backend); asking for it is refused by name.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidArgument
from ..spec import CheckpointSpec
from ..weight_source import TensorSource
from .encoder import parse_bits
from .qwen_tower import PATCHES, QwenTowerGraph, export_tower_onnx, tower_aux

log = logging.getLogger("triton_vlm")
TOWER_PREFIX = ("model.visual.",)
MAX_PATCHES = 8192  # patches per encoder call
EXPORT_GRIDS = ((1, 4, 6), (2, 4, 4))  # the export's example batch (any grids: the axes are dynamic)


def load_graph(model_dir: str | Path) -> QwenTowerGraph:
    spec = CheckpointSpec.load(model_dir)
    return QwenTowerGraph(spec.hf_config.vision_config, TensorSource(model_dir).with_prefixes(TOWER_PREFIX))


def export_qwen_onnx(model_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    return export_tower_onnx(load_graph(model_dir), out, EXPORT_GRIDS, dtype)


def _rows(patches: np.ndarray, patch_dim: int) -> np.ndarray:
    return np.ascontiguousarray(patches, np.float32).reshape(-1, patch_dim)  # [N, C*T*P*P]: the processor's rows


class QwenTorchBackend:
    name = "torch"

    def __init__(self, model_dir: Path, settings) -> None:
        self.graph = load_graph(model_dir)
        self.device = settings.torch.vision_device
        dtype = parse_bits(settings.torch.vision_bits)
        self.graph.to(self.device, dtype)
        self.dtype = str(dtype).replace("torch.", "")
        self.max_batch, self.max_patches = settings.max_batch, MAX_PATCHES

    @torch.inference_mode()
    def encode(self, patches: np.ndarray, grids) -> torch.Tensor:
        g = self.graph
        aux = tower_aux(grids, g.config)
        x = torch.from_numpy(_rows(patches, g.config.patch_dim)).to(self.device, g.dtype)
        return g(x, *(torch.from_numpy(aux[n]).to(self.device) for n in g.aux_names)).float()


class QwenOnnxBackend:
    name, dtype, device = "onnxruntime", "float32", "cpu"

    def __init__(self, model_dir: Path, settings) -> None:
        import onnxruntime as ort  # noqa: PLC0415

        from .export import cached_onnx  # noqa: PLC0415

        self.path = Path(settings.onnx_path) if settings.onnx_path else cached_onnx(model_dir, "float32")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = settings.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        self.config = CheckpointSpec.load(model_dir).hf_config.vision_config
        self.names = [i.name for i in self.session.get_inputs()]
        self.patch_dim = int(self.session.get_inputs()[0].shape[1])
        self.max_batch, self.max_patches = settings.max_batch, MAX_PATCHES
        log.info("vision: onnxruntime on %s (native-resolution tower), %d threads", self.path,
                 opts.intra_op_num_threads)

    def encode(self, patches: np.ndarray, grids) -> torch.Tensor:
        aux = tower_aux(grids, self.config)
        feed = {n: aux[n] for n in self.names if n != PATCHES}
        feed[PATCHES] = _rows(patches, self.patch_dim)
        return torch.from_numpy(self.session.run(None, feed)[0])


def make_qwen_backend(model_dir: Path, settings):
    if settings.backend == "torch":
        return QwenTorchBackend(model_dir, settings)
    if settings.backend == "onnxruntime":
        return QwenOnnxBackend(model_dir, settings)
    raise InvalidArgument(f"vision_backend {settings.backend!r} is not available for a native-resolution tower "
                          "(Qwen2-VL / Qwen2.5-VL / Qwen3-VL); use torch (GPU or CPU) or onnxruntime (CPU)")
