"""The vision tower + projector of a LLaVA checkpoint, loaded without the language model.

`VisionEncoder(model_dir, VisionSettings(...))(pixel_values [n, 3, H, W]) -> [n, T, hidden]` equals
`LlavaForConditionalGeneration.get_image_features(...)` on the same weights. The settings are those of
text-generation-webui's multimodal pipelines: `vision_device` / `vision_bits` for the tower, `projector_device` / `projector_bits` for the
projector, and a pipeline chosen from the checkpoint's config ("auto") or by name (`triton_vlm.checkpoint.PIPELINES`).
The feature layer and select strategy always come from the checkpoint's config, so the number of features per
image is the number of placeholders preprocess inserts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import InvalidArgument
from .checkpoint import describe_pipelines, get_pipeline, pipeline_for_config
from .spec import CheckpointError, CheckpointSpec, TensorSource

_DTYPES = {32: torch.float32, 16: torch.float16, "bf16": torch.bfloat16}


def parse_bits(value: str | int | None) -> torch.dtype:
    v = str(value or "32").strip().lower()
    key = "bf16" if v in ("bf16", "bfloat16") else int(v) if v.isdigit() else v
    if key not in _DTYPES:
        raise ValueError(f"bits must be 32, 16 or bf16, got {value!r}")
    return _DTYPES[key]


def check_pixel_values(pv, image_size: int) -> None:
    """Raise InvalidArgument unless `pv` is [images, 3, image_size, image_size] of finite values."""
    import numpy as np  # noqa: PLC0415

    want = f"[n, 3, {image_size}, {image_size}]"
    if pv.ndim != 4 or (pv.shape[0] and tuple(pv.shape[1:]) != (3, image_size, image_size)):
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


class VisionEncoder(nn.Module):
    def __init__(self, model_dir: str | Path, settings: VisionSettings = VisionSettings()):
        super().__init__()
        from transformers import AutoModel  # noqa: PLC0415
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector  # noqa: PLC0415

        model_dir = Path(model_dir)
        spec = CheckpointSpec.load(model_dir)
        if spec.vision is None:
            raise CheckpointError(f"{model_dir} is not a LLaVA-style checkpoint (no vision_config)")
        config = spec.hf_config
        raw = json.loads((model_dir / "config.json").read_text())
        pipe = pipeline_for_config(raw) if settings.pipeline in ("", "auto") else get_pipeline(settings.pipeline)
        if pipe is None or not pipe.matches(raw):
            raise CheckpointError(f"{model_dir}: no vision pipeline for model_type {raw.get('model_type')!r}; "
                                  f"available: {describe_pipelines()}")
        self.pipeline = pipe.name
        self.feature_layer = spec.vision.feature_layer
        self.select_strategy = spec.vision.select_strategy
        self.tower_device = torch.device(settings.vision_device)
        self.proj_device = torch.device(settings.projector_device)
        self.tower_dtype = parse_bits(settings.vision_bits)
        self.proj_dtype = parse_bits(settings.projector_bits)

        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        weights = TensorSource(model_dir)
        for module, names in ((self.tower, ("model.vision_tower.", "vision_tower.")),
                              (self.projector, ("model.multi_modal_projector.", "multi_modal_projector."))):
            sd = weights.with_prefixes(names)
            missing, unexpected = module.load_state_dict(sd, strict=False)
            missing = [m for m in missing if "position_ids" not in m]
            if missing:
                raise ValueError(f"{model_dir}: weights missing for {names[1]}: {missing[:5]}")
        self.tower.to(self.tower_device, self.tower_dtype).eval()
        self.projector.to(self.proj_device, self.proj_dtype).eval()
        self.image_size = spec.vision.image_size
        self.tokens_per_image = spec.vision.num_image_tokens
        self.hidden_size = spec.text.hidden_size

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, H, W] -> image embeddings [n, T, hidden] (float32, on the CPU)."""
        n = pixel_values.shape[0]
        if n == 0:
            return torch.zeros(0, self.tokens_per_image, self.hidden_size)
        out = self.tower(pixel_values.to(self.tower_device, self.tower_dtype), output_hidden_states=True,
                         return_dict=True)
        layers = self.feature_layer if isinstance(self.feature_layer, (list, tuple)) else [self.feature_layer]
        feats = [out.hidden_states[i] for i in layers]  # each [n, 1 + patches, vision_hidden]
        if self.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        x = torch.cat(feats, dim=-1)  # [n, T, vision_hidden * len(layers)]
        x = self.projector(x.to(self.proj_device, self.proj_dtype))  # [n, T, hidden]
        return x.float().cpu()


def encode_batch(encoder: VisionEncoder, per_request: list, chunk: int = 32) -> list:
    """The images of many requests in as few forwards as possible (ragged counts, zero allowed).

    `per_request[i]`: request i's pixel values as numpy [n_i, 3, H, W], or None for none. Returns, per request,
    its image embeddings as numpy [n_i, T, hidden], or the `InvalidArgument` its input raised (the others are
    unaffected). All valid images are concatenated and encoded `chunk` at a time.
    """
    import numpy as np  # noqa: PLC0415

    counts, pixels, out = [], [], []
    for pv in per_request:
        try:
            pv = np.zeros((0, 3, encoder.image_size, encoder.image_size), np.float32) if pv is None else pv
            check_pixel_values(pv, encoder.image_size)
            counts.append(pv.shape[0])
            if pv.shape[0]:
                pixels.append(torch.from_numpy(np.ascontiguousarray(pv, dtype=np.float32)))
        except InvalidArgument as e:
            counts.append(e)
    if pixels:
        allpix = torch.cat(pixels)  # [sum images, 3, H, W]
        embeds = torch.cat([encoder(c) for c in allpix.split(chunk)])  # [sum images, T, hidden]
    else:
        embeds = encoder(torch.zeros(0, 3, 1, 1))
    start = 0
    for n in counts:
        if isinstance(n, Exception):
            out.append(n)
            continue
        out.append(embeds[start:start + n].numpy())
        start += n
    return out
