"""What binding cache keys to content costs (issue 24), per image, beside the vision encoder's own time.

- vision: `content_digest` (SHA-256 over the tiles' float32 bytes) of a llava-1.5 image (one 336x336 tile,
  1.35 MB) and of a LLaVA-NeXT image (5 tiles: the base tile and a 2x2 grid, 6.8 MB); `content_digests` of a
  batch of images, on the calling thread and on `HASH_THREADS` threads;
- llm: the prefix cache's `tensor_digest` of one llava-1.5 image's embeddings (576 x 4096 fp16, 4.7 MB), from
  host memory and, on a GPU, from device memory (a copy to the host first);
- the encoder: a CLIP ViT-L/14-336 tower + llava-1.5's MLP projector (random weights: the time is the same),
  batches of `--batch` images, per image, and one image alone; fp16 on a GPU, fp32 on a CPU (`--skip-encoder`
  leaves it out).

    python -m bench.vision.cache_trust [--device cuda] [--batch 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from triton_vlm.engine.kv.prefix_cache import tensor_digest
from triton_vlm.vision import service as S


def per_call_ms(fn, reps: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def hashing(batch: int, device: str) -> dict:
    rng = np.random.default_rng(0)
    one = rng.standard_normal((1, 3, 336, 336)).astype(np.float32)
    five = rng.standard_normal((5, 3, 336, 336)).astype(np.float32)
    many = [(rng.standard_normal((1, 3, 336, 336)).astype(np.float32), (336, 336)) for _ in range(batch)]
    threads = S.HASH_THREADS
    out = {
        "vision_llava15_image_ms": per_call_ms(lambda: S.content_digest(one, (336, 336)), 50),
        "vision_llava_next_5_tiles_ms": per_call_ms(lambda: S.content_digest(five, (672, 672)), 10),
        f"vision_llava_next_5_tiles_{threads}_threads_ms": per_call_ms(lambda: S.content_digests([(five, (672, 672))]),
                                                                        10),
        f"vision_{batch}_images_one_thread_ms_per_image":
            per_call_ms(lambda: [S.content_digest(t, s) for t, s in many], 2) / batch,
        f"vision_{batch}_images_{threads}_threads_ms_per_image": per_call_ms(lambda: S.content_digests(many), 2) / batch,
    }
    emb = torch.randn(576, 4096, dtype=torch.float16)
    out["llm_embeds_digest_host_ms"] = per_call_ms(lambda: tensor_digest(emb), 20)
    if device.startswith("cuda"):
        gpu = emb.to(device)
        out["llm_embeds_digest_from_gpu_ms"] = per_call_ms(lambda: tensor_digest(gpu), 20)
    return out


def encoder(batch: int, device: str) -> dict:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    tower = CLIPVisionModel(CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                             num_attention_heads=16, image_size=336, patch_size=14))
    proj = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
    tower, proj = tower.to(device, dtype).eval(), proj.to(device, dtype).eval()
    pixels = torch.randn(batch, 3, 336, 336, device=device, dtype=dtype)

    @torch.inference_mode()
    def run():
        h = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]  # llava's layer
        proj(h)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    out = {f"encoder_batch_{batch}_ms_per_image": per_call_ms(run, 3 if device.startswith("cuda") else 1) / batch}
    pixels = pixels[:1]
    out["encoder_batch_1_ms"] = per_call_ms(run, 5 if device.startswith("cuda") else 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-encoder", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs" + (
        f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""), **hashing(args.batch, args.device)}
    if not args.skip_encoder:
        res.update(encoder(args.batch, args.device))
    for k, v in res.items():
        print(f"{k:48s} {v:.3f}" if isinstance(v, float) else f"{k:48s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
