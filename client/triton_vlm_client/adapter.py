"""A LoRA adapter folder -> the tensors a request carries (`lora_weights` FP16 [N, W], `lora_config` INT32 [N, 3]),
with numpy and safetensors only (no torch in the client).

A folder holds TensorRT-LLM's converted pair (`model.lora_weights.npy` + `model.lora_config.npy`, sent as they
are) or a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`), converted here as TensorRT-LLM's
`hf_lora_convert.py` does (row = A, then scale * B, zero padded; module ids q 1, k 2, v 3, o 4, gate 5, down 6,
up 7) but with PEFT's own rules where that converter departs from them: `alpha_pattern` is honoured, and
adapters the server would refuse (vision tower or projector keys, DoRA, biases, `modules_to_save`) are refused
here too. The server's `triton_vlm.lora.peft` applies the same rules; a test checks both give the same tensors.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
_KEY = re.compile(r"^base_model\.model\.(?P<name>(?:model\.language_model\.|language_model\.model\.|model\.)layers\."
                  r"(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+))\.lora_(?P<ab>[AB])\.weight$")
_VISION = ("vision_tower", "multi_modal_projector", "vision_model", "visual")


def read_adapter(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """-> (lora_weights float16 [N, W], lora_config int32 [N, 3]); ValueError says what is wrong."""
    d = Path(path)
    w, c = d / "model.lora_weights.npy", d / "model.lora_config.npy"
    if w.is_file() and c.is_file():
        weights, config = np.load(w), np.load(c)
        if weights.ndim == 3:  # the converter's files keep TensorRT-LLM's batch dimension of 1
            weights, config = weights[0], config[0]
        return weights.astype(np.float16), config[:, :3].astype(np.int32)
    if (d / "adapter_config.json").is_file():
        return _from_peft(d)
    raise ValueError(f"{d}: neither model.lora_weights.npy + model.lora_config.npy nor a PEFT adapter "
                     "(adapter_config.json + adapter_model.safetensors)")


def _pattern(patterns: dict, name: str, default):
    """PEFT's rule: the first key of `patterns` matching the end of the module name wins."""
    return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", name)), default)


def _from_peft(d: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = json.loads((d / "adapter_config.json").read_text())
    if cfg.get("use_dora") or cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ValueError(f"{d}: DoRA, trained biases and modules_to_save are not supported")
    r0, alpha0 = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    pairs: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}
    for key, t in load_file(str(d / "adapter_model.safetensors")).items():
        m = _KEY.match(key)
        if any(v in key for v in _VISION) or m is None or m.group("module") not in MODULE_IDS:
            raise ValueError(f"{d}: tensor {key} is not a LoRA weight of a language-model projection")
        pairs.setdefault((int(m.group("layer")), m.group("module"), m.group("name")), {})[m.group("ab")] = t
    rows, config = [], []
    for (layer, module, name), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], MODULE_IDS[kv[0][1]])):
        r = int(_pattern(cfg.get("rank_pattern") or {}, name, r0))
        alpha = float(_pattern(cfg.get("alpha_pattern") or {}, name, alpha0))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        a, b = ab["A"].astype(np.float32), ab["B"].astype(np.float32)  # [r, in], [out, r]
        rows.append(np.concatenate([a.reshape(-1), (b * np.float32(scale)).reshape(-1)]))
        config.append([MODULE_IDS[module], layer, r])
    width = max(len(x) for x in rows)
    weights = np.zeros((len(rows), width), np.float16)
    for i, x in enumerate(rows):
        weights[i, :len(x)] = x
    return weights, np.asarray(config, np.int32)
