"""The Gated DeltaNet layer of hybrid text models (Qwen3.5 / Qwen3.6 `linear_attention` layers), over explicit states.

A linear-attention layer keeps no KV: each sequence carries a fixed-size state per layer (`state_cache.py` holds
them in slots):
- the causal conv window `conv` [channels, K]: the last K inputs of the depthwise conv1d (channels = q, k and v
  side by side, K = `linear_conv_kernel_dim`); transformers keeps K of them, of which the conv reads the last K - 1;
- the recurrent state `recurrent` [v_heads, key_dim, value_dim], fp32.

The math is transformers' `Qwen3_5GatedDeltaNet` (the reference), computed in the same order so that tokens equal:
1. `in_proj_qkv`, `in_proj_z` (the output gate), `in_proj_b` (beta), `in_proj_a` (the decay's input);
2. the causal depthwise conv1d with SiLU over q|k|v, in the three shapes transformers calls it in: a fresh prompt
   (zero left padding), a prompt continuing a state (the state's K columns in front), one decode token
   (`causal_conv1d_update`: the state and the token, no padding);
3. q, k L2-normalised (eps 1e-6) in fp32, q scaled by key_dim^-0.5; beta = sigmoid(b);
   g = -exp(A_log) * softplus(a + dt_bias) (log-space decay);
4. the gated delta rule: `chunk_rule` (a prompt: chunks of `CHUNK` = 64 positions, transformers'
   `torch_chunk_gated_delta_rule`, its chunk size, so the sums match) or `recurrent_rule` (decode: one token per
   row, `torch_recurrent_gated_delta_rule`), continuing from the row's state;
5. the gated RMSNorm (norm, weight, then times SiLU(z)) per value head and `out_proj`.

A prompt split into engine chunks continues exactly as one pass only where each engine chunk's length is a multiple
of `CHUNK` (the delta rule's own chunks then start at the same positions): `prefill_granule` says so to the
scheduler. Rows of a prompt call are computed one at a time at their own length (padding would enter the state);
decode rows are batched (one token each, no padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk_size for torch_chunk_gated_delta_rule (prefill)
L2_EPS = 1e-6  # transformers' l2norm eps (matches flash-linear-attention)


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes, from the text config's `linear_*` fields."""

    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads (a multiple of key_heads: grouped value heads)
    key_dim: int  # linear_key_head_dim
    value_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim (K)
    eps: float  # rms_norm_eps of the gated RMSNorm

    @property
    def channels(self) -> int:
        """The conv's channels: q and k (key_heads * key_dim each) and v (value_heads * value_dim)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def conv_shape(self) -> tuple[int, int]:
        return (self.channels, self.conv_kernel)

    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)

    def state_bytes(self, conv_dtype: torch.dtype) -> int:
        """Bytes of one sequence's state in one layer (the recurrent state is fp32, as transformers keeps it)."""
        conv = self.channels * self.conv_kernel * torch.finfo(conv_dtype).bits // 8
        h, dk, dv = self.recurrent_shape()
        return conv + h * dk * dv * 4

    @classmethod
    def from_config(cls, text) -> "DeltaNetShape":
        """The shape from a text config; the conv's activation (`hidden_act`) must be SiLU, the one computed here."""
        if getattr(text, "hidden_act", "silu") != "silu":
            raise ValueError(f"linear_attention layers with hidden_act={text.hidden_act!r}: only 'silu' is served")
        return cls(key_heads=int(text.linear_num_key_heads), value_heads=int(text.linear_num_value_heads),
                   key_dim=int(text.linear_key_head_dim), value_dim=int(text.linear_value_head_dim),
                   conv_kernel=int(text.linear_conv_kernel_dim), eps=float(text.rms_norm_eps))


@dataclass
class DeltaNetWeights:
    """One layer's tensors (transformers' names under `linear_attn.`); projections are callables so that a
    per-row adapter delta can be added to them (the engine's `Linear`)."""

    in_proj_qkv: Callable[[torch.Tensor], torch.Tensor]  # [.., hidden] -> [.., channels]
    in_proj_z: Callable[[torch.Tensor], torch.Tensor]  # -> [.., value_heads * value_dim]
    in_proj_b: Callable[[torch.Tensor], torch.Tensor]  # -> [.., value_heads]
    in_proj_a: Callable[[torch.Tensor], torch.Tensor]  # -> [.., value_heads]
    out_proj: Callable[[torch.Tensor], torch.Tensor]  # [.., value_heads * value_dim] -> [.., hidden]
    conv_weight: torch.Tensor  # [channels, K] (conv1d.weight [channels, 1, K] squeezed)
    dt_bias: torch.Tensor  # [value_heads]
    a_log: torch.Tensor  # [value_heads] (A_log)
    norm_weight: torch.Tensor  # [value_dim]


# ---- the causal conv ------------------------------------------------------------------------------------------

def conv_prompt(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, fresh: bool) -> torch.Tensor:
    """One row's prompt tokens x [1, channels, T] through the causal conv + SiLU; conv [1, channels, K] is the row's
    window, updated in place to the last K inputs. `fresh`: no tokens before (zero left padding, as transformers'
    first prefill); else the window's K columns are the left context (transformers' continued prefill)."""
    k, t = weight.shape[-1], x.shape[-1]
    if fresh:  # transformers pads a prompt shorter than the window to K on the left
        full = x if t >= k else F.pad(x, (k - t, 0))
    else:
        full = torch.cat([conv, x], dim=-1)  # [1, C, K + T]
    conv.copy_(full[..., -k:])
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), None, padding=k - 1,
                   groups=weight.shape[0])[:, :, :full.shape[-1]]
    return F.silu(out[:, :, -t:]).to(x.dtype)


def conv_step(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Decode: x [rows, channels, 1], conv [rows, channels, K] updated in place (transformers'
    `causal_conv1d_update`): the window and the token, no padding, the last output."""
    full = torch.cat([conv, x], dim=-1).to(weight.dtype)  # [rows, C, K + 1]
    conv.copy_(full[:, :, -conv.shape[-1]:])
    out = F.conv1d(full, weight.unsqueeze(1), None, padding=0, groups=weight.shape[0])[:, :, -1:]
    return F.silu(out).to(x.dtype)


# ---- the gated delta rule -------------------------------------------------------------------------------------

def _heads_first(q, k, v, g, beta, value_heads: int):
    """[rows, T, heads, d] -> fp32 [rows, v_heads, T, d] (q and k repeated per value-head group); q, k
    L2-normalised; q scaled by d^-0.5."""
    if q.shape[2] != value_heads:
        rep = value_heads // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, beta, g = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g)]
    q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + L2_EPS)
    return q, k, v, g, beta


def chunk_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked gated delta rule over one or more rows' prompt tokens (no padding inside a row).
    q, k [rows, T, k_heads, dk]; v [rows, T, v_heads, dv]; g, beta [rows, T, v_heads]; state [rows, v_heads, dk, dv]
    fp32, continued and written back in place. Returns [rows, T, v_heads, dv] in q's dtype."""
    dtype, t = q.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2])
    q = q * (q.shape[-1] ** -0.5)
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)  # [rows, H, chunks, chunk]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # [rows, H, chunks, chunk, chunk]
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cum[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :t]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def recurrent_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token per row (decode): shapes as `chunk_rule` with T = 1 (or more, a token at a time); state updated in
    place."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2])
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        kv_mem = (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    state.copy_(s)
    return out.transpose(1, 2).contiguous().to(dtype)


# ---- the layer ------------------------------------------------------------------------------------------------

def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNormGated: x [.., d] normalised in fp32, times weight, times SiLU(gate)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet:
    """One linear-attention layer over the rows' state slots (see the module doc)."""

    def __init__(self, shape: DeltaNetShape, w: DeltaNetWeights):
        self.shape, self.w = shape, w

    def _split(self, mixed: torch.Tensor):
        """mixed [rows, T, channels] (after the conv) -> q, k [rows, T, k_heads, dk], v [rows, T, v_heads, dv]."""
        s = self.shape
        rows, t = mixed.shape[:2]
        kd, vd = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        q, k, v = torch.split(mixed, [kd, kd, vd], dim=-1)
        return (q.reshape(rows, t, -1, s.key_dim), k.reshape(rows, t, -1, s.key_dim),
                v.reshape(rows, t, -1, s.value_dim))

    def _gates(self, x: torch.Tensor):
        b, a = self.w.in_proj_b(x), self.w.in_proj_a(x)  # [rows, T, v_heads]
        g = -self.w.a_log.float().exp() * F.softplus(a.float() + self.w.dt_bias)
        return g, b.sigmoid()

    def _out(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """core [rows, T, v_heads, dv] -> the layer's output [rows, T, hidden]."""
        rows, t = core.shape[:2]
        z = self.w.in_proj_z(x).reshape(-1, self.shape.value_dim)
        h = gated_rms_norm(core.reshape(-1, self.shape.value_dim), z, self.w.norm_weight, self.shape.eps)
        return self.w.out_proj(h.reshape(rows, t, -1))

    def prompt(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor, fresh: bool,
               chunk: int = CHUNK) -> torch.Tensor:
        """One row's prompt tokens x [1, T, hidden]; conv [1, channels, K] and recurrent [1, v_heads, dk, dv] are the
        row's state (views into its slot), continued in place. `fresh`: the first tokens of the sequence."""
        mixed = conv_prompt(self.w.in_proj_qkv(x).transpose(1, 2), conv, self.w.conv_weight, fresh)
        q, k, v = self._split(mixed.transpose(1, 2))
        g, beta = self._gates(x)
        return self._out(chunk_rule(q, k, v, g, beta, recurrent, chunk), x)

    def decode(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
        """Decode rows x [rows, 1, hidden]; conv [rows, channels, K], recurrent [rows, v_heads, dk, dv] (gathered
        from the rows' slots; the caller scatters them back)."""
        mixed = conv_step(self.w.in_proj_qkv(x).transpose(1, 2), conv, self.w.conv_weight)
        q, k, v = self._split(mixed.transpose(1, 2))
        g, beta = self._gates(x)
        return self._out(recurrent_rule(q, k, v, g, beta, recurrent), x)


def weights_from(tensors: dict[str, torch.Tensor], prefix: str,
                 linear: Optional[Callable[[str], Callable[[torch.Tensor], torch.Tensor]]] = None) -> DeltaNetWeights:
    """A layer's weights from `tensors` by transformers' names under `prefix` (e.g. `layers.0.linear_attn.`);
    `linear(name)` builds a projection (default: a plain `F.linear` on the tensor)."""
    def plain(name: str):
        weight = tensors[prefix + name + ".weight"]
        return lambda x: F.linear(x, weight)
    make = linear or plain
    return DeltaNetWeights(
        in_proj_qkv=make("in_proj_qkv"), in_proj_z=make("in_proj_z"), in_proj_b=make("in_proj_b"),
        in_proj_a=make("in_proj_a"), out_proj=make("out_proj"),
        conv_weight=tensors[prefix + "conv1d.weight"].squeeze(1), dt_bias=tensors[prefix + "dt_bias"],
        a_log=tensors[prefix + "A_log"], norm_weight=tensors[prefix + "norm.weight"])
