"""Quantize a tiny checkpoint offline into the FP8 formats the model makers publish (the engine's FP8 fixtures).

`quantize_checkpoint(src, out, fmt)` writes `src`'s tensors under their own keys (the hub layout stays the hub
layout: the renames must apply to the scales too), the decoder's linear layers quantized to float8_e4m3fn with
their scales beside them, every other floating tensor (embeddings, norms, lm_head, vision tower, projector) in
bfloat16 as the releases store what they leave unquantized (Qwen's `-FP8` checkpoints, llm-compressor's output of
a bf16 model; the bases are fp32: both the engine and `transformers` then read the same bf16 values), and the
other files copied, config.json gaining the format's `quantization_config`:
- `fp8-block`: Qwen's `-FP8` releases (`quant_method: "fp8"`, `weight_block_size`, `activation_scheme:
  "dynamic"`, `modules_to_not_convert`): one float32 `weight_scale_inv` = amax / 448 per block;
- `ct-channel` / `ct-tensor`: compressed-tensors' "FP8-Dynamic" (`quant_method: "compressed-tensors"`,
  `format: "float-quantized"`, static per-channel or per-tensor weights, dynamic per-token activations,
  `ignore`): `weight_scale` = amax / 448 per output row ([out, 1]) or tensor ([1]), in bfloat16 as
  llm-compressor writes a bf16 model's.
`ensure_fp8_checkpoint(base, fmt, shards=1)` caches one under the cache dir, in `shards` files with an index
when > 1 (as the releases are sharded; `base`: "llava" = the trained demo model in
the hub's layout, "qwen2_5_vl" = a random Qwen2.5-VL-shaped checkpoint, "qwen3_vl" = a random dense Qwen3-VL
(sharded hub layout, QK-norm, DeepStack; its k/v rows are 48 wide: [16, 16] blocks, `BASE_BLOCKS`), "qwen3_5" /
"qwen3_5_moe" = the random hybrid Qwen3.5 / Qwen3.5-MoE of `qwen35_checkpoint` (tests/test_qwen3_5.py's shapes,
seed 3; the MoE's experts 32 and shared expert 48 wide: [16, 16] blocks) in Qwen's `-FP8` layout: its linear
layers' in_proj_qkv / in_proj_z / out_proj, attention, MLP and experts quantized, in_proj_a / in_proj_b, conv1d,
A_log, dt_bias, norms, router and shared-expert gate bf16 and listed in `modules_to_not_convert`, bf16 scales).
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..weight_source import INDEX_FILES, SINGLE_FILES, TensorSource

FORMATS = ("fp8-block", "ct-channel", "ct-tensor")
BASES = ("llava", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
BLOCK = (32, 32)  # the tiny models' dims are multiples of 32; the releases use [128, 128] on theirs
BASE_BLOCKS = {"qwen3_vl": (16, 16), "qwen3_5_moe": (16, 16)}  # fp8-block's block where a base's dims are not
# multiples of BLOCK
# the decoder's projections a release quantizes: attention's and the MLP's (dense, a shared expert, each expert of
# the hub's per-expert files), a Gated DeltaNet layer's in_proj_qkv / in_proj_z / out_proj (Qwen3.5's `-FP8`: its
# in_proj_a / in_proj_b, conv1d, A_log, dt_bias and norm stay bf16, as do the router and the shared expert's gate)
QUANTIZED = re.compile(r"(^|\.)language_model\.layers\.\d+\.((self_attn|mlp(\.shared_expert|\.experts\.\d+)?)\."
                       r"[a-z]+_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$")
# what the hybrid (Qwen3.5) releases list in `modules_to_not_convert` besides lm_head and the tower (names as
# transformers' `should_convert_module` matches them: a suffix of the module's name)
HYBRID_NOT_CONVERTED = ["linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.conv1d", "mlp.gate",
                        "mlp.shared_expert_gate"]
# fp8-block's weight_scale_inv dtype by base (default float32): bf16 for the hybrids, as Qwen's Qwen3.5 / 3.6 `-FP8`
# files are described to store them (the engine widens them to fp32 exactly, as transformers does)
BASE_SCALES = {"qwen3_5": torch.bfloat16, "qwen3_5_moe": torch.bfloat16}
VERSION = 2  # bump when the fixtures change (2: unquantized tensors in bf16, as the releases)
BASE_VERSION = 1  # bump when the random bases change


def fp8_block(w: torch.Tensor, block: tuple[int, int],
              scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> (e4m3 [R, C], scale_inv [R / bm, C / bn] in `scale_dtype`)."""
    (rows, cols), (bm, bn) = w.shape, block
    b = w.float().reshape(rows // bm, bm, cols // bn, bn)
    scale = (b.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)  # [R / bm, C / bn]
    q = (b / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def fp8_channel(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> (e4m3 [R, C], bf16 scale [R, 1] or [1])."""
    w = w.float()
    amax = w.abs().amax().reshape(1) if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    q = w / scale.float()  # [R, C] / [1] or [R, 1]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantization_config(fmt: str, not_converted: list[str], block: tuple[int, int] = BLOCK) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": not_converted}
    strategy = "channel" if fmt == "ct-channel" else "tensor"
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
            "group_size": None, "block_structure": None, "actorder": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": [f"re:.*{re.escape(m)}.*" if m != "lm_head" else m for m in not_converted],
            "kv_cache_scheme": None, "sparsity_config": {}}


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: str, block: tuple[int, int] = BLOCK,
                        scale_dtype: torch.dtype = torch.float32, shards: int = 1) -> Path:
    """Write `src` quantized in `fmt` to `out` (see the module docstring; `block`, `scale_dtype`: fp8-block's
    block size and weight_scale_inv dtype; `shards` > 1: in that many files with a `model.safetensors.index.json`,
    a weight and its scale possibly in different files, as the sharded releases are)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    src, out = Path(src), Path(out)
    source = TensorSource(src)
    suffix = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    tensors: dict[str, torch.Tensor] = {}
    for name, (_, key) in source.files.items():
        w = source.get(name)
        if not QUANTIZED.search(name):
            tensors[key] = (w.to(torch.bfloat16) if w.is_floating_point() else w).contiguous()
            continue
        q, scale = fp8_block(w, block, scale_dtype) if fmt == "fp8-block" else fp8_channel(w, fmt == "ct-tensor")
        tensors[key], tensors[key[: -len("weight")] + suffix] = q.contiguous(), scale.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(INDEX_FILES) | set(SINGLE_FILES)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, out / f.name)
    _save(tensors, out, shards)
    config = json.loads((out / "config.json").read_text())
    towers = sorted({m.group(1) for k in tensors
                     if (m := re.match(r"((model\.)?(vision_tower|visual|multi_modal_projector))\.", k))})
    hybrid = HYBRID_NOT_CONVERTED if any(".linear_attn." in k for k in tensors) else []
    config["quantization_config"] = quantization_config(fmt, ["lm_head", *towers, *hybrid], block)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _save(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    from .hub_layout import save_shards  # noqa: PLC0415

    if shards > 1:
        save_shards(tensors, out, shards)
    else:
        save_file(tensors, str(out / SINGLE_FILES[0]), metadata={"format": "pt"})


def _base(base: str) -> Path:
    from ..paths import cache_dir  # noqa: PLC0415

    if base == "llava":
        from .hub_layout import ensure_demo_hub_model  # noqa: PLC0415

        return ensure_demo_hub_model(progress=False)
    if base not in BASES:
        raise ValueError(f"base must be one of {BASES}, got {base!r}")
    path = cache_dir() / f"fp8-base-{base}-v{BASE_VERSION}"
    if not (path / "config.json").is_file():
        from .build import _lock  # noqa: PLC0415
        from .qwen_checkpoint import build_qwen_vl  # noqa: PLC0415

        with _lock(path):
            if not (path / "config.json").is_file():
                tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
                if base.startswith("qwen3_5"):
                    from .qwen35_checkpoint import build_qwen3_5  # noqa: PLC0415

                    build_qwen3_5(tmp, shards=2, seed=3, max_position_embeddings=512,
                                  experts=4 if base == "qwen3_5_moe" else 0)
                elif base == "qwen3_vl":
                    from .qwen3_checkpoint import build_qwen3_vl  # noqa: PLC0415

                    build_qwen3_vl(tmp, shards=2, seed=3)
                else:
                    build_qwen_vl(tmp, "qwen2_5_vl", seed=11)
                tmp.rename(path)
    return path


def ensure_fp8_checkpoint(base: str, fmt: str, shards: int = 1) -> Path:
    """`base` quantized in `fmt` (in `shards` files), cached under the cache dir (written atomically on first
    use)."""
    from ..paths import cache_dir  # noqa: PLC0415
    from .build import _lock  # noqa: PLC0415

    src = _base(base)
    out = cache_dir() / f"fp8-{base}-{fmt}-v{VERSION}{f'-{shards}shards' if shards > 1 else ''}"
    done = out / (SINGLE_FILES[0] if shards == 1 else INDEX_FILES[0])
    if done.is_file():
        return out
    with _lock(out):
        if not done.is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            quantize_checkpoint(src, tmp, fmt, BASE_BLOCKS.get(base, BLOCK), BASE_SCALES.get(base, torch.float32),
                                shards)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out
