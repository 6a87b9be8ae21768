"""The multimodal front half: images/s through preprocess + vision for 1920x1080 JPEGs (4 a request, the
Qwen2.5-VL processor's own pixel bounds) at 1 and 2 instances and 1 / N decode threads, against `transformers`' own
processor call; then the engine's busy share through the live server at concurrency 16 with the same requests.

    python -m bench.vision.front_half            # 6 requests (24 images) a row, 32 through the server
    python -m bench.vision.front_half --quick    # 3 a row, 16 through the server
    python -m bench.vision.front_half --no-server

The checkpoint (random weights, built once, cached): a Qwen2.5-VL (`build_qwen_vl`) whose `preprocessor_config.json`
has Qwen2.5-VL-7B-Instruct's `min_pixels` 3136 / `max_pixels` 12845056, so a 1920x1080 image is resized to
1932x1092: 78x138 = 10,764 patches, 2,691 tokens, as the real processor does. The towers are tiny (the text model
hidden 64, 2 layers, a 16,384-token context; the vision tower hidden 32, 2 layers, both windowed: a full-attention
block is quadratic in the 10,764 patches, 3.5 s an image on a 2-core Xeon even this narrow, where a GPU's
attention kernels take milliseconds): the CPU side of the front half (decode, resize, normalise, patchify, hashing,
the wire) is the real cost, the encoder's is a small model's (a real 670M-parameter tower runs on the GPU).

1. In-process rows (the models' Python classes, no Triton): an "instance" is a process holding a
   `preprocess.service.Preprocessor` (the preprocess model's class) and a `vision.service.VisionService` (the vision
   model's, backend `auto`: onnxruntime on a CPU), as Triton's python stubs do; each instance takes requests from a
   shared counter and runs preprocess then vision on each. Mode `preprocess` stops after preprocess. Every JPEG
   is distinct (no cache hit). images/s = images / wall time from the moment every instance is warm.
   `transformers` row: `Qwen2_5_VLProcessor`'s image half as it runs it (`AutoImageProcessor(images=[4 PIL
   images])`, then the tokenizer on the expanded prompt; the JPEGs opened and converted to RGB by PIL in the timing,
   as ours decode them), in 1 and 2 processes.
2. Through the server (`TritonServer`, the launcher's rule for this machine, or `--set`): `--server-requests`
   requests from 16 clients, each 4 distinct JPEGs and `max_tokens` 8; images/s at the client and the engine's
   busy share (its step-time gauges: prefill + decode seconds / wall time, `bench.peers.procs.engine_line`).
Writes `bench/results/front_half.json` and prints a markdown table with the machine.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import machine
from triton_vlm.paths import cache_dir

RESULTS = Path(__file__).resolve().parents[1] / "results" / "front_half.json"
VERSION = "v2"
SIZE = (1920, 1080)  # PIL (width, height)
PER_REQUEST = 4
PROMPT = ("<|im_start|>user\n<image><image><image><image>\nCompare the four pictures.<|im_end|>\n"
          "<|im_start|>assistant\n")
QWEN25_PIXELS = {"min_pixels": 3136, "max_pixels": 12845056}  # Qwen2.5-VL-7B-Instruct's preprocessor_config.json
CONCURRENCY = 16


def ensure_model() -> Path:
    from triton_vlm.demo.qwen_checkpoint import build_qwen_vl  # noqa: PLC0415

    path = cache_dir() / f"bench-front-half-{VERSION}"
    if not (path / "config.json").is_file():
        import shutil  # noqa: PLC0415
        import tempfile  # noqa: PLC0415

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".front-half-", dir=path.parent))
        build_qwen_vl(tmp, "qwen2_5_vl", seed=5, text_hidden=64, layers=2, max_position_embeddings=16384)
        cfg = tmp / "preprocessor_config.json"
        cfg.write_text(json.dumps(json.loads(cfg.read_text()) | QWEN25_PIXELS, indent=2))
        cfg = tmp / "config.json"  # every tower block windowed: see the module doc
        c = json.loads(cfg.read_text())
        c["vision_config"]["fullatt_block_indexes"] = []
        cfg.write_text(json.dumps(c, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path


def jpeg(i: int) -> bytes:
    """Image `i`: a 1920x1080 JPEG (quality 90) of smooth gradients, shapes and mild noise, like a photo's size
    (~0.3-0.5 MB), distinct per `i`."""
    from PIL import Image, ImageDraw  # noqa: PLC0415

    w, h = SIZE
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([(x / w) * 255, (y / h) * 255, ((x + y) / (w + h)) * 255], -1) * rng.uniform(0.5, 1, 3)
    base += rng.normal(0, 6, base.shape)
    im = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w - 200)), int(rng.integers(0, h - 200))
        draw.ellipse((x0, y0, x0 + int(rng.integers(50, 400)), y0 + int(rng.integers(50, 400))),
                     fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def request_images(r: int) -> list[bytes]:
    """Request `r`'s JPEGs, written once under the cache (every process reads the same files)."""
    folder = cache_dir() / "bench-front-half-v1-images"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(PER_REQUEST):
        f = folder / f"{r}-{k}.jpg"
        if not f.is_file():
            tmp = f.with_suffix(".tmp")
            tmp.write_bytes(jpeg(1000 * (r + 1) + k))
            tmp.replace(f)
        out.append(f.read_bytes())
    return out


# --- in-process rows -------------------------------------------------------------------------------------------

def _worker(kind: str, model: str, threads: int, counter, total: int, ready, go, out) -> None:
    """One instance: warm up, wait for `go`, then take requests from `counter` until `total` were taken."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)  # as the server's stubs on a small machine (install.server_env)
    try:
        run = _ours(model, threads, kind) if kind != "transformers" else _transformers(model)
        images = {r: request_images(r) for r in range(-1, total)}
        run(images[-1])  # warm up (ONNX session, processor tables)
    except Exception as e:  # noqa: BLE001 - said by the parent, which must not wait for this worker
        out.put({"error": f"{type(e).__name__}: {e}"})
        ready.release()
        return
    ready.release()
    go.wait()
    stages = {"preprocess_s": 0.0, "vision_s": 0.0, "requests": 0}
    while True:
        with counter.get_lock():
            r = counter.value
            counter.value += 1
        if r >= total:
            break
        for k, v in run(images[r]).items():
            stages[k] += v
        stages["requests"] += 1
    out.put(stages)


def _ours(model: str, threads: int, kind: str):
    from triton_vlm.preprocess.service import Preprocessor  # noqa: PLC0415
    from triton_vlm.vision.service import VisionInput, build  # noqa: PLC0415

    pre = Preprocessor(model, decode_threads=threads)
    vision = build(model, {"device": "cpu"}) if kind == "preprocess + vision" else None

    def run(images: list[bytes]) -> dict:
        t0 = time.perf_counter()
        res = pre(PROMPT, images, 8)
        t1 = time.perf_counter()
        if vision is not None:
            vision.encode_rows([VisionInput(res.pixel_values, res.image_sizes, len(res.image_sizes),
                                            res.media_grids)])
        return {"preprocess_s": t1 - t0, "vision_s": time.perf_counter() - t1}

    return run


def _transformers(model: str):
    """`Qwen2_5_VLProcessor`'s image half as it runs it: the checkpoint's image processor on the 4 PIL images, then
    the tokenizer on the prompt with each `<|image_pad|>` expanded to its grid's tokens (the processor class itself
    cannot be built here: its video half needs torchvision, which is not installed)."""
    from PIL import Image  # noqa: PLC0415
    from transformers import AutoImageProcessor, AutoTokenizer  # noqa: PLC0415

    ip, tok = AutoImageProcessor.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    text = PROMPT.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")

    def run(images: list[bytes]) -> dict:
        t0 = time.perf_counter()
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        out = ip(images=pil, return_tensors="np")
        expanded = text
        for grid in out["image_grid_thw"]:
            expanded = expanded.replace("<|image_pad|>", "<|hold|>" * (int(np.prod(grid)) // ip.merge_size ** 2), 1)
        tok([expanded.replace("<|hold|>", "<|image_pad|>")])
        return {"preprocess_s": time.perf_counter() - t0}

    return run


def in_process_row(kind: str, model: Path, instances: int, threads: int, requests: int) -> dict:
    ctx = mp.get_context("spawn")
    counter, ready, go, out = ctx.Value("i", 0), ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kind, str(model), threads, counter, requests, ready, go, out))
             for _ in range(instances)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    t0 = time.perf_counter()
    go.set()
    stages = [out.get() for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    errors = [s["error"] for s in stages if "error" in s]
    if errors:
        raise RuntimeError(f"{kind}: an instance failed: {errors[0]}")
    images = PER_REQUEST * sum(s["requests"] for s in stages)
    row = {"kind": kind, "instances": instances, "decode_threads": threads, "images": images,
           "wall_s": round(wall, 3), "images_per_s": round(images / wall, 3)}
    for k in ("preprocess_s", "vision_s"):
        total = sum(s.get(k, 0.0) for s in stages)
        if total:
            row[k.replace("_s", "_ms_per_image")] = round(1e3 * total / images, 1)
    return row


# --- through the server ----------------------------------------------------------------------------------------

def server_row(model: Path, requests: int, params: dict) -> dict:
    from bench.peers.procs import engine_line, scrape_engine  # noqa: PLC0415
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    payloads = {r: request_images(10_000 + r) for r in range(requests + 1)}
    params = {**params, "llm": {"kv_cache_mb": "256", **params.get("llm", {})}}  # 16 x 11k tokens fit in 90 MB
    with TritonServer(str(model), free_port(), free_port(), free_port(), params=params, exit_timeout=10,
                      models=("ensemble", "preprocess", "vision", "llm")) as server:
        server.wait_ready(600)
        with VLMClient(server.grpc_url, timeout=600) as c:
            c.generate(PROMPT, payloads[requests], max_tokens=8)  # warm up
        lock, tickets, done = threading.Lock(), iter(range(requests)), []

        def client() -> None:
            with VLMClient(server.grpc_url, timeout=600) as c:
                while True:
                    with lock:
                        r = next(tickets, None)
                    if r is None:
                        return
                    c.generate(PROMPT, payloads[r], max_tokens=8, min_tokens=8)
                    with lock:
                        done.append(r)

        before = scrape_engine(server.metrics_url)
        t0 = time.perf_counter()
        workers = [threading.Thread(target=client, daemon=True) for _ in range(CONCURRENCY)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        after = scrape_engine(server.metrics_url)
        fh = server.front_half
    busy = (after.get("prefill_seconds", 0) + after.get("decode_seconds", 0)
            - before.get("prefill_seconds", 0) - before.get("decode_seconds", 0))
    return {"kind": "server", "front_half": fh.describe() if fh else "", "concurrency": CONCURRENCY,
            "requests": len(done), "images": PER_REQUEST * len(done), "wall_s": round(wall, 2),
            "images_per_s": round(PER_REQUEST * len(done) / wall, 3), "engine_busy_share": round(busy / wall, 4),
            "engine": engine_line(before, after, wall)}


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# The multimodal front half ({meta['date']})", "", machine.line(meta), "",
           f"1920x1080 JPEGs, {PER_REQUEST} a request, Qwen2.5-VL processor bounds (10,764 patches, 2,691 tokens an "
           "image); `transformers` = the checkpoint's image processor + tokenizer as `Qwen2_5_VLProcessor` calls them.", "",
           "| what | instances | decode threads | images/s | preprocess ms/image | vision ms/image |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "server":
            continue
        out.append(f"| {r['kind']} | {r['instances']} | {r['decode_threads'] or '-'} | {r['images_per_s']:.2f} | "
                   f"{r.get('preprocess_ms_per_image', '-')} | {r.get('vision_ms_per_image', '-')} |")
    for r in rows:
        if r["kind"] == "server":
            out += ["", f"Through the server ({r['front_half']}), concurrency {r['concurrency']}, {r['requests']} "
                        f"requests: {r['images_per_s']:.2f} images/s, engine busy {100 * r['engine_busy_share']:.1f}% "
                        f"of the run; {r['engine']}"]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vision.front_half", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None, help="requests per in-process row (default 6, --quick 3)")
    ap.add_argument("--server-requests", type=int, default=None, help="default 32, --quick 16")
    ap.add_argument("--threads", type=int, default=2, help="the decode threads of the parallel rows")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--no-rows", action="store_true", help="only the server run")
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", help="server parameters")
    args = ap.parse_args(argv)
    n = args.requests or (3 if args.quick else 6)
    model = ensure_model()
    for r in range(-1, n):
        request_images(r)  # written once, before any row
    rows = []
    for instances in (1, 2) if not args.no_rows else ():
        rows.append(in_process_row("transformers", model, instances, 0, n))
        for threads in (1, args.threads):
            for kind in ("preprocess", "preprocess + vision"):
                rows.append(in_process_row(kind, model, instances, threads, n))
                print(json.dumps(rows[-1]), flush=True)
    if not args.no_server:
        params: dict = {}
        for item in args.set:
            key, _, value = item.partition("=")
            m, _, k = key.rpartition(".")
            params.setdefault(m or "*", {})[k] = value
        rows.append(server_row(model, args.server_requests or (16 if args.quick else 32), params))
    meta = {"command": " ".join(["python -m bench.vision.front_half", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine.describe(),
            "kernel_races": machine.kernel_races()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
