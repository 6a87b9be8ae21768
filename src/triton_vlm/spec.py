"""One description of a checkpoint, read once, built the same way in every process (gpt-fast's `ModelArgs`).

`CheckpointSpec.load(model_dir)` parses `config.json` (through transformers' `AutoConfig`, local files only:
it fills the defaults llava-1.5's sparse `text_config` relies on and normalises old rope keys) and
`generation_config.json`, and returns plain values:
- `text` (`TextSpec`): what the decoder forward needs (Llama family: Llama, Vicuna, Mistral);
- `vision` (`VisionSpec`, None for a plain Llama): tower type, image (tile) and patch size, feature layer and
  select strategy, and the tokens of one tile, by one formula (`image_token_count`); how many tiles and tokens
  an image of a given size takes is its model family's (`families/`: one tile for llava-1.5, anyres for
  LLaVA-NeXT);
- `eos_ids`: `generation_config.json`'s `eos_token_id`, else the text config's, else the top config's;
- `context_length`: `max_position_embeddings` (a `sliding_window` does not shorten it: attention is masked to
  the window instead, `TextSpec.layer_windows`, as transformers' Mistral and Qwen2 do);
- `image_token_id`.
The weights are read by the one loader, `weight_source.TensorSource` (files, shards and key layouts).
A checkpoint that cannot be served raises `CheckpointError` (a deployment error, not a request error).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# plain text checkpoints (Qwen2: Llama with q/k/v biases); the text model a vision-language checkpoint nests is its
# family's to accept (`families.Family.text_model_types`, checked by `families.family_of`)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# hybrid text models (transformers' model_type of the nested text config): what their modules compute besides the
# config's fields (transformers' Qwen3_5RMSNorm is zero-centred, its attention gated, its M-RoPE always interleaved
# with sections [11, 11, 10] unless the config says otherwise); the hybrid forward serves these only
_QWEN3_5 = dict(norm_offset=1.0, attn_output_gate=True, mrope_interleaved=True, mrope_section=(11, 11, 10))
HYBRID_TEXT = {"qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5}
# mixture-of-experts text models whose modules differ from Qwen3-VL-MoE's (every layer sparse, `decoder_sparse_step`
# / `mlp_only_layers` not read; a shared expert of `shared_expert_intermediate_size` with its sigmoid gate beside the
# routed experts): transformers' Qwen3_5MoeSparseMoeBlock
MOE_TEXT = {"qwen3_5_moe_text": dict(every_layer=True, shared_expert=True)}
FEATURE_STRATEGIES = ("default", "full")
VISION_TOWERS_WITH_CLS = ("clip_vision_model",)  # towers whose output starts with a CLS token
VISION_TOWERS_WITHOUT_CLS = ("siglip_vision_model",)


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served (missing files, unsupported model, inconsistent configs)."""


def image_token_count(image_hw: tuple[int, int], patch: int, extra_tokens: int, strategy: str) -> int:
    """Placeholders per image = the tower's output tokens (patches + CLS-like extras), less the CLS token that
    the "default" feature select strategy drops (as transformers' LLaVA does)."""
    n = (image_hw[0] // patch) * (image_hw[1] // patch) + extra_tokens - (1 if strategy == "default" else 0)
    if n <= 0:
        raise CheckpointError(f"computed {n} image tokens per image (image {image_hw}, patch {patch})")
    return n


@dataclass(frozen=True)
class TextSpec:
    """What the decoder forward needs, read from the (text) config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int  # the context length: prompt + max_tokens must fit
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta (+ llama3 / linear fields)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: Optional[int] = None  # LLaVA placeholder id; None for a plain Llama
    # per layer, the sliding attention window (a query sees the keys q - window < k <= q), 0 = full attention;
    # () when no layer slides (Mistral with sliding_window: every layer; Qwen2: layer_types "sliding_attention")
    layer_windows: tuple[int, ...] = ()
    # M-RoPE (Qwen2-VL): the rotary frequencies' split between the temporal, height and width positions; () = 1-D
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # the sections interleaved across the frequencies (T, H, W, T, H, W, ...)
    video_token_id: Optional[int] = None  # Qwen2-VL's video placeholder id; None for a family without videos
    # mixture of experts (Qwen3-VL-MoE): experts per sparse layer, experts per token, each expert's width, and
    # which layers are sparse (`num_experts` > 0, (i + 1) % `decoder_sparse_step` == 0, not in `mlp_only_layers`;
    # Qwen3.5-MoE: every layer, `MOE_TEXT`)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    # Qwen3.5-MoE: each sparse layer's shared expert (a SiLU-gated MLP this wide, times sigmoid of its own gate,
    # added to the routed experts' sum); 0 = none (Qwen3-VL-MoE)
    shared_expert_size: int = 0
    # hybrid text models (Qwen3.5's `layer_types`): each layer's token mixer, "full_attention" or
    # "linear_attention" (Gated DeltaNet, `engine/model/hybrid.py`); () = attention everywhere (the Llama forward)
    layer_kinds: tuple[str, ...] = ()
    rotary_dim: int = 0  # partial rotary: the leading values of each head that rotate (0 = head_dim)
    norm_offset: float = 0.0  # RMSNorms multiply by (offset + weight): 1 for zero-centred norms (Qwen3.5)
    attn_output_gate: bool = False  # q_proj also yields a gate per head: attention output x sigmoid(gate)
    # the linear layers' (key heads, value heads, key dim, value dim, conv kernel): `deltanet.DeltaNetShape`
    linear_dims: tuple[int, ...] = ()

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Every id whose positions take vision features, in the order the features come (prompt order)."""
        return tuple(i for i in (self.image_token_id, self.video_token_id) if i is not None)


@dataclass(frozen=True)
class VisionSpec:
    model_type: str  # e.g. "clip_vision_model"
    image_size: int  # the tower's square input size
    patch_size: int
    feature_layer: Any  # int or list of ints (hidden states concatenated)
    select_strategy: str  # "default" (drop CLS) or "full"
    extra_tokens: Optional[int]  # CLS-like tokens the tower outputs besides the patches (None: unknown tower)

    @property
    def num_image_tokens(self) -> int:
        return image_token_count((self.image_size, self.image_size), self.patch_size, self.known_extra_tokens(),
                                 self.select_strategy)

    def known_extra_tokens(self, override: Optional[int] = None) -> int:
        """The tower's extra tokens; `override` (the processor config's `num_additional_image_tokens`) wins."""
        if override is not None:
            return int(override)
        if self.extra_tokens is None:
            raise CheckpointError(f"vision tower {self.model_type!r}: unknown number of extra (CLS) tokens; set "
                                  "num_additional_image_tokens in processor_config.json")
        return self.extra_tokens


@dataclass(frozen=True)
class CheckpointSpec:
    model_dir: Path
    text: TextSpec
    vision: Optional[VisionSpec]
    eos_ids: tuple[int, ...]
    image_token_id: Optional[int]
    context_length: int
    hf_config: Any = field(repr=False, compare=False)  # the parsed transformers config (for the vision tower)
    quant: Any = None  # `quant.QuantConfig` of a quantized checkpoint, None for unquantized weights

    @classmethod
    def load(cls, model_dir: str | Path) -> "CheckpointSpec":
        from transformers import AutoConfig  # noqa: PLC0415

        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise CheckpointError(f"{d} has no config.json (expected a Hugging Face checkpoint directory)")
        try:
            top = AutoConfig.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{d}: cannot parse config.json ({type(e).__name__}: {e})") from None
        from .checkpoint_fields import Unservable, check_fields  # noqa: PLC0415
        from .quant import read_quantization  # noqa: PLC0415

        try:  # a quantization not read exactly, or a field that changes the math, is refused here
            quant = read_quantization(top)
            check_fields(top)
        except Unservable as e:
            raise CheckpointError(f"{d}: {e}") from None
        text_cfg = getattr(top, "text_config", None) or top
        eos = _eos_ids(d, text_cfg, top)
        image_token_id = getattr(top, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(top, "image_token_index", None)
        image_token_id = None if image_token_id is None else int(image_token_id)
        text = _text_spec(text_cfg, top, eos, image_token_id)
        vision = _vision_spec(top) if getattr(top, "vision_config", None) is not None else None
        return cls(model_dir=d, text=text, vision=vision, eos_ids=eos, image_token_id=image_token_id,
                   context_length=text.max_position_embeddings, hf_config=top, quant=quant)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(dict.fromkeys(int(v) for v in value))
    return (int(value),)


def read_json(path: Path) -> dict:
    """A JSON file of the checkpoint; {} when absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _eos_ids(d: Path, text_cfg: Any, top: Any) -> tuple[int, ...]:
    eos = _ids(read_json(d / "generation_config.json").get("eos_token_id"))
    eos = eos or _ids(getattr(text_cfg, "eos_token_id", None)) or _ids(getattr(top, "eos_token_id", None))
    if not eos:
        raise CheckpointError(f"{d}: no eos_token_id in generation_config.json or config.json")
    return eos


def _rope(text: Any) -> dict:
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if not rope:  # very old configs without the normalised form
        rope = dict(getattr(text, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"rope scaling type {rope['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return rope


def _text_spec(text: Any, top: Any, eos: tuple[int, ...], image_token_id: Optional[int]) -> TextSpec:
    if text is top and text.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"language model type {text.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(text, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {text.hidden_act!r} is not supported; only 'silu' (Llama family)")
    hybrid = _hybrid(text)  # first: refuses linear-attention layers of a text model not served
    max_pos = int(text.max_position_embeddings)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    tie = bool(getattr(top, "tie_word_embeddings", False)) or bool(getattr(text, "tie_word_embeddings", False))
    return TextSpec(
        vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0), num_layers=int(text.num_hidden_layers),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int(getattr(text, "head_dim", None) or
                                                             text.hidden_size // heads),
        rms_norm_eps=float(text.rms_norm_eps), max_position_embeddings=max_pos, rope=_rope(text),
        tie_word_embeddings=tie, attention_bias=bool(getattr(text, "attention_bias", False)),
        mlp_bias=bool(getattr(text, "mlp_bias", False)), eos_token_ids=eos, image_token_id=image_token_id,
        layer_windows=_layer_windows(text), video_token_id=None if getattr(top, "video_token_id", None) is None
        else int(top.video_token_id), **_moe(text),
        **({"mrope_section": _mrope(text), "mrope_interleaved": _mrope_interleaved(text)} | hybrid))


def _hybrid(text: Any) -> dict:
    """A hybrid text model's fields (`HYBRID_TEXT`; {} for an attention-only one). Partial rotary is served by the
    hybrid forward only: elsewhere `partial_rotary_factor` != 1 is refused."""
    factor = float(_rope_fields(text).get("partial_rotary_factor", 1.0) or 1.0)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    rules = HYBRID_TEXT.get(getattr(text, "model_type", None))
    if rules is None:
        if "linear_attention" in (getattr(text, "layer_types", None) or ()):
            raise CheckpointError(f"linear_attention layers are served for {sorted(HYBRID_TEXT)} text models only, "
                                  f"not model_type {getattr(text, 'model_type', None)!r}")
        if factor != 1.0:
            raise CheckpointError(f"partial_rotary_factor {factor} is not supported for model_type "
                                  f"{getattr(text, 'model_type', None)!r}")
        return {}
    kinds = tuple(text.layer_types)
    if set(kinds) - {"full_attention", "linear_attention"} or len(kinds) != int(text.num_hidden_layers):
        raise CheckpointError(f"layer_types {list(kinds)}: one 'full_attention' or 'linear_attention' per layer")
    rope = _rope_fields(text)
    section = tuple(int(x) for x in (rope.get("mrope_section") or rules["mrope_section"]))
    rotary = int(head_dim * factor)
    if sum(section) != rotary // 2:
        raise CheckpointError(f"mrope_section {list(section)} must add up to the rotary dim / 2 = {rotary // 2}")
    dims = tuple(int(getattr(text, f)) for f in ("linear_num_key_heads", "linear_num_value_heads",
                                                  "linear_key_head_dim", "linear_value_head_dim",
                                                  "linear_conv_kernel_dim"))
    if dims[1] % dims[0]:
        raise CheckpointError(f"linear_num_value_heads {dims[1]} is not a multiple of linear_num_key_heads {dims[0]}")
    return dict(layer_kinds=kinds, rotary_dim=rotary, norm_offset=rules["norm_offset"],
                attn_output_gate=rules["attn_output_gate"], linear_dims=dims, mrope_section=section,
                mrope_interleaved=rules["mrope_interleaved"])


def _moe(text: Any) -> dict:
    """The mixture-of-experts fields as transformers' Qwen3-VL-MoE decoder layers read them, or Qwen3.5-MoE's
    (`MOE_TEXT`: every layer sparse, a shared expert); {} for a dense model. Their routers always renormalise the
    top-k weights, as transformers' do."""
    experts = int(getattr(text, "num_experts", 0) or 0)
    if not experts:
        return {}
    rules = MOE_TEXT.get(getattr(text, "model_type", None), {})
    step, dense = int(getattr(text, "decoder_sparse_step", 1) or 1), set(getattr(text, "mlp_only_layers", None) or ())
    if rules.get("every_layer"):  # transformers' Qwen3_5MoeDecoderLayer: a sparse block in every layer
        step, dense = 1, set()
    layers = tuple(i for i in range(int(text.num_hidden_layers)) if i not in dense and (i + 1) % step == 0)
    top_k = int(text.num_experts_per_tok)
    if not 0 < top_k <= experts:
        raise CheckpointError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    shared = int(text.shared_expert_intermediate_size) if rules.get("shared_expert") else 0
    if rules.get("shared_expert") and shared <= 0:
        raise CheckpointError(f"shared_expert_intermediate_size {shared} must be positive")
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=int(text.moe_intermediate_size),
                sparse_layers=layers, shared_expert_size=shared)


def _rope_fields(text: Any) -> dict:
    return getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}


def _mrope_interleaved(text: Any) -> bool:
    return bool(_rope_fields(text).get("mrope_interleaved"))


def _mrope(text: Any) -> tuple[int, ...]:
    rope = _rope_fields(text)
    section = tuple(int(x) for x in (rope.get("mrope_section") or ()))
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    if getattr(text, "model_type", None) in HYBRID_TEXT:
        return section  # checked against the rotary dim by `_hybrid`
    if section and sum(section) != head_dim // 2:
        raise CheckpointError(f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}")
    return section


def _layer_windows(text: Any) -> tuple[int, ...]:
    """Sliding windows per layer as transformers applies them: `layer_types` when the config has them (Qwen2:
    "sliding_attention" layers use `sliding_window`, which its config sets only with use_sliding_window), else
    `sliding_window` on every layer (Mistral); () when no layer slides."""
    window = int(getattr(text, "sliding_window", None) or 0)
    types = getattr(text, "layer_types", None)
    if not window:
        return ()
    if types is None:
        return (window,) * int(text.num_hidden_layers)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _vision_spec(top: Any) -> VisionSpec:
    vision = top.vision_config
    if getattr(vision, "image_size", None) is None:  # patches at the image's own size, no CLS (Qwen2-VL's):
        # tokens per image are the family's layout (`families/`)
        return VisionSpec(model_type=vision.model_type, image_size=0, patch_size=int(vision.patch_size),
                          feature_layer=-1, select_strategy="full", extra_tokens=0)
    strategy = getattr(top, "vision_feature_select_strategy", "default")
    if strategy not in FEATURE_STRATEGIES:
        raise CheckpointError(f"vision_feature_select_strategy {strategy!r} is unsupported; use one of "
                              f"{FEATURE_STRATEGIES}")
    extra = 1 if vision.model_type in VISION_TOWERS_WITH_CLS else 0 if vision.model_type in VISION_TOWERS_WITHOUT_CLS \
        else None
    return VisionSpec(model_type=vision.model_type, image_size=int(vision.image_size),
                      patch_size=int(vision.patch_size), feature_layer=getattr(top, "vision_feature_layer", -2),
                      select_strategy=strategy, extra_tokens=extra)
