"""The Llama-family decoder forward (Llama / Vicuna / Mistral / Qwen2 layout), reading and writing the paged KV cache.

One forward call takes `rows` rows that each get `q_len` new tokens (a prefill chunk of one prompt, or one
decode token for every running row) as embeddings `[rows, q_len, hidden]` plus an `AttentionBatch` from
`KVCache.plan`, and returns fp32 logits. Pieces, as in transformers' Llama: RMSNorm computed in fp32, rotary
embeddings looked up per row from each token's own position (rope_theta; "linear" and Llama-3 "llama3"
scaling), grouped-query attention over each row's own cache slots, masked to its own causal length (`attention.py`:
torch's `scaled_dot_product_attention` over the gathered keys, or for a decode step on a CPU one C call per
layer reading them in place, `cpu_decode.py`, which also takes the decode step's residual adds + RMSNorms and
SiLU gates), a SiLU-gated MLP and the lm_head. Qwen2 is the same forward with q/k/v biases (a
`Linear` takes the checkpoint's bias when it has one). A layer with a sliding window (`TextSpec.layer_windows`:
Mistral's `sliding_window`, Qwen2's "sliding_attention" layers) also masks the keys at or beyond `window`
positions back, as transformers' sliding-window causal mask: a query at position q sees keys q - window < k <= q.
Column j of a row's gathered keys is its position j (`KVCache.plan` reads a row's slots in position order).

Batch invariance: a row only ever attends to its own keys (gathered from its own blocks); padding up to the
longest row of the call is masked out, so it gets softmax weight exactly 0. What batching can still change
is floating-point blocking inside the matmuls (a different number of rows per GEMM): ulp-level, far below
the logit gaps that decide tokens (tests/engine/test_engine.py checks 16 mixed requests token for token).

Every projection is a `Linear` (q/k/v as one fused GEMM, gate/up as one, o, down, lm_head; on a CPU with
weights prepacked for oneDNN, `gemm.py`): the one place where a per-row adapter delta (LoRA, `lora.py`) is
added, per original module into its columns of a fused result. Rotary embeddings are applied to q and k in one
pass over their fused columns. An `AdapterBatch` knows which adapter each row of the call uses and
adds each row's delta to the projection (`add(x, y, layer, module)`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from . import attention, fusion, mrope
from ..cpu import cbuild, cpu_forward, gemm, gemv, gemv_bf16, gemv_fp8
from .attention import apply_rotary  # noqa: F401 - part of this module's API (tests, families)
from ..kv.kv_cache import AttentionBatch, KVCache
from ..lora.lora import LoraBatch
from .weights import ModelConfig, load_config, load_weights
from ...quant import fp8_gpu
from ...quant.fp8_weight import Fp8Weight

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LM_HEAD = "lm_head"  # module name of the output projection (layer -1)


class AdapterBatch(Protocol):
    """Per-row adapters of one forward call (LoRA plugs in here)."""

    def add(self, x: torch.Tensor, y: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y [rows, q_len, out], the base projection of x [rows, q_len, in], plus each row's delta (y itself
        when no row adapts this module)."""


def _zeros(weight) -> torch.Tensor:
    """[out] zeros: the bias of a part without one (an FP8 weight's bias is fp32, as its products)."""
    if isinstance(weight, Fp8Weight):
        return torch.zeros(weight.shape[0], dtype=weight.gpu[1] if weight.gpu else torch.float32,
                           device=weight.q.device)
    return weight.new_zeros(weight.shape[0])


class Linear:
    """y = x @ W^T (+ b) (+ the adapter batch's per-row delta for this layer/module). With `packed`, the weight
    is kept in oneDNN's blocked layout (`gemm.py`: where that is faster than `F.linear`).

    `parts` fuses projections of the same input: the weight is theirs stacked ([sum of outs, in]), one GEMM
    computes them side by side, and each part's adapter delta goes into its own columns of the result
    (q/k/v, gate/up: fewer, larger GEMMs; each output column is the same dot product as unfused)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, layer: int, module: str,
                 packed: bool = False, parts: tuple[tuple[str, int], ...] = ()):
        self.weight = gemm.pack(weight) if packed else weight  # [out, in] (dense, or packed: opaque)
        if packed:
            gemm.prepare(self.weight)
        self.bias = bias  # [out]
        self.layer, self.module = layer, module
        self.parts = parts or ((module, weight.shape[0]),)  # (module, out features) side by side

    @classmethod
    def fused(cls, w: dict[str, torch.Tensor], i: int, name: str, modules: tuple[str, ...], packed: bool,
              compute: Optional[torch.dtype] = None) -> "Linear":
        """Layer i's projections `modules` (same input) as one Linear; a missing bias is zeros (adds exactly 0).
        `compute`: the model's dtype (default: its final norm's, else the weights')."""
        weights = [w[f"layers.{i}.{m}"] for m in modules]  # each [out_m, in]
        bias = None
        if any(f"layers.{i}.{m}.bias" in w for m in modules):
            bias = torch.cat([w.get(f"layers.{i}.{m}.bias", _zeros(weights[j]))
                              for j, m in enumerate(modules)])
        parts = tuple((m, t.shape[0]) for m, t in zip(modules, weights))
        if any(isinstance(t, Fp8Weight) for t in weights):
            kept = Fp8Weight.cat(weights) if all(isinstance(t, Fp8Weight) for t in weights) else None
            lin = None if kept is None else cls.fp8_cuda(kept, bias, layer=i, module=name, parts=parts) \
                if kept.gpu is not None else cls.fp8(kept, bias, layer=i, module=name, parts=parts)
            if lin is not None:
                return lin
            weights = [t.dequantize().to(t.gpu[1] if t.gpu else torch.float32) if isinstance(t, Fp8Weight) else t
                       for t in weights]
        if compute is None:  # the model's dtype (its norms are never held 16-bit)
            compute = w["norm"].dtype if "norm" in w else weights[0].dtype
        return cls.held(torch.cat(weights), bias, compute, layer=i, module=name, packed=packed, parts=parts)

    @classmethod
    def held(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], compute: torch.dtype, *, layer: int,
             module: str, packed: bool, parts: tuple[tuple[str, int], ...] = ()) -> "Linear":
        """A Linear computing in `compute` on `weight`: a bf16 / fp16 weight of a CPU fp32 model stays as stored
        where the 16-bit gemv is chosen (`gemv_bf16.py`: `load_weights` keeps it only then), else is upcast."""
        if weight.dtype != compute and weight.dtype in gemv_bf16.HALF and compute == torch.float32 \
                and weight.device.type == "cpu" and (kernel := gemv_bf16.chosen()) is not None:
            lin = cls(weight, bias, layer=layer, module=module, parts=parts)
            lin.half_packed, lin.half_kernel = gemv_bf16.pack(weight), kernel
            lin.weight = lin.half_packed.data  # the one copy: [N/64, K, 64] in the stored dtype
            return lin
        return cls(weight.to(compute), bias, layer=layer, module=module, packed=packed, parts=parts)

    @classmethod
    def fp8(cls, w: Fp8Weight, bias: Optional[torch.Tensor], *, layer: int, module: str,
            parts: tuple[tuple[str, int], ...]) -> Optional["Linear"]:
        """A Linear on an FP8 weight kept as e4m3 (`gemv_fp8.py`: decode-sized products read the bytes; larger
        ones dequantize the weight for the call), or None where the kernel cannot read it."""
        kernel = gemv_fp8.kernel()
        if kernel is None or not kernel.chosen or (bias is not None and bias.dtype != torch.float32):
            return None
        try:
            packed8 = gemv_fp8.pack(w.q, w.scale, w.block)
        except ValueError:
            return None
        lin = cls(packed8.data, None if bias is None else bias.contiguous(), layer=layer, module=module, parts=parts)
        lin.fp8_packed, lin.fp8_kernel = packed8, kernel
        return lin

    @classmethod
    def fp8_cuda(cls, w: Fp8Weight, bias: Optional[torch.Tensor], *, layer: int, module: str,
                 parts: tuple[tuple[str, int], ...]) -> Optional["Linear"]:
        """A Linear on an FP8 weight kept e4m3 on a Hopper GPU (`quant/fp8_gpu.py`: block-scaled products), or
        None where its fused rows are not whole 128-row blocks."""
        if not fp8_gpu.usable(*w.shape, w.block):
            return None
        lin = cls(w.q, bias, layer=layer, module=module, parts=parts)
        lin.fp8_device = fp8_gpu.GpuFp8Weight(w.q, w.scale, w.gpu[0])
        lin.fp8_dtype = w.gpu[1]
        return lin

    fp8_packed: Optional[gemv_fp8.PackedFp8] = None  # an FP8 weight kept as e4m3 (`fp8`): `weight` is its bytes
    half_packed: Optional[gemv_bf16.PackedHalf] = None  # a bf16 / fp16 weight kept as stored (`held`): `weight` too
    fp8_device: Optional[fp8_gpu.GpuFp8Weight] = None  # one kept e4m3 on a GPU (`fp8_cuda`): `weight` is its bytes
    fp8_dtype: torch.dtype = torch.float32  # the GPU products' output dtype

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] matrix (a copy when packed or FP8)."""
        if self.fp8_device is not None:
            w = self.fp8_device
            return Fp8Weight(w.q, w.scale, (fp8_gpu.GROUP,) * 2).dequantize().to(self.fp8_dtype)
        if self.half_packed is not None:
            return self.half_packed.widen()
        return self.fp8_packed.dequantize() if self.fp8_packed is not None else gemm.dense(self.weight)

    def _fp8_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] on the FP8 (or bf16 / fp16: `gemv_bf16.py`, the same way) weight: 1-4 rows by
        the kernel, more on the weight dequantized
        in chunks of output rows for this call by the kernel (`gemv_fp8.Kernel.matmul`: never the whole fp32
        matrix at once; torch's e4m3 cast is ~10x slower)."""
        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        kernel, w = (self.fp8_kernel, self.fp8_packed) if self.fp8_packed is not None else \
            (self.half_kernel, self.half_packed)
        if 0 < rows <= gemv_fp8.MAX_ROWS and x.dtype == torch.float32:
            y = kernel.run(x2, w, self.bias)
        else:
            y = kernel.matmul(x2, w, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def __call__(self, x: torch.Tensor, adapters: Optional[AdapterBatch] = None) -> torch.Tensor:
        if self.fp8_packed is not None or self.half_packed is not None:
            y = self._fp8_product(x)
        elif self.fp8_device is not None:
            y = fp8_gpu.product(x, self.fp8_device, self.bias, self.fp8_dtype)
        else:
            y = gemm.linear(x, self.weight, self.bias)
        if adapters is None:
            return y
        if len(self.parts) == 1:  # as PEFT: the sum in the adapter's dtype (fp32), then back to the model's
            return adapters.add(x, y, self.layer, self.module)
        start = 0
        for module, n in self.parts:
            part = y[..., start:start + n]  # [rows, q_len, n]: a view into y
            added = adapters.add(x, part, self.layer, module)
            if added is not part:
                part.copy_(added)
            start += n
        return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in fp32, then weight * normed.to(x.dtype)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":  # one fused op: bit for bit the formula below
        return torch.rms_norm(x, weight.shape, weight, eps)   # (tests/engine/test_model.py)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) with torch ops (delta None: 0); `cpu_decode.Kernel.add_rms_norm` in C."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 intermediate] (gate, then up) -> silu(gate) * up [..., intermediate]."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for rope_type default / linear / llama3 (as transformers)."""
    base = float(rope.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_ctx = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def window_masks(batch: AttentionBatch, windows: set[int]) -> dict[int, torch.Tensor]:
    """Attention mask [rows, 1, q_len, T] per window: 0 -> the batch's causal mask; w -> also key k > q - w."""
    masks = {0: batch.mask}
    key_pos = torch.arange(batch.mask.shape[-1], device=batch.mask.device)  # [T]: column j is position j
    for w in windows - {0}:
        masks[w] = batch.mask & (key_pos > batch.positions[:, None, :, None] - w)
    return masks


class SharedExpert:
    """Qwen3.5-MoE's shared expert (transformers' `Qwen3_5MoeSparseMoeBlock`): every token through one SiLU-gated MLP,
    times sigmoid of its own gate (a [1, hidden] projection), added to the routed experts' sum."""

    def __init__(self, gate_up: "torch.Tensor | Linear", down: "torch.Tensor | Linear", gate: torch.Tensor):
        # [2 S, H], [H, S] (or `Linear`s: weights kept as stored, `hybrid.py`), [1, H]
        self.gate_up, self.down, self.gate = gate_up, down, gate
        self.gated = True  # transformers' shared expert is always gated (a test turns it off as a control)

    def tensors(self) -> list[torch.Tensor]:
        return _tensors_of([self.gate_up, self.down]) + [self.gate]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        y = _project(silu_mul(_project(x, self.gate_up)), self.down)
        return torch.sigmoid(F.linear(x, self.gate)) * y if self.gated else y


def _project(x: torch.Tensor, w: "torch.Tensor | Linear") -> torch.Tensor:
    """x @ w^T: a plain weight, or a `Linear` (an FP8 / bf16 weight kept as stored)."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)


def _tensors_of(ws) -> list[torch.Tensor]:
    """The tensors held for weights that are plain tensors or `Linear`s (their bytes, FP8 scales, biases)."""
    out = []
    for w in ws:
        if isinstance(w, torch.Tensor):
            out.append(w)
            continue
        out += [w.weight] + ([w.bias] if w.bias is not None else [])
        out += [w.fp8_packed.scale] if w.fp8_packed is not None else []
        out += [w.fp8_device.scale] if w.fp8_device is not None else []
    return out


class Experts:
    """A sparse layer (transformers' `Qwen3VLMoeTextSparseMoeBlock`): the router's softmax over the experts (fp32),
    the top k renormalised to sum to 1, each token through its k experts' SiLU-gated MLPs, weighted and summed.
    The tokens are grouped by expert: one product per active expert over its tokens, the experts in ascending
    order (transformers' order, so the same sums). With `shared` (Qwen3.5-MoE's `Qwen3_5MoeSparseMoeBlock`): the
    routed sum plus the gated shared expert's output."""

    def __init__(self, router: torch.Tensor, gate_up, down, top_k: int, shared: Optional[SharedExpert] = None):
        # [E, H], [E, 2 I, H], [E, H, I]; or gate_up / down one `Linear` per expert (FP8 kept as stored, `of`)
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k = top_k
        self.shared = shared
        self.renormalize = True  # transformers' router always renormalises (a test turns it off as a control)

    @classmethod
    def of(cls, w: dict[str, torch.Tensor], i: int, top_k: int, linears: bool = False,
           compute: Optional[torch.dtype] = None) -> Optional["Experts"]:
        """Layer i's sparse block, else None. `linears`: the shared expert's projections as `Linear`s (kept as
        stored where its weights are FP8 / bf16); experts given as tuples of `Fp8Weight` (`hybrid_weights`) become
        one FP8 `Linear` per expert (dequantized and stacked where the kernel cannot read them)."""
        if f"layers.{i}.router" not in w:
            return None
        shared = None
        if f"layers.{i}.shared_expert_gate" in w:
            if linears:
                shared = SharedExpert(Linear.fused(w, i, "shared_expert.gate_up_proj", ("shared_expert.gate_proj",
                                                   "shared_expert.up_proj"), False, compute),
                                      Linear.fused(w, i, "shared_expert.down_proj", ("shared_expert.down_proj",),
                                                   False, compute), w[f"layers.{i}.shared_expert_gate"])
            else:
                shared = SharedExpert(torch.cat([w[f"layers.{i}.shared_expert.gate_proj"],
                                                 w[f"layers.{i}.shared_expert.up_proj"]]),
                                      w[f"layers.{i}.shared_expert.down_proj"], w[f"layers.{i}.shared_expert_gate"])
        gate_up, down = (_expert_linears(w[f"layers.{i}.experts.{n}"], i, n) for n in ("gate_up_proj", "down_proj"))
        return cls(w[f"layers.{i}.router"], gate_up, down, top_k, shared)

    def tensors(self) -> list[torch.Tensor]:
        experts = [self.gate_up, self.down] if isinstance(self.gate_up, torch.Tensor) else \
            _tensors_of([*self.gate_up, *self.down])
        return [self.router] + experts + (self.shared.tensors() if self.shared is not None else [])

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # [T, H]
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        flat = chosen.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            picks = order[start:start + n]  # flat (token, slot) picks of expert e
            start += n
            tokens = picks // self.top_k
            gate, up = _project(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = _project(F.silu(gate) * up, self.down[e]) * weights.reshape(-1)[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(h.shape)


def _expert_linears(ws, i: int, name: str):
    """The experts' stacked weight [E, out, in] as it is, or a tuple of `Fp8Weight`s as one FP8 `Linear` per
    expert (the C gemv reading e4m3 + scales); where the kernel cannot read one, all dequantized and stacked."""
    if isinstance(ws, torch.Tensor):
        return ws
    lins = [Linear.fp8(t, None, layer=i, module=f"experts.{name}", parts=((f"experts.{name}", t.shape[0]),))
            for t in ws]
    return lins if all(lin is not None for lin in lins) else torch.stack([t.dequantize() for t in ws])


class Layer:
    def __init__(self, w: dict[str, torch.Tensor], i: int, eps: float, window: int = 0, packed: bool = False,
                 top_k: int = 0):
        self.input_norm, self.post_norm, self.eps = w[f"layers.{i}.input_norm"], w[f"layers.{i}.post_norm"], eps
        self.window = window  # sliding attention window, 0 = full causal attention
        self.qkv_proj = Linear.fused(w, i, "qkv_proj", ("q_proj", "k_proj", "v_proj"), packed)  # [q + 2 kv, hidden]
        self.o_proj = Linear.fused(w, i, "o_proj", ("o_proj",), packed)
        self.moe = Experts.of(w, i, top_k)  # a sparse layer's router and experts (Qwen3-VL-MoE), else None
        self.gate_up_proj = self.down_proj = None
        if self.moe is None:
            # [2 intermediate, hidden]
            self.gate_up_proj = Linear.fused(w, i, "gate_up_proj", ("gate_proj", "up_proj"), packed)
            self.down_proj = Linear.fused(w, i, "down_proj", ("down_proj",), packed)
        # QK-norm (Qwen3): an RMSNorm [head_dim] over each head of q and of k, before the rotary embedding
        self.q_norm, self.k_norm = w.get(f"layers.{i}.q_norm"), w.get(f"layers.{i}.k_norm")

    def linears(self) -> list[Linear]:
        dense = [] if self.moe is not None else [self.gate_up_proj, self.down_proj]
        return [self.qkv_proj, self.o_proj] + dense

    def mlp(self, h: torch.Tensor, adapters: Optional[AdapterBatch], act) -> torch.Tensor:
        """h [rows, q_len, hidden] -> [rows, q_len, hidden]: the SiLU-gated MLP, or the experts."""
        if self.moe is not None:
            return self.moe(h)
        return self.down_proj(act(self.gate_up_proj(h, adapters)), adapters)


    def qk_norm(self, qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv [..., (heads + 2 kv) * hd] with q's and k's heads RMS-normed (Qwen3's q_norm / k_norm); as it is
        without them."""
        if self.q_norm is None:
            return qkv
        hd = self.q_norm.shape[0]
        q, k, v = qkv.split((heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
        q = rms_norm(q.unflatten(-1, (heads, hd)), self.q_norm, self.eps).flatten(-2)
        k = rms_norm(k.unflatten(-1, (kv_heads, hd)), self.k_norm, self.eps).flatten(-2)
        return torch.cat((q, k, v), dim=-1)


@dataclass(frozen=True)
class Segment:
    """One prompt's prefill chunk in a ragged forward (`LlamaModel.forward_ragged`)."""

    length: int  # its tokens
    batch: AttentionBatch  # one row, `length` new tokens (`KVCache.plan`)
    rope: Optional[torch.Tensor] = None  # M-RoPE positions [3, 1, length] or [1, length]; None: cache positions


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = c = config
        self.embed_tokens = weights["embed"]  # [vocab, hidden] (bf16 / fp16 as stored: `weights.load_weights`)
        self.norm = weights["norm"]
        self.dtype, self.device = self.norm.dtype, self.norm.device  # the compute dtype (norms are always cast)
        packed = gemm.packing_enabled(self.device, self.dtype)
        self.lm_head = Linear.held(weights["lm_head"], None, self.dtype, layer=-1, module=LM_HEAD,
                                   packed=packed)  # tied: a packed copy
        windows = c.layer_windows or (0,) * c.num_layers
        self.layers = [Layer(weights, i, c.rms_norm_eps, windows[i], packed, c.experts_per_token)
                       for i in range(c.num_layers)]
        inv = rope_inv_freq(c.rope, c.head_dim)  # [head_dim / 2]
        freqs = torch.arange(c.max_position_embeddings, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.cos = emb.cos().to(self.device, self.dtype)
        sin, half = emb.sin().to(self.device, self.dtype), c.head_dim // 2
        self.sin_rot = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [max_pos, head_dim] (`apply_rotary`)
        self.attention = attention.Attention(self.cos, self.sin_rot, c.num_heads, c.num_kv_heads)
        self.deepstack_levels = 0  # DeepStack (Qwen3-VL): features per media token besides its embedding
        self._c_forward: Optional[cpu_forward.Forward] | bool = False  # False: not built yet (`c_forward`)
        self._c_forward_use: Optional[bool] = None  # whether decode steps take it, decided once (`c_forward`)
        self.fused: Optional[fusion.Fused] = None  # decode steps on compiled functions (`fusion.py`), None: eager
        self.fusion: Optional[fusion.Choice] = None  # what `choose_fusion` decided, and why
        if packed:  # built and checked at load, not inside the first request's step
            self.c_forward()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                        device: str = "cpu") -> "LlamaModel":
        config = load_config(model_dir)
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        return cls(config, load_weights(model_dir, config, dtype, device))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the model holds (weights, rotary tables); a tied lm_head appears twice (packed: a copy)."""
        out = [self.embed_tokens, self.norm, self.lm_head.weight, self.cos, self.sin_rot]
        for layer in self.layers:
            out += [layer.input_norm, layer.post_norm] + [t for t in (layer.q_norm, layer.k_norm) if t is not None]
            out += layer.moe.tensors() if layer.moe is not None else []
            for lin in layer.linears():
                out += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
                out += [lin.fp8_packed.scale] if lin.fp8_packed is not None else []
                out += [lin.fp8_device.scale] if lin.fp8_device is not None else []
        return out

    def weights_held(self) -> str:
        """How the weight matrices are kept in memory, "+"-joined: the decoder's projections' dtypes ("float8_e4m3fn"
        for an FP8 checkpoint's read by the FP8 gemv; the model's dtype for those dequantized or cast at load;
        "bfloat16" / "float16" for a checkpoint's kept as stored on an fp32 CPU model, `gemv_bf16.py`), then the
        lm_head's and the embedding's where they are not the model's dtype: "float8_e4m3fn+bfloat16" for an FP8
        release whose unquantized embedding and lm_head are kept bf16; "float32" for an fp32 model."""
        def held(lin: Linear) -> str:
            if lin.fp8_packed is not None or lin.fp8_device is not None:
                return "float8_e4m3fn"
            return str(lin.half_packed.dtype if lin.half_packed is not None else self.dtype).removeprefix("torch.")

        dtype = str(self.dtype).removeprefix("torch.")
        names = [held(lin) for layer in self.layers for lin in layer.linears()]
        names += [n for n in (held(self.lm_head), str(self.embed_tokens.dtype).removeprefix("torch.")) if n != dtype]
        return "+".join(dict.fromkeys(names))

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       num_blocks=num_blocks, block_size=block_size, dtype=self.dtype, device=self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # [..., hidden]; a bf16 / fp16 table kept as stored: its rows widened after the gather (exact)
        return F.embedding(ids.to(self.device), self.embed_tokens).to(self.dtype)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                adapters: Optional[AdapterBatch] = None, all_logits: bool = False, whole: bool = True,
                rope: Optional[torch.Tensor] = None, deepstack: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows, q_len, hidden] -> fp32 logits [rows, vocab] of each row's last new token
        ([rows, q_len, vocab] with all_logits). The new tokens' K/V are written into `cache`. A decode step of
        1-4 rows on a CPU runs as one C call, LoRA rows included (`cpu_forward.py`; `whole=False`: layer by
        layer)."""
        # `rope`: rotary positions that are not the cache positions (M-RoPE, `mrope.py`): int64 [rows, q_len] (1-D:
        # decode steps after an image prompt) or [3, rows, q_len] (a prompt's 3-D positions: never the C kernels)
        # `deepstack`: [levels, rows, q_len, hidden] added after the first `levels` layers (DeepStack: the vision
        # features at the media positions, zeros elsewhere); prefill only (never the C kernels)
        rows, q_len, _ = x.shape
        fused = self.fused if q_len == 1 and deepstack is None and (rope is None or rope.dim() < 3) else None
        kernel = None if (rope is not None and rope.dim() == 3) or deepstack is not None or fused is not None \
            else self.attention.kernel_for(q_len)
        masks = window_masks(batch, {layer.window for layer in self.layers})  # each [rows, 1, q_len, T]
        one_call = (kernel is not None and whole and not all_logits and rows <= gemv.MAX_ROWS
                    and (adapters is None or isinstance(adapters, LoraBatch)) and self.c_forward() is not None)
        if kernel is not None and not (one_call or kernel.chosen):
            kernel = None  # checked, but slower than torch ops here (cbuild: chosen by measurement)
        if kernel is not None:  # the step's rows, checked once for every layer
            step = self._decode_step(kernel, batch, masks, cache, rope)
            if one_call:
                logits = self.c_forward().run(step, x, cache.k, cache.v, adapters)  # [rows, vocab], or None
                if logits is not None:
                    return logits
        if kernel is not None and not kernel.chosen:
            kernel = None  # the step fell back from the one call (adapters it cannot read): torch ops
        last = (lambda t: t) if all_logits else None if q_len == 1 else (lambda t: t[:, -1:])
        logits = None
        if kernel is not None:
            def attend(i: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:  # -> [rows, 1, heads * hd]
                return step.attend(qkv.reshape(rows, -1), layer.window, cache.k[i], cache.v[i]).view(rows, 1, -1)
            logits = self._layers(x, attend, adapters, kernel.add_rms_norm, kernel.silu_mul, last)
        elif fused is not None:
            logits = self._fused_layers(fused, x, batch, cache, adapters, masks, rope, last)  # None: it failed
        if logits is None:
            tables = self._tables(batch, rope)  # cos, sin_rot [rows, q_len, 1, head_dim]

            def attend(i: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:  # -> [rows, q_len, heads * hd]
                return self.attention.attend(qkv, batch, cache, i, tables, masks[layer.window], layer.window)
            logits = self._layers(x, attend, adapters, add_rms_norm, silu_mul, last, deepstack)
        return logits if all_logits else logits[:, 0]  # from [rows, q_len or 1, vocab]

    def _fused_layers(self, fused: fusion.Fused, x: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                      adapters: Optional[AdapterBatch], masks: dict[int, torch.Tensor], rope: Optional[torch.Tensor],
                      last) -> Optional[torch.Tensor]:
        """A decode step's layers on the compiled functions (`fusion.py`; under flex, or where the race found the
        fused attention core slower, the attention is `Attention.attend`'s) ->
        logits, or None where a compiled call raised (`fusion.FusedCallFailed`: no CUDA fault, no out-of-memory; not
        while a CUDA graph is captured): logged, fusion off for this process, the caller recomputes the step eagerly
        (the K/V it wrote are written again)."""
        tables = self._tables(batch, rope)  # cos, sin_rot [rows, 1, 1, head_dim]
        flex = self.attention.backend == "flex"

        def attend(i: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:  # -> [rows, 1, heads * hd]
            if flex or not fused.core:
                return self.attention.attend(qkv, batch, cache, i, tables, masks[layer.window], layer.window)
            return fused.attend(qkv, tables, batch.write_slots, batch.read_slots, masks[layer.window], cache.k[i],
                                cache.v[i])
        try:
            return self._layers(x, attend, adapters, fused.add_rms_norm, fused.silu_mul, last)
        except fusion.FusedCallFailed as e:  # an optional speed path: the eager step instead
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise  # the capture fails (`cuda_graph.py` retries it); its warm-up runs already went eager
            why = str(e)
            log.error("decode fusion failed while serving (%s); this step is recomputed eagerly and every later one "
                      "runs eager", why, exc_info=e)
            self.fused = None
            self.fusion = fusion.Choice(False, f"failed while serving: {why}")
            return None

    def choose_fusion(self, block_size: int, keys: int = fusion.RACE_KEYS, graphs: bool = True) -> fusion.Choice:
        """Whether decode steps run the compiled functions (`fusion.choose`: TRITON_VLM_DECODE_FUSION, a check, and
        on CUDA a race), decided at load -> the choice (also `self.fusion`)."""
        self.fusion = fusion.choose(self, block_size, keys, graphs)
        return self.fusion

    @torch.inference_mode()
    def forward_ragged(self, x: torch.Tensor, segments: list[Segment], cache: KVCache,
                       adapters: Optional[AdapterBatch] = None,
                       deepstack: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Several prompts' prefill chunks in one forward (vLLM's ragged batch): x [1, total, hidden], segment i
        the next `segments[i].length` tokens, its own single-row `AttentionBatch`. The projections, norms and the
        MLP run once over all the tokens (one pass over the weights); attention runs per segment over its own
        keys. -> fp32 logits [segments, vocab] of each segment's last token. `adapters` apply to every token
        (the segments share one adapter, or none)."""
        ends = torch.tensor([seg.length for seg in segments]).cumsum(0)  # [segments]
        if int(ends[-1]) != x.shape[1] or any(seg.batch.positions.shape[0] != 1 for seg in segments):
            raise ValueError(f"segments of {ends.tolist()} tokens in one row do not cover x {tuple(x.shape)}")
        windows = {layer.window for layer in self.layers}
        parts = [(seg, self._tables(seg.batch, seg.rope), window_masks(seg.batch, windows)) for seg in segments]

        def attend(i: int, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:  # -> [1, total, heads * hd]
            outs, start = [], 0
            for seg, tables, masks in parts:
                piece = qkv[:, start:start + seg.length]  # [1, n, width]
                outs.append(self.attention.attend(piece, seg.batch, cache, i, tables, masks[layer.window],
                                                  layer.window))
                start += seg.length
            return torch.cat(outs, dim=1)
        last = (ends - 1).to(x.device)
        return self._layers(x, attend, adapters, add_rms_norm, silu_mul,
                            lambda t: t[0].index_select(0, last)[:, None], deepstack)[:, 0]  # [segments, vocab]

    def _layers(self, x: torch.Tensor, attend, adapters: Optional[AdapterBatch], add_norm, act,
                last=None, deepstack: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder layers, the final norm and lm_head over x [rows, q_len, hidden] -> fp32 logits [rows', n,
        vocab]. `attend(i, layer, qkv)`: layer i's attention core; `add_norm`, `act`: the residual add + RMSNorm
        and the SiLU gate (torch's or the C kernels'); `last`: None (a decode step: the final residual add fused
        into the final norm), or which positions go to the lm_head (x [rows, q_len, hidden] -> [rows', n,
        hidden]); `deepstack` [levels, rows, q_len, hidden]: added to the hidden states after layer i < levels, as
        transformers' `_deepstack_process` (the layer's output first, then the features)."""
        c = self.config
        levels = 0 if deepstack is None else deepstack.shape[0]
        x, h = add_norm(x, None, self.layers[0].input_norm, self.layers[0].eps)  # x, h [rows, q_len, hidden]
        for i, layer in enumerate(self.layers):
            qkv = layer.qk_norm(layer.qkv_proj(h, adapters), c.num_heads, c.num_kv_heads)
            out = attend(i, layer, qkv)  # qkv [rows, q_len, (heads + 2 kv) * hd]
            x, h = add_norm(x, layer.o_proj(out, adapters), layer.post_norm, layer.eps)
            down = layer.mlp(h, adapters, act)  # [rows, q_len, hidden]
            if i < levels:  # the layer's output, then the DeepStack features at the media positions
                x, down = x + down, None
                x = x + deepstack[i].to(x.dtype)
            if i + 1 < len(self.layers):  # the residual add and the next layer's input norm
                x, h = add_norm(x, down, self.layers[i + 1].input_norm, layer.eps)
            elif last is not None:  # the final norm over the positions that make logits
                x, h = add_norm(last(x if down is None else x + down), None, self.norm, self.config.rms_norm_eps)
            else:
                x, h = add_norm(x, down, self.norm, self.config.rms_norm_eps)
        return self.lm_head(h, adapters).float()

    def c_forward(self) -> Optional[cpu_forward.Forward]:
        """The C decode forward for this model where it is to be used, else None: built and checked (bit for bit
        against the layer-by-layer path on a scratch cache) at first use, then used where its switch is "1" or
        it won its race against the layer-by-layer path on this model (`_race_c_forward`), decided once."""
        taken = None  # the gemv kernel, where this call takes it for the layer-by-layer path (`_take_gemv`)
        if self._c_forward is False:
            self._c_forward = None
            try:  # an optional speed path: any failure leaves the layer-by-layer path (cbuild)
                built = cpu_forward.Forward.for_model(self)
                taken = None if built is None else _take_gemv()
                reason = None if built is None else self._check_c_forward(built)
            except Exception as e:  # noqa: BLE001
                built, reason = None, f"{type(e).__name__}: {e}"
            if reason is not None:
                log.warning("C decode forward not used: %s; decode steps run layer by layer", reason)
            elif built is not None:
                self._c_forward = built
        if self._c_forward_use is None:  # decided once: this runs at every decode step
            built = self._c_forward
            self._c_forward_use = built is not None and (
                cpu_forward.mode() == "1" or self._race_c_forward(built).faster)
        if taken is not None:
            if self._c_forward_use:
                log.info("decode gemv kernel on for products of 1-%d rows: the C decode forward reads it, and the "
                         "layer-by-layer path of the same steps must give its bits (its own race against oneDNN "
                         "was lost: %s)", gemv.MAX_ROWS, taken.race.describe("oneDNN") if taken.race else "-")
            else:
                taken.chosen = False  # as its race decided
        return self._c_forward if self._c_forward_use else None

    def _race_c_forward(self, built: cpu_forward.Forward) -> cbuild.Race:
        """The one call against the layer-by-layer path on this model (one row at position 1), timed at the
        first load on a machine and cached beside the build per model shape; a failure counts as lost."""
        c = self.config
        key = f"{c.num_layers}x{c.hidden_size}/{c.num_heads}/{c.num_kv_heads}/{tuple(self.lm_head.weight.shape)}"
        held = self.weights_held()
        key += "" if held == "float32" else f"/{held}"  # an FP8 model races its own (its products are others)
        try:
            kernel = self.attention.kernel_for(1)
            cache = self.new_cache(1, 4)
            row = cache.new_row()
            x = self.embed(torch.tensor([[1]]))  # [1, 1, hidden]
            self.forward(x, cache.plan([row], 1), cache, whole=False)  # position 0
            batch = cache.plan([row], 1)  # position 1, written again by every timed call
            masks = window_masks(batch, {layer.window for layer in self.layers})
            race = cbuild.cached_race(cpu_forward.library_path(), key, lambda: cbuild.race(
                lambda: built.run(self._decode_step(kernel, batch, masks, cache), x, cache.k, cache.v),
                lambda: self.forward(x, batch, cache, whole=False), rounds=5))
        except Exception as e:  # noqa: BLE001 - cbuild: a timing that fails leaves the layer-by-layer path
            log.warning("C decode forward not used: timing failed: %s: %s; decode steps run layer by layer",
                        type(e).__name__, e)
            return cbuild.Race(float("inf"), 0.0)
        if race.faster:
            log.info("C decode forward on (%s)", race.describe("the layer-by-layer path"))
        else:
            log.warning("C decode forward not used: slower than the layer-by-layer path here (%s)",
                        race.describe("layer by layer"))
        return race

    def _check_c_forward(self, built: cpu_forward.Forward) -> Optional[str]:
        """Why `built` must not be used (None: it may): two rows, one decode step at position 0 and one at
        position 1, on two scratch caches, layer by layer and as one call."""
        kernel = self.attention.kernel_for(1)
        if kernel is None:
            return "the C decode kernels are off"
        caches = [self.new_cache(2, 4) for _ in range(2)]
        rows = [caches[0].new_row() for _ in range(2)]
        x = self.embed(torch.tensor([[1], [2]]))  # [2, 1, hidden]
        self.forward(x, caches[0].plan(rows, 1), caches[0], whole=False)  # position 0: a key to attend to
        caches[1].k.copy_(caches[0].k)
        caches[1].v.copy_(caches[0].v)
        batch = caches[0].plan(rows, 1)  # position 1: the same slots in both caches
        want = self.forward(x, batch, caches[0], whole=False)  # [2, vocab]
        masks = window_masks(batch, {layer.window for layer in self.layers})
        got = built.run(self._decode_step(kernel, batch, masks, caches[1]), x, caches[1].k, caches[1].v)
        if not (torch.equal(got, want) and torch.equal(caches[1].k, caches[0].k)
                and torch.equal(caches[1].v, caches[0].v)):
            return "its logits or cache writes differ from the layer-by-layer path"
        return None

    def _tables(self, batch: AttentionBatch, rope: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rows of every new token [rows, q_len, 1, hd] (cos, sin_rot): at the cache positions, at
        `rope`'s 1-D positions, or M-RoPE's from its 3-D ones."""
        if rope is None:
            return self.attention.tables(batch.positions)
        if rope.dim() == 3:
            return mrope.tables(self.cos, self.sin_rot, rope.to(self.device), self.config.mrope_section,
                                self.config.mrope_interleaved)
        return self.attention.tables(rope.to(self.device))

    def _decode_step(self, kernel, batch: AttentionBatch, masks: dict[int, torch.Tensor], cache: KVCache,
                     rope: Optional[torch.Tensor] = None):
        """The C kernels' checked view of a decode batch (`cpu_decode.DecodeStep`); they read the positions for
        the rotary rows only (`rope`'s, when given, instead of the cache positions)."""
        rows = batch.positions.shape[0]
        positions = batch.positions if rope is None else rope
        return kernel.step(positions.reshape(rows).contiguous(), batch.write_slots.contiguous(),
                           batch.read_slots.contiguous(),  # [rows], [rows], [rows, T]
                           {w: m.reshape(rows, -1).contiguous() for w, m in masks.items()},  # each [rows, T]
                           self.cos, self.sin_rot, self.config.num_heads, self.config.num_kv_heads,
                           cache.k.shape[1])


def _take_gemv() -> Optional[gemv.Kernel]:
    """The C decode forward computes its products with the gemv kernel whether or not that kernel won its own race
    against oneDNN (one product: within a few percent either way, measured 5.8 vs 5.7 ms on the 2-core Xeon),
    and the layer-by-layer path of the same steps (LoRA adapters it cannot read; `whole=False`) must give the
    same bits. So where the C forward is built, 1-4 row products take the kernel too: -> the kernel if this call
    switched it on (`c_forward` switches it back off where the C forward is then not used), else None. Its
    switch at "0" keeps it off (then the bit check refuses the C forward)."""
    kernel = gemm.decode_kernel()
    if kernel is None or kernel.chosen or cbuild.mode(gemv.ENV) == "0":
        return None
    kernel.chosen = True
    return kernel
