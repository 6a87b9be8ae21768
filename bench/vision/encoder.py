"""The vision encoder: torch vs onnxruntime, cross-request batching through the server, and the embedding cache.

    python -m bench.vision.encoder            # full run (a few minutes on 2 CPUs)
    python -m bench.vision.encoder --quick    # fewer repeats and requests

On a benchmark vision tower of CLIP ViT-B/32 size at 224 px (12 layers, hidden 768, 12 heads, MLP 3072, patch 32:
49 patches + CLS; random weights, built once and cached) in a LLaVA with the demo's small language model:

1. in-process: images/s of the torch and onnxruntime backends at batch 1, 8 and 32 (`--threads`, default 1: what
   each stub gets from the launcher on these 2-core machines);
2. through the server, the `vision` model called directly (one image per request, no content keys so nothing is
   cached): images/s at concurrency 1 and 8, the ratio showing cross-request batching;
3. through the ensemble, a chat of `--turns` turns where turn k resends the k - 1 earlier images plus a new one
   (as chat front-ends do), with the embedding cache on and off: hit rate and time saved.
Writes `bench/results/vision-results.json`.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np

from bench.server.throughput import RESULTS_DIR

VIT_B32 = dict(image_size=224, patch_size=32, vision_hidden=768, vision_layers=12, vision_heads=12,
               vision_intermediate=3072)
VERSION = "v1"


def ensure_vit_model() -> Path:
    from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint  # noqa: PLC0415
    from triton_vlm.paths import cache_dir  # noqa: PLC0415

    out = cache_dir() / f"bench-vit-b32-{VERSION}"
    if not (out / ".complete").is_file():
        model, processor = build_random_llava_objects(seed=5, **VIT_B32)
        save_checkpoint(model, processor, out)
        (out / ".complete").write_text("")
    return out


def in_process(model_dir: Path, threads: int, repeats: int) -> list[dict]:
    import torch  # noqa: PLC0415

    from triton_vlm.vision.backends import BackendSettings, make_backend  # noqa: PLC0415

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    backends = {name: make_backend(model_dir, BackendSettings(backend=name, threads=threads, max_batch=64))
                for name in ("torch", "onnxruntime")}
    rows = []
    for batch in (1, 8, 32):
        pixels = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        row = {"batch": batch}
        for name, backend in backends.items():
            backend(pixels)  # warm-up
            best = min(_timed(backend, pixels) for _ in range(repeats))
            row[name] = round(batch / best, 2)
        row["ort/torch"] = round(row["onnxruntime"] / row["torch"], 2)
        print(f"  batch {batch:>2}: torch {row['torch']:7.1f} img/s, onnxruntime {row['onnxruntime']:7.1f} img/s "
              f"({row['ort/torch']:.2f}x)", flush=True)
        rows.append(row)
    return rows


def _timed(fn, arg) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def serve(model_dir: Path, vision: dict):
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-bench-vision-"))
    return TritonServer(str(model_dir), free_port(), free_port(), free_port(), run_dir=run_dir,
                        params={"vision": vision}, log_file=run_dir / "server.log")


def batch_sizes(server) -> tuple[float, float]:
    """(encoder calls, images encoded) so far, from the vision model's metrics."""
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    count = re.search(r"^triton_vlm_vision_batch_size_count\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    total = re.search(r"^triton_vlm_vision_batch_size_sum\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return (float(count.group(1)), float(total.group(1))) if count and total else (0.0, 0.0)


def vision_direct(server, concurrency: int, n: int) -> float:
    """images/s with `concurrency` clients each sending one image per request to the vision model."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    pixels = np.random.default_rng(0).standard_normal((1, 1, 3, 224, 224)).astype(np.float32)
    tickets, lock = iter(range(n)), threading.Lock()

    def worker():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        x = grpcclient.InferInput("pixel_values", list(pixels.shape), "FP32")
        x.set_data_from_numpy(pixels)
        while True:
            with lock:
                if next(tickets, None) is None:
                    break
            client.infer("vision", [x], timeout=120)
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.perf_counter() - t0)


def chat(server, turns: int, chats: int) -> tuple[float, dict]:
    """Seconds for `chats` chats of `turns` turns (turn k sends k images), and the vision metrics after."""
    from triton_vlm.demo.shapes import COLORS, SHAPES, draw  # noqa: PLC0415
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    rng = random.Random(3)
    t0 = time.perf_counter()
    with VLMClient(server.grpc_url, timeout=300) as c:
        for k in range(chats):
            images = []
            for turn in range(turns):
                buf = io.BytesIO()
                draw(rng.choice(SHAPES), rng.choice(list(COLORS)), (224, 224), rng).save(buf, "PNG")
                images.append(buf.getvalue())
                prompt = "".join(f"USER: <image>\nWhat is it? ASSISTANT: a shape.\n" for _ in images[:-1])
                c.generate(prompt + "USER: <image>\nWhat is it? ASSISTANT:", images, max_tokens=2)
    seconds = time.perf_counter() - t0
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^(triton_vlm_(?:vision_images_encoded|embedding_cache_hits|embedding_cache_misses)_total)'
                       r'\{[^}]*\} ([0-9.e+]+)$', text, re.M)
    return seconds, {k: float(v) for k, v in found}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="onnxruntime", help="vision_backend of the server runs")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "vision-results.json")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    model_dir = ensure_vit_model()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "threads": args.threads}
    print(f"== in-process, {args.threads} thread(s)", flush=True)
    result["in_process"] = in_process(model_dir, args.threads, 3 if args.quick else 5)
    n = 48 if args.quick else 96
    print(f"== through the server ({args.backend}), the vision model called directly", flush=True)
    with serve(model_dir, {"vision_backend": args.backend, "embedding_cache_mb": "0"}) as server:
        vision_direct(server, 4, 8)  # warm-up
        c1 = vision_direct(server, 1, n)
        calls0, images0 = batch_sizes(server)
        c8 = vision_direct(server, 8, n)
        time.sleep(0.2)
        calls1, images1 = batch_sizes(server)
    mean_batch = (images1 - images0) / max(1.0, calls1 - calls0)
    result["server"] = {"c1_img_s": round(c1, 2), "c8_img_s": round(c8, 2), "c8/c1": round(c8 / c1, 2),
                        "c8_mean_batch": round(mean_batch, 2)}
    print(f"  concurrency 1: {c1:.1f} img/s, concurrency 8: {c8:.1f} img/s ({c8 / c1:.2f}x; mean encoder batch "
          f"{mean_batch:.1f})", flush=True)
    chats = 2 if args.quick else 4
    print(f"== chat: {chats} chats x {args.turns} turns, each turn resending the earlier images", flush=True)
    runs = {}
    for label, mb in (("cache off", "0"), ("cache on", "256")):
        with serve(model_dir, {"vision_backend": args.backend, "embedding_cache_mb": mb}) as server:
            runs[label] = chat(server, args.turns, chats)
    (off, m_off), (on, m_on) = runs["cache off"], runs["cache on"]
    hits, misses = m_on.get("triton_vlm_embedding_cache_hits_total", 0), \
        m_on.get("triton_vlm_embedding_cache_misses_total", 0)
    result["chat"] = {"seconds_cache_off": round(off, 2), "seconds_cache_on": round(on, 2),
                      "images_encoded_off": m_off.get("triton_vlm_vision_images_encoded_total"),
                      "images_encoded_on": m_on.get("triton_vlm_vision_images_encoded_total"),
                      "hit_rate": round(hits / max(1.0, hits + misses), 3), "time_saved": round(1 - on / off, 3)}
    print(f"  cache off {off:.1f} s ({result['chat']['images_encoded_off']:.0f} images encoded), cache on {on:.1f} s "
          f"({result['chat']['images_encoded_on']:.0f} encoded, hit rate {result['chat']['hit_rate']:.0%}): "
          f"{result['chat']['time_saved']:.0%} less time", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
