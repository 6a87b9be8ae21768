"""The compute floor of a serving run on one CPU core: how fast the language model's matrix products alone could go.

    python -m bench.engine.roofline              # this machine's one-thread GEMM rate and the bench model's FLOPs per token

On a CPU the decode steps of many rows and every prefill are compute-bound: each token of a prompt costs
2 x (the language model's projection weights) FLOPs, and each generated token that plus the lm_head. Both vLLM and
ours give the model one core here (vLLM's worker binds its OpenMP thread to one core and reserves the other;
ours runs the engine's thread alone on its core, `server/cpu_layout.py`), so neither can beat

    floor tok/s = output tokens / (the run's matmul FLOPs / one core's GEMM rate)

whatever its scheduler does. `gemm_rate` measures that rate in the engine's own path (oneDNN, weights prepacked,
`engine/cpu/gemm.py`) on the bench model's largest projection, fp32, one thread, at prefill and decode row counts.
`bench.peers.side_by_side` prints each engine's tok/s as a fraction of this floor, measured in the same run.

FLOPs counted: 2 x weights per token for the q/k/v/o and MLP projections of every layer; the lm_head (2 x hidden x
vocab) once per output token (a prefill computes it for the last position only). Attention's own FLOPs (2 x 2 x
context x hidden per token and layer) are left out: at these contexts (under 100 keys) they are under 2% of the total.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelFlops:
    per_prompt_token: float  # FLOPs of the projections for one prompt token (no lm_head)
    lm_head: float  # FLOPs of the lm_head for one position

    def run(self, prompt_tokens: int, output_tokens: int, requests: int) -> float:
        """FLOPs of `requests` requests with these token totals: every prompt token through the projections, every
        output token's lm_head, every output token but each request's first through the projections (the first
        comes out of the prefill)."""
        return (prompt_tokens * self.per_prompt_token + output_tokens * self.lm_head
                + max(0, output_tokens - requests) * self.per_prompt_token)


def model_flops(model_dir: Path) -> ModelFlops:
    """From the checkpoint's config.json (a llava-style config with `text_config`, or a bare Llama config)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    h, layers, inter = t["hidden_size"], t["num_hidden_layers"], t["intermediate_size"]
    heads = t["num_attention_heads"]
    hd = t.get("head_dim") or h // heads
    kv = t.get("num_key_value_heads", heads)
    per_layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * inter  # q, k, v, o, gate/up/down
    return ModelFlops(per_prompt_token=2.0 * layers * per_layer, lm_head=2.0 * h * t["vocab_size"])


@dataclass(frozen=True)
class GemmRate:
    gflops: float  # the better of the row counts measured
    by_rows: dict  # rows -> GFLOP/s
    shape: tuple[int, int]  # [out, in] of the weight measured


def gemm_rate(model_dir: Path, rows: tuple[int, ...] = (16, 64), seconds: float = 0.4) -> GemmRate:
    """One thread's fp32 GEMM rate on the model's gate/up projection, through the engine's prepacked oneDNN path
    (plain `F.linear` where that path is not available), best of `seconds` of calls per row count."""
    from triton_vlm.engine.cpu import gemm  # noqa: PLC0415

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    out_f, in_f = 2 * t["intermediate_size"], t["hidden_size"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.randn(out_f, in_f)
        packed = gemm.pack(w)
        by_rows = {}
        for m in rows:
            x = torch.randn(m, in_f)
            best = float("inf")
            for _ in range(3):
                gemm.linear(x, packed, None)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                gemm.linear(x, packed, None)
                best = min(best, time.perf_counter() - t0)
            by_rows[m] = round(2.0 * m * in_f * out_f / best / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
    return GemmRate(gflops=max(by_rows.values()), by_rows=by_rows, shape=(out_f, in_f))


def floor_tok_s(flops: ModelFlops, rate: GemmRate, prompt_tokens: int, output_tokens: int, requests: int) -> float:
    """Output tokens per second if one core did nothing but the run's matrix products at `rate`."""
    seconds = flops.run(prompt_tokens, output_tokens, requests) / (rate.gflops * 1e9)
    return output_tokens / seconds if seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=38, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=32, help="output tokens per request")
    args = ap.parse_args(argv)
    from bench.common.model import ensure_bench_model  # noqa: PLC0415

    model = ensure_bench_model(verbose=False)
    flops, rate = model_flops(model), gemm_rate(model)
    floor = floor_tok_s(flops, rate, args.prompt, args.output, 1)
    print(json.dumps({"flops": asdict(flops), "gemm": asdict(rate), "floor_tok_s": round(floor, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
