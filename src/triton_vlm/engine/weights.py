"""Read a Llama-family language model (Llama / Vicuna / Mistral layout) out of a Hugging Face checkpoint.

Accepted directories:

- a LLaVA checkpoint (`model_type: llava`): only the language model's tensors are read (the vision tower and
  projector belong to the vision step). Two key layouts exist:
  transformers 5.x in memory / newer saves: `model.language_model.layers.N...` + `lm_head.weight`;
  older saves (and what transformers 5.x `save_pretrained` still writes): `language_model.model.layers.N...`
  + `language_model.lm_head.weight`.
- a plain Llama / Mistral checkpoint: `model.layers.N...` + `lm_head.weight`.

Weights come from `model.safetensors`, from shards listed in `model.safetensors.index.json`, or (older
checkpoints) `pytorch_model.bin` / its index. Tied embeddings (`tie_word_embeddings` or no lm_head tensor)
reuse `embed_tokens` as the lm_head. The config is parsed with transformers' `AutoConfig` (local files only),
which fills the defaults that llava-1.5's sparse `text_config` relies on and normalises old `rope_theta` /
`rope_scaling` keys into `rope_parameters`.

Tensors are returned under canonical names: `embed`, `norm`, `lm_head`, `layers.{i}.{module}` with module in
`MODULES` (+ `.bias` when the checkpoint has biases) and `layers.{i}.input_norm` / `layers.{i}.post_norm`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgument

# every linear module of a decoder layer, by its Hugging Face name (the LoRA issue maps these to module ids)
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTN_MODULES + MLP_MODULES
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# (layers prefix, embed key, final norm key, lm_head key) per layout; the first whose embed key exists wins
LAYOUTS = (
    ("model.language_model.", "model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
     "lm_head.weight"),
    ("language_model.model.", "language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
     "language_model.lm_head.weight"),
    ("model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
)


@dataclass(frozen=True)
class ModelConfig:
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
    image_token_id: int | None = None  # LLaVA placeholder id; None for a plain Llama

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def load_config(model_dir: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InvalidArgument(f"{model_dir} has no config.json (expected a Hugging Face checkpoint directory)")
    top = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    text = getattr(top, "text_config", None) or top
    if text.model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgument(
            f"language model type {text.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(text, "hidden_act", "silu") != "silu":
        raise InvalidArgument(f"hidden_act {text.hidden_act!r} is not supported; only 'silu' (Llama family)")
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if not rope:  # very old configs without the normalised form
        rope = dict(getattr(text, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise InvalidArgument(
            f"rope scaling type {rope['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise InvalidArgument("partial_rotary_factor != 1.0 is not supported")
    max_pos = int(text.max_position_embeddings)
    window = getattr(text, "sliding_window", None)
    if window:  # Mistral v0.1: never let a sequence outgrow the window instead of masking by window
        max_pos = min(max_pos, int(window))
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise InvalidArgument(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)

    eos = ()
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    eos = eos or _ids(getattr(text, "eos_token_id", None)) or _ids(getattr(top, "eos_token_id", None))
    image_token_id = getattr(top, "image_token_id", None)
    if image_token_id is None:
        image_token_id = getattr(top, "image_token_index", None)
    tie = bool(getattr(top, "tie_word_embeddings", False)) or bool(getattr(text, "tie_word_embeddings", False))
    return ModelConfig(
        vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size), num_layers=int(text.num_hidden_layers),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(text.rms_norm_eps),
        max_position_embeddings=max_pos, rope=rope, tie_word_embeddings=tie,
        attention_bias=bool(getattr(text, "attention_bias", False)), mlp_bias=bool(getattr(text, "mlp_bias", False)),
        eos_token_ids=eos, image_token_id=None if image_token_id is None else int(image_token_id),
    )


class _TensorSource:
    """Lazy access to the checkpoint's tensors by key, whatever the file layout."""

    def __init__(self, model_dir: Path):
        self.files: dict[str, Path] = {}  # key -> file
        self._open: dict[Path, Any] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = model_dir / index_name
            if index.is_file():
                for key, fname in json.loads(index.read_text())["weight_map"].items():
                    self.files[key] = model_dir / fname
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            path = model_dir / single
            if path.is_file():
                for key in self._handle(path).keys():
                    self.files[key] = path
                return
        raise InvalidArgument(f"{model_dir} holds no model.safetensors, safetensors index or pytorch_model.bin")

    def _handle(self, path: Path):
        if path not in self._open:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[path] = safe_open(str(path), framework="pt")
            else:
                self._open[path] = torch.load(str(path), map_location="cpu", weights_only=True)
        return self._open[path]

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        h = self._handle(self.files[key])
        return h.get_tensor(key) if hasattr(h, "get_tensor") else h[key]


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (see the module docstring), cast to `dtype` on `device`."""
    src = _TensorSource(Path(model_dir))
    for layers, embed_key, norm_key, head_key in LAYOUTS:
        if embed_key in src:
            break
    else:
        raise InvalidArgument(
            f"no language-model embedding found in {model_dir}; looked for {[lay[1] for lay in LAYOUTS]}")

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise InvalidArgument(f"checkpoint {model_dir} misses tensor {key}")
        return src.get(key).to(device=device, dtype=dtype)

    out = {"embed": take(embed_key), "norm": take(norm_key)}
    out["lm_head"] = out["embed"] if config.tie_word_embeddings or head_key not in src else take(head_key)
    for i in range(config.num_layers):
        p = f"{layers}layers.{i}."
        out[f"layers.{i}.input_norm"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
        for m in MODULES:
            group = "self_attn" if m in ATTN_MODULES else "mlp"
            out[f"layers.{i}.{m}"] = take(f"{p}{group}.{m}.weight")
            if f"{p}{group}.{m}.bias" in src:
                out[f"layers.{i}.{m}.bias"] = take(f"{p}{group}.{m}.bias")
    _check_shapes(out, config)
    return out


def _check_shapes(w: dict[str, torch.Tensor], c: ModelConfig) -> None:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        want |= {
            f"layers.{i}.q_proj": (q, c.hidden_size), f"layers.{i}.k_proj": (kv, c.hidden_size),
            f"layers.{i}.v_proj": (kv, c.hidden_size), f"layers.{i}.o_proj": (c.hidden_size, q),
            f"layers.{i}.gate_proj": (c.intermediate_size, c.hidden_size),
            f"layers.{i}.up_proj": (c.intermediate_size, c.hidden_size),
            f"layers.{i}.down_proj": (c.hidden_size, c.intermediate_size),
        }
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise InvalidArgument(f"tensor {name} has shape {tuple(w[name].shape)}, config implies {shape}")
