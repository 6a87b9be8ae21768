"""The one weight loader: a checkpoint's tensors by their transformers-5 names, whatever the files and key layout.

Files: `model.safetensors`, or the shards `model.safetensors.index.json` names (only those; a shard the index
names that is missing, or a key the index puts in a shard that does not hold it, is refused), or (older
checkpoints) `pytorch_model.bin` / its index.

Keys: every tensor is known by the name transformers 5 gives it in memory (`model.language_model.layers.N...`,
`lm_head.weight`, `model.vision_tower.embeddings...`, `model.multi_modal_projector...`, `model.image_newline`;
a plain Llama's `model.layers.N...`), whatever layout the checkpoint was saved in. The renames are transformers'
own for the families served (`transformers/conversion_mapping.py`), applied in its order; each family declares its
own (`families.Family.weight_renames`: llava's, llava_next's, qwen2_vl's), and the tower's follows:
- "CLIPVisionModel" (SigLIP and SigLIP2 share it), scoped to the tower: `PrefixChange(prefix_to_remove=
  "vision_model")`, i.e. `model.vision_tower.vision_model.` -> `model.vision_tower.`.
So the hub's transformers-4 saves (`language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`, `image_newline`), transformers-5 saves
(`language_model.model.*`, `vision_tower.*`) and the in-memory names all load alike. Keys no rule maps and no
consumer asks for are ignored, as transformers ignores unexpected keys; two file keys that map to one name are
refused (transformers would load one of them silently).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from .checkpoint_fields import Unservable
from .quant import QuantizedWeights, read_quantization
from .spec import CheckpointError, read_json

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")

# towers whose transformers class is CLIPVisionModel or shares its mapping (SiglipVisionModel, Siglip2VisionModel)
TOWERS_WITHOUT_VISION_MODEL = ("clip_vision_model", "siglip_vision_model", "siglip2_vision_model")
TOWER_RENAME = (r"^model\.vision_tower\.vision_model\.", "model.vision_tower.")


def renames_for(config: dict) -> tuple[tuple[str, str], ...]:
    """The rename rules transformers applies to a checkpoint with this raw config.json: its family's
    (`families.Family.weight_renames`), then the tower's; none for a text model."""
    from .families import family_for_config  # noqa: PLC0415 - the families name their checkpoints' layouts

    family = family_for_config(config)
    if family is None:
        return ()
    rules = tuple(family.weight_renames)
    tower = (config.get("vision_config") or {}).get("model_type")
    if tower in TOWERS_WITHOUT_VISION_MODEL:
        rules += (TOWER_RENAME,)
    return rules


def canonical_key(key: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key, count=1)
    return key


class TensorSource:
    """Lazy access to a checkpoint's tensors by their transformers-5 names (see the module docstring)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        config = read_json(self.model_dir / "config.json")
        self.rules = renames_for(config)
        self._open: dict[Path, Any] = {}
        self.files: dict[str, tuple[Path, str]] = {}  # name -> (file, key in the file)
        for name, (path, key) in self._file_keys():
            canon = canonical_key(key, self.rules)
            if canon in self.files:
                raise CheckpointError(f"{self.model_dir}: checkpoint keys {self.files[canon][1]!r} and {key!r} "
                                      f"both load as {canon!r}; a checkpoint must hold each tensor once")
            self.files[canon] = (path, key)
        try:  # a quantized checkpoint's scales leave the tensors; its weights are dequantized when read
            self.quant = QuantizedWeights.split(read_quantization(config), self.files)
        except Unservable as e:
            raise CheckpointError(f"{self.model_dir}: {e}") from None

    def _file_keys(self) -> Iterator[tuple[str, tuple[Path, str]]]:
        d = self.model_dir
        for index_name in INDEX_FILES:
            if (d / index_name).is_file():
                yield from self._indexed(d / index_name)
                return
        for single in SINGLE_FILES:
            if (d / single).is_file():
                for key in self._keys(d / single):
                    yield key, (d / single, key)
                return
        raise CheckpointError(f"{d} holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                              "or pytorch_model.bin.index.json")

    def _indexed(self, index: Path) -> Iterator[tuple[str, tuple[Path, str]]]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = {str(f) for f in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a weight index with a weight_map ({type(e).__name__}: {e})") \
                from None
        for shard in sorted(shards):
            path = self.model_dir / shard
            if not path.is_file():
                raise CheckpointError(f"{self.model_dir}: shard {shard!r} named by {index.name} is missing")
        held = {shard: set(self._keys(self.model_dir / shard)) for shard in sorted(shards)
                if shard.endswith(".safetensors")}  # header only; a .bin shard is checked when read
        for key, shard in weight_map.items():
            if shard in held and key not in held[shard]:
                raise CheckpointError(f"{self.model_dir}: {index.name} puts tensor {key!r} in {shard!r}, which "
                                      "does not hold it")
            yield key, (self.model_dir / shard, key)

    def _keys(self, path: Path) -> list[str]:
        h = self._handle(path)
        return list(h.keys())

    def _handle(self, path: Path):
        if path not in self._open:
            try:
                if path.suffix == ".safetensors":
                    from safetensors import safe_open  # noqa: PLC0415

                    self._open[path] = safe_open(str(path), framework="pt")
                else:
                    self._open[path] = torch.load(str(path), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                raise CheckpointError(f"cannot read weights file {path}: {type(e).__name__}: {e}") from None
        return self._open[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as the model computes with it (a quantized weight dequantized: `quant.dequant`)."""
        try:
            return self.quant.dequantize(name, self._read(*self.files[name]),
                                         lambda n: self._read(*self.quant.held[n]))
        except Unservable as e:
            raise CheckpointError(f"{self.model_dir}: {e}") from None

    def get_fp8(self, name: str):
        """A quantized weight kept in FP8 (`quant.fp8_weight.Fp8Weight`), or None where it is not quantized or
        must be dequantized at load (zero points, compressed-tensors scales other than fp32 ones, a grid `get`
        refuses: then `get` says why; block-wise FP8's bf16 / fp16 scales are widened to fp32, as transformers
        does). Its values are `get`'s, `float(q) * s` over each scale's block, without making them (no fp32
        copy at load: tests/test_gemv_fp8.py compares them)."""
        from .quant.fp8_weight import Fp8Weight  # noqa: PLC0415

        scale_name = self.quant.scales.get(name)
        if scale_name is None or name in self.quant.zero_points:
            return None
        q, scale = self._read(*self.files[name]), self._read(*self.quant.held[scale_name])
        quant = self.quant.quant
        if quant.method == "fp8" and scale.dtype in (torch.bfloat16, torch.float16):
            scale = scale.float()  # transformers' Fp8Dequantize widens the scales: float(q) * float(s) in fp32
        if q.dim() != 2 or scale.dtype != torch.float32:
            return None
        rows, cols = q.shape
        if quant.method == "fp8" and quant.block is not None and scale.numel() > 1:
            bm, bn = quant.block  # `dequant.block_dequantize`'s grid, exactly: else it refuses (`get`)
            if rows % bm or cols % bn or tuple(scale.shape) != (rows // bm, cols // bn):
                return None
            return Fp8Weight.of(q, scale, quant.block)
        if scale.numel() != 1 and (quant.method == "fp8" or scale.numel() != rows):  # per tensor; ct: per channel
            return None
        return Fp8Weight.of(q, scale, None)

    def stored_dtype(self, name: str) -> str:
        """The dtype a tensor is stored in, as safetensors names it ("BF16", "F32", ...; a .bin's torch dtype's
        name), read from the header without loading the tensor."""
        path, key = self.files[name]
        h = self._handle(path)
        if hasattr(h, "get_slice"):
            return str(h.get_slice(key).get_dtype())
        return {torch.bfloat16: "BF16", torch.float16: "F16"}.get(self._read(path, key).dtype, "other")

    def _read(self, path: Path, key: str) -> torch.Tensor:
        h = self._handle(path)
        if hasattr(h, "get_tensor"):
            return h.get_tensor(key)
        if key not in h:
            raise CheckpointError(f"{self.model_dir}: the weight index puts tensor {key!r} in {path.name}, which "
                                  "does not hold it")
        return h[key]

    def with_prefixes(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Every tensor under one of `prefixes` (transformers-5 names), keyed without it."""
        out = {}
        for name in self.files:
            for p in prefixes:
                if name.startswith(p):
                    out[name[len(p):]] = self.get(name)
        return out
