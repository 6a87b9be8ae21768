"""Per-request LoRA through the real server: what adapters cost our engine, what they cost the `hf` + PEFT
baseline, and many adapters through a small device cache.

    python -m bench.server.lora_server              # full run (a few minutes on 2 CPUs)
    python -m bench.server.lora_server --quick      # fewer requests per row

On the benchmark model (`bench.common.model`) with a registry of 32 PEFT adapters (ranks 8 and 16 alternating, all seven
projections of every layer; built once, cached), every request one image + a prompt, `max_tokens == min_tokens`:

1. engine: concurrency 16, beam_width 1 and 4, without adapters, then with 4 adapters mixed (request i uses
   adapter i % 4 by `lora_name`, so every batch mixes them) -> ratio lora / base (target >= 0.8);
2. hf (transformers + peft, one request at a time): the same 4-adapter rows -> ratio engine / hf (target >= 5);
3. engine with `max_loras=8`: 32 adapters cycling at concurrency 16 (beam 1) -> errors, tok/s and the device
   level's hit rate from the server's metrics.
Writes `bench/results/lora-results.json` and prints a table. One torch thread per server process (as
`bench.server.throughput`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

from bench.common.model import ensure_bench_model
from bench.server.throughput import PROMPT, RESULTS_DIR, make_images, run_row, warm_up

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
N_ADAPTERS = 32


def ensure_adapters(model_dir: Path) -> Path:
    """32 random PEFT adapters for the benchmark model (cached next to it)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from triton_vlm.lora.format import module_shape  # noqa: PLC0415
    from triton_vlm.spec import CheckpointSpec  # noqa: PLC0415

    root = model_dir.parent / f"{model_dir.name}-lora{N_ADAPTERS}"
    if (root / ".complete").is_file():
        return root
    spec = CheckpointSpec.load(model_dir).text
    for k in range(N_ADAPTERS):
        r, g = 8 if k % 2 == 0 else 16, torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(spec.num_layers):
            for module, block in MODULES.items():
                n_in, n_out = module_shape(spec, module)
                key = f"base_model.model.model.language_model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.02
        d = root / f"tenant{k:02d}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                           "target_modules": list(MODULES), "bias": "none"}))
    (root / ".complete").write_text("")
    return root


class LoraRequester:
    """One benchmark request; request i uses adapter `names[i % len(names)]` (none when `names` is empty)."""

    def __init__(self, grpc_url: str, max_tokens: int, names: list[str], timeout: float = 600.0):
        from triton_vlm_client import VLMClient  # noqa: PLC0415

        self.client = VLMClient(grpc_url, protocol="grpc", timeout=timeout)
        self.max_tokens, self.names, self.images = max_tokens, names, make_images()

    def __call__(self, i: int, beam_width: int) -> tuple[float, int]:
        lora = {"lora_name": self.names[i % len(self.names)]} if self.names else {}
        t0 = time.perf_counter()
        res = self.client.generate(PROMPT, [self.images[i % len(self.images)]], max_tokens=self.max_tokens,
                                   min_tokens=self.max_tokens, beam_width=beam_width, **lora)
        return time.perf_counter() - t0, int(res.sequence_lengths[0])


def device_hit_rate(metrics_port: int) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {m: float(v) for m, v in re.findall(
        r'^triton_vlm_lora_cache_(hits|misses)_total\{[^}]*level="device"[^}]*\} ([0-9.e+]+)$', text, re.M)}
    return found.get("hits", 0.0), found.get("misses", 0.0)


def serve(model_dir: Path, registry: Path, llm: dict):
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-bench-lora-"))
    return TritonServer(str(model_dir), free_port(), free_port(), free_port(), run_dir=run_dir,
                        params={"*": {"lora_dir": str(registry)}, "llm": llm}, log_file=run_dir / "server.log")


def measure(server, label: str, names: list[str], beam: int, n: int, args) -> dict:
    send = LoraRequester(server.grpc_url, args.max_tokens, names)
    row = run_row(send, label, beam, args.concurrency, n, args.row_seconds, lambda: True)
    print(f"  {label:<22} beam {beam}: {row.requests} ok, {row.errors} errors, {row.tokens_per_s:7.1f} tok/s, "
          f"p50 {row.p50_s:.2f} s" + (f" (first error: {row.first_error})" if row.errors else ""), flush=True)
    return {"label": label, "beam": beam, "requests": row.requests, "errors": row.errors,
            "tok_s": round(row.tokens_per_s, 2), "p50_s": round(row.p50_s, 3)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--row-seconds", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "lora-results.json")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    model_dir = ensure_bench_model()
    registry = ensure_adapters(model_dir)
    names = sorted(p.name for p in registry.iterdir() if p.is_dir())
    n = 32 if args.quick else 64
    rows: list[dict] = []
    engine = {"max_rows": "64", "kv_cache_tokens": str(64 * 160)}
    print("== engine", flush=True)
    with serve(model_dir, registry, engine) as server:
        send = LoraRequester(server.grpc_url, args.max_tokens, names[:4])
        warm_up(send, [1, 4])
        for beam in (1, 4):
            rows.append(measure(server, "engine base", [], beam, n, args))
            rows.append(measure(server, "engine 4 adapters", names[:4], beam, n, args))
    print("== hf + peft (one request at a time)", flush=True)
    with serve(model_dir, registry, {"backend": "hf"}) as server:
        warm_up(LoraRequester(server.grpc_url, args.max_tokens, names[:4]), [1])
        for beam in (1, 4):
            rows.append(measure(server, "hf+peft 4 adapters", names[:4], beam, max(8, n // 4), args))
    print(f"== engine, {N_ADAPTERS} adapters through max_loras=8", flush=True)
    with serve(model_dir, registry, {**engine, "max_loras": "8"}) as server:
        warm_up(LoraRequester(server.grpc_url, args.max_tokens, names[:2]), [1])
        before = device_hit_rate(server.metrics_port)
        rows.append(measure(server, f"engine {N_ADAPTERS} adapters/8 slots", names, 1, 2 * n, args))
        time.sleep(1.0)  # the metrics refresh every 0.5 s
        hits, misses = (a - b for a, b in zip(device_hit_rate(server.metrics_port), before))
        rows[-1]["device_hit_rate"] = round(hits / max(1.0, hits + misses), 3)
    report(rows, args.out)
    return 0


def report(rows: list[dict], out: Path) -> None:
    by = {(r["label"], r["beam"]): r for r in rows}
    print("\nbeam | engine base | engine 4 adapters | hf+peft 4 adapters | adapters/base | engine/hf (adapters)")
    for beam in (1, 4):
        base, lora, hf = by[("engine base", beam)], by[("engine 4 adapters", beam)], by[("hf+peft 4 adapters", beam)]
        print(f"{beam:>4} | {base['tok_s']:>11.1f} | {lora['tok_s']:>17.1f} | {hf['tok_s']:>18.1f} | "
              f"{lora['tok_s'] / base['tok_s']:>12.2f}x | {lora['tok_s'] / max(hf['tok_s'], 1e-9):>19.1f}x")
    many = rows[-1]
    print(f"\n{many['label']}: {many['requests']} ok, {many['errors']} errors, {many['tok_s']:.1f} tok/s, device "
          f"hit rate {many['device_hit_rate']:.0%}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
