"""Read a hybrid text model (Qwen3.5's: Gated DeltaNet layers beside gated full attention) out of a checkpoint.

Tensors by transformers-5 names under the language model's prefix (`weights.LAYOUTS`), returned under canonical
names the model reads:
- `embed`, `norm`, `lm_head` (tied as `weights._lm_head` decides);
- every layer: `layers.{i}.input_norm`, `layers.{i}.post_norm`, the MLP's `gate_proj` / `up_proj` / `down_proj`;
- a sparse layer (Qwen3.5-MoE: `TextSpec.sparse_layers`) instead of the MLP: `router`, the fused experts
  `experts.gate_up_proj` [E, 2 I, hidden] / `experts.down_proj` [E, hidden, I] (the hub's files hold one tensor per
  expert, `mlp.experts.{e}.gate_proj.weight` ..., which transformers' qwen2_moe conversion stacks and concatenates
  as done here; fused files load as `weights._experts` reads them), the shared expert's `shared_expert.gate_proj` /
  `up_proj` / `down_proj` and its gate `shared_expert_gate` [1, hidden];
- a full-attention layer: `q_proj` ([heads * head_dim * 2, hidden] with the output gate: per head, the query's
  head_dim rows then the gate's), `k_proj`, `v_proj`, `o_proj` (+ `.bias` where held), `q_norm`, `k_norm`;
- a linear-attention layer: `layers.{i}.linear_attn.` + transformers' names (`in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a`, `out_proj` weights, `conv1d.weight`, `dt_bias`, `A_log`, `norm.weight`).
Zero-centred RMSNorms (`TextSpec.norm_offset` 1: Qwen3_5RMSNorm computes `normed * (1 + weight)` in fp32) are
returned as `offset + weight` in fp32, the factor transformers multiplies by; the gated RMSNorm of the linear
layers is an ordinary one (its `weight` as stored).

Projections as stored, as `weights.load_weights` keeps the dense families' (issue 38): on an fp32 CPU model, a
block-wise FP8 / compressed-tensors checkpoint's quantized projections (the full-attention q/k/v/o, the MLPs, the
shared expert, each routed expert, a linear layer's in_proj_qkv / in_proj_z / out_proj: whatever holds a scale)
stay `quant.fp8_weight.Fp8Weight` where the FP8 gemv is chosen (a sparse layer's experts then come as one tuple
of E `Fp8Weight`s per name: gate_up [2 I, hidden] each, down [hidden, I]), and the bf16 / fp16 matrices (the
embedding, lm_head, what an FP8 release leaves unquantized: in_proj_a / in_proj_b, a bf16 release's every
projection) stay as stored where the 16-bit gemv is chosen; everything else is dequantized or cast to `dtype`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...quant.fp8_weight import Fp8Weight
from ...spec import CheckpointError, TextSpec
from ...weight_source import TensorSource
from .weights import LAYOUTS, _experts, _fp8_kernel_chosen, _half_kernel_chosen, _lm_head

FULL, LINEAR = "full_attention", "linear_attention"
LINEAR_PROJ = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight")
LINEAR_TENSORS = LINEAR_PROJ + ("conv1d.weight", "dt_bias", "A_log", "norm.weight")


def load_hybrid_weights(model_dir: str | Path, c: TextSpec, dtype: torch.dtype, device: str | torch.device,
                        fp8: bool = True, half: bool = True) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (module doc), cast to `dtype` on `device` (offset norms: fp32); with `fp8` / `half`
    the projections kept as stored where the CPU kernels are chosen (module doc)."""
    src = TensorSource(model_dir)
    for layers, embed_key, norm_key, head_key in LAYOUTS:
        if embed_key in src:
            break
    else:
        raise CheckpointError(f"no language-model embedding found in {model_dir}")
    cpu32 = dtype == torch.float32 and torch.device(device).type == "cpu"
    fp8 = fp8 and cpu32 and src.quant.quant is not None and _fp8_kernel_chosen()
    half = half and cpu32 and _half_kernel_chosen(src, embed_key, head_key)

    def take(key: str, cast: torch.dtype = dtype) -> torch.Tensor:
        if key not in src:
            raise CheckpointError(f"checkpoint {model_dir} misses tensor {key}")
        return src.get(key).to(device=device, dtype=cast)

    def matrix(key: str):  # a projection: e4m3 + scales kept with `fp8`, bf16 / fp16 as stored with `half`
        kept = src.get_fp8(key) if fp8 and key in src else None
        if kept is not None:
            return kept
        if key not in src:
            raise CheckpointError(f"checkpoint {model_dir} misses tensor {key}")
        t = src.get(key).to(device)
        return t if half and t.dtype in (torch.bfloat16, torch.float16) else t.to(dtype)

    def norm(key: str) -> torch.Tensor:  # [d] the factor the normed values are multiplied by
        return take(key, torch.float32) + c.norm_offset if c.norm_offset else take(key)

    out = {"embed": matrix(embed_key), "norm": norm(norm_key)}
    out["lm_head"] = _lm_head(src, head_key, out["embed"], c, matrix)
    for i, kind in enumerate(c.layer_kinds):
        p = f"{layers}layers.{i}."
        out[f"layers.{i}.input_norm"] = norm(p + "input_layernorm.weight")
        out[f"layers.{i}.post_norm"] = norm(p + "post_attention_layernorm.weight")
        if i in c.sparse_layers:
            out |= _sparse(src, p, i, c, take, matrix, fp8)
        else:
            for m in ("gate_proj", "up_proj", "down_proj"):
                out[f"layers.{i}.{m}"] = matrix(f"{p}mlp.{m}.weight")
        if kind == LINEAR:
            for name in LINEAR_TENSORS:
                # A_log / dt_bias / the gated norm stay as stored in fp32 where the model computes in fp32
                key = f"{p}linear_attn.{name}"
                out[f"layers.{i}.linear_attn.{name}"] = matrix(key) if name in LINEAR_PROJ else take(key)
            continue
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"layers.{i}.{m}"] = matrix(f"{p}self_attn.{m}.weight")
            if f"{p}self_attn.{m}.bias" in src:
                out[f"layers.{i}.{m}.bias"] = take(f"{p}self_attn.{m}.bias")
        for n in ("q_norm", "k_norm"):
            out[f"layers.{i}.{n}"] = norm(f"{p}self_attn.{n}.weight")
    _check_shapes(out, c)
    return out


def _sparse(src: TensorSource, p: str, i: int, c: TextSpec, take, matrix, fp8: bool) -> dict[str, torch.Tensor]:
    """A sparse layer's router, fused experts and shared expert (module doc); `matrix` reads a projection as
    kept; with `fp8` the hub's per-expert FP8 tensors stay e4m3 (one tuple per name)."""
    kept = _fp8_experts(src, p, i, c, matrix, take) if fp8 else None
    if kept is not None:
        out = kept
    elif f"{p}mlp.experts.gate_up_proj" in src or f"{p}mlp.experts.0.gate_proj.weight" not in src:
        out = _experts(p, i, c, take)
    else:  # the hub's per-expert tensors, stacked as transformers' MergeModulelist(dim=0) + Concatenate(dim=1)
        def stack(m: str) -> torch.Tensor:  # [E, out, in]
            ts = [take(f"{p}mlp.experts.{e}.{m}.weight") for e in range(c.num_experts)]
            if len({tuple(t.shape) for t in ts}) != 1:
                raise CheckpointError(f"layer {i}: the experts' mlp.experts.*.{m}.weight differ in shape: "
                                      f"{sorted({tuple(t.shape) for t in ts})}")
            return torch.stack(ts)
        fused = {f"{p}mlp.gate.weight": take(f"{p}mlp.gate.weight"),
                 f"{p}mlp.experts.gate_up_proj": torch.cat([stack("gate_proj"), stack("up_proj")], dim=1),
                 f"{p}mlp.experts.down_proj": stack("down_proj")}
        out = _experts(p, i, c, fused.__getitem__)  # its shape checks
    if c.shared_expert_size:
        for m in ("gate_proj", "up_proj", "down_proj"):
            out[f"layers.{i}.shared_expert.{m}"] = matrix(f"{p}mlp.shared_expert.{m}.weight")
        out[f"layers.{i}.shared_expert_gate"] = take(f"{p}mlp.shared_expert_gate.weight")
    return out


def _fp8_experts(src: TensorSource, p: str, i: int, c: TextSpec, matrix, take) -> dict | None:
    """The hub's per-expert FP8 tensors kept e4m3: `experts.gate_up_proj` a tuple of E `Fp8Weight` [2 I, hidden]
    (each expert's gate rows then its up rows, as transformers concatenates them), `experts.down_proj` one of E
    [hidden, I]; None where any is not kept so (fused files, unquantized experts, partial row blocks)."""
    if f"{p}mlp.experts.0.gate_proj.weight" not in src:
        return None
    gate_up, down = [], []
    for e in range(c.num_experts):
        g, u, d = (matrix(f"{p}mlp.experts.{e}.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
        if not all(isinstance(t, Fp8Weight) for t in (g, u, d)) or (fused := Fp8Weight.cat([g, u])) is None:
            return None
        if (tuple(fused.shape), tuple(d.shape)) != ((2 * c.moe_intermediate_size, c.hidden_size),
                                                     (c.hidden_size, c.moe_intermediate_size)):
            raise CheckpointError(f"layer {i}: expert {e}'s gate/up/down have shapes {tuple(g.shape)}, "
                                  f"{tuple(u.shape)}, {tuple(d.shape)}; the config implies "
                                  f"{(c.moe_intermediate_size, c.hidden_size)} x2, "
                                  f"{(c.hidden_size, c.moe_intermediate_size)}")
        gate_up.append(fused)
        down.append(d)
    router = take(f"{p}mlp.gate.weight")
    if tuple(router.shape) != (c.num_experts, c.hidden_size):
        raise CheckpointError(f"layer {i}: mlp.gate.weight has shape {tuple(router.shape)}; the config implies "
                              f"{(c.num_experts, c.hidden_size)}")
    return {f"layers.{i}.router": router, f"layers.{i}.experts.gate_up_proj": tuple(gate_up),
            f"layers.{i}.experts.down_proj": tuple(down)}


def _check_shapes(w: dict[str, torch.Tensor], c: TextSpec) -> None:
    hd, gate = c.head_dim, 2 if c.attn_output_gate else 1
    want = {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}
    for i, kind in enumerate(c.layer_kinds):
        if i not in c.sparse_layers:
            want[f"layers.{i}.down_proj"] = (c.hidden_size, c.intermediate_size)
        elif c.shared_expert_size:
            s = c.shared_expert_size
            want |= {f"layers.{i}.shared_expert.gate_proj": (s, c.hidden_size),
                     f"layers.{i}.shared_expert.up_proj": (s, c.hidden_size),
                     f"layers.{i}.shared_expert.down_proj": (c.hidden_size, s),
                     f"layers.{i}.shared_expert_gate": (1, c.hidden_size)}
        if kind == FULL:
            want |= {f"layers.{i}.q_proj": (c.num_heads * hd * gate, c.hidden_size),
                     f"layers.{i}.k_proj": (c.num_kv_heads * hd, c.hidden_size),
                     f"layers.{i}.o_proj": (c.hidden_size, c.num_heads * hd), f"layers.{i}.q_norm": (hd,)}
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(w[name].shape)}, config implies {shape}")
