"""The built-in demo model: a tiny LLaVA trained offline on coloured shapes, plus offline checkpoint builders.

- `checkpoint`: `build_tokenizer`, `build_random_llava` (random, seeded HF LLaVA checkpoints for tests)
- `shapes`: the synthetic task (`draw`, `SHAPES`, `COLORS`, `QUESTIONS`, `prompt`)
- `ensure_demo_model()`: path of the trained demo model, built and cached on first use
- `ensure_demo_adapters()`: the registry folder of its LoRA adapters (`french`, `sentence`), trained on first use
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


__all__ = ["ensure_demo_model", "ensure_demo_adapters"]
