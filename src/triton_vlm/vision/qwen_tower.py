"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower as one static torch graph: exact against transformers,
ONNX-exportable.

transformers' towers (`Qwen2VisionTransformerPretrainedModel`, `Qwen2_5_VisionTransformerPretrainedModel`) compute
their per-image layout inside `forward` with Python loops over `grid_thw` and split attention per image; no
exporter keeps that dynamic. Here the layout is host-side numpy (`qwen_layout.tower_aux`, once per batch) and
`QwenTowerGraph` is the same graph for any batch:

- patch embedding: the Conv3d (kernel = stride = the patch) is a MatMul on the processor's flattened patch rows;
- 2-D rotary from `position_ids` and the fixed inverse frequencies, cos/sin and the rotation in fp32;
- attention within groups of patches (`qwen_layout`): the patches' q, k, v gathered into [G, L] by the group
  index, padding masked as keys (-inf added to the fp32 scores, softmax in fp32), each patch's output gathered back
  from its slot. Full-attention blocks group by frame (an image, or one step of a video), 2.5-VL's windowed blocks
  by window, so a patch attends within its own image (window) only and several images in one call get exactly
  what each gets alone;
- norms in fp32 (LayerNorm for Qwen2-VL, RMSNorm as transformers computes it for 2.5-VL); the PatchMerger: each run
  of `spatial_merge_size**2` consecutive patches concatenated, then its MLP.

Qwen3-VL (kind `qwen3_vl`): the patch embedding's bias; the learned position table, each patch's bilinear taps
(`pos_index`, `pos_weight`, host-side: transformers' own) summed and added after the patch embedding; LayerNorm
blocks with a `linear_fc1` / `linear_fc2` MLP; its mergers (`_StackMerger`: the main one, and one per DeepStack
level with the norm after the 2x2 shuffle) whose outputs are concatenated: [tokens, out_hidden * (1 + levels)].

2.5-VL's window permutation (transformers reorders the merge units window by window, runs the blocks and undoes
it after the merger) is folded into the window groups: every op but attention is per patch and the merge units stay
whole, so the graph keeps the processor's order and only attention reads patches in window order (the same order
as transformers', so the same sums).

`export_tower_onnx` writes it as ONNX (opset 17, TorchScript exporter): inputs `patches` + `aux_names(config)`,
output `encoder_output` [N / spatial_merge_size**2, out_hidden], dynamic patch and token axes.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..spec import CheckpointError
from .qwen_layout import (ATTN_INDEX, ATTN_SLOT, AUX_NAMES, POS_INDEX, POS_WEIGHT, POSITION_IDS, QWEN2_5_VL,
                          QWEN2_VL, QWEN3_VL, WINDOW_INDEX, WINDOW_SLOT, TowerConfig, aux_names, is_qwen_vision,
                          tower_aux)

__all__ = ["AUX_NAMES", "PATCHES", "OUTPUT", "POSITION_IDS", "ATTN_INDEX", "ATTN_SLOT", "WINDOW_INDEX", "WINDOW_SLOT",
           "QWEN2_VL", "QWEN2_5_VL", "QWEN3_VL", "TowerConfig", "QwenTowerGraph", "aux_names", "example_inputs",
           "export_tower_onnx", "is_qwen_vision", "tower_aux"]
PATCHES, OUTPUT = "patches", "encoder_output"
OPSET = 17
DTYPES = {"float32": torch.float32, "float16": torch.float16}
EPS = 1e-6


class _Norm(nn.Module):
    """LayerNorm (Qwen2-VL) or RMSNorm (2.5-VL), eps 1e-6, computed in fp32 whatever the graph's dtype."""

    def __init__(self, dim: int, rms: bool):
        super().__init__()
        self.dim, self.rms = dim, rms
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:  # transformers' Qwen2_5_VLRMSNorm: the weight multiplies in the input's dtype
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
            return self.weight * h.to(x.dtype)
        return F.layer_norm(x.float(), (self.dim,), self.weight.float(), self.bias.float(), EPS).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return (h * cos + _rotate_half(h) * sin).to(x.dtype)


@dataclass(frozen=True)
class _Groups:
    """One attention layout in the graph: patches gathered into groups [G, L] (padding slots gather patch 0 and
    are masked as keys; their outputs are dropped), the rotary angles gathered alike, and each patch's slot."""

    index: torch.Tensor  # [G, L], padding clamped to 0
    cos: torch.Tensor  # [G, L, 1, head_dim] fp32
    sin: torch.Tensor
    keep: torch.Tensor  # [G, 1, 1, L] bool: a patch, not padding
    mask: torch.Tensor  # the same as fp32 to add: 0 for a patch, -inf for padding
    slot: torch.Tensor  # [N]

    @classmethod
    def build(cls, index: torch.Tensor, slot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> "_Groups":
        valid = index >= 0
        index = index.clamp(min=0)
        zero = torch.zeros((), dtype=torch.float32, device=index.device)
        mask = torch.where(valid, zero, zero - float("inf"))[:, None, None, :]
        return cls(index, cos[index].unsqueeze(2), sin[index].unsqueeze(2), valid[:, None, None, :], mask, slot)


class _Attention(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.sdpa = True  # QwenTowerGraph.set_attention

    def forward(self, x: torch.Tensor, groups: _Groups) -> torch.Tensor:
        qkv = self.qkv(x)[groups.index]  # [G, L, 3 * width]
        g, n = groups.index.shape
        q, k, v = qkv.reshape(g, n, 3, self.heads, self.head_dim).unbind(2)  # [G, L, H, D]
        q, k = _rotate(q, groups.cos, groups.sin), _rotate(k, groups.cos, groups.sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [G, H, L, D]
        if self.sdpa and not (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=groups.keep, scale=self.scale)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            probs = torch.softmax(scores.float() + groups.mask, dim=-1).to(v.dtype)
            out = torch.matmul(probs, v)
        return self.proj(out.transpose(1, 2).reshape(g * n, self.heads * self.head_dim)[groups.slot])


class _Mlp(nn.Module):
    """Qwen2-VL: fc1, act, fc2; 2.5-VL: SwiGLU-style gate_proj/up_proj/down_proj (with biases)."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        from transformers.activations import ACT2FN  # noqa: PLC0415 - transformers' exact activations

        self.act = ACT2FN[cfg.act]
        self.gated, self.linear = cfg.kind == QWEN2_5_VL, cfg.kind == QWEN3_VL
        if self.gated:
            self.gate_proj = nn.Linear(cfg.width, cfg.mlp_hidden)
            self.up_proj = nn.Linear(cfg.width, cfg.mlp_hidden)
            self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.width)
        elif self.linear:  # Qwen3-VL's names
            self.linear_fc1 = nn.Linear(cfg.width, cfg.mlp_hidden)
            self.linear_fc2 = nn.Linear(cfg.mlp_hidden, cfg.width)
        else:
            self.fc1 = nn.Linear(cfg.width, cfg.mlp_hidden)
            self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        if self.linear:
            return self.linear_fc2(self.act(self.linear_fc1(x)))
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        rms = cfg.kind == QWEN2_5_VL
        self.norm1, self.norm2 = _Norm(cfg.width, rms), _Norm(cfg.width, rms)
        self.attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)

    def forward(self, x: torch.Tensor, groups: _Groups) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), groups)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.hidden = cfg.width * cfg.merge * cfg.merge
        self.ln_q = _Norm(cfg.width, cfg.kind == QWEN2_5_VL)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, cfg.out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class _StackMerger(nn.Module):
    """Qwen3-VL's `Qwen3VLVisionPatchMerger`: LayerNorm over each patch (main) or over the merge unit's
    concatenation (`postshuffle`, the DeepStack mergers), then linear_fc1, GELU, linear_fc2."""

    def __init__(self, cfg: TowerConfig, postshuffle: bool):
        super().__init__()
        self.hidden, self.postshuffle = cfg.width * cfg.merge * cfg.merge, postshuffle
        self.norm = _Norm(self.hidden if postshuffle else cfg.width, False)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, cfg.out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.hidden)) if self.postshuffle else self.norm(x).reshape(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        kernel = (cfg.temporal_patch, cfg.patch, cfg.patch)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.width, kernel_size=kernel, stride=kernel,
                              bias=cfg.kind == QWEN3_VL)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """The Conv3d over one patch per row (kernel = stride = the patch) is a MatMul with the flat kernel."""
        w = self.proj.weight
        y = torch.matmul(patches.to(w.dtype), w.reshape(w.shape[0], -1).t())
        return y if self.proj.bias is None else y + self.proj.bias


class QwenTowerGraph(nn.Module):
    """The tower: `forward(patches [N, patch_dim], *aux in aux_names order) -> [N / merge**2, out_hidden]`.

    `weights`: the tower's tensors keyed without the `model.visual.` prefix (what `TensorSource.with_prefixes`
    returns); missing or misshapen tensors are refused with `CheckpointError` naming them, others are ignored.

    `attention`: "sdpa" (torch's `scaled_dot_product_attention`, padding as a boolean mask: a fused kernel where
    one applies, no [G, heads, L, L] scores) or "eager" (explicit fp32 scores and softmax). The ONNX export always
    traces the eager form."""

    ATTENTIONS = ("sdpa", "eager")

    def __init__(self, vision_config: Any, weights: Mapping[str, torch.Tensor], attention: str = "sdpa"):
        super().__init__()
        cfg = TowerConfig.from_config(vision_config)
        self.config = cfg
        self.aux_names = aux_names(cfg)
        self.full_blocks = frozenset(range(cfg.depth)) if not cfg.windowed else frozenset(cfg.fullatt)
        self.inv_freq = cfg.inv_freq()
        with torch.device("meta"):  # no random init of weights that are overwritten next
            self.patch_embed = _PatchEmbed(cfg)
            if cfg.pos_embeddings:
                self.pos_embed = nn.Embedding(cfg.pos_embeddings, cfg.width)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
            self.merger = _StackMerger(cfg, False) if cfg.kind == QWEN3_VL else _Merger(cfg)
            if cfg.deepstack:
                self.deepstack_merger_list = nn.ModuleList(_StackMerger(cfg, True) for _ in cfg.deepstack)
        self.to_empty(device="cpu")
        self._load(weights)
        self.set_attention(attention)
        self.eval()

    def set_attention(self, attention: str) -> None:
        if attention not in self.ATTENTIONS:
            raise ValueError(f"attention must be one of {self.ATTENTIONS}, got {attention!r}")
        for block in self.blocks:
            block.attn.sdpa = attention == "sdpa"

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        expected = self.state_dict()
        missing = [k for k in expected if k not in weights]
        if missing:
            raise CheckpointError(f"Qwen vision tower: the checkpoint lacks {len(missing)} tensor(s) "
                                  f"(after its model.visual. prefix): {', '.join(missing[:10])}"
                                  + (" ..." if len(missing) > 10 else ""))
        wrong = [f"{k} {tuple(weights[k].shape)} (config says {tuple(t.shape)})" for k, t in expected.items()
                 if tuple(weights[k].shape) != tuple(t.shape)]
        if wrong:
            raise CheckpointError(f"Qwen vision tower: tensor shapes disagree with the vision config: "
                                  f"{', '.join(wrong[:10])}")
        with torch.no_grad():
            for k, t in expected.items():
                t.copy_(weights[k])

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] fp32: transformers' axial rope (h angles, w angles, repeated)."""
        inv = torch.tensor(self.inv_freq, dtype=torch.float32, device=positions.device)
        freqs = positions.unsqueeze(-1).float() * inv  # [N, 2, head_dim / 4]
        half = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        emb = torch.cat((half, half), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, *aux: torch.Tensor) -> torch.Tensor:
        if len(aux) != len(self.aux_names):
            raise TypeError(f"QwenTowerGraph takes patches and {self.aux_names}, got {len(aux)} aux tensors")
        a = dict(zip(self.aux_names, aux))
        cos, sin = self._rotary(a[POSITION_IDS])
        full = _Groups.build(a[ATTN_INDEX], a[ATTN_SLOT], cos, sin)
        window = _Groups.build(a[WINDOW_INDEX], a[WINDOW_SLOT], cos, sin) if self.config.windowed else full
        x = self.patch_embed(patches)
        if self.config.pos_embeddings:  # transformers' `fast_pos_embed_interpolate`: the taps' weighted sum
            pos = (self.pos_embed(a[POS_INDEX]) * a[POS_WEIGHT][:, :, None]).sum(1)  # [N, width]
            x = x + pos.to(x.dtype)
        stack, levels = [], list(self.config.deepstack)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.full_blocks else window)
            if i in levels:
                stack.append(self.deepstack_merger_list[levels.index(i)](x))
        return torch.cat([self.merger(x)] + stack, dim=-1) if stack else self.merger(x)


def example_inputs(graph: QwenTowerGraph, grids: Sequence[Sequence[int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random patches for these grids and their aux tensors, in the graph's input order and dtype."""
    aux = tower_aux(grids, graph.config)
    n = aux[POSITION_IDS].shape[0]
    g = torch.Generator().manual_seed(seed)
    device = graph.patch_embed.proj.weight.device
    patches = torch.randn(n, graph.config.patch_dim, generator=g).to(device, graph.dtype)
    return (patches,) + tuple(torch.from_numpy(aux[name]).to(device) for name in graph.aux_names)


def export_tower_onnx(graph: QwenTowerGraph, out: str | Path, grids_example: Sequence[Sequence[int]],
                      dtype: str = "float32", external_data: bool = False) -> Path:
    """Write the graph as ONNX in `dtype` (float16: weights and activations fp16; norms, rotary and softmax fp32;
    `patches` is then fp16 too): inputs `patches` [N, patch_dim] + `graph.aux_names` (int64), output
    `encoder_output` [N / merge**2, out_hidden]; dynamic axes: patches, frames, frame_patches, windows, tokens.

    A graph over protobuf's 2 GB (a 7B checkpoint's tower in fp32), or any with `external_data`, keeps its weights in
    one file beside it, `<out>.data` (onnxruntime and TensorRT's parser read it from the graph's directory).
    Written in a private directory, then renamed into place (the weights first)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if graph.dtype != DTYPES[dtype]:
        graph = copy.deepcopy(graph).to(DTYPES[dtype])
    inputs = example_inputs(graph, grids_example)
    names = (PATCHES,) + graph.aux_names
    axes = {name: {0: "patches"} for name in names}
    axes[ATTN_INDEX] = {0: "frames", 1: "frame_patches"}
    if WINDOW_INDEX in axes:
        axes[WINDOW_INDEX] = {0: "windows"}  # a window's patch count is fixed per checkpoint
    axes[OUTPUT] = {0: "tokens"}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp = work / out.name
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the aux count check, static per graph
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
            torch.onnx.export(graph, inputs, str(tmp), opset_version=OPSET, input_names=list(names),
                              output_names=[OUTPUT], dynamic_axes=axes, dynamo=False)
        if external_data or len(list(work.iterdir())) > 1:  # over 2 GB the exporter writes a file per tensor
            data = _one_data_file(tmp)
            os.replace(data, out.with_name(data.name))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _one_data_file(path: Path) -> Path:
    """Re-save the ONNX graph at `path` with every weight in one file beside it, `<name>.data`."""
    import onnx  # noqa: PLC0415

    model = onnx.load(str(path), load_external_data=True)
    for f in path.parent.iterdir():
        f.unlink()
    data = path.with_name(path.name + ".data")
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return data
