"""`quantization_config`, read once where the checkpoint is read (`spec.CheckpointSpec.load`).

Served (weights dequantized once at load, `quant.dequant`; tokens equal `transformers` loading the same files
with `dequantize=True` in fp32):
- `quant_method: "fp8"` (transformers' `FineGrainedFP8Config`; Qwen's `-FP8` releases): float8_e4m3fn weights,
  one `weight_scale_inv` per `weight_block_size` block (or one per tensor without a block size),
  `activation_scheme: "dynamic"`, `scale_fmt: "float"`; `modules_to_not_convert` are stored unquantized;
- `quant_method: "compressed-tensors"` with FP8 weights (`format` "float-quantized" or "naive-quantized"): one
  group whose `weights` are 8-bit `float`, symmetric, static, `strategy` "channel" or "tensor" (`weight_scale`
  [out, 1] or [1]), and `input_activations` none or dynamic 8-bit float per token; `ignore`d modules are stored
  unquantized.
Anything else (another method, static activations, integer or 4-bit weights, group strategies, a KV-cache
scheme, sparsity, ue8m0 scales) is refused at load (`checkpoint_fields.Unservable`, raised as
`spec.CheckpointError`) naming the field, its value and what is supported: serving it with its scales ignored
answers silently wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..checkpoint_fields import Unservable

SUPPORTED_METHODS = ("fp8", "compressed-tensors")
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class QuantConfig:
    """A quantization the engine reads exactly (see the module docstring)."""

    method: str  # "fp8" | "compressed-tensors"
    scale_suffix: str  # the scale tensor beside each quantized `weight`: "weight_scale_inv" | "weight_scale"
    block: Optional[tuple[int, int]] = None  # fp8: the (rows, cols) of one scale's block; None: per tensor
    strategy: str = "block"  # "block" (fp8), "channel" | "tensor" (compressed-tensors)
    # the dtype the product weight x scale is computed in, as the reference does: "float32" (transformers'
    # Fp8Dequantize) or "scale" (compressed-tensors' dequantize: the scale's dtype)
    compute: str = "float32"

    @property
    def label(self) -> str:
        """What `/v1/models` and the metrics say is served."""
        exact = "computed as its float32 dequantization"  # dequantized at load or inside the products (gemv_fp8)
        if self.method == "fp8":
            grid = f"block {self.block[0]}x{self.block[1]}" if self.block else "per-tensor"
            return f"fp8-e4m3 ({grid} weight_scale_inv), {exact}"
        return f"fp8-e4m3 (compressed-tensors, per-{self.strategy} weight_scale), {exact}"


def _raw(top: Any) -> Optional[dict]:
    """The checkpoint's quantization_config (top config, else its text config) as a dict; None when absent."""
    if isinstance(top, dict):
        cfgs: tuple = (top, top.get("text_config") or {})
        get = dict.get
    else:
        cfgs, get = (top, getattr(top, "text_config", None)), getattr
    for cfg in cfgs:
        q = get(cfg, "quantization_config", None) if cfg is not None else None
        if q is not None:
            return q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else dict(vars(q)))
    return None


def read_quantization(top: Any) -> Optional[QuantConfig]:
    """The checkpoint's quantization (None for unquantized weights), from its parsed config or raw config.json
    dict; `Unservable` for one the engine does not read exactly."""
    raw = _raw(top)
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    raise Unservable(f"config.json quantization_config.quant_method = {method!r} is not supported; supported: "
                     f"{list(SUPPORTED_METHODS)} with FP8 (e4m3) weights")


def _refuse(field: str, value: Any, supported: str) -> Unservable:
    return Unservable(f"config.json quantization_config.{field} = {value!r} is not supported; supported: {supported}")


def _fp8(raw: dict) -> QuantConfig:
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _refuse("activation_scheme", raw.get("activation_scheme"), "'dynamic'")
    if raw.get("scale_fmt", "float") not in (None, "float"):
        raise _refuse("scale_fmt", raw.get("scale_fmt"), "'float' (float32 / bfloat16 weight_scale_inv)")
    if raw.get("fmt", "e4m3") not in (None, "e4m3"):
        raise _refuse("fmt", raw.get("fmt"), "'e4m3' (float8_e4m3fn weights)")
    if raw.get("modules_to_convert"):
        raise _refuse("modules_to_convert", raw.get("modules_to_convert"), "none (FP8 linear layers only)")
    if raw.get("expert_dtype", "fp8") not in (None, "fp8"):
        raise _refuse("expert_dtype", raw.get("expert_dtype"), "'fp8'")
    block = raw.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                              for b in block)):
            raise _refuse("weight_block_size", block, "two positive integers, e.g. [128, 128], or null")
        block = (int(block[0]), int(block[1]))
    return QuantConfig("fp8", "weight_scale_inv", block=block, strategy="block" if block else "tensor")


def _compressed_tensors(raw: dict) -> QuantConfig:
    fmt = raw.get("format")
    if fmt not in CT_FORMATS:
        raise _refuse("format", fmt, f"{list(CT_FORMATS)} (FP8 weights)")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(field):
            raise _refuse(field, raw.get(field), "none")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "one group (one FP8 scheme for every quantized Linear)")
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    w = group.get("weights") or {}
    if not (w.get("num_bits") == 8 and w.get("type") == "float" and w.get("symmetric", True)
            and not w.get("dynamic") and w.get("strategy") in CT_WEIGHT_STRATEGIES and not w.get("group_size")):
        raise _refuse(f"{where}.weights", w, "8-bit float, symmetric, static, strategy 'channel' or 'tensor'")
    act = group.get("input_activations")
    if act is not None and not (act.get("num_bits") == 8 and act.get("type") == "float" and act.get("dynamic")
                                and act.get("strategy") == "token"):
        raise _refuse(f"{where}.input_activations", act, "null or 8-bit float, dynamic, strategy 'token'")
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", group.get("output_activations"), "null")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(f"{where}.targets", targets, "['Linear']")
    return QuantConfig("compressed-tensors", "weight_scale", strategy=str(w["strategy"]), compute="scale")
