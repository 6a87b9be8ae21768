"""What Qwen2-VL's native-resolution images cost against llava-1.5's one fixed tile, on the same text model,
through the real server.

    python -m bench.vision.qwen_vl            # 48 requests per concurrency-8 row, 3 rounds
    python -m bench.vision.qwen_vl --quick    # 16, 2 rounds

Two random checkpoints (built once, cached) share the text model's shape (Qwen2: hidden 512, 8 layers, 8 heads,
4 KV heads, intermediate 1408, as `bench.common.model` / `bench.vision.next_tiling`) and a vision tower of the same width
(hidden 256, 4 layers, 4 heads, MLP 512, 14-px patches):
- llava-1.5 style (`build_variant_llava(text="qwen2", vision="siglip")`): every image squashed to one 224 px tile,
  256 patches -> 256 image tokens whatever its size;
- Qwen2-VL (`build_qwen_vl`): the image at its own resolution, `max_pixels` = 448 x 448 (200704) so a 224x224
  image gives 16x16 patches -> 64 tokens (after the 2x2 merger), 448x224 -> 128, 448x448 -> 256 (1024 patches
  through the tower).
Every request is one image of 224x224, 448x224 or 448x448 px (distinct pixels per request, so the embedding cache
never hides the vision cost) and a short prompt, streamed, `max_tokens == min_tokens`. Measured client side, as
`bench.vision.next_tiling`: time to first token at concurrency 1 (p50/p90, and the mean per image size), tokens/s at
concurrency 8. The vision encoder's share comes from Triton's own counters of the `vision` model
(`nv_inference_request_duration_us`: queue + compute, per vision request), scraped before and after each
concurrency-1 request (outside its timing), so per image size, and around the whole row: over the client's mean
TTFT of the same requests. The vision service's `triton_vlm_vision_images_encoded_total` and
`triton_vlm_embedding_cache_hits_total` show every image went through the encoder. Both servers run at once and
their rows alternate, 3 rounds (2 with --quick); the table gives the median of the rounds. Writes
`bench/results/qwen_vl.json` and prints a markdown table with the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import machine
from bench.peers.procs import parse_triton_metrics, triton_per_request
from triton_vlm.paths import cache_dir

RESULTS = Path(__file__).resolve().parents[1] / "results" / "qwen_vl.json"
PROMPT = "<|im_start|>user\n<image>\nDescribe the image in detail.<|im_end|>\n<|im_start|>assistant\n"
TEXT = dict(text_hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, max_position_embeddings=2048)
TOWER = dict(vision_hidden=256, vision_layers=4, vision_heads=4)  # Qwen2-VL's builder: MLP = 2 x hidden
SIGLIP = dict(image_size=224, patch_size=14, vision_intermediate=512, vision_feature_select_strategy="full")
MAX_PIXELS = 448 * 448  # 224x224 -> 64 tokens, 448x224 -> 128, 448x448 -> 256
SIZES = ((224, 224), (448, 224), (448, 448))  # PIL (width, height)
VISION_COUNTERS = ("triton_vlm_vision_images_encoded_total", "triton_vlm_embedding_cache_hits_total")
VERSION = "v1"


def ensure_models(root: Optional[Path] = None, text: Optional[dict] = None, tower: Optional[dict] = None
                  ) -> dict[str, Path]:
    """The two checkpoints under `root` (default: the cache), built once; `text` / `tower` override the shapes."""
    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl  # noqa: PLC0415
    from triton_vlm.demo.variants import build_variant_llava  # noqa: PLC0415

    root = root or cache_dir() / f"bench-qwen-vl-{VERSION}"
    text, tower = text or TEXT, tower or TOWER
    out = {"llava-1.5 (siglip)": root / "llava", "qwen2-vl": root / "qwen2-vl"}
    builders = {"llava-1.5 (siglip)": lambda d: build_variant_llava(d, text="qwen2", vision="siglip", seed=7,
                                                                    **text, **tower, **SIGLIP),
                "qwen2-vl": lambda d: _max_pixels(build_qwen_vl(d, "qwen2_vl", seed=7, **text, **tower))}
    root.mkdir(parents=True, exist_ok=True)
    for name, path in out.items():
        if not (path / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
            builders[name](tmp)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)  # whole: a half-built folder is never taken for a checkpoint
    return out


def _max_pixels(path: Path) -> Path:
    cfg_file = path / "preprocessor_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"max_pixels": MAX_PIXELS}, indent=2))
    return path


def image(i: int) -> bytes:
    """Request `i`'s image: size `SIZES[i % 3]`, pixels seeded by `i` (distinct per request)."""
    from PIL import Image  # noqa: PLC0415

    w, h = SIZES[i % len(SIZES)]
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Sample:
    ttft_s: float  # send -> the first streamed piece
    total_s: float
    tokens: int  # new tokens
    size: int  # its image's index in SIZES
    vision_ms: float = float("nan")  # the vision model's request time (Triton's), scraped around it at c=1


def one(client, i: int, max_tokens: int) -> Sample:
    """One streamed request of image `i`."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    for piece in client.stream(PROMPT, [image(i)], max_tokens=max_tokens, min_tokens=max_tokens):
        first = first or time.perf_counter()
        tokens += len(piece.token_ids)
    total = time.perf_counter() - t0
    return Sample((first or time.perf_counter()) - t0, total, tokens, i % len(SIZES))


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Triton's per-model counters and the vision service's own (`VISION_COUNTERS`, summed over labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got = parse_triton_metrics(text)
    got["vision service"] = {name: sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                                       if x.split("{", 1)[0].split(" ", 1)[0] == name) for name in VISION_COUNTERS}
    return got


def vision_share(before: dict, after: dict, ttft_mean_s: float) -> dict:
    """The vision model's per-request times between two scrapes and their share of the client's mean TTFT."""
    per = triton_per_request(before, after).get("vision", {})
    svc0, svc1 = before.get("vision service", {}), after.get("vision service", {})
    out = {f"vision_{k}": v for k, v in per.items()}
    out |= {k.removeprefix("triton_vlm_").removesuffix("_total"): svc1.get(k, 0.0) - svc0.get(k, 0.0)
            for k in VISION_COUNTERS}
    if "request_ms" in per and ttft_mean_s > 0:
        out["vision_share_of_ttft"] = round(per["request_ms"] / (1000 * ttft_mean_s), 4)
    return out


def row(url: str, start: int, n: int, concurrency: int, max_tokens: int, metrics: Optional[str] = None) -> dict:
    """`n` requests from `concurrency` clients; with `metrics` (Triton's URL), the vision counters around the row,
    and at concurrency 1 around each request too (outside its timing: the vision time of each image size)."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    lock, tickets, samples = threading.Lock(), iter(range(start, start + n)), []
    each = metrics is not None and concurrency == 1

    def worker() -> None:
        with VLMClient(url, timeout=300) as c:
            while True:
                with lock:
                    i = next(tickets, None)
                if i is None:
                    return
                was = scrape(metrics) if each else {}
                s = one(c, i, max_tokens)
                if each:
                    s = replace(s, vision_ms=triton_per_request(was, scrape(metrics)).get("vision", {}).get(
                        "request_ms", float("nan")))
                with lock:
                    samples.append(s)

    before = scrape(metrics) if metrics else {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return summarise(samples, wall, before, scrape(metrics) if metrics else {})


def _by_size(samples: list[Sample], field: str) -> list[float]:
    return [statistics.fmean([getattr(s, field) for s in samples if s.size == k] or [float("nan")])
            for k in range(len(SIZES))]


def summarise(samples: list[Sample], wall: float, before: dict, after: dict) -> dict:
    ttft = sorted(s.ttft_s for s in samples)
    out = {"requests": len(samples), "tokens": sum(s.tokens for s in samples),
           "tokens_per_s": sum(s.tokens for s in samples) / wall, "ttft_p50_s": statistics.median(ttft),
           "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))], "ttft_mean_s": statistics.fmean(ttft),
           "ttft_mean_by_size_s": _by_size(samples, "ttft_s"), "vision_ms_by_size": _by_size(samples, "vision_ms")}
    return out | (vision_share(before, after, out["ttft_mean_s"]) if after else {})


def measure(models: dict[str, Path], n: int, max_tokens: int, rounds: int) -> list[dict]:
    """Both servers up at once; their rows alternate (`rounds` times), so both see the same machine load."""
    from triton_vlm.preprocess.checkpoint import ModelInfo  # noqa: PLC0415
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    params = {"llm": {"kv_cache_tokens": "65536", "max_rows": "64"}}
    n1 = max(9, n // 4 // len(SIZES) * len(SIZES))  # concurrency-1 requests: every size alike
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, model in models.items():
            run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-bench-qwen-vl-"))
            servers[name] = stack.enter_context(TritonServer(str(model), free_port(), free_port(), free_port(),
                                                             params=params, run_dir=run_dir,
                                                             log_file=run_dir / "server.log"))
            row(servers[name].grpc_url, 10_000, 6, 2, max_tokens)  # warm-up (also exports the vision graph)
        rows: dict[str, list] = {name: [] for name in models}
        for r in range(rounds):
            for name, s in servers.items():
                metrics = f"http://127.0.0.1:{s.metrics_port}/metrics"
                rows[name].append((row(s.grpc_url, 100 * r, n1, 1, max_tokens, metrics),
                                   row(s.grpc_url, 1_000 + 100 * r, n, 8, max_tokens, metrics)))
    return [result(name, ModelInfo.load(model), rows[name]) for name, model in models.items()]


def result(name: str, info, rounds: list[tuple[dict, dict]]) -> dict:
    """One model's figures: the median over the rounds of each row's figure."""
    c1, c8 = [x[0] for x in rounds], [x[1] for x in rounds]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(x.get(key, float("nan")) for x in rows)

    def by_size(key: str) -> list[float]:
        return [statistics.median(x[key][k] for x in c1) for k in range(len(SIZES))]

    ttft, vision = by_size("ttft_mean_by_size_s"), by_size("vision_ms_by_size")
    return {"model": name, "image_tokens": [info.image_tokens((h, w)) for w, h in SIZES], "rounds": rounds,
            "ttft_p50_s": med(c1, "ttft_p50_s"), "ttft_p90_s": med(c1, "ttft_p90_s"), "ttft_mean_by_size_s": ttft,
            "vision_ms_by_size": vision, "vision_share_by_size": [v / 1000 / t for v, t in zip(vision, ttft)],
            "vision_request_ms": med(c1, "vision_request_ms"), "vision_share_of_ttft": med(c1, "vision_share_of_ttft"),
            "tokens_per_s": med(c8, "tokens_per_s"),
            "images_encoded": sum(x.get("vision_images_encoded", 0) for r in rounds for x in r),
            "cache_hits": sum(x.get("embedding_cache_hits", 0) for r in rounds for x in r)}


def markdown(results: list[dict], meta: dict) -> str:
    sizes = " / ".join(f"{w}x{h}" for w, h in SIZES)
    lines = [f"| model | image tokens ({sizes}) | TTFT p50 / p90 (c=1) | mean TTFT by size (c=1) | "
             "vision ms by size (share of TTFT) | vision share of TTFT, all sizes | tok/s (c=8) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        by_size = " / ".join(f"{t * 1000:.0f}" for t in r["ttft_mean_by_size_s"])
        vision = " / ".join(f"{v:.0f} ({100 * f:.0f}%)" for v, f in zip(r["vision_ms_by_size"],
                                                                        r["vision_share_by_size"]))
        lines.append(f"| {r['model']} | {' / '.join(map(str, r['image_tokens']))} | {r['ttft_p50_s'] * 1000:.0f} / "
                     f"{r['ttft_p90_s'] * 1000:.0f} ms | {by_size} ms | {vision} | "
                     f"{100 * r['vision_share_of_ttft']:.0f}% | {r['tokens_per_s']:.1f} |")
    lines += ["", f"`{meta['command']}`, {meta['date']}; every image through the encoder: "
              + ", ".join(f"{r['model']} {r['images_encoded']:.0f} encoded, {r['cache_hits']:.0f} cache hits"
                          for r in results), machine.line(meta)]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vision.qwen_vl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    n = 16 if args.quick else 48
    results = measure(ensure_models(), n, args.max_tokens, rounds=2 if args.quick else 3)
    meta = {"command": " ".join(["python -m bench.vision.qwen_vl", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine.describe(),
            "kernel_races": machine.kernel_races(), "max_pixels": MAX_PIXELS, "max_tokens": args.max_tokens}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
