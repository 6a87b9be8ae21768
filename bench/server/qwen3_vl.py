"""Qwen3-VL-shaped random models through the server against `transformers` `generate()` one request at a time, and
the MoE against the dense model of the same active parameters at concurrency 16.

    python -m bench.server.qwen3_vl            # 8 requests per c=1 row, 32 at c=16, 2 rounds
    python -m bench.server.qwen3_vl --quick    # 4 and 16, 1 round
    python -m bench.server.qwen3_vl --family qwen3_5   # a Qwen3.5-shaped hybrid model (issue 36) instead

Two random checkpoints (`demo/qwen3_checkpoint.py`, built once, cached), Qwen3-VL-2B and Qwen3-VL-30B-A3B scaled
down alike to fit a small CPU machine (widths / 4, 8 layers):
- dense (2B-shaped): hidden 512, 8 layers, 8 heads of 64 (2 KV heads), MLP 1536 (3 x hidden, as the 2B's
  6144 / 2048), QK-norm, interleaved M-RoPE;
- MoE (30B-A3B-shaped): the same attention, every layer sparse, 32 experts, 8 per token, expert MLP 192
  (0.375 x hidden, as the 30B-A3B's 768 / 2048): the active MLP parameters per token (8 x 3 x 512 x 192) equal the
  dense MLP's (3 x 512 x 1536), so the two differ only by the experts' routing and grouping;
- both: a vision tower of hidden 256, 6 layers, 4 heads, 16-px patches, a 16x16 position table, DeepStack after
  layers 1, 3 and 5 (as the 2B's three levels); images up to 256 placeholder tokens.
Every request is one distinct 384x384 image (144 placeholder tokens: the embedding cache never hides the tower)
and a short prompt, greedy, `max_tokens == min_tokens` (32). Baseline: `transformers`' own
`Qwen3VL(Moe)ForConditionalGeneration.generate()` in this process with its image processor and tokenizer (the
checkpoint's files; `min_new_tokens` = `max_new_tokens`), one request at a time: what serving it without a server
gives. Ours: the real tritonserver (`VLMClient` on the ensemble: preprocess, the exported tower, our engine), one
request at a time, then 16 at once (closed loop). Latency is send -> answer; tok/s = new tokens / wall time.
`--torch-threads` (default 1) is OMP_NUM_THREADS of the server's processes and the baseline's torch threads, as
`bench.server.throughput` sets them: on a 2-core machine shared with other work, 2 OpenMP threads spin-waiting on
a busy core make matmuls 10-50x slower (a first run with the baseline at torch's default of 2 threads measured it
at 1.5 tok/s). The rows alternate between the baseline and the server each round; the table gives the median
over the rounds. Writes
`bench/results/qwen3_vl.json` and prints a markdown table with the machine.
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
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import machine
from triton_vlm.paths import cache_dir

RESULTS = Path(__file__).resolve().parents[1] / "results" / "qwen3_vl.json"
PROMPT = "<|im_start|>user\n<image>\nDescribe the image in detail.<|im_end|>\n<|im_start|>assistant\n"
NATIVE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = dict(text_hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, max_position_embeddings=2048)
TOWER = dict(vision_hidden=256, vision_layers=6, vision_heads=4, deepstack=[1, 3, 5], positions=256)
SHAPES = {"dense (2B-shaped)": dict(intermediate=1536),
          "MoE (30B-A3B-shaped)": dict(intermediate=1536, experts=32, top_k=8, moe_intermediate=192,
                                       dense_layers=())}
MAX_PIXELS = 32 * 32 * 256  # up to 256 placeholder tokens per image
SIDE = 384  # 384x384 -> 24x24 patches -> 144 tokens
VERSION = "v1"


def ensure_models(root: Optional[Path] = None, text: Optional[dict] = None, tower: Optional[dict] = None
                  ) -> dict[str, Path]:
    """The two checkpoints under `root` (default: the cache), built once; `text` / `tower` override the shapes."""
    from triton_vlm.demo.qwen3_checkpoint import build_qwen3_vl  # noqa: PLC0415

    root = root or cache_dir() / f"bench-qwen3-vl-{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, shape in SHAPES.items():
        path = root / ("moe" if "experts" in shape else "dense")
        if not (path / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
            build_qwen3_vl(tmp, shards=2, seed=7, **(text or TEXT), **(tower or TOWER), **shape)
            cfg = tmp / "preprocessor_config.json"
            cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"max_pixels": MAX_PIXELS}, indent=2))
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)  # whole: a half-built folder is never taken for a checkpoint
        out[name] = path
    return out


def ensure_qwen3_5(root: Optional[Path] = None) -> dict[str, Path]:
    """`--family qwen3_5`: a Qwen3.5-shaped random checkpoint (`demo/qwen35_checkpoint.py`: hybrid, 3 Gated DeltaNet
    layers to 1 gated full-attention layer, hidden 256, 8 layers, as `bench.engine.hybrid`), built once."""
    from triton_vlm.demo.qwen35_checkpoint import build_qwen3_5  # noqa: PLC0415

    path = (root or cache_dir() / f"bench-qwen3-vl-{VERSION}") / "qwen3_5"
    if not (path / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".qwen3_5-", dir=path.parent if path.parent.exists() else None))
        build_qwen3_5(tmp, shards=2, seed=7, hidden=256, layers=8, max_position_embeddings=2048)
        cfg = tmp / "preprocessor_config.json"
        cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"max_pixels": MAX_PIXELS}, indent=2))
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        shutil.move(str(tmp), str(path))  # whole: a half-built folder is never taken for a checkpoint
    return {"Qwen3.5 (hybrid, hidden 256, 8 layers)": path}


def image(i: int) -> bytes:
    """Request `i`'s image: SIDE x SIDE, pixels seeded by `i` (distinct per request)."""
    from PIL import Image  # noqa: PLC0415

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class Baseline:
    """transformers in process: the checkpoint's image processor, tokenizer and model, one request at a time."""

    def __init__(self, model_dir: Path):
        import transformers  # noqa: PLC0415

        from triton_vlm.families import family_for_config  # noqa: PLC0415

        family = family_for_config(json.loads((model_dir / "config.json").read_text()))
        self.model = getattr(transformers, family.model_class).from_pretrained(str(model_dir)).eval()
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))

    def __call__(self, i: int, max_tokens: int) -> tuple[float, int]:
        """(seconds, new tokens) of request `i`, its preprocessing included."""
        import torch  # noqa: PLC0415
        from PIL import Image  # noqa: PLC0415

        t0 = time.perf_counter()
        px = self.processor([Image.open(io.BytesIO(image(i))).convert("RGB")], return_tensors="pt")
        t, h, w = px["image_grid_thw"][0].tolist()
        text = PROMPT.replace("<image>", NATIVE).replace("<|image_pad|>", "<|image_pad|>" * (t * h * w // 4))
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        kinds = (ids == self.model.config.image_token_id).int()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                                      pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0)
        return time.perf_counter() - t0, int(out.shape[1] - ids.shape[1])


def server_row(url: str, start: int, n: int, concurrency: int, max_tokens: int) -> dict:
    """`n` requests from `concurrency` clients in a closed loop through the ensemble."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    lock, tickets, samples = threading.Lock(), iter(range(start, start + n)), []

    def worker() -> None:
        with VLMClient(url, timeout=600) as c:
            while (i := _next(lock, tickets)) is not None:
                t0 = time.perf_counter()
                res = c.generate(PROMPT, [image(i)], max_tokens=max_tokens, min_tokens=max_tokens)
                with lock:
                    samples.append((time.perf_counter() - t0, len(res.output_ids[0])))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarise(samples, time.perf_counter() - t0)


def _next(lock: threading.Lock, tickets) -> Optional[int]:
    with lock:
        return next(tickets, None)


def baseline_row(base: Baseline, start: int, n: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    samples = [base(i, max_tokens) for i in range(start, start + n)]
    return summarise(samples, time.perf_counter() - t0)


def summarise(samples: list[tuple[float, int]], wall: float) -> dict:
    lat = sorted(s for s, _ in samples)
    return {"requests": len(samples), "tokens": sum(k for _, k in samples),
            "tokens_per_s": sum(k for _, k in samples) / wall, "latency_p50_s": statistics.median(lat),
            "latency_max_s": lat[-1]}


def measure(models: dict[str, Path], n1: int, n16: int, max_tokens: int, rounds: int) -> list[dict]:
    """Per model: the server up, the baseline loaded; rows alternate baseline / server c=1 / server c=16."""
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    params = {"llm": {"kv_cache_tokens": "32768", "max_rows": "32"}}
    out = []
    for name, model in models.items():
        rows: dict[str, list] = {"transformers, c=1": [], "server, c=1": [], "server, c=16": []}
        with contextlib.ExitStack() as stack:
            run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-bench-qwen3-vl-"))
            server = stack.enter_context(TritonServer(str(model), free_port(), free_port(), free_port(),
                                                      params=params, run_dir=run_dir,
                                                      log_file=run_dir / "server.log"))
            server_row(server.grpc_url, 10_000, 4, 2, max_tokens)  # warm-up (also exports the vision graph)
            base = Baseline(model)
            base(10_100, 4)  # warm-up
            for r in range(rounds):
                rows["transformers, c=1"].append(baseline_row(base, 100 * r, n1, max_tokens))
                rows["server, c=1"].append(server_row(server.grpc_url, 100 * r, n1, 1, max_tokens))
                rows["server, c=16"].append(server_row(server.grpc_url, 1_000 + 100 * r, n16, 16, max_tokens))
            del base
        out.append({"model": name, "rows": {k: _median(v) for k, v in rows.items()}, "rounds": rows})
    return out


def _median(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["| model | transformers c=1: tok/s, p50 | server c=1: tok/s, p50 | server / transformers (c=1) | "
             "server c=16: tok/s, p50 |", "|---|---:|---:|---:|---:|"]
    for r in results:
        hf, s1, s16 = (r["rows"][k] for k in ("transformers, c=1", "server, c=1", "server, c=16"))
        lines.append(f"| {r['model']} | {hf['tokens_per_s']:.1f}, {hf['latency_p50_s']:.2f} s | "
                     f"{s1['tokens_per_s']:.1f}, {s1['latency_p50_s']:.2f} s | "
                     f"{s1['tokens_per_s'] / hf['tokens_per_s']:.2f}x | "
                     f"{s16['tokens_per_s']:.1f}, {s16['latency_p50_s']:.2f} s |")
    if len(results) == 2:
        a, b = (r["rows"]["server, c=16"]["tokens_per_s"] for r in results)
        lines.append(f"\nMoE / dense of the same active parameters, server c=16: {b / a:.2f}x tok/s")
    lines += ["", f"`{meta['command']}`, {meta['date']}, {meta['max_tokens']} tokens per request, one {SIDE}x{SIDE} "
              f"image each (144 tokens), torch threads {meta.get('torch_threads', 'default')}", machine.line(meta)]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.server.qwen3_vl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--only", choices=("dense", "moe"), help="one model only")
    ap.add_argument("--family", choices=("qwen3_vl", "qwen3_5"), default="qwen3_vl",
                    help="qwen3_5: a Qwen3.5-shaped hybrid model instead of the two Qwen3-VL ones")
    ap.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the server's processes and "
                    "the baseline's torch threads (default 1; 0 = their defaults)")
    args = ap.parse_args(argv)
    if args.torch_threads:
        import os  # noqa: PLC0415

        import torch  # noqa: PLC0415

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.torch_threads)
        torch.set_num_threads(args.torch_threads)
    models = ensure_qwen3_5() if args.family == "qwen3_5" else ensure_models()
    if args.only:
        models = {k: v for k, v in models.items() if v.name == args.only}
    n1, n16, rounds = (4, 16, 1) if args.quick else (8, 32, 2)
    results = measure(models, n1, n16, args.max_tokens, rounds)
    meta = {"command": " ".join(["python -m bench.server.qwen3_vl", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine.describe(),
            "kernel_races": machine.kernel_races(), "max_tokens": args.max_tokens, "torch_threads": args.torch_threads}
    out = RESULTS.with_name(f"{args.family}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
