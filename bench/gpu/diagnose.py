"""Where a GPU decode step's host time goes: the companion of `bench.gpu.check` for a lent GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -m bench.gpu.diagnose [--out DIR]

On a small random LLaVA in fp16 (its GPU work is tiny, so a step's time is the host's), greedy one stream:
1. per-token time with CUDA graphs on and off (the host's floor per step);
2. every host-device synchronisation of the decode steps (torch's sync debug mode), grouped by the engine
   source line that caused it, per step;
3. a cProfile of the decode loop: the engine functions with the most own time per step.
Prints a short report and writes it to `<out>/gpu_diagnose.md`.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:  # the project need not be installed on the GPU machine
    sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

TOKENS = 96


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _engine(model_dir: Path, graphs: bool):
    from triton_vlm.engine.engine import Engine, EngineConfig

    return Engine(model_dir, EngineConfig(device=DEVICE, dtype="float16" if DEVICE == "cuda" else "float32",
                                          kv_cache_tokens=4096, cuda_graphs=graphs))


def _request(i: int, tokens: int = TOKENS):
    from triton_vlm.params import GenerationParams, GenerationRequest

    return GenerationRequest(f"r{i}", [1, 40 + i % 7, 41, 42, 43, 44],
                             GenerationParams(max_tokens=tokens, min_tokens=tokens))


def per_token_ms(eng, reps: int = 3) -> float:
    eng.generate([_request(99)])  # warm: graphs captured
    best = float("inf")
    for i in range(reps):
        _sync()
        t0 = time.perf_counter()
        eng.generate([_request(i)])
        best = min(best, (time.perf_counter() - t0) / TOKENS * 1e3)
    return best


def sync_sites(eng) -> tuple[int, collections.Counter]:
    """(steps, Counter of 'file:line function' of the innermost project frame of each sync warning)."""
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "triton_vlm" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else filename
        sites[where] += 1

    warnings.showwarning = record
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            eng.generate([_request(7)])
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return TOKENS, sites


def profile(eng) -> str:
    prof = cProfile.Profile()
    prof.enable()
    eng.generate([_request(5)])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only rehearses the script")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    from triton_vlm.demo.checkpoint import build_random_llava

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu rehearsal"
    lines = [f"# GPU diagnose ({name})", ""]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_llava(Path(tmp) / "llava", seed=3)
        for graphs in (True, False):
            eng = _engine(model_dir, graphs)
            lines.append(f"- one stream, graphs {'on' if graphs else 'off'}: {per_token_ms(eng):.3f} ms per token")
            if graphs:
                steps, sites = sync_sites(eng)
                lines.append(f"- syncs over {steps} tokens, by site (count, per token):")
                lines += [f"  - {n} ({n / steps:.2f}) {site}" for site, n in sites.most_common(12)]
                lines += ["", "```", profile(eng)[:6000], "```"]
            eng.shutdown()
            del eng
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    text = "\n".join(lines)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_diagnose.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
