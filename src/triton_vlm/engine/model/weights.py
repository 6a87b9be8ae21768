"""Read a Llama-family language model (Llama / Vicuna / Mistral / Qwen2 layout) out of a Hugging Face checkpoint.

Accepted directories:

- a LLaVA checkpoint (`model_type: llava` / `llava_next`): only the language model's tensors are read (the
  vision tower and projector belong to the vision step), by their transformers-5 names
  (`model.language_model.layers.N...` + `lm_head.weight`) whatever layout the checkpoint was saved in (the hub's
  and transformers 5's `language_model.model.*` + `language_model.lm_head.*`: `weight_source.TensorSource`
  renames them as transformers does);
- a plain Llama / Mistral / Qwen2 checkpoint: `model.layers.N...` + `lm_head.weight`.

Biases: every projection whose checkpoint holds a `.bias` gets it (Qwen2: q/k/v; Llama with attention_bias).
Mixture of experts (`TextSpec.sparse_layers`): a sparse layer's router and fused experts instead of its MLP.
QK-norm: a layer whose checkpoint holds `self_attn.q_norm` / `k_norm` gets both (Qwen3: RMSNorm per head).

Weights come through `weight_source.TensorSource` (safetensors, sharded or not, or `pytorch_model.bin`); the
config is `spec.CheckpointSpec.load(model_dir).text`. The lm_head, as transformers 5 ties it: the checkpoint's
`lm_head.weight` when it holds one (transformers unties a tied config whose lm_head differs from the
embedding; an equal one is the embedding tensor itself), else `embed_tokens` when `tie_word_embeddings`; a
checkpoint with neither is refused (transformers would start that lm_head from random values).

Tensors are returned under canonical names: `embed`, `norm`, `lm_head`, `layers.{i}.{module}` with module in
`MODULES` (+ `.bias` when the checkpoint has biases) and `layers.{i}.input_norm` / `layers.{i}.post_norm`.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...quant import fp8_gpu
from ...quant.fp8_weight import Fp8Weight
from ...spec import CheckpointError, CheckpointSpec, TextSpec
from ...weight_source import TensorSource

log = logging.getLogger(__name__)

# every linear module of a decoder layer, by its Hugging Face name (the LoRA issue maps these to module ids)
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTN_MODULES + MLP_MODULES

# (layers prefix, embed key, final norm key, lm_head key) by transformers-5 names (`TensorSource`'s): a LLaVA's
# language model, a plain Llama; the first whose embed key exists wins
LAYOUTS = (
    ("model.language_model.", "model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
     "lm_head.weight"),
    ("model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
)

ModelConfig = TextSpec  # what the decoder forward needs (`spec.TextSpec`)


def load_config(model_dir: str | Path) -> ModelConfig:
    return CheckpointSpec.load(model_dir).text


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", fp8: bool = True, half: bool = True) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (see the module docstring), cast to `dtype` on `device`. With `fp8`, the dense
    layers' FP8 projections stay `quant.fp8_weight.Fp8Weight` (e4m3 + scales) where they can: fp32 on the CPU where
    the FP8 gemv is chosen (`engine/cpu/gemv_fp8.py`), on a GPU where the block-scaled products are
    (`quant/fp8_gpu.py`); the others are dequantized to `dtype` at load. With `half`, an fp32 CPU model keeps the
    embedding, the lm_head and the dense layers' projections that the checkpoint stores in bf16 / fp16 (a bf16
    release; what an FP8 release leaves unquantized) as stored where the 16-bit gemv is chosen
    (`engine/cpu/gemv_bf16.py`: products widen them in registers, exact); norms and biases are cast."""
    src = TensorSource(model_dir)
    quant, dev = src.quant.quant, torch.device(device)
    gpu_layout = _gpu_fp8_layout(dev, dtype) if fp8 and quant is not None and quant.method == "fp8" \
        and dev.type == "cuda" and quant.block is not None else None
    fp8 = fp8 and quant is not None and dtype == torch.float32 and dev.type == "cpu" and _fp8_kernel_chosen()
    for layers, embed_key, norm_key, head_key in LAYOUTS:
        if embed_key in src:
            break
    else:
        raise CheckpointError(
            f"no language-model embedding found in {model_dir}; looked for {[lay[1] for lay in LAYOUTS]}")
    half = half and dtype == torch.float32 and dev.type == "cpu" and _half_kernel_chosen(src, embed_key, head_key)

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise CheckpointError(f"checkpoint {model_dir} misses tensor {key}")
        return src.get(key).to(device=device, dtype=dtype)

    def matrix(key: str) -> torch.Tensor:  # bf16 / fp16 kept as stored with `half` (the values are the same)
        if key not in src:
            raise CheckpointError(f"checkpoint {model_dir} misses tensor {key}")
        t = src.get(key)
        return t.to(device) if half and t.dtype in (torch.bfloat16, torch.float16) else t.to(device, dtype)

    out = {"embed": matrix(embed_key), "norm": take(norm_key)}
    out["lm_head"] = _lm_head(src, head_key, out["embed"], config, matrix)
    for i in range(config.num_layers):
        p = f"{layers}layers.{i}."
        out[f"layers.{i}.input_norm"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
        sparse = i in config.sparse_layers
        if sparse:
            out |= _experts(p, i, config, take)
        for m in ATTN_MODULES if sparse else MODULES:
            group = "self_attn" if m in ATTN_MODULES else "mlp"
            kept = src.get_fp8(f"{p}{group}.{m}.weight") if (fp8 or gpu_layout) and not sparse else None
            if kept is not None and gpu_layout is not None:  # a Hopper GPU: e4m3 on the device (`fp8_gpu.py`)
                kept = kept.to_gpu(dev, gpu_layout, dtype) if fp8_gpu.usable(*kept.shape, kept.block) else None
            out[f"layers.{i}.{m}"] = kept if kept is not None else \
                take(f"{p}{group}.{m}.weight") if sparse else matrix(f"{p}{group}.{m}.weight")
            if f"{p}{group}.{m}.bias" in src:
                out[f"layers.{i}.{m}.bias"] = take(f"{p}{group}.{m}.bias")
        norms = ("q_norm", "k_norm")  # QK-norm (Qwen3): both or neither, as the checkpoint holds them
        if any(f"{p}self_attn.{n}.weight" in src for n in norms):
            out |= {f"layers.{i}.{n}": take(f"{p}self_attn.{n}.weight") for n in norms}
    _check_shapes(out, config)
    if fp8 or gpu_layout:
        kept = sum(isinstance(t, Fp8Weight) for t in out.values())
        log.info("FP8 checkpoint: %d of %d quantized projection weights kept in e4m3 (%s), the others dequantized "
                 "to %s", kept, len(src.quant.scales), "block-scaled GPU products" if gpu_layout else
                 "the FP8 decode gemv", str(dtype).removeprefix("torch."))
    if half:
        kept = [k for k, t in out.items() if isinstance(t, torch.Tensor) and t.dtype != dtype and t.dim() == 2]
        if kept:
            log.info("bf16 / fp16 weights: %d matrices kept as stored (%s) for the 16-bit gemv, products in %s",
                     len(kept), ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else ""),
                     str(dtype).removeprefix("torch."))
    return out


def _experts(p: str, i: int, c: ModelConfig, take) -> dict[str, torch.Tensor]:
    """A sparse layer's router [E, hidden] and fused experts, in transformers' in-memory layout: gate_up
    [E, 2 I, hidden], down [E, hidden, I]. A file holding them transposed (the hub's [E, hidden, 2 I] /
    [E, I, hidden]) is transposed on load, as transformers' `Transpose(1, 2, check_dims=True)` does: kept when
    the shape is already the in-memory one."""
    e, h, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    out = {f"layers.{i}.router": take(f"{p}mlp.gate.weight")}
    for name, shape in (("gate_up_proj", (e, 2 * inter, h)), ("down_proj", (e, h, inter))):
        t = take(f"{p}mlp.experts.{name}")
        if tuple(t.shape) != shape:
            t = t.transpose(1, 2).contiguous()
        if tuple(t.shape) != shape:
            raise CheckpointError(f"layer {i}: mlp.experts.{name} has shape {tuple(t.shape)}; the config implies "
                                  f"{shape} (or its last two axes swapped)")
        out[f"layers.{i}.experts.{name}"] = t
    if tuple(out[f"layers.{i}.router"].shape) != (e, h):
        raise CheckpointError(f"layer {i}: mlp.gate.weight has shape {tuple(out[f'layers.{i}.router'].shape)}; "
                              f"the config implies {(e, h)}")
    return out


def _lm_head(src: TensorSource, key: str, embed: torch.Tensor, config: ModelConfig, take) -> torch.Tensor:
    if key in src:
        head = take(key)
        return embed if config.tie_word_embeddings and torch.equal(head, embed) else head
    if config.tie_word_embeddings:
        return embed
    raise CheckpointError(f"checkpoint {src.model_dir} has no {key} and tie_word_embeddings is false (transformers "
                          "would start the lm_head from random values); set tie_word_embeddings or add the lm_head")


def _gpu_fp8_layout(device: torch.device, dtype: torch.dtype):
    """The weight-scale layout of the FP8 GPU products where they are chosen on `device` (`quant/fp8_gpu.py`; the
    reason is logged once either way), else None."""
    return fp8_gpu.choose(device, dtype)[0]


def _fp8_kernel_chosen() -> bool:
    """Whether FP8 weights stay FP8 here: the FP8 gemv built, checked and faster (`engine/cpu/gemv_fp8.py`)."""
    from ..cpu import gemv_fp8  # noqa: PLC0415

    kernel = gemv_fp8.kernel()
    return kernel is not None and kernel.chosen


def _half_kernel_chosen(src: TensorSource, *keys: str) -> bool:
    """Whether bf16 / fp16 matrices stay as stored here: the checkpoint stores its embedding or lm_head so (read
    from the header; an all-fp32 checkpoint never builds the kernel), and the 16-bit gemv is built, checked and
    chosen (`engine/cpu/gemv_bf16.py`)."""
    if not any(k in src and src.stored_dtype(k) in ("BF16", "F16") for k in keys):
        return False
    from ..cpu import gemv_bf16  # noqa: PLC0415

    return gemv_bf16.chosen() is not None


def _check_shapes(w: dict[str, torch.Tensor], c: ModelConfig) -> None:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        want |= {
            f"layers.{i}.q_proj": (q, c.hidden_size), f"layers.{i}.k_proj": (kv, c.hidden_size),
            f"layers.{i}.v_proj": (kv, c.hidden_size), f"layers.{i}.o_proj": (c.hidden_size, q),
        }
        if i not in c.sparse_layers:
            want |= {
                f"layers.{i}.gate_proj": (c.intermediate_size, c.hidden_size),
                f"layers.{i}.up_proj": (c.intermediate_size, c.hidden_size),
                f"layers.{i}.down_proj": (c.hidden_size, c.intermediate_size),
            }
    want |= {f"{name}.bias": (want[name][0],) for name in list(want) if f"{name}.bias" in w}
    want |= {f"layers.{i}.{n}": (c.head_dim,) for i in range(c.num_layers) for n in ("q_norm", "k_norm")
             if f"layers.{i}.q_norm" in w or f"layers.{i}.k_norm" in w}
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(w[name].shape)}, config implies {shape}")
