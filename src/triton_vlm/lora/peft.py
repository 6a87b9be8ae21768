"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) -> `Adapter`, exactly as PEFT applies
them, and -> TensorRT-LLM's tensors.

Rules (PEFT 0.21's):
- per module, r = `rank_pattern`'s first matching key, else `r`; alpha = `alpha_pattern`'s first matching key,
  else `lora_alpha` (a key matches a module name when `re.match(rf"(.*\\.)?({key})$", name)`); scale =
  alpha / r, or alpha / sqrt(r) with `use_rslora`. TensorRT-LLM's converter ignores `alpha_pattern`; we do not.
- language-model keys only, in both transformers layouts (`base_model.model.model.language_model.layers.N...`
  and `base_model.model.language_model.model.layers.N...`) and a plain Llama's (`base_model.model.model.layers.N`);
- refused with a message that says why (never mapped onto language-model layers, never ignored): an adapter
  that targets the vision tower or the projector, DoRA (`use_dora`, `lora_magnitude_vector`), a trained bias
  (`bias` other than "none", or bias tensors), `modules_to_save`, and any other module (embeddings, lm_head).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..errors import InvalidArgument
from ..spec import TextSpec
from .format import MODULE_IDS, Adapter, LoraModule, check_experts, module_shape, to_trtllm

_KEY = re.compile(r"^base_model\.model\.(?P<name>(?:model\.language_model\.|language_model\.model\.|model\.)layers\."
                  r"(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+))\.lora_(?P<ab>[AB])\.weight$")
_VISION = ("vision_tower", "multi_modal_projector", "vision_model", "visual")


def pattern_value(patterns: dict, name: str, default):
    """PEFT's `get_pattern_key`: the first key of `patterns` that matches the end of `name` wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _check_config(cfg: dict, where: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    if cfg.get("use_dora"):
        raise InvalidArgument(f"{where}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise InvalidArgument(f"{where}: adapters with trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise InvalidArgument(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported (only LoRA "
                              "weights of the language model's projections are applied)")


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    if (d / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file  # noqa: PLC0415

        return load_file(str(d / "adapter_model.safetensors"))
    if (d / "adapter_model.bin").is_file():
        return torch.load(str(d / "adapter_model.bin"), map_location="cpu", weights_only=True)
    raise InvalidArgument(f"{d}: no adapter_model.safetensors or adapter_model.bin")


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[tuple[str, int, str], dict[str, torch.Tensor]]:
    """(module name, layer, module) -> {"A": ..., "B": ...}; refuses every key that is not a LM projection."""
    pairs: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if any(v in key for v in _VISION):
            raise InvalidArgument(f"{where}: the adapter targets the vision tower or projector ({key}); only "
                                  "language-model adapters are served")
        if "lora_magnitude_vector" in key:
            raise InvalidArgument(f"{where}: DoRA adapters are not supported ({key})")
        m = _KEY.match(key)
        if ".experts." in key or ".shared_expert" in key or (m is not None and m.group("module") == "experts"):
            raise InvalidArgument(f"{where}: the adapter targets mixture-of-experts weights ({key}); LoRA on the "
                                  "experts is not served (adapters may target the attention projections and the "
                                  "dense layers' MLP)")
        if m is None or m.group("module") not in MODULE_IDS:
            raise InvalidArgument(f"{where}: tensor {key} is not a LoRA weight of a language-model projection "
                                  f"({', '.join(MODULE_IDS)}); biases, embeddings, lm_head are not supported")
        pairs.setdefault((m.group("name"), int(m.group("layer")), m.group("module")), {})[m.group("ab")] = t
    return pairs


def load_peft(adapter_dir: str | Path, spec: TextSpec | None, name: str | None = None) -> Adapter:
    """`spec` checks layers and shapes against the served model; None takes them from the tensors (the
    converter CLI, which has no base model)."""
    d = Path(adapter_dir)
    where = f"adapter {name or d.name}"
    try:
        cfg = json.loads((d / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{where}: cannot read adapter_config.json ({e})") from None
    _check_config(cfg, where)
    r0, alpha0, rslora = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"])), bool(cfg.get("use_rslora"))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    modules: dict[tuple[int, str], LoraModule] = {}
    for (mod_name, layer, module), ab in _pairs(_read_tensors(d), where).items():
        n_layers = spec.num_layers if spec is not None else layer + 1
        if set(ab) != {"A", "B"} or not 0 <= layer < n_layers:
            raise InvalidArgument(f"{where}: {mod_name} needs lora_A and lora_B of a layer in [0, {n_layers})")
        r = int(pattern_value(rank_pattern, mod_name, r0))
        alpha = float(pattern_value(alpha_pattern, mod_name, alpha0))
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        if spec is not None:
            check_experts(spec, layer, module, where)
        n_in, n_out = module_shape(spec, module) if spec is not None else (a.shape[1], b.shape[0])
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise InvalidArgument(f"{where}: {mod_name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                                  f"expected [{r}, {n_in}] and [{n_out}, {r}] (r {r})")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        modules[(layer, module)] = LoraModule(a.contiguous(), b.contiguous(), scale)
    if not modules:
        raise InvalidArgument(f"{where}: no LoRA weights found")
    return Adapter(name or d.name, modules)


def peft_to_trtllm(adapter_dir: str | Path, spec: TextSpec | None = None, dtype=None):
    """PEFT adapter -> (lora_weights [N, W], lora_config [N, 3]) as TensorRT-LLM's converter writes them
    (A, then scale * B, zero padded), but honouring `alpha_pattern` and refusing what it would mis-map."""
    import numpy as np  # noqa: PLC0415

    return to_trtllm(load_peft(adapter_dir, spec), dtype or np.float16)
