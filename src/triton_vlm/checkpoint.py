"""What the serving code needs to know about a Hugging Face LLaVA checkpoint, read without loading weights.

`ModelInfo.load(model_dir)` reads `config.json`, `generation_config.json` and the processor / tokenizer files
and returns plain values: the image placeholder id and how many placeholders one image takes, the image size
the processor produces, bos / eos / pad ids, the context length, image start/end marker strings (as text-generation-webui's
multimodal pipelines add around each image),
vocab and hidden sizes, and the pipeline name.

Pipelines (text-generation-webui's multimodal scheme): a registry maps a pipeline name ("llava") to the checkpoint family it serves; a
pipeline is chosen from the config (`architectures`, then `model_type`) or by name (`get_pipeline`).
Checkpoint problems raise `CheckpointError` (a deployment error, not a request error) saying what was found
and what is supported.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .spec import CheckpointError, CheckpointSpec, image_token_count
from .spec import read_json as _read_json

log = logging.getLogger(__name__)

# re-exported: the checkpoint's one description and its error type live in `spec.py`
__all__ = ["CheckpointError", "HFComponents", "ModelInfo", "load_components", "get_pipeline", "pipeline_for_config",
           "describe_pipelines", "available_pipelines"]


@dataclass
class HFComponents:
    """The checkpoint's tokenizer and image processor, loaded once and shared by ModelInfo and Preprocessor."""

    tokenizer: Any
    image_processor: Any
    processor: Any = None  # the LlavaProcessor when the checkpoint saved one
    processor_config: dict = field(default_factory=dict)  # raw processor_config.json (may be empty)


def load_components(model_dir: str | Path) -> HFComponents:
    """AutoProcessor, falling back to AutoTokenizer + AutoImageProcessor for checkpoints without a processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    d = Path(model_dir)
    proc_cfg = _read_json(d / "processor_config.json")
    try:
        processor = AutoProcessor.from_pretrained(str(d))
    except Exception as e:  # no processor files, or a processor class we do not know
        log.info("AutoProcessor failed for %s (%s); loading tokenizer and image processor separately", d, e)
        processor = None
    tokenizer = getattr(processor, "tokenizer", None)
    image_processor = getattr(processor, "image_processor", None)
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(d))
        if image_processor is None:
            image_processor = AutoImageProcessor.from_pretrained(str(d))
    except Exception as e:
        raise CheckpointError(f"{d}: cannot load the tokenizer / image processor ({type(e).__name__}: {e}); a "
                              "LLaVA checkpoint needs tokenizer files and a (pre)processor config") from None
    return HFComponents(tokenizer, image_processor, processor, proc_cfg)


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    pipeline: str  # registry name, e.g. "llava"
    model_class: str  # transformers class holding the weights, e.g. "LlavaForConditionalGeneration"
    image_token: str  # placeholder string, e.g. "<image>"
    image_token_id: int  # placeholder id; the llm replaces these positions with image features
    num_image_tokens: int  # placeholders per image
    image_size: tuple[int, int]  # (H, W) of the processor's pixel_values
    patch_size: int
    vision_feature_select_strategy: str  # "default" (drop CLS) or "full"
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    pad_token_id: Optional[int]
    add_bos: bool  # the tokenizer prepends bos_token_id to an encoded prompt
    context_length: int  # prompt + new tokens
    image_start: str = ""  # text added before each image (e.g. MiniGPT-4's "<Img>")
    image_end: str = ""  # text added after each image
    vocab_size: int = 0  # rows of the language model's embedding
    hidden_size: int = 0  # language model hidden size (= projector output)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        pipeline: str | None = None,
        context_length: int | None = None,
        image_start: str | None = None,
        image_end: str | None = None,
        components: HFComponents | None = None,
    ) -> "ModelInfo":
        """Read the checkpoint in `model_dir` (no weights). Pass `components` to reuse a loaded processor."""
        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise CheckpointError(f"{d} is not a Hugging Face checkpoint: no config.json")
        raw = _read_json(d / "config.json")
        pipe = get_pipeline(pipeline) if pipeline else pipeline_for_config(raw)
        if pipe is None:
            raise CheckpointError(
                f"{d}: unsupported checkpoint: model_type {raw.get('model_type')!r}, architectures "
                f"{raw.get('architectures')}; supported: {describe_pipelines()}")
        if not pipe.matches(raw):
            raise CheckpointError(
                f"{d}: pipeline {pipe.name!r} serves model_type {pipe.model_type!r} "
                f"({', '.join(pipe.architectures)}) but the checkpoint has model_type {raw.get('model_type')!r}, "
                f"architectures {raw.get('architectures')}")
        comps = components if components is not None else load_components(d)
        return pipe.describe(d, comps, context_length=context_length, image_start=image_start or "",
                             image_end=image_end or "")


# --- pipelines -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pipeline:
    name: str
    model_type: str  # config.json model_type
    architectures: tuple[str, ...]  # config.json architectures served
    model_class: str  # transformers class to load the weights with
    describe: Callable[..., ModelInfo]  # (model_dir, components, *, context_length, image_start, image_end)

    def matches(self, config: dict) -> bool:
        archs = config.get("architectures") or []
        return config.get("model_type") == self.model_type or any(a in self.architectures for a in archs)


def _processor_output_size(image_processor: Any) -> tuple[int, int]:
    """(H, W) of pixel_values, measured on two dummy images of opposite aspect ratios; must not vary."""
    from PIL import Image

    shapes = set()
    for size in ((48, 20), (20, 48)):
        out = image_processor([Image.new("RGB", size, (128, 64, 32))], return_tensors="np")
        pv = np.asarray(out["pixel_values"])
        if pv.ndim != 4 or pv.shape[1] != 3:
            raise CheckpointError(f"image processor {type(image_processor).__name__} returned pixel_values of "
                                  f"shape {pv.shape}; expected [n, 3, H, W] (tiling processors are unsupported)")
        shapes.add(tuple(int(x) for x in pv.shape[-2:]))
    if len(shapes) != 1:
        raise CheckpointError(f"image processor output size depends on the input image ({sorted(shapes)}); "
                              "a fixed size is required (e.g. center crop or a fixed height/width)")
    return shapes.pop()


def _image_tokens(spec: CheckpointSpec, comps: HFComponents, image_size: tuple[int, int]) -> int:
    """Placeholders per image (`spec.image_token_count`), on the processor's output size; the processor
    config's `num_additional_image_tokens` wins over the tower type's CLS count when present."""
    vision = spec.vision
    if image_size != (vision.image_size, vision.image_size):
        raise CheckpointError(f"the image processor produces {image_size[0]}x{image_size[1]} images but the "
                              f"vision tower expects {vision.image_size}x{vision.image_size}")
    proc_patch = getattr(comps.processor, "patch_size", None)
    if comps.processor is not None and proc_patch and int(proc_patch) != vision.patch_size:
        raise CheckpointError(f"processor patch_size {proc_patch} differs from the vision tower's {vision.patch_size}")
    extra = vision.known_extra_tokens(comps.processor_config.get("num_additional_image_tokens"))
    return image_token_count(image_size, vision.patch_size, extra, vision.select_strategy)


def _image_token(spec: CheckpointSpec, comps: HFComponents) -> str:
    tok = comps.tokenizer
    image_token = getattr(comps.processor, "image_token", None) or getattr(tok, "image_token", None) or "<image>"
    tok_id = tok.convert_tokens_to_ids(image_token)
    if tok_id != spec.image_token_id:
        raise CheckpointError(f"config image_token_id {spec.image_token_id} but the tokenizer maps "
                              f"{image_token!r} to {tok_id}")
    if not 0 <= spec.image_token_id < spec.text.vocab_size:
        raise CheckpointError(f"image_token_id {spec.image_token_id} is outside the vocabulary (size "
                              f"{spec.text.vocab_size})")
    return image_token


def _describe_llava(model_dir: Path, comps: HFComponents, *, context_length: int | None, image_start: str,
                    image_end: str) -> ModelInfo:
    spec = CheckpointSpec.load(model_dir)
    if spec.vision is None or spec.image_token_id is None:
        raise CheckpointError(f"{model_dir}: expected a LLaVA checkpoint (vision_config and image_token_id)")
    tok, text_cfg = comps.tokenizer, spec.hf_config.text_config
    image_size = _processor_output_size(comps.image_processor)
    bos = tok.bos_token_id if tok.bos_token_id is not None else getattr(text_cfg, "bos_token_id", None)
    with_special = tok("x", add_special_tokens=True)["input_ids"]
    pad = tok.pad_token_id
    if pad is None:
        pad = _read_json(model_dir / "generation_config.json").get("pad_token_id",
                                                                   getattr(text_cfg, "pad_token_id", None))
    ctx = int(context_length) if context_length is not None else spec.context_length
    if ctx <= 0:
        raise CheckpointError(f"context length must be positive, got {ctx}; pass context_length")
    return ModelInfo(
        model_dir=str(model_dir), pipeline="llava", model_class="LlavaForConditionalGeneration",
        image_token=_image_token(spec, comps), image_token_id=spec.image_token_id,
        num_image_tokens=_image_tokens(spec, comps, image_size), image_size=image_size,
        patch_size=spec.vision.patch_size, vision_feature_select_strategy=spec.vision.select_strategy,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=spec.eos_ids,
        pad_token_id=None if pad is None else int(pad),
        add_bos=bos is not None and bool(with_special) and with_special[0] == bos,
        context_length=ctx, image_start=image_start, image_end=image_end,
        vocab_size=spec.text.vocab_size, hidden_size=spec.text.hidden_size)


PIPELINES: dict[str, Pipeline] = {
    "llava": Pipeline("llava", "llava", ("LlavaForConditionalGeneration",), "LlavaForConditionalGeneration",
                      _describe_llava),
}


def available_pipelines() -> list[str]:
    return sorted(PIPELINES)


def describe_pipelines() -> str:
    return "; ".join(f"{p.name} (model_type {p.model_type!r}: {', '.join(p.architectures)})"
                     for p in PIPELINES.values())


def get_pipeline(name: str) -> Pipeline:
    try:
        return PIPELINES[name]
    except KeyError:
        raise CheckpointError(f"unknown pipeline {name!r}; available: {', '.join(available_pipelines())}") from None


def pipeline_for_config(config: dict) -> Pipeline | None:
    """The pipeline serving a raw config.json dict: by architectures first, then model_type; None if none."""
    archs = config.get("architectures") or []
    for p in PIPELINES.values():
        if any(a in p.architectures for a in archs):
            return p
    for p in PIPELINES.values():
        if config.get("model_type") == p.model_type:
            return p
    return None
