"""The `vision_backend`s: one interface, `backend(pixels [n, 3, H, W] fp32 numpy) -> embeddings [n, T, hidden]`
as a torch tensor on the backend's device.

- `torch`: `VisionEncoder` (the tower + projector in torch; honours vision_device / vision_bits /
  projector_device / projector_bits, as text-generation-webui's multimodal pipelines).
- `onnxruntime`: the exported fp32 ONNX file (`export.cached_onnx`) on onnxruntime's CPU provider with
  `intra_op_num_threads` = the stub's thread setting (`OMP_NUM_THREADS`, set per stub by the launcher). CPU only,
  fp32 only: onnxruntime has no fp16 kernels for most ops on a CPU (it inserts casts, often slower).
- `tensorrt`: a plan built from the fp16 ONNX file (`trt.py`), on a GPU.

Every backend reports `name`, `dtype` (of its embeddings; part of the embedding cache's key), `max_batch`
(the most images one call may take; callers split) and `device`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import InvalidArgument
from .encoder import VisionEncoder, VisionSettings

log = logging.getLogger("triton_vlm")
BACKENDS = ("torch", "onnxruntime", "tensorrt")
TORCH_ONLY = ("vision_device", "vision_bits", "projector_device", "projector_bits")


@dataclass(frozen=True)
class BackendSettings:
    backend: str = "torch"  # never "auto" here: `service.choose_backend` resolves it
    torch: VisionSettings = field(default_factory=VisionSettings)
    onnx_path: str = ""  # "" = export (cached by checkpoint content) on first start
    plan_path: str = ""  # tensorrt: a built plan; "" = build one (cached) from the fp16 ONNX file
    max_batch: int = 32  # images per encoder call (tensorrt: the profile's max)
    threads: int = 0  # onnxruntime intra-op threads; 0 = OMP_NUM_THREADS or 1


def check_settings(s: BackendSettings, explicit: set[str]) -> None:
    """Refuse settings the chosen backend would ignore, naming what it honours."""
    if s.backend not in BACKENDS:
        raise InvalidArgument(f"vision_backend must be one of {', '.join(BACKENDS)}, got {s.backend!r}")
    ignored = sorted(k for k in TORCH_ONLY if k in explicit) if s.backend != "torch" else []
    if ignored:
        honours = {"onnxruntime": "the fp32 ONNX graph on the CPU (threads from OMP_NUM_THREADS)",
                   "tensorrt": "an fp16 TensorRT plan on the GPU (LayerNorm and softmax in fp32)"}[s.backend]
        raise InvalidArgument(f"vision_backend {s.backend!r} runs {honours}; {', '.join(ignored)} apply to the "
                              "torch backend only: leave them unset or use vision_backend torch")


class TorchBackend:
    name, dtype = "torch", "float32"

    def __init__(self, model_dir: Path, s: BackendSettings):
        self.encoder = VisionEncoder(model_dir, s.torch)
        self.max_batch, self.device = s.max_batch, str(self.encoder.graph.proj_device)
        self.dtype = str(self.encoder.graph.proj_dtype).replace("torch.", "")

    @torch.inference_mode()
    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        enc = self.encoder
        return enc.graph(torch.from_numpy(pixels).to(enc.tower_device, enc.tower_dtype))  # [n, T, hidden]


class OnnxRuntimeBackend:
    name, dtype, device = "onnxruntime", "float32", "cpu"

    def __init__(self, model_dir: Path, s: BackendSettings):
        import onnxruntime as ort  # noqa: PLC0415

        from .export import INPUT, cached_onnx  # noqa: PLC0415

        self.path = Path(s.onnx_path) if s.onnx_path else cached_onnx(model_dir, "float32")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = s.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        self.input, self.max_batch = INPUT, s.max_batch
        log.info("vision: onnxruntime on %s, %d threads", self.path, opts.intra_op_num_threads)

    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input: np.ascontiguousarray(pixels, np.float32)})[0])


def make_backend(model_dir: str | Path, s: BackendSettings, explicit: Optional[set[str]] = None):
    check_settings(s, explicit or set())
    model_dir = Path(model_dir)
    if native_resolution(model_dir):  # Qwen2-VL / Qwen2.5-VL: whole images of any size (`qwen_backends.py`)
        from .qwen_backends import make_qwen_backend  # noqa: PLC0415

        return make_qwen_backend(model_dir, s)
    if s.backend == "torch":
        return TorchBackend(model_dir, s)
    if s.backend == "onnxruntime":
        return OnnxRuntimeBackend(model_dir, s)
    from .trt import TensorRTBackend  # noqa: PLC0415 - imports tensorrt, GPU machines only

    return TensorRTBackend(model_dir, s)


def native_resolution(model_dir: str | Path) -> bool:
    """The checkpoint's tower takes whole images at their own size (its family's layout says so: Qwen2-VL's), not
    fixed-size tiles."""
    from ..families import family_of  # noqa: PLC0415
    from ..spec import CheckpointSpec  # noqa: PLC0415

    spec = CheckpointSpec.load(model_dir)
    return spec.vision is not None and family_of(spec).whole_images
