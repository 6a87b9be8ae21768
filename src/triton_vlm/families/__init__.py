"""One module per model family: everything a family does differently, asked by the stages (see `base.Family`).

| family | module | transformers class |
| --- | --- | --- |
| `llava` | `llava.py` | `LlavaForConditionalGeneration` (llava-1.5, llava-interleave) |
| `llava_next` | `llava_next.py` | `LlavaNextForConditionalGeneration` (llava-v1.6) |
| `qwen2_vl` | `qwen2_vl.py` | `Qwen2VLForConditionalGeneration` (Qwen2-VL) |
| `qwen2_5_vl` | `qwen2_vl.py` | `Qwen2_5_VLForConditionalGeneration` (Qwen2.5-VL) |
| `qwen3_vl` | `qwen3_vl.py` | `Qwen3VLForConditionalGeneration` (Qwen3-VL, dense) |
| `qwen3_vl_moe` | `qwen3_vl.py` | `Qwen3VLMoeForConditionalGeneration` (Qwen3-VL-MoE) |
| `qwen3_5` | `qwen3_5.py` | `Qwen3_5ForConditionalGeneration` (Qwen3.5 / 3.6 dense: hybrid linear attention) |
| `qwen3_5_moe` | `qwen3_5.py` | `Qwen3_5MoeForConditionalGeneration` (Qwen3.5-MoE: hybrid, shared expert) |

Adding a family (LLaVA-OneVision, Qwen2-VL, ...) is a new module with a `Family` subclass, registered in
`FAMILIES` below: its checkpoint recognition and layout (`weight_renames`), `ImageLayout` (tiles and tokens per
image), projector and `Packer` (post-processing of the tiles' features), the text models it nests and what the
engine does differently for them (`text_rules`: data, never a name). Preprocess, vision, the weight loader, the
engine and the launcher take everything from it (docs/families.md).
"""
from __future__ import annotations

from typing import Any, Optional

from ..spec import CheckpointError, CheckpointSpec
from .base import Family, ImageLayout, Packer, PositionRule, Size, TextRules
from .llava import LLAVA
from .llava_next import LLAVA_NEXT, AnyResLayout
from .qwen2_vl import QWEN2_5_VL, QWEN2_VL, PatchLayout
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE
from .qwen3_vl import QWEN3_VL, QWEN3_VL_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAVA, LLAVA_NEXT, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE,
                                                  QWEN3_5, QWEN3_5_MOE)}

__all__ = ["FAMILIES", "AnyResLayout", "PatchLayout", "Family", "ImageLayout", "Packer", "PositionRule", "Size",
           "TextRules", "describe_families", "family_for_config", "family_of", "get_family", "text_rules"]


def describe_families() -> str:
    return "; ".join(f.describe() for f in FAMILIES.values())


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise CheckpointError(f"unknown pipeline {name!r}; available: {', '.join(sorted(FAMILIES))}") from None


def family_for_config(config: dict) -> Optional[Family]:
    """The family serving a raw config.json dict: by architectures first, then model_type; None if none."""
    archs = config.get("architectures") or []
    for f in FAMILIES.values():
        if any(a in f.architectures for a in archs):
            return f
    for f in FAMILIES.values():
        if config.get("model_type") == f.model_type:
            return f
    return None


def family_of(spec: CheckpointSpec, name: str = "auto") -> Family:
    """The family of a loaded checkpoint (or the one named, which must serve it)."""
    cfg: Any = spec.hf_config
    raw = {"model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}
    family = family_for_config(raw) if name in ("", "auto") else get_family(name)
    if family is None or not family.matches(raw):
        raise CheckpointError(f"{spec.model_dir}: unsupported checkpoint: model_type {raw['model_type']!r}, "
                              f"architectures {raw['architectures']}; supported: {describe_families()}")
    family.check_text(spec)
    return family


def text_rules(spec: CheckpointSpec) -> TextRules:
    """What the engine does differently for this checkpoint's text model (none for a plain text checkpoint)."""
    if getattr(spec.hf_config, "text_config", None) is None:
        return TextRules()
    return family_of(spec).text_rules(spec)
