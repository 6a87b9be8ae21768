"""One LoRA adapter in memory, and TensorRT-LLM's tensor format for it.

TensorRT-LLM (`examples/hf_lora_convert.py`, `lora_manager.py`) carries an adapter as two tensors:
- `lora_config` INT32 [N, 3]: rows `[module_id, layer, r]`;
- `lora_weights` [N, W]: row = flatten(A [r, in]) then flatten(scale * B [out, r]), zero padded to the longest
  row (W). The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B.
Module ids of the Llama projections, as TensorRT-LLM's converter maps Hugging Face names: q_proj 1, k_proj 2,
v_proj 3, o_proj 4, gate_proj 5, down_proj 6, up_proj 7.

In memory an `Adapter` keeps, per (layer, module), A and B in fp32 and the scale apart (PEFT applies it after
B: `base(x) + B(A(x)) * scale`), so an adapter read from PEFT computes exactly what PEFT computes; one read
from TensorRT-LLM tensors has its scale folded into B already (scale 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidArgument
from ..spec import TextSpec

MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
MODULE_NAMES = {v: k for k, v in MODULE_IDS.items()}
MAX_RANK = 256


def module_shape(spec: TextSpec, module: str) -> tuple[int, int]:
    """(in, out) features of a projection of the language model."""
    h, q, kv, ff = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    gate = 2 if spec.attn_output_gate else 1  # q_proj also yields the output gate (Qwen3.5): twice the outputs
    return {"q_proj": (h, q * gate), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ff),
            "up_proj": (h, ff), "down_proj": (ff, h)}[module]


def check_experts(spec: TextSpec, layer: int, module: str, where: str) -> None:
    """A mixture-of-experts layer has no dense MLP: an adapter on its MLP projections is refused by name (LoRA is
    served on the attention projections, and on the MLP of the dense layers). A hybrid model's linear-attention layer
    (`spec.TextSpec.layer_kinds`) has no q/k/v/o_proj: an adapter on them is refused by name (its own projections,
    `linear_attn.*`, are not LoRA targets here: `peft._pairs` refuses their keys)."""
    if spec.layer_kinds and spec.layer_kinds[layer] == "linear_attention" and module in ("q_proj", "k_proj", "v_proj",
                                                                                          "o_proj"):
        full = [i for i, k in enumerate(spec.layer_kinds) if k == "full_attention"]
        raise InvalidArgument(f"{where}: {module} of layer {layer}: that layer is a linear-attention (Gated DeltaNet) "
                              f"layer without {module}; attention adapters may target the full-attention layers "
                              f"{full}, MLP adapters any layer")
    if layer in spec.sparse_layers and module in ("gate_proj", "up_proj", "down_proj"):
        dense = [i for i in range(spec.num_layers) if i not in spec.sparse_layers]
        raise InvalidArgument(f"{where}: {module} of layer {layer} is in a mixture-of-experts layer; LoRA on the "
                              f"experts is not served (adapters may target q_proj, k_proj, v_proj, o_proj, and "
                              f"gate_proj / up_proj / down_proj of the dense layers {dense})")


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [r, in]: fp32 (registry adapters, as PEFT keeps them) or the model's dtype (wire weights)
    b: torch.Tensor  # [out, r]; the adapter math upcasts both to fp32, as PEFT does
    scale: float  # applied after B (1.0 when folded into B)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class Adapter:
    name: str
    modules: dict[tuple[int, str], LoraModule] = field(default_factory=dict)  # (layer, module) -> weights

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size()
                   for m in self.modules.values())

    def to(self, device: torch.device | str) -> "Adapter":
        mods = {k: LoraModule(m.a.to(device), m.b.to(device), m.scale) for k, m in self.modules.items()}
        return Adapter(self.name, mods)


def to_trtllm(adapter: Adapter, dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """-> (lora_weights [N, W] in `dtype`, lora_config INT32 [N, 3]), rows in (layer, module id) order."""
    rows, config = [], []
    for (layer, module), m in sorted(adapter.modules.items(), key=lambda kv: (kv[0][0], MODULE_IDS[kv[0][1]])):
        rows.append(np.concatenate([m.a.reshape(-1).numpy(), (m.b * m.scale).reshape(-1).numpy()]))
        config.append([MODULE_IDS[module], layer, m.rank])
    width = max((len(r) for r in rows), default=0)
    weights = np.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        weights[i, :len(r)] = r
    return weights, np.asarray(config, dtype=np.int32).reshape(-1, 3)


@dataclass(frozen=True)
class RowPlan:
    """One checked row of TensorRT-LLM tensors: where its A and B are (A = row[:r * n_in], B = the next
    n_out * r values)."""
    index: int
    layer: int
    module: str
    rank: int
    n_in: int
    n_out: int


def check_trtllm(weights: np.ndarray, config: np.ndarray, spec: TextSpec,
                 max_rank: int = MAX_RANK) -> list[RowPlan]:
    """Checks TensorRT-LLM tensors (one request's [N, W] and [N, 3], batch dimension removed) against the model
    without copying the weights: shapes and dtype from the array header, config rows one by one, and NaN / inf
    by one float64 sum over the weights' own buffer (numpy reduces in small buffered chunks; a finite sum of
    finite fp16 / fp32 values cannot overflow float64, and any NaN or inf makes it non-finite). Every problem
    raises InvalidArgument naming the input, the value and what is allowed (TensorRT-LLM's texts)."""
    weights, config = np.asarray(weights), np.asarray(config)
    if weights.ndim != 2 or config.ndim != 2 or config.shape[1] != 3:
        raise InvalidArgument(f"lora_weights must be [N, W] and lora_config [N, 3]; got {list(weights.shape)} and "
                              f"{list(config.shape)}")
    if weights.shape[0] != config.shape[0]:
        raise InvalidArgument(f"Expected dim1 lora_weights and lora_config to have the same size: "
                              f"{weights.shape[0]} != {config.shape[0]}")
    if weights.dtype.kind != "f":
        raise InvalidArgument(f"lora_weights must be floating point (FP16 on the wire); got {weights.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN: refused below, not a warning
        total = np.sum(weights, dtype=np.float64)
    if not np.isfinite(total):
        raise InvalidArgument("lora_weights holds NaN or infinite values")
    plans: list[RowPlan] = []
    seen: set[tuple[int, str]] = set()
    for i, (module_id, layer, r) in enumerate(config.tolist()):
        module = MODULE_NAMES.get(int(module_id))
        if module is None:
            raise InvalidArgument(f"lora_config row {i}: lora module {module_id} not enabled for this model; "
                                  f"allowed: {MODULE_IDS}")
        if not 0 <= layer < spec.num_layers:
            raise InvalidArgument(f"lora_config row {i}: Expected layerId to be in the range [0, "
                                  f"{spec.num_layers}), got {layer}")
        if not 1 <= r <= max_rank:
            raise InvalidArgument(f"lora_config row {i}: Invalid low_rank (r) {r}; must be in [1, {max_rank}] "
                                  "(max_lora_rank)")
        check_experts(spec, layer, module, f"lora_config row {i}")
        n_in, n_out = module_shape(spec, module)
        need = r * (n_in + n_out)
        if need > weights.shape[1]:
            raise InvalidArgument(f"lora_weights row {i} has to few values for {module} of layer {layer} with r "
                                  f"{r}: {weights.shape[1]} < {need}")
        if (layer, module) in seen:
            raise InvalidArgument(f"lora_config row {i}: {module} of layer {layer} appears twice")
        seen.add((layer, module))
        plans.append(RowPlan(i, layer, module, r, n_in, n_out))
    return plans


def from_trtllm(name: str, weights: np.ndarray, config: np.ndarray, spec: TextSpec, max_rank: int = MAX_RANK,
                dtype: torch.dtype = torch.float32) -> Adapter:
    """TensorRT-LLM tensors (one request's [N, W] and [N, 3], batch dimension removed), checked by
    `check_trtllm` -> Adapter with A / B in `dtype` (the model's: wire weights are cast to it, as TensorRT-LLM
    does). One copy per row (the input buffer is not kept); A and B are views of it."""
    weights = np.asarray(weights)
    mods: dict[tuple[int, str], LoraModule] = {}
    for p in check_trtllm(weights, config, spec, max_rank):
        split = p.rank * p.n_in
        row = torch.tensor(weights[p.index, :split + p.n_out * p.rank], dtype=dtype)  # [r * (in + out)]
        mods[(p.layer, p.module)] = LoraModule(row[:split].view(p.rank, p.n_in), row[split:].view(p.n_out, p.rank),
                                               1.0)
    return Adapter(name, mods)
