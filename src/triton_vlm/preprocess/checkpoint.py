"""What the serving code needs to know about a Hugging Face LLaVA checkpoint, read without loading weights.

`ModelInfo.load(model_dir)` reads `config.json`, `generation_config.json` and the processor / tokenizer files
and returns plain values: the image placeholder id, the family's image layout (tiles and placeholders per image
size, `layout`; `num_image_tokens` is the most one image takes), the tile size the processor produces, bos /
eos / pad ids, the context length, image start/end marker strings (as text-generation-webui's multimodal
pipelines add around each image), vocab and hidden sizes, and the pipeline name.

Pipelines (text-generation-webui's multimodal scheme) are the model families of `families/` ("llava",
"llava_next"): one is chosen from the config (`architectures`, then `model_type`) or by name (`get_pipeline`).
Checkpoint problems raise `CheckpointError` (a deployment error, not a request error) saying what was found
and what is supported.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..families import FAMILIES, Family, ImageLayout, describe_families, family_for_config, get_family
from ..spec import CheckpointError, CheckpointSpec
from ..spec import read_json as _read_json

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
    num_image_tokens: int  # the most placeholders one image takes (every image's count in a fixed layout)
    image_size: tuple[int, int]  # (H, W) of one tile of the processor's pixel_values
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
    layout: Optional[ImageLayout] = None  # tiles and placeholder tokens per image size (the family's)

    def image_tokens(self, size: tuple[int, int]) -> int:
        """Placeholders for an image of (height, width) pixels."""
        return self.num_image_tokens if self.layout is None else self.layout.tokens(size)

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
        pipe = get_family(pipeline) if pipeline else family_for_config(raw)
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
        return _describe(pipe, d, comps, context_length=context_length, image_start=image_start or "",
                         image_end=image_end or "")


# --- pipelines: the model families (`families/`) ------------------------------------------------------------
Pipeline = Family  # text-generation-webui's name for what serves one checkpoint family
PIPELINES = FAMILIES


def _layout(spec: CheckpointSpec, comps: HFComponents, family: Family) -> ImageLayout:
    """The family's image layout, checked against the checkpoint's own processor: the processor config's
    `num_additional_image_tokens` is the tower's CLS count when present, the processor's patch size and output
    must be the tower's."""
    layout = family.layout(spec, comps.processor_config.get("num_additional_image_tokens"))
    family.check_processor(layout, comps.image_processor)
    proc_patch = getattr(comps.processor, "patch_size", None)
    if comps.processor is not None and proc_patch and int(proc_patch) != layout.patch:
        raise CheckpointError(f"processor patch_size {proc_patch} differs from the vision tower's {layout.patch}")
    return layout


def _image_token(spec: CheckpointSpec, comps: HFComponents, family: Family) -> str:
    tok = comps.tokenizer
    if family.image_token is not None:
        return _checked_token(spec, tok, family.image_token)
    image_token = getattr(comps.processor, "image_token", None) or getattr(tok, "image_token", None) or "<image>"
    return _checked_token(spec, tok, image_token)


def _checked_token(spec: CheckpointSpec, tok: Any, image_token: str) -> str:
    tok_id = tok.convert_tokens_to_ids(image_token)
    if tok_id != spec.image_token_id:
        raise CheckpointError(f"config image_token_id {spec.image_token_id} but the tokenizer maps "
                              f"{image_token!r} to {tok_id}")
    if not 0 <= spec.image_token_id < spec.text.vocab_size:
        raise CheckpointError(f"image_token_id {spec.image_token_id} is outside the vocabulary (size "
                              f"{spec.text.vocab_size})")
    return image_token


def _describe(family: Family, model_dir: Path, comps: HFComponents, *, context_length: int | None,
              image_start: str, image_end: str) -> ModelInfo:
    spec = CheckpointSpec.load(model_dir)
    if spec.vision is None or spec.image_token_id is None:
        raise CheckpointError(f"{model_dir}: expected a LLaVA checkpoint (vision_config and image_token_id)")
    tok, text_cfg = comps.tokenizer, family.text_config(spec.hf_config)
    layout = _layout(spec, comps, family)
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
        model_dir=str(model_dir), pipeline=family.name, model_class=family.model_class,
        image_token=_image_token(spec, comps, family), image_token_id=spec.image_token_id,
        num_image_tokens=layout.max_tokens, image_size=layout.tile_hw,
        patch_size=spec.vision.patch_size, vision_feature_select_strategy=spec.vision.select_strategy,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=spec.eos_ids,
        pad_token_id=None if pad is None else int(pad),
        add_bos=bos is not None and bool(with_special) and with_special[0] == bos,
        context_length=ctx, image_start=image_start or family.image_start, image_end=image_end or family.image_end,
        vocab_size=spec.text.vocab_size, hidden_size=spec.text.hidden_size, layout=layout)


def available_pipelines() -> list[str]:
    return sorted(FAMILIES)


def describe_pipelines() -> str:
    return describe_families()


def get_pipeline(name: str) -> Family:
    return get_family(name)


def pipeline_for_config(config: dict) -> Family | None:
    """The family serving a raw config.json dict: by architectures first, then model_type; None if none."""
    return family_for_config(config)
