"""The vision tower + projector of a LLaVA-family checkpoint, loaded without the language model.

`EncoderGraph` is the computation every backend runs on tiles (an image is one tile for llava-1.5, several for
LLaVA-NeXT): the tower up to the configured feature layer(s) (the layers above are dropped), the select
strategy, the family's projector; the torch backend runs it in torch and the exporter (`export.py`) writes it as
ONNX. `VisionEncoder(model_dir, VisionSettings(...))(pixel_values [tiles, 3, H, W]) -> [tiles, T, hidden]` equals
the tiles' features of `Llava(Next)ForConditionalGeneration.get_image_features(...)` on the same weights, before
the family's packing (`families/*.py`: `Packer`, run by the vision service). Its settings are those of
text-generation-webui's multimodal pipelines: `vision_device` / `vision_bits` for the tower, `projector_device` /
`projector_bits` for the projector, and a pipeline (model family) chosen from the checkpoint's config ("auto") or
by name (`triton_vlm.families.FAMILIES`). The feature layer and select strategy always come from the
checkpoint's config, so the features per image are the placeholders preprocess inserts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..errors import InvalidArgument
from ..families import Family, family_of
from ..spec import CheckpointError, CheckpointSpec
from ..weight_source import TensorSource

_DTYPES = {32: torch.float32, 16: torch.float16, "bf16": torch.bfloat16}


def parse_bits(value: str | int | None) -> torch.dtype:
    v = str(value or "32").strip().lower()
    key = "bf16" if v in ("bf16", "bfloat16") else int(v) if v.isdigit() else v
    if key not in _DTYPES:
        raise ValueError(f"bits must be 32, 16 or bf16, got {value!r}")
    return _DTYPES[key]


def check_pixel_values(pv, image_size) -> None:
    """Raise InvalidArgument unless `pv` is [images, 3, H, W] of finite values, (H, W) = `image_size` (an int: a
    square)."""
    import numpy as np  # noqa: PLC0415

    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    want = f"[n, 3, {h}, {w}]"
    if pv.ndim != 4 or (pv.shape[0] and tuple(pv.shape[1:]) != (3, h, w)):
        raise InvalidArgument(f"input 'pixel_values' must have shape {want} (the checkpoint's image size), "
                              f"got {list(pv.shape)}")
    if pv.size and not np.isfinite(pv).all():
        raise InvalidArgument("input 'pixel_values' holds NaN or infinite values; only finite values are allowed")


@dataclass(frozen=True)
class VisionSettings:
    vision_device: str = "cpu"
    vision_bits: str | int = 32
    projector_device: str = "cpu"
    projector_bits: str | int = 32
    pipeline: str = "auto"


class EncoderGraph(nn.Module):
    """pixel_values [tiles, 3, H, W] -> embeddings [tiles, T, hidden]: the tower run up to the configured feature
    layer(s) (the layers above are dropped: never computed, never exported), the select strategy ("default" drops
    CLS, "full" keeps it), then the family's projector. The torch backend runs it; the ONNX exporter exports it,
    so both compute the same graph."""

    def __init__(self, model_dir: Path, spec: CheckpointSpec, attn_implementation: Optional[str] = None,
                 family: Optional[Family] = None):
        super().__init__()
        from transformers import AutoModel  # noqa: PLC0415

        family = family or family_of(spec)
        config = spec.hf_config
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.tower = AutoModel.from_config(config.vision_config, **kw)
        self.projector = family.projector(config)
        weights = TensorSource(model_dir)
        for module, names in ((self.tower, family.weight_prefixes["tower"]),
                              (self.projector, family.weight_prefixes["projector"])):
            missing, _ = module.load_state_dict(weights.with_prefixes(names), strict=False)
            missing = [m for m in missing if "position_ids" not in m]
            if missing:
                raise CheckpointError(f"{model_dir}: weights missing for {names[0]}: {missing[:5]} (the checkpoint's "
                                      f"keys, as transformers 5 names them, hold no such tensors)")
        layers = spec.vision.feature_layer
        self.layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        self.select_strategy = spec.vision.select_strategy
        self.proj_device, self.proj_dtype = torch.device("cpu"), torch.float32
        self._truncate()

    def _truncate(self) -> None:
        """Keep only the encoder layers the feature layers read (hidden_states[k] is the output of k layers)."""
        body = getattr(self.tower, "vision_model", self.tower)  # transformers < 5 wraps the tower once more
        encoder = getattr(body, "encoder", None)
        blocks = getattr(encoder, "layers", None)
        if not isinstance(blocks, nn.ModuleList):
            return  # an unknown tower layout: run it whole
        n = len(blocks)
        absolute = [i if i >= 0 else n + 1 + i for i in self.layers]
        need = max(absolute)
        encoder.layers = blocks[:need]
        self.layers = absolute

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values, output_hidden_states=True, return_dict=True)
        feats = [out.hidden_states[i] for i in self.layers]  # each [tiles, extra + patches, vision_hidden]
        if self.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        x = feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)  # [tiles, T, vision_hidden * len(layers)]
        return self.projector(x.to(self.proj_device, self.proj_dtype))  # [tiles, T, hidden]


class VisionEncoder(nn.Module):
    """The torch backend: `EncoderGraph` with text-generation-webui's device / precision settings."""

    def __init__(self, model_dir: str | Path, settings: VisionSettings = VisionSettings()):
        super().__init__()
        model_dir = Path(model_dir)
        spec = CheckpointSpec.load(model_dir)
        if spec.vision is None:
            raise CheckpointError(f"{model_dir} is not a LLaVA-style checkpoint (no vision_config)")
        self.family = family_of(spec, settings.pipeline)
        self.pipeline = self.family.name
        self.tower_device = torch.device(settings.vision_device)
        self.tower_dtype = parse_bits(settings.vision_bits)
        self.graph = EncoderGraph(model_dir, spec, family=self.family)
        self.graph.proj_device, self.graph.proj_dtype = torch.device(settings.projector_device), \
            parse_bits(settings.projector_bits)
        self.graph.tower.to(self.tower_device, self.tower_dtype).eval()
        self.graph.projector.to(self.graph.proj_device, self.graph.proj_dtype).eval()
        self.image_size = spec.vision.image_size
        self.tokens_per_image = spec.vision.num_image_tokens  # per tile
        self.hidden_size = spec.text.hidden_size

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, 3, H, W] -> tile embeddings [tiles, T, hidden] (float32, on the CPU)."""
        if pixel_values.shape[0] == 0:
            return torch.zeros(0, self.tokens_per_image, self.hidden_size)
        return self.graph(pixel_values.to(self.tower_device, self.tower_dtype)).float().cpu()
