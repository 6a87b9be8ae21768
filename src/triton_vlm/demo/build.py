"""Build, check and cache the trained demo model (`ensure_demo_model()`, `python -m triton_vlm.demo`).

The model lives at `<cache>/<DEMO_VERSION>`, `<cache>` = `$TRITON_VLM_CACHE` or `~/.cache/triton_vlm`.
It is built in a temporary sibling directory and renamed into place only after it passed its accuracy bar,
so a killed build never leaves a half model; a file lock makes concurrent callers wait for one build.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
import transformers

from triton_vlm.demo.evaluate import evaluate, evaluate_text_only, evaluate_two_images
from triton_vlm.demo.train import Recipe, train
from triton_vlm.paths import cache_dir

# Bump whenever anything that changes the weights changes (Recipe, shapes.py drawing, training code).
DEMO_VERSION = "demo-v3"
RECIPE = Recipe()
# One thread: torch CPU kernels may reduce in a different order with another thread count (determinism), the
# model is too small to gain from more, and two OpenMP-threaded builds on a shared 2-core machine spin-wait
# each other to a crawl (measured: >10 min instead of ~1.5).
BUILD_THREADS = 1
EVAL_N = 120
EVAL_SEED = 12345  # training images come from Random(RECIPE.seed + 1); this is a different stream
MIN_COLOR, MIN_SHAPE, MIN_DESCRIBE = 0.95, 0.90, 0.90
INFO_FILE = "demo_info.json"


def demo_model_path() -> Path:
    return cache_dir() / DEMO_VERSION


def is_complete(path: Path) -> bool:
    return (path / INFO_FILE).is_file() and (path / "model.safetensors").is_file()


def ensure_demo_model(progress: bool = True) -> Path:
    """Path of the cached demo model; builds it first (about a minute or two) if it is missing."""
    path = demo_model_path()
    if is_complete(path):
        ensure_chat_template(path)
        return path
    return build_demo_model(path, progress=progress)


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where LlavaProcessor.save_pretrained writes the processor's template


def ensure_chat_template(path: Path) -> None:
    """Give a cached demo model the current chat template (llava-1.5's) without retraining: the template is not
    part of the weights. Rewritten atomically, only when it differs; a read-only cache is left as it is."""
    from triton_vlm.demo.checkpoint import CHAT_TEMPLATE

    f = path / CHAT_TEMPLATE_FILE
    try:
        if f.is_file() and f.read_text() == CHAT_TEMPLATE:
            return
        with _lock(path):
            tmp = path / f".{CHAT_TEMPLATE_FILE}.tmp-{os.getpid()}"
            tmp.write_text(CHAT_TEMPLATE)
            os.chmod(tmp, 0o644)
            os.replace(tmp, f)
    except OSError:
        pass


def read_info(path: Path | None = None) -> dict:
    return json.loads(((path or demo_model_path()) / INFO_FILE).read_text())


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def build_demo_model(out: Path | str, *, force: bool = False, progress: bool = True,
                     recipe: Recipe = RECIPE) -> Path:
    """Train, evaluate and save the demo model to `out` atomically; returns `out`.

    A complete model already at `out` is kept unless `force`. Concurrent builds of the same `out` wait for
    each other (file lock) instead of training twice. Raises RuntimeError if the model misses its bar.
    """
    out = Path(out).expanduser().resolve()
    with _lock(out):
        if is_complete(out) and not force:  # possibly built by someone else while we waited
            return out
        return _build(out, progress, recipe)


def _build(out: Path, progress: bool, recipe: Recipe) -> Path:
    t0 = time.perf_counter()
    with _num_threads(BUILD_THREADS):
        model, processor = train(recipe, progress=progress)
        train_seconds = time.perf_counter() - t0
        acc = evaluate(model, processor, n=EVAL_N, seed=EVAL_SEED)
        two_images = evaluate_two_images(model, processor)  # optional skills: recorded, not enforced
        text_only = evaluate_text_only(model, processor)
    if acc.color < MIN_COLOR or acc.shape < MIN_SHAPE or acc.describe < MIN_DESCRIBE:
        raise RuntimeError(
            f"demo model below its accuracy bar (colour >= {MIN_COLOR}, shape >= {MIN_SHAPE}, describe >= "
            f"{MIN_DESCRIBE}): {acc.as_dict()}; first failures: {acc.failures[:5]}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        from triton_vlm.demo.checkpoint import save_checkpoint

        save_checkpoint(model, processor, tmp)
        info = {
            "version": DEMO_VERSION,
            "parameters": sum(p.numel() for p in model.parameters()),
            "size_bytes": dir_size(tmp),
            "weights_sha256": file_sha256(tmp / "model.safetensors"),
            "held_out_accuracy": acc.as_dict(),
            "held_out_seed": EVAL_SEED,
            "two_image_accuracy": two_images,
            "text_only_accuracy": text_only,
            "train_seconds": round(train_seconds, 1),
            "build_seconds": round(time.perf_counter() - t0, 1),
            "threads": BUILD_THREADS,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "recipe": dataclasses.asdict(recipe),
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes 0600; other users' servers may read the cache
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
