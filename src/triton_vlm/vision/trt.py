"""TensorRT for the vision encoder (GPU machines only; `tensorrt` is not importable elsewhere).

`build_plan(onnx, out, max_batch)` compiles the fp16 ONNX file (`export.py`: LayerNorm and softmax in fp32) with
TensorRT's Python API as a strongly typed network (precision from the graph, no FP16 builder flag: TensorRT
10.12 deprecated weak typing and 11 removes the flag) and one optimisation profile on the batch axis: min 1,
opt max/2, max `max_batch`, as TensorRT-LLM builds its LLaVA encoder. `python -m triton_vlm.vision build-trt ONNX
OUT --max-batch N` is the command line; `cached_plan` builds on first start, keyed by the ONNX file's content,
the TensorRT version and the GPU (plans are tied to both).

`TensorRTBackend` runs the plan inside the `vision` python model rather than as a separate `tensorrt_plan`
model: the embedding cache and the cross-request batching decide which images to encode, and a batch is split
into calls of at most the profile's max (a larger one fails with "Runtime dimension does not satisfy any
optimization profile"). Pixels go to the GPU once; embeddings stay there (`run_device`) so the llm model can take
them by DLPack.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from .export import INPUT, OUTPUT, cached_onnx

log = logging.getLogger("triton_vlm")


def build_plan(onnx_path: str | Path, out: str | Path, max_batch: int) -> Path:
    import tensorrt as trt  # noqa: PLC0415

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    _, c, h, w = network.get_input(0).shape
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape(INPUT, (1, c, h, w), (max(1, max_batch // 2), c, h, w), (max_batch, c, h, w))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build a plan from {onnx_path} (see the log above)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_bytes(bytes(plan))
    os.replace(tmp, out)
    return out


def cached_plan(model_dir: str | Path, max_batch: int) -> Path:
    import tensorrt as trt  # noqa: PLC0415

    onnx_path = cached_onnx(model_dir, "float16")
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    key = hashlib.sha256(onnx_path.read_bytes()).hexdigest()[:24]
    plan = onnx_path.parent / f"vision_trt{trt.__version__}_{gpu}_{key}_b{max_batch}.plan"
    if not plan.is_file():
        log.info("vision: building the TensorRT plan %s (first start on this GPU)", plan)
        build_plan(onnx_path, plan, max_batch)
    return plan


class TensorRTBackend:
    name, dtype, device = "tensorrt", "float16", "cuda"

    def __init__(self, model_dir: Path, s):
        import tensorrt as trt  # noqa: PLC0415

        plan = Path(s.plan_path) if s.plan_path else cached_plan(model_dir, s.max_batch)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{plan} is not a TensorRT plan for this TensorRT version and GPU; rebuild it")
        self.context = self.engine.create_execution_context()
        self.max_batch = int(self.engine.get_tensor_profile_shape(INPUT, 0)[2][0])  # the profile's max
        self.stream = torch.cuda.Stream()
        log.info("vision: TensorRT plan %s, batch 1..%d", plan, self.max_batch)

    def run_device(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, H, W] -> embeddings [n, T, hidden] fp16 on the GPU, n split by the profile's max."""
        pixels = pixels.to("cuda", torch.float16).contiguous()
        outs = [self._run(chunk.contiguous()) for chunk in pixels.split(self.max_batch)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run(self, pixels: torch.Tensor) -> torch.Tensor:
        self.context.set_input_shape(INPUT, tuple(pixels.shape))
        out = torch.empty(tuple(self.context.get_tensor_shape(OUTPUT)), dtype=torch.float16, device="cuda")
        self.context.set_tensor_address(INPUT, pixels.data_ptr())
        self.context.set_tensor_address(OUTPUT, out.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution of the vision plan failed")
        self.stream.synchronize()
        return out

    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        return self.run_device(torch.from_numpy(pixels))  # stays on the GPU
