"""Where the project keeps its files: the repository root and the cache folder."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """`$TRITON_VLM_CACHE` (an empty value counts as unset), else `~/.cache/triton_vlm`."""
    env = os.environ.get("TRITON_VLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "triton_vlm"
