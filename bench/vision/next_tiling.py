"""What LLaVA-NeXT's tiling costs: one text model served with llava-1.5 images (one tile each) and with
LLaVA-NeXT's anyres tiles, through the real server.

    python -m bench.vision.next_tiling            # 48 requests per concurrency-8 row, 3 rounds
    python -m bench.vision.next_tiling --quick    # 16, 2 rounds

Two random checkpoints (built once, cached) share the text model (Llama: hidden 512, 8 layers, 8 heads, 4 KV
heads, as `bench.common.model`) and a CLIP tower of 64 px tiles (patch 8: 64 features per tile; 4 layers, hidden 256);
the NeXT one has llava-v1.6's pinpoints in tiles ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3)). Every request is one
image of 128x128, 192x64 or 64x192 px (distinct pixels per request, so the embedding cache never hides the
vision cost) and a short prompt, streamed, `max_tokens == min_tokens`. Measured client side:
- time to first token at concurrency 1 (send to the first streamed piece: preprocess, vision, prefill), p50/p90;
- tokens/s at concurrency 8 (new tokens of all requests / wall time).
Both servers run at once and their rows alternate, 3 rounds (2 with --quick): the table gives the median of the
rounds, so a machine shared with other work loads both alike. Writes `bench/results/next_tiling.json` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from triton_vlm.paths import cache_dir

RESULTS = Path(__file__).resolve().parents[1] / "results" / "next_tiling.json"
PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"
TEXT = dict(text_hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, max_position_embeddings=2048)
TOWER = dict(vision_hidden=256, vision_layers=4, vision_heads=4, vision_intermediate=1024)
SIZES = ((128, 128), (192, 64), (64, 192))  # PIL (width, height)
VERSION = "v1"


def ensure_models() -> dict[str, Path]:
    from triton_vlm.demo.checkpoint import build_random_llava  # noqa: PLC0415
    from triton_vlm.demo.next_checkpoint import build_random_llava_next  # noqa: PLC0415

    root = cache_dir() / f"bench-tiling-{VERSION}"
    out = {"llava-1.5": root / "llava", "llava-next": root / "llava-next"}
    if not (out["llava-1.5"] / "config.json").is_file():
        build_random_llava(out["llava-1.5"], image_size=64, patch_size=8, seed=7, **TEXT, **TOWER)
    if not (out["llava-next"] / "config.json").is_file():
        build_random_llava_next(out["llava-next"], tile=64, patch=8, seed=7, **TEXT, **TOWER)
    return out


def image(i: int) -> bytes:
    from PIL import Image  # noqa: PLC0415

    w, h = SIZES[i % len(SIZES)]
    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(i).random((h, w, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def one(client, i: int, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token s, total s, new tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    for piece in client.stream(PROMPT, [image(i)], max_tokens=max_tokens, min_tokens=max_tokens):
        first = first or time.perf_counter()
        tokens += len(piece.token_ids)
    total = time.perf_counter() - t0
    return (first or time.perf_counter()) - t0, total, tokens


def row(url: str, start: int, n: int, concurrency: int, max_tokens: int) -> dict:
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    lock, tickets, samples = threading.Lock(), iter(range(start, start + n)), []

    def worker() -> None:
        with VLMClient(url, timeout=300) as c:
            while True:
                with lock:
                    i = next(tickets, None)
                if i is None:
                    return
                s = one(c, i, max_tokens)
                with lock:
                    samples.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(s[0] for s in samples)
    return {"requests": len(samples), "tokens_per_s": sum(s[2] for s in samples) / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))]}


def measure(models: dict[str, Path], n: int, max_tokens: int, rounds: int) -> list[dict]:
    """Both servers up at once; their rows alternate (`rounds` times), so both see the same machine load."""
    from triton_vlm.preprocess.checkpoint import ModelInfo  # noqa: PLC0415
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    params = {"llm": {"kv_cache_tokens": "65536", "max_rows": "64"}}
    sizes = [(h, w) for w, h in SIZES]
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, model in models.items():
            run_dir = Path(tempfile.mkdtemp(prefix=f"triton-vlm-bench-{name}-"))
            servers[name] = stack.enter_context(TritonServer(str(model), free_port(), free_port(), free_port(),
                                                             params=params, run_dir=run_dir,
                                                             log_file=run_dir / "server.log"))
            row(servers[name].grpc_url, 10_000, 4, 2, max_tokens)  # warm-up (also exports the vision graph)
        rows: dict[str, list] = {name: [] for name in models}
        for r in range(rounds):
            for name, server in servers.items():
                rows[name].append((row(server.grpc_url, 100 * r, max(6, n // 4), 1, max_tokens),
                                   row(server.grpc_url, 1_000 + 100 * r, n, 8, max_tokens)))
    out = []
    for name, model in models.items():
        info = ModelInfo.load(model)
        c1, c8 = [x[0] for x in rows[name]], [x[1] for x in rows[name]]
        out.append({"model": name, "image_tokens": [info.image_tokens(s) for s in sizes],
                    "tiles": [info.layout.tiles(s) for s in sizes], "rounds": rows[name],
                    "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in c1),
                    "ttft_p90_s": statistics.median(x["ttft_p90_s"] for x in c1),
                    "tokens_per_s": statistics.median(x["tokens_per_s"] for x in c8)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vision.next_tiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    n = 16 if args.quick else 48
    results = measure(ensure_models(), n, args.max_tokens, rounds=2 if args.quick else 3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print("| model | tiles per image | image tokens per image | TTFT p50 / p90 (c=1) | tok/s (c=8) |")
    print("|---|---|---|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {'/'.join(map(str, r['tiles']))} | {'/'.join(map(str, r['image_tokens']))} | "
              f"{r['ttft_p50_s'] * 1000:.0f} / {r['ttft_p90_s'] * 1000:.0f} ms | {r['tokens_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
