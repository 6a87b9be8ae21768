"""The built-in demo model: a tiny LLaVA trained offline on coloured shapes, plus offline checkpoint builders.

- `checkpoint`: `build_tokenizer`, `build_random_llava` (random, seeded HF LLaVA checkpoints for tests)
- `shapes`: the synthetic task (`draw`, `SHAPES`, `COLORS`, `QUESTIONS`, `prompt`)
- `ensure_demo_model()`: path of the trained demo model, built and cached on first use
- `ensure_demo_adapters()`: the registry folder of its LoRA adapters (`french`, `sentence`), trained on first use
- `ensure_demo_hub_model()`: the demo model rewritten into the layout of the llava-hf checkpoints on the hub
  (`hub_layout`: transformers-4 keys, two shards and an index), built from it on first use
"""
from __future__ import annotations

from pathlib import Path


def ensure_demo_model(progress: bool = True) -> Path:
    """Path of the cached trained demo model (`$TRITON_VLM_CACHE` or ~/.cache/triton_vlm); builds if missing."""
    from triton_vlm.demo.build import ensure_demo_model as _ensure

    return _ensure(progress=progress)


def ensure_demo_adapters(progress: bool = True) -> Path:
    """The registry folder of the demo model's LoRA adapters (one subfolder each); trains missing ones."""
    from triton_vlm.demo.adapters import ensure_demo_adapters as _ensure
    from triton_vlm.demo.build import BUILD_THREADS, _num_threads, cache_dir

    model = ensure_demo_model(progress)
    with _num_threads(BUILD_THREADS):
        return _ensure(model, cache_dir(), progress=progress)


def ensure_demo_hub_model(progress: bool = True) -> Path:
    """The cached demo model in the hub's key layout, in two shards (`hub_layout.to_hub_layout`)."""
    from triton_vlm.demo.hub_layout import ensure_demo_hub_model as _ensure

    return _ensure(progress=progress)


__all__ = ["ensure_demo_model", "ensure_demo_adapters", "ensure_demo_hub_model"]
