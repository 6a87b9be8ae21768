"""Server settings that depend on a GPU: the language model's default dtype and Triton's CUDA memory pool.

- dtype: with the llm on CUDA and no `dtype` given, the checkpoint's own `torch_dtype` (config.json
  `text_config.torch_dtype`, else the top level's): float32 would double a float16 checkpoint's memory
  (28 GB for a 7B model). On the CPU the default stays float32 (CPU half-precision matmuls are slow).
- CUDA memory pool: tensors handed from one model to the next on the GPU (`image_embeds`, vision -> llm) are
  allocated from Triton's CUDA memory pool; when it is full Triton falls back to pinned host memory, a copy
  to the host and back. Triton's default pool is 64 MB, less than one batch of 7B-model embeddings. Sized as
  the embeddings of one full dynamic batch in flight between vision and llm:

      vision max_batch_size x preprocess max_images x tokens per image x LM hidden size x dtype bytes

  (tokens per image: the most one image takes, `families` `layout.max_tokens`, for LLaVA-NeXT),

  (64 x 8 x 577 x 4096 x 2 bytes = 2.3 GiB for llava-1.5-7b in float16), at least 256 MiB, at most 4 GiB
  (the pool is reserved at start; larger batches still work through pinned memory). `cuda_pool_mb` overrides.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

MIB = 1 << 20
POOL_FLOOR = 256 * MIB
POOL_CAP = 4096 * MIB
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def merged(params: dict[str, dict[str, str]], model: str) -> dict[str, str]:
    """The parameters `model` gets: the `*` entries, then its own."""
    return {**params.get("*", {}), **params.get(model, {})}


def cuda_devices(params: dict[str, dict[str, str]]) -> list[int]:
    """The GPU ids the models are placed on (`device`, `vision_device`, `projector_device` = `cuda[:N]`)."""
    ids = set()
    for model in ("llm", "vision"):
        p = merged(params, model)
        for key in ("device", "vision_device", "projector_device"):
            m = re.fullmatch(r"cuda(?::(\d+))?", p.get(key, "").strip())
            if m:
                ids.add(int(m.group(1) or 0))
    return sorted(ids)


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The checkpoint's `torch_dtype` (text config first), if it is one the llm accepts."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") or {}
    for value in (text.get("torch_dtype"), text.get("dtype"), cfg.get("torch_dtype"), cfg.get("dtype")):
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPE_BYTES:
            return value.removeprefix("torch.")
    return None


def default_llm_dtype(model_dir: str | Path, params: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """`params` with the llm's dtype set to the checkpoint's when the llm runs on CUDA and none is given."""
    llm = merged(params, "llm")
    if "dtype" in llm or not re.fullmatch(r"cuda(:\d+)?", llm.get("device", "").strip()):
        return params
    dtype = checkpoint_dtype(model_dir)
    if dtype is None:
        return params
    out = {k: dict(v) for k, v in params.items()}
    out.setdefault("llm", {})["dtype"] = dtype
    return out


def _pbtxt_int(text: str, pattern: str, default: int) -> int:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else default


def embeds_pool_bytes(repo: Path, model_dir: str | Path, llm_dtype: str) -> int:
    """Bytes of `image_embeds` for one full vision batch (see the module docstring), within floor and cap.
    `repo` is the filled model repository."""
    from ..spec import CheckpointSpec  # noqa: PLC0415 - transformers' config parsing; only on a GPU start

    spec = CheckpointSpec.load(model_dir)
    vision_cfg = (repo / "vision" / "config.pbtxt").read_text() if (repo / "vision").is_dir() else ""
    pre_cfg = (repo / "preprocess" / "config.pbtxt").read_text() if (repo / "preprocess").is_dir() else ""
    batch = _pbtxt_int(vision_cfg, r"max_batch_size:\s*(\d+)", 64)
    images = _pbtxt_int(pre_cfg, r'key:\s*"max_images"\s*value:\s*\{\s*string_value:\s*"(\d+)"', 8)
    v = spec.vision
    tokens = (v.image_size // v.patch_size) ** 2 + 1 if v is not None else 0  # patches + CLS ("full" select)
    if v is not None:  # the most one image takes in the family's layout (LLaVA-NeXT: many tiles)
        from ..families import family_of  # noqa: PLC0415

        tokens = max(tokens, family_of(spec).layout(spec).max_tokens)
    need = batch * images * tokens * spec.text.hidden_size * DTYPE_BYTES.get(llm_dtype, 4)
    return max(POOL_FLOOR, min(POOL_CAP, need))


def pool_args(repo: Path, model_dir: str | Path, params: dict[str, dict[str, str]],
              pool_mb: int | None = None) -> list[str]:
    """`--cuda-memory-pool-byte-size=<gpu>:<bytes>` for each GPU a model runs on; none on a CPU-only start."""
    gpus = cuda_devices(params)
    if not gpus:
        return []
    size = pool_mb * MIB if pool_mb else embeds_pool_bytes(repo, model_dir, merged(params, "llm").get("dtype",
                                                                                                    "float32"))
    return [f"--cuda-memory-pool-byte-size={g}:{size}" for g in gpus]
