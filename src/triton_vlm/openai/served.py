"""What the front end serves: the base model's id, the registry's adapters, the tokenizer and chat template, and
the checkpoint's facts the API needs (end ids, context length, default sampling).

Model ids follow vLLM: the base model's id is `--served-model-name`, default the checkpoint folder's name; each
adapter of the LoRA registry (`--lora-dir`, else the folder the server's llm model was given) is a model of its
own, `parent` = the base id; `root` is the base id too (no card shows a filesystem path); a request naming an
adapter runs with `lora_name` = that adapter. The registry is listed again when its folder changes, so adapters
added to a running server appear without a restart.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .chat_template import ChatTemplate, load_template
from .errors import APIError


@dataclass
class Adapters:
    root: Optional[Path]
    _cache: tuple[int, list[str]] = field(default=(-1, []))

    def names(self) -> list[str]:
        if self.root is None or not self.root.is_dir():
            return []
        stamp = self.root.stat().st_mtime_ns  # adding or removing a subfolder changes it
        if self._cache[0] != stamp:
            from ..lora.registry import Registry  # the server's own naming rules

            self._cache = (stamp, Registry(self.root, None).names())
        return self._cache[1]


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """Sampling used when a request sets none of temperature / top_p / top_k: the checkpoint's
    generation_config.json, read as `transformers` does (do_sample false or absent -> greedy, the ensemble's own
    default; do_sample true -> its temperature / top_p / top_k)."""
    f = model_dir / "generation_config.json"
    try:
        cfg = json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        cfg = {}
    if not cfg.get("do_sample"):
        return {}
    out = {"temperature": float(cfg.get("temperature", 1.0))}
    if cfg.get("top_p") is not None:
        out["top_p"] = float(cfg["top_p"])
    if cfg.get("top_k") is not None:
        out["top_k"] = int(cfg["top_k"])
    return out


def image_markers(spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What stands for an image and for a video in a prompt of this checkpoint: `<image>` and its family's own
    format; `<video>` and its family's (none for a family that takes no videos)."""
    from ..families import family_for_config  # noqa: PLC0415
    from ..preprocess.prompt import IMAGE_MARKER  # noqa: PLC0415
    from ..spec import read_json  # noqa: PLC0415

    family = family_for_config(read_json(spec.model_dir / "config.json"))
    if family is None:
        return (IMAGE_MARKER,), ()
    videos = ("<video>",) + family.video_markers if family.video_token is not None else ()
    return (IMAGE_MARKER,) + family.image_markers, videos


class ServedModel:
    def __init__(self, model_dir: Path, *, served_name: Optional[str] = None, lora_dir: Optional[Path] = None,
                 chat_template: Optional[Path] = None, context_length: int = 0):
        from transformers import AutoTokenizer

        from ..spec import CheckpointSpec

        self.model_dir = Path(model_dir).expanduser().resolve()
        self.base_id = served_name or self.model_dir.name
        self.created = int(time.time())
        spec = CheckpointSpec.load(self.model_dir)
        self.eos_ids = frozenset(spec.eos_ids)
        self.context_length = context_length or spec.context_length
        self.weights = spec.quant.label if spec.quant is not None else "unquantized"  # /v1/models says it
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        source, origin = load_template(self.model_dir, chat_template, self.tokenizer)
        self.markers, self.video_markers = image_markers(spec)
        self.chat = ChatTemplate(source, self.tokenizer, origin, self.markers, self.video_markers) if source else None
        self.adapters = Adapters(Path(lora_dir).expanduser().resolve() if lora_dir else None)
        self.defaults = generation_defaults(self.model_dir)

    def resolve(self, model: str) -> Optional[str]:
        """The lora_name a request's `model` selects (None for the base model); 404 when it names neither."""
        if model == self.base_id:
            return None
        if model in self.adapters.names():
            return model
        raise APIError(404, f"The model `{model}` does not exist (GET /v1/models lists the models served).",
                       param="model", code="model_not_found")

    def cards(self, held: Optional[str] = None) -> list[dict]:
        """The base model's card and one per adapter. The base's says which precision is served: `weights`, from
        the checkpoint's quantization_config (e.g. "fp8-e4m3 (block 128x128 weight_scale_inv), computed as its
        float32 dequantization", or "unquantized"), and `held`, how the engine keeps the matrices in memory (the
        llm's metric, e.g. "float8_e4m3fn+bfloat16"; None where the server does not say)."""
        base = {"id": self.base_id, "object": "model", "created": self.created, "owned_by": "triton-vlm",
                "root": self.base_id, "parent": None, "max_model_len": self.context_length, "weights": self.weights,
                "held": held}
        cards = [base]
        for name in self.adapters.names():
            cards.append({"id": name, "object": "model", "created": self.created, "owned_by": "triton-vlm",
                          "root": self.base_id, "parent": self.base_id,
                          "max_model_len": self.context_length})
        return cards
