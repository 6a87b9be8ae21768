"""The built-in demo model: a tiny LLaVA trained offline on coloured shapes, plus offline checkpoint builders.

- `checkpoint`: `build_tokenizer`, `build_random_llava` (random, seeded HF LLaVA checkpoints for tests)
- `shapes`: the synthetic task (`draw`, `SHAPES`, `COLORS`, `QUESTIONS`, `prompt`)
- `ensure_demo_model()`: path of the trained demo model, built and cached on first use
"""
from __future__ import annotations

from pathlib import Path


def ensure_demo_model(progress: bool = True) -> Path:
    """Path of the cached trained demo model (`$TRITON_VLM_CACHE` or ~/.cache/triton_vlm); builds if missing."""
    from triton_vlm.demo.build import ensure_demo_model as _ensure

    return _ensure(progress=progress)


__all__ = ["ensure_demo_model"]
