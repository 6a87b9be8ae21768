"""One decode stream against the machine's memory bandwidth: measured bandwidth, bytes read per decoded token,
and the line that compares a measured decode rate with both.

    python -m bench.common.bandwidth            # measure the bandwidth, print the bench model's bytes per token

- **Bandwidth** (`measure_bandwidth`): a single-thread streaming read. A 512 MiB fp32 tensor (16x the 32 MiB L3
  of the benchmark machines, so every pass comes from DRAM), filled once so its pages are mapped, is summed
  with `torch.Tensor.sum()` under `torch.set_num_threads(1)` `reps` (20) times; GB/s = bytes / the fastest pass
  (10^9 bytes per GB). One thread because the benchmark's server processes run with `OMP_NUM_THREADS=1`: this
  is what one core can pull from memory, the ceiling of one decode stream. Other work on the machine lowers it
  (on the shared 2-core machine it read 17 to 40 GB/s depending on what else ran), so the load average is
  recorded with it.
- **Bytes per token** (`token_bytes`): what one decode step of one stream must read at the least, from the
  checkpoint's own tensors (names and shapes) and config, at the element size of the dtype the engine runs in:
  every language-model tensor (q/k/v/o, gate/up/down, lm_head, RMSNorm weights, any biases) except the token
  embedding table, of which one row is read (with tied embeddings the table is the lm_head and is counted
  whole); plus the KV cache read by attention: layers x 2 (K and V) x kv_heads x head_dim per position, at the
  mean context of the decode steps. Step k (k = 1 .. new - 1; token 1 comes from the prefill) attends over
  prompt + k positions, so the mean is prompt + new / 2. Not counted: activations (KiB), the KV write of the
  new position, and anything the implementation reads twice (e.g. a gathered copy of the KV): this is the
  floor, so rate x bytes is the bandwidth the stream *uses usefully*.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GB = 1e9
MB = 1e6


@dataclass
class Bandwidth:
    gb_s: float  # best pass
    passes_gb_s: list[float]  # every pass, in order
    buffer_mib: int
    threads: int
    method: str
    load_1min: float  # load average when measured: other work on the machine lowers the figure

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(buffer_mib: int = 512, reps: int = 20) -> Bandwidth:
    """Single-thread streaming read of a `buffer_mib` fp32 buffer, best of `reps` passes (after one untimed)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)  # [n] fp32, every page touched
        x.sum()  # untimed first pass
        passes = []
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            passes.append(x.numel() * 4 / (time.perf_counter() - t0) / GB)
        del x
    finally:
        torch.set_num_threads(prev)
    return Bandwidth(gb_s=max(passes), passes_gb_s=[round(p, 2) for p in passes], buffer_mib=buffer_mib, threads=1,
                     method=f"torch.Tensor.sum() of a {buffer_mib} MiB fp32 tensor, 1 thread, best of {reps}",
                     load_1min=round(os.getloadavg()[0], 2))


@dataclass
class TokenBytes:
    weights: int  # language-model tensors read by a decode step (embedding table excluded)
    embed_row: int  # the one embedding row read
    kv_per_position: int  # K + V of one position, all layers
    context: float  # mean positions attended per decode step
    kv: int  # kv_per_position x context
    dtype: str

    @property
    def total(self) -> int:
        return self.weights + self.embed_row + self.kv

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _is_text(name: str) -> bool:
    return "vision_tower" not in name and "projector" not in name


def token_bytes(model_dir: Path, prompt_tokens: int, new_tokens: int, dtype: str = "float32") -> TokenBytes:
    """Bytes one decode step of one stream reads (see the module docstring), from `model_dir`'s checkpoint."""
    from safetensors import safe_open  # noqa: PLC0415

    size = DTYPE_BYTES[dtype]
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    weights = embed = row = 0
    has_head = False
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if not _is_text(name):
                    continue
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                if "embed_tokens" in name:
                    embed = n * size
                    row = shape[-1] * size
                else:
                    weights += n * size
                    has_head |= "lm_head" in name
    tied_head = tied and not has_head  # the embedding table is the lm_head: read whole
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads", text["num_attention_heads"])
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_pos = text["num_hidden_layers"] * 2 * kv_heads * head_dim * size
    context = prompt_tokens + new_tokens / 2
    return TokenBytes(weights=weights + (embed if tied_head else 0), embed_row=0 if tied_head else row,
                      kv_per_position=kv_pos, context=context, kv=round(kv_pos * context), dtype=dtype)


def describe_bytes(tb: TokenBytes) -> str:
    return (f"bytes per decoded token ({tb.dtype}): weights {tb.weights / MB:.2f} MB (every language-model tensor "
            f"but the embedding table) + 1 embedding row {tb.embed_row / 1e3:.1f} kB + KV read "
            f"{tb.kv / MB:.3f} MB ({tb.kv_per_position / 1e3:.1f} kB/position x {tb.context:.1f} positions on "
            f"average) = {tb.total / MB:.2f} MB")


def fraction(tok_s: float, tb: TokenBytes, bw: Bandwidth) -> float:
    return tok_s * tb.total / GB / bw.gb_s


def fraction_line(label: str, tok_s: float, tb: TokenBytes, bw: Bandwidth) -> str:
    """`<label>: X tok/s x Y MB/token = Z GB/s = F% of the measured W GB/s`."""
    used = tok_s * tb.total / GB
    return (f"{label}: {tok_s:.1f} tok/s x {tb.total / MB:.2f} MB/token = {used:.2f} GB/s = "
            f"{100 * used / bw.gb_s:.1f}% of the measured {bw.gb_s:.2f} GB/s")


def main(argv: list[str] | None = None) -> int:
    import argparse  # noqa: PLC0415

    from bench.common.model import ensure_bench_model  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="Measure the single-thread memory bandwidth; print the bench model's "
                                             "bytes per decoded token.")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=29)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    bw = measure_bandwidth(a.mib, a.reps)
    print(f"bandwidth: {bw.gb_s:.2f} GB/s ({bw.method}; load average {bw.load_1min}; passes {bw.passes_gb_s})")
    tb = token_bytes(ensure_bench_model(), a.prompt_tokens, a.new_tokens)
    print(describe_bytes(tb))
    print(f"-> one stream at 100% of it: {bw.gb_s * GB / tb.total:.1f} tok/s; at 50%: "
          f"{0.5 * bw.gb_s * GB / tb.total:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
