"""The decoder forward of hybrid text models (Qwen3.5 / Qwen3.6): Gated DeltaNet layers beside gated full attention.

`TextSpec.layer_kinds` says each layer's token mixer (data from the checkpoint, never a model name):
- `full_attention`: Qwen3 attention (QK-norm per head) with an output gate (`attn_output_gate`: q_proj's output
  holds, per head, the query's head_dim values then the gate's; the attention output times sigmoid(gate) before
  o_proj) and partial rotary (`rotary_dim` < head_dim: the first rotary_dim values of each head rotate, the rest
  pass; M-RoPE, interleaved, over those frequencies), over the paged KV (`attention.attend_torch`);
- `linear_attention`: `deltanet.GatedDeltaNet` over the rows' state slots (`hybrid_cache.HybridCache`): a prompt's
  positions by the chunked rule one row at a time (transformers' chunking: the scheduler's prefill chunks of a
  hybrid model are multiples of `deltanet.CHUNK`, `prefill_granule`), tokens after a row's prompt (decode steps,
  and a preempted request's recompute) by the recurrent rule, a decode step's rows batched (their states gathered
  from the slots and scattered back).
Norms (`norm_offset` 1: zero-centred RMSNorm, the factor `1 + weight` precomputed at load) in fp32 as transformers'
`Qwen3_5RMSNorm`; a SiLU-gated MLP, or in a sparse layer (Qwen3.5-MoE, `TextSpec.sparse_layers`) `model.Experts`
with its shared expert (`model.SharedExpert`: sigmoid-gated, added to the routed sum). Everything here is torch ops
(no C decode kernel, no CUDA graphs, no packed oneDNN weights: a first, exact version; the linear layers'
flash-linear-attention kernels are not wired) but the projections: each a `model.Linear`, so an FP8 checkpoint's
e4m3 projections (full attention, MLPs, shared and routed experts, a linear layer's in_proj_qkv / in_proj_z /
out_proj) and the bf16 ones (embedding, lm_head, in_proj_a / in_proj_b) stay as stored on an fp32 CPU model, read
by the same C gemvs as the dense families' (`hybrid_weights`, `gemv_fp8.py`, `gemv_bf16.py`; issue 38).

Same interface as `model.LlamaModel` for the runner and the profile: `forward`, `forward_ragged` (segments run one
by one), `embed`, `new_cache` (a `HybridCache`: KV for the full layers, `state_slots` state slots), `tensors`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import attention, deltanet, mrope
from ..kv.hybrid_cache import HybridCache, StateBatch
from ..kv.kv_cache import AttentionBatch
from ..kv.state_cache import StateSpec
from .hybrid_weights import FULL, LINEAR, load_hybrid_weights
from .model import DTYPES, LM_HEAD, AdapterBatch, Experts, Linear, Segment, _tensors_of, silu_mul
from .weights import load_config
from ...spec import TextSpec

NO_PREFIX_CACHE = ("the linear-attention layers' state at a cached prefix's end is not kept (no state snapshots), "
                   "so a cached prefix could not continue")


def zc_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNorm: normed in fp32 times `factor` (1 + weight, fp32), back to x's dtype."""
    if x.dtype == torch.float32 and factor.dtype == torch.float32:
        return torch.rms_norm(x, factor.shape, factor, eps)
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * factor.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Partial rotary: x [rows, q_len, heads, hd]; cos, sin_rot [rows, q_len, 1, rd] -> the first rd values rotated
    (transformers' apply_rotary_pos_emb with cos of rotary_dim), the rest as they are."""
    rd = cos.shape[-1]
    return torch.cat([attention.apply_rotary(x[..., :rd], cos, sin_rot), x[..., rd:]], dim=-1)


class FullLayer:
    """Gated full attention (module doc); `kv` is its index among the cache's layers."""

    def __init__(self, w: dict[str, torch.Tensor], i: int, kv: int, c: TextSpec, dtype: torch.dtype):
        self.kv, self.c = kv, c
        self.qkv_proj = Linear.fused(w, i, "qkv_proj", ("q_proj", "k_proj", "v_proj"), False, dtype)
        self.o_proj = Linear.fused(w, i, "o_proj", ("o_proj",), False, dtype)
        self.q_norm, self.k_norm = w[f"layers.{i}.q_norm"], w[f"layers.{i}.k_norm"]

    def __call__(self, h, batch: AttentionBatch, cache: HybridCache, tables, adapters) -> torch.Tensor:
        """h [rows, q_len, hidden] -> [rows, q_len, hidden]; the new K/V written into the cache."""
        c = self.c
        rows, q_len, _ = h.shape
        hd, heads, kvh = c.head_dim, c.num_heads, c.num_kv_heads
        gate_w = 2 if c.attn_output_gate else 1
        q, k, v = self.qkv_proj(h, adapters).split((heads * hd * gate_w, kvh * hd, kvh * hd), dim=-1)
        q = q.view(rows, q_len, heads, hd * gate_w)
        gate = q[..., hd:].reshape(rows, q_len, heads * hd) if gate_w == 2 else None
        q = zc_norm(q[..., :hd], self.q_norm, c.rms_norm_eps)  # [rows, q_len, heads, hd]
        k = zc_norm(k.view(rows, q_len, kvh, hd), self.k_norm, c.rms_norm_eps)
        q, k = rotate(q, *tables), rotate(k, *tables)
        qkv = torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)  # [rows, q_len, (heads + 2 kv) * hd]
        same = (h.new_ones(1, 1, 1, hd), h.new_zeros(1, 1, 1, hd))  # rotated above: the identity here
        out = attention.attend_torch(qkv, *(t.expand(rows, q_len, 1, hd) for t in same), batch.write_slots,
                                     batch.read_slots, batch.mask, cache.k[self.kv], cache.v[self.kv], heads, kvh)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out, adapters)


class LinearLayer:
    """A Gated DeltaNet layer over the rows' state slots; `index` is its index among the linear layers."""

    def __init__(self, w: dict[str, torch.Tensor], i: int, index: int, shape: deltanet.DeltaNetShape,
                 dtype: torch.dtype):
        self.index = index
        self.projections: list[Linear] = []  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj

        def linear(name: str) -> Linear:  # not a LoRA target: called without adapters
            self.projections.append(Linear.fused(w, i, f"linear_attn.{name}", (f"linear_attn.{name}.weight",), False,
                                             dtype))
            return self.projections[-1]

        self.net = deltanet.GatedDeltaNet(shape, deltanet.weights_from(w, f"layers.{i}.linear_attn.", linear))

    def __call__(self, h: torch.Tensor, st: StateBatch, cache: HybridCache) -> torch.Tensor:
        """h [rows, q_len, hidden] -> [rows, q_len, hidden]; the rows' states continued in their slots."""
        rows, q_len, _ = h.shape
        states, li = cache.states, self.index
        if q_len == 1 and all(s >= e for s, e in zip(st.starts, st.prompt_ends)):  # a decode step: batched
            conv, rec = states.gather("conv", li, st.slots), states.gather("recurrent", li, st.slots)
            out = self.net.decode(h, conv, rec)  # conv [rows, C, K], rec [rows, H, dk, dv] updated
            states.scatter("conv", li, st.slots, conv)
            states.scatter("recurrent", li, st.slots, rec)
            return out
        slots = st.slots.tolist()
        return torch.cat([self._row(h[r:r + 1], st.starts[r], st.prompt_ends[r], slots[r], cache)
                          for r in range(rows)])

    def _row(self, h: torch.Tensor, start: int, prompt_end: int, slot: int, cache: HybridCache) -> torch.Tensor:
        """One row's tokens h [1, n, hidden] at positions start..: the prompt's by the chunked rule, the rest one
        at a time by the recurrent rule (as they were first computed: decode steps)."""
        conv = cache.states.view("conv", self.index, slot)  # [1, C, K]
        rec = cache.states.view("recurrent", self.index, slot)  # [1, H, dk, dv]
        split = max(0, min(prompt_end - start, h.shape[1]))
        outs = []
        if split:
            outs.append(self.net.prompt(h[:, :split], conv, rec, fresh=start == 0))
        for j in range(split, h.shape[1]):
            outs.append(self.net.decode(h[:, j:j + 1], conv, rec))
        return torch.cat(outs, dim=1)


class HybridModel:
    """A hybrid decoder (module doc) with `LlamaModel`'s interface."""

    def __init__(self, config: TextSpec, w: dict[str, torch.Tensor], state_slots: int = 1,
                 dtype: Optional[torch.dtype] = None):
        """`dtype`: the compute dtype (default: the embedding's; a bf16 one kept as stored needs it said)."""
        self.config = c = config
        self.embed_tokens, self.norm = w["embed"], w["norm"]  # [vocab, hidden] (bf16 as stored: widened), [hidden]
        self.dtype, self.device = dtype or self.embed_tokens.dtype, self.embed_tokens.device
        self.lm_head = Linear.held(w["lm_head"], None, self.dtype, layer=-1, module=LM_HEAD, packed=False)
        shape = deltanet.DeltaNetShape.from_config(_LinearFields(c))
        self.layers: list = []
        kv = lin = 0
        for i, kind in enumerate(c.layer_kinds):
            if kind == FULL:
                self.layers.append(FullLayer(w, i, kv, c, self.dtype))
                kv += 1
            else:
                self.layers.append(LinearLayer(w, i, lin, shape, self.dtype))
                lin += 1
        self.norms = [(w[f"layers.{i}.input_norm"], w[f"layers.{i}.post_norm"]) for i in range(c.num_layers)]
        # per layer: its experts (a sparse layer), else its MLP's (gate_up, down)
        self.mlps = [Experts.of(w, i, c.experts_per_token, linears=True, compute=self.dtype) or
                     (Linear.fused(w, i, "gate_up_proj", ("gate_proj", "up_proj"), False, self.dtype),
                      Linear.fused(w, i, "down_proj", ("down_proj",), False, self.dtype))
                     for i in range(c.num_layers)]
        self.kv_layers, self.state_slots = kv, state_slots
        self.state_spec = StateSpec(layers=lin, states=(("conv", shape.conv_shape(), self.dtype),
                                                        ("recurrent", shape.recurrent_shape(), torch.float32)))
        rd = c.rotary_dim or c.head_dim
        inv = 1.0 / (float(c.rope.get("rope_theta", 10000.0)) ** (torch.arange(0, rd, 2, dtype=torch.int64).float()
                                                                   / rd))  # [rd / 2]
        freqs = torch.arange(c.max_position_embeddings, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rd]
        sin = emb.sin().to(self.device, self.dtype)
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin_rot = torch.cat((-sin[:, :rd // 2], sin[:, rd // 2:]), dim=-1)
        self.deepstack_levels = 0
        self.no_prefix_cache = NO_PREFIX_CACHE  # the engine turns prefix caching off, saying this
        self.prefill_granule = deltanet.CHUNK  # prefill chunks that do not end a prompt: multiples of this

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                        state_slots: int = 1) -> "HybridModel":
        config = load_config(model_dir)
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        return cls(config, load_hybrid_weights(model_dir, config, dtype, device), state_slots, dtype)

    def linears(self) -> list[Linear]:
        """Every decoder projection but the experts' (attention, MLP, shared expert, a linear layer's)."""
        out = []
        for layer, mlp in zip(self.layers, self.mlps):
            out += [layer.qkv_proj, layer.o_proj] if isinstance(layer, FullLayer) else layer.projections
            if isinstance(mlp, Experts):
                out += [p for p in (mlp.shared.gate_up, mlp.shared.down) if isinstance(p, Linear)] \
                    if mlp.shared is not None else []
            else:
                out += list(mlp)
        return out

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed_tokens, self.norm, self.cos, self.sin_rot] + _tensors_of([self.lm_head])
        for layer, norms, mlp in zip(self.layers, self.norms, self.mlps):
            out += list(norms) + (mlp.tensors() if isinstance(mlp, Experts) else _tensors_of(mlp))
            if isinstance(layer, FullLayer):
                out += _tensors_of([layer.qkv_proj, layer.o_proj]) + [layer.q_norm, layer.k_norm]
            else:
                wt = layer.net.w
                out += _tensors_of(layer.projections) + [wt.conv_weight, wt.dt_bias, wt.a_log, wt.norm_weight]
        return out

    def weights_held(self) -> str:
        """How the weight matrices are kept in memory, "+"-joined as `LlamaModel.weights_held` says it: the
        projections' dtypes ("float8_e4m3fn" for an FP8 checkpoint's read by the FP8 gemv, experts included;
        "bfloat16" for those kept as stored: an FP8 release's in_proj_a / in_proj_b; the model's dtype for those
        dequantized or cast at load), then the lm_head's and the embedding's where not the model's dtype."""
        def held(lin: Linear) -> str:
            if lin.fp8_packed is not None or lin.fp8_device is not None:
                return "float8_e4m3fn"
            return str(lin.half_packed.dtype if lin.half_packed is not None else self.dtype).removeprefix("torch.")

        dtype = str(self.dtype).removeprefix("torch.")
        lins = self.linears() + [e for mlp in self.mlps if isinstance(mlp, Experts)
                                 and not isinstance(mlp.gate_up, torch.Tensor) for e in (*mlp.gate_up, *mlp.down)]
        names = sorted({held(lin) for lin in lins}, key=lambda n: (n != "float8_e4m3fn", n != dtype, n))
        if any(isinstance(mlp, Experts) and isinstance(mlp.gate_up, torch.Tensor) for mlp in self.mlps):
            names += [dtype]  # experts dequantized / cast at load
        names += [n for n in (held(self.lm_head), str(self.embed_tokens.dtype).removeprefix("torch.")) if n != dtype]
        return "+".join(dict.fromkeys(names))

    def new_cache(self, num_blocks: int, block_size: int, slots: Optional[int] = None) -> HybridCache:
        c = self.config
        return HybridCache(spec=self.state_spec, slots=slots or self.state_slots, num_layers=self.kv_layers,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_blocks=num_blocks,
                           block_size=block_size, dtype=self.dtype, device=self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # [..., hidden]; a bf16 / fp16 table kept as stored: its rows widened after the gather (exact)
        return F.embedding(ids.to(self.device), self.embed_tokens).to(self.dtype)

    def _tables(self, batch: AttentionBatch, rope: Optional[torch.Tensor]):
        """cos, sin_rot [rows, q_len, 1, rd] of the new tokens (cache positions, 1-D `rope`, or M-RoPE's 3-D)."""
        if rope is not None and rope.dim() == 3:
            return mrope.tables(self.cos, self.sin_rot, rope.to(self.device), self.config.mrope_section,
                                self.config.mrope_interleaved)
        pos = batch.positions if rope is None else rope.to(self.device)
        return self.cos[pos][:, :, None], self.sin_rot[pos][:, :, None]

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache: HybridCache,
                adapters: Optional[AdapterBatch] = None, all_logits: bool = False, whole: bool = True,
                rope: Optional[torch.Tensor] = None, deepstack: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [rows, q_len, hidden] -> fp32 logits [rows, vocab] of each row's last token ([rows, q_len, vocab]
        with all_logits); the full layers' K/V and the linear layers' states updated."""
        if deepstack is not None:
            raise ValueError("DeepStack features given to a hybrid model, which has none")
        c, tables = self.config, self._tables(batch, rope)
        for layer, (n_in, n_post), mlp in zip(self.layers, self.norms, self.mlps):
            h = zc_norm(x, n_in, c.rms_norm_eps)
            if isinstance(layer, FullLayer):
                x = x + layer(h, batch, cache, tables, adapters)
            else:
                x = x + layer(h, batch.states, cache)
            h = zc_norm(x, n_post, c.rms_norm_eps)
            if isinstance(mlp, Experts):
                x = x + mlp(h)
            else:
                x = x + mlp[1](silu_mul(mlp[0](h, adapters)), adapters)
        if not all_logits:
            x = x[:, -1:]
        logits = self.lm_head(zc_norm(x, self.norm, c.rms_norm_eps), adapters).float()
        return logits if all_logits else logits[:, 0]

    def forward_ragged(self, x: torch.Tensor, segments: list[Segment], cache: HybridCache,
                       adapters: Optional[AdapterBatch] = None,
                       deepstack: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Several prompts' chunks x [1, total, hidden]: each segment its own forward (the linear layers run row
        by row anyway) -> [segments, vocab]."""
        out, start = [], 0
        for seg in segments:
            out.append(self.forward(x[:, start:start + seg.length], seg.batch, cache, adapters, rope=seg.rope))
            start += seg.length
        return torch.cat(out)


class _LinearFields:
    """The text config's `linear_*` fields as `DeltaNetShape.from_config` reads them, from a `TextSpec`."""

    def __init__(self, c: TextSpec):
        (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
         self.linear_value_head_dim, self.linear_conv_kernel_dim) = c.linear_dims
        self.rms_norm_eps = c.rms_norm_eps


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               max_rows: int = 1):
    """The checkpoint's decoder: a `HybridModel` (one state slot per row the engine runs) where its text model has
    linear-attention layers, else a `model.LlamaModel`."""
    from .model import LlamaModel  # noqa: PLC0415

    config = load_config(model_dir)
    if LINEAR in config.layer_kinds:
        return HybridModel.from_pretrained(model_dir, dtype, device, state_slots=max_rows)
    return LlamaModel.from_pretrained(model_dir, dtype, device)
