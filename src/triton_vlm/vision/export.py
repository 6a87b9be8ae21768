"""The vision encoder as one ONNX file: the artifact onnxruntime runs on a CPU and TensorRT compiles on a GPU.

`export_onnx(model_dir, out, dtype)` writes `EncoderGraph` (the tower up to the feature layer, the select strategy,
the projector) as TensorRT-LLM exports the LLaVA encoder: eager attention (the sdpa path breaks the exporters),
opset 17, input `input` [tiles, 3, H, W], output `encoder_output` [tiles, T, hidden], a dynamic axis of tiles
(images of llava-1.5; every image's base and grid tiles of LLaVA-NeXT, any number per image), the TorchScript
exporter (`dynamo=False`: since PyTorch 2.9 the default dynamo exporter ignores `dynamic_axes`). The family's
packing of an image's tiles (LLaVA-NeXT: unpad, row separators; `families/llava_next.py` says why) runs in
torch on the graph's output.

`dtype="float16"` writes the graph TensorRT builds strongly typed: weights and activations fp16, but every
LayerNorm and every attention softmax computes in fp32 (input cast up, output cast back): a plain fp16 ViT
loses accuracy in TensorRT (anchors section 7). Attention is our eager function (`_eager_fp32_softmax`,
registered with transformers' AttentionInterface): plain eager attention with an explicit fp32 softmax.

`cached_onnx(model_dir, dtype)` exports once per checkpoint content: the key is a SHA-256 over config.json, the
vision tower's and projector's tensors (and the family's packing tensors: LLaVA-NeXT's image_newline) and this
exporter's version, so a changed checkpoint is exported again
and an unchanged one is not (the `vision` model calls it on first start).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ..spec import CheckpointSpec
from ..weight_source import TensorSource
from .encoder import EncoderGraph

log = logging.getLogger("triton_vlm")
EXPORTER_VERSION = "1"
OPSET = 17
INPUT, OUTPUT = "input", "encoder_output"
DTYPES = {"float32": torch.float32, "float16": torch.float16}


class _FP32LayerNorm(nn.Module):
    """A LayerNorm that computes in fp32 inside an fp16 graph (its weights stay fp32)."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.shape, self.eps = ln.normalized_shape, ln.eps
        self.weight, self.bias = nn.Parameter(ln.weight.float()), nn.Parameter(ln.bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), self.shape, self.weight, self.bias, self.eps).to(x.dtype)


def _eager_fp32_softmax(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention whose softmax runs in fp32 whatever the graph's dtype (an explicit Cast in the ONNX
    graph: `softmax(x, dtype=float32)` is exported as an fp16 Softmax)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [n, heads, T, T]
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores.to(torch.float32), dim=-1).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


ATTENTION = "triton_vlm_eager_fp32_softmax"


def export_graph(model_dir: str | Path, dtype: str = "float32") -> EncoderGraph:
    """The graph to export, in `dtype` (float16: LayerNorms and softmax kept fp32)."""
    from transformers import AttentionInterface  # noqa: PLC0415

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    AttentionInterface.register(ATTENTION, _eager_fp32_softmax)
    graph = EncoderGraph(Path(model_dir), CheckpointSpec.load(model_dir), attn_implementation=ATTENTION).eval()
    if dtype == "float16":
        graph.half()
        graph.proj_dtype = torch.float16
        for parent in list(graph.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.LayerNorm):
                    setattr(parent, name, _FP32LayerNorm(child))
    return graph


def export_onnx(model_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    from .backends import native_resolution  # noqa: PLC0415

    if native_resolution(model_dir):  # Qwen2-VL / Qwen2.5-VL: the whole tower with its host-side layout inputs
        from .qwen_backends import export_qwen_onnx  # noqa: PLC0415

        return export_qwen_onnx(model_dir, out, dtype)
    spec = CheckpointSpec.load(model_dir)
    graph = export_graph(model_dir, dtype)
    size = spec.vision.image_size
    dummy = torch.zeros(2, 3, size, size, dtype=DTYPES[dtype])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with torch.no_grad(), warnings.catch_warnings():
        # the tracer's notes on CLIP's fixed-size branch (the image size is fixed per checkpoint) and the
        # TorchScript exporter's deprecation notice are expected here
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(graph, (dummy,), str(tmp), opset_version=OPSET, input_names=[INPUT],
                          output_names=[OUTPUT], dynamic_axes={INPUT: {0: "tiles"}, OUTPUT: {0: "tiles"}},
                          dynamo=False)
    os.replace(tmp, out)  # readers never see a half-written file
    return out


def checkpoint_key(model_dir: str | Path, dtype: str) -> str:
    """SHA-256 over config.json, the tower's and projector's tensors (names, shapes, bytes), dtype, exporter
    (computed once per process and checkpoint: hashing a 7B LLaVA's tower reads ~0.6 GB)."""
    d = Path(model_dir).resolve()
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.iterdir()) if p.is_file())
    return _checkpoint_key(d, dtype, stamp)


@functools.lru_cache(maxsize=8)
def _checkpoint_key(d: Path, dtype: str, stamp: tuple) -> str:
    h = hashlib.sha256(f"exporter {EXPORTER_VERSION} opset {OPSET} {dtype}\n".encode())
    h.update((d / "config.json").read_bytes())
    from ..families import family_of  # noqa: PLC0415

    source = TensorSource(d)
    for prefixes in family_of(CheckpointSpec.load(d)).hashed_prefixes():
        for name, t in sorted(source.with_prefixes(prefixes).items()):
            h.update(f"{name} {list(t.shape)} {t.dtype}\n".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cached_onnx(model_dir: str | Path, dtype: str = "float32", cache: str | Path | None = None) -> Path:
    """The exported file for this checkpoint's content, exported on the first call."""
    from ..paths import cache_dir  # noqa: PLC0415

    root = Path(cache) if cache else cache_dir() / "onnx"
    path = root / checkpoint_key(model_dir, dtype)[:32] / f"vision_{dtype}.onnx"
    if not path.is_file():
        log.info("vision: exporting %s to %s (first start for this checkpoint)", model_dir, path)
        export_onnx(model_dir, path, dtype)
    return path
