"""Rewrite a LLaVA checkpoint into the layout of the llava-hf checkpoints on the hub (transformers 4.x saves).

`to_hub_layout(src, out, shards=2)` writes the same tensors (bit for bit) under the hub's keys, split into
`shards` files `model-0000i-of-0000N.safetensors` with a `model.safetensors.index.json`, and copies every other
file (config, tokenizer, processor, generation config) as it is:

| transformers 5 (in memory) | the hub (llava-1.5-7b-hf, llava-v1.6-*-hf, llava-interleave-qwen) |
| --- | --- |
| `model.language_model.X` | `language_model.model.X` |
| `lm_head.X` | `language_model.lm_head.X` |
| `model.vision_tower.X` (CLIP / SigLIP) | `vision_tower.vision_model.X` |
| `model.multi_modal_projector.X` | `multi_modal_projector.X` |
| `model.image_newline` (LLaVA-NeXT) | `image_newline` |

The source may be in any layout the loader reads (`weight_source.TensorSource`). `ensure_demo_hub_model()` is
the demo model in this layout, written from the cached demo model on first use (a second) and cached beside it
(its copied `demo_info.json` names the demo weights it was written from: a rebuilt demo model is copied again).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..weight_source import INDEX_FILES, SINGLE_FILES, TensorSource

if TYPE_CHECKING:
    import torch

HUB_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),
)
SHARDS = 2  # the demo's hub copy: the smallest count that still exercises the index


def hub_key(name: str) -> str:
    """The hub's key of a tensor's transformers-5 name (names outside LLaVA's parts are kept)."""
    for new, old in HUB_PREFIXES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def _split(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """`names` in order, cut into `shards` consecutive runs of about equal bytes, none empty."""
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be between 1 and the {len(names)} tensors, got {shards}")
    total, runs, acc = sum(sizes[n] for n in names), [[]], 0
    for i, name in enumerate(names):
        to_open = shards - len(runs)
        if runs[-1] and to_open and (acc >= total * len(runs) / shards or len(names) - i == to_open):
            runs.append([])
        runs[-1].append(name)
        acc += sizes[name]
    return runs


def to_hub_layout(src: str | Path, out: str | Path, shards: int = SHARDS) -> Path:
    """Write `src`'s checkpoint to `out` in the hub's key layout, in `shards` safetensors files with an index."""
    src, out = Path(src), Path(out)
    source = TensorSource(src)
    tensors = {hub_key(n): source.get(n).contiguous() for n in source.keys()}
    out.mkdir(parents=True, exist_ok=True)
    skip = set(INDEX_FILES) | set(SINGLE_FILES)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, out / f.name)
    save_shards(tensors, out, shards)
    return out


def save_shards(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """`tensors` (keys in order) in `shards` files `model-0000i-of-0000N.safetensors` with the index."""
    from safetensors.torch import save_file  # noqa: PLC0415

    names = sorted(tensors)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    runs = _split(names, sizes, shards)
    weight_map = {}
    for i, run in enumerate(runs, 1):
        fname = f"model-{i:05d}-of-{len(runs):05d}.safetensors"
        save_file({n: tensors[n] for n in run}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in run}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILES[0]).write_text(json.dumps(index, indent=2) + "\n")


def demo_hub_model_path() -> Path:
    from .build import demo_model_path  # noqa: PLC0415

    base = demo_model_path()
    return base.with_name(f"{base.name}-hub-{SHARDS}shards")


def _current(out: Path, demo: Path) -> bool:
    """`out` is a complete copy of the demo model as it is now (its copied info names the same weights)."""
    from .build import INFO_FILE  # noqa: PLC0415

    try:
        info = json.loads((out / INFO_FILE).read_text())
        return (out / INDEX_FILES[0]).is_file() and \
            info["weights_sha256"] == json.loads((demo / INFO_FILE).read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError):
        return False


def ensure_demo_hub_model(progress: bool = True) -> Path:
    """The trained demo model in the hub's layout (`to_hub_layout`), cached; written atomically on first use and
    again whenever the demo model was rebuilt."""
    from .build import _lock, ensure_demo_model  # noqa: PLC0415

    out = demo_hub_model_path()
    demo = ensure_demo_model(progress=progress)
    if _current(out, demo):
        return out
    with _lock(out):
        if _current(out, demo):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            to_hub_layout(demo, tmp, SHARDS)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.chmod(tmp, 0o755)
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.rename(out, old / out.name)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
