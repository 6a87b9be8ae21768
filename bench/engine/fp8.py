"""One-stream decode rate and resident memory: the benchmark model's fp32 weights against the same weights quantized
to block-wise FP8 (Qwen's `-FP8` layout, [128, 128] blocks; the embedding, lm_head, norms and vision tower in bf16
as the releases store them) and against the same weights in bf16 (a plain bf16 release), each served in fp32.

    python -m bench.engine.fp8                   # every side, 3 greedy requests of 64 tokens each, JSON + a line each

Each side runs in its own process (so its resident memory is its own): `triton_vlm.engine.Engine` on the
checkpoint, driven directly (no Triton), greedy requests one at a time with random image features; the rate is
decoded tokens (all but the first, which the prefill gives) / the time after the first token; memory is the
process's peak resident set (`ru_maxrss`), the resident set the engine's load and run add (VmRSS after the run
minus VmRSS before the engine, torch and transformers already imported; with and without the KV cache), the
anonymous memory they add once glibc gives the freed heap back (`malloc_trim`, as the server's KV profile does
at load; libraries' file pages left out), and the
bytes of the engine's weight tensors, all of them and the decoder's projections alone (what the checkpoint
quantizes: the embedding and lm_head stay as it stores them). Every side has the same 4,096-token KV cache, so the
growth is also given without it.

The sides: `fp32` (the bench model), `bf16` (its tensors in bf16; the 16-bit gemv, `engine/cpu/gemv_bf16.py`, keeps
every matrix bf16 and computes in fp32), `fp8` (the FP8 copy: projections e4m3 by the FP8 gemv,
`engine/cpu/gemv_fp8.py`, embedding and lm_head bf16 by the 16-bit gemv) and `fp8-upcast` (the same with
`TRITON_VLM_CPU_GEMV_BF16=0`: embedding and lm_head upcast to fp32 at load, as before). Every side runs its C
kernels wherever they build and check (`FORCED`; `--auto` lets each process's races decide, which on a loaded
machine can leave one side on oneDNN); the JSON's `held` says what each side held. `--rounds N` alternates the
sides N times and keeps each side's best rate and prefill. Issue 38's target: FP8 >= 1.5x fp32's rate, <= 0.35x its memory.

    python -m bench.engine.fp8 --kernels         # the products of one decode step: fp32 gemv vs the FP8 gemv
    python -m bench.engine.fp8 --steps           # the 4 sides' decode step and prefill alternated in one process

`--steps` loads the four sides' models in one process (`LlamaModel`, kernels forced on) and times a prefill of 29
tokens and the decode step after it, side after side, 40 rounds, keeping each side's fastest: on a machine loaded
by other work the whole-process rates above swing 2x between rounds, the fastest step of many does not.

`--kernels` times the projection products of one one-stream decode step of the benchmark model's shapes (per
layer the C forward's fused qkv, o, fused gate_up and down; the lm_head, left unquantized by the checkpoint, in
fp32 on both sides) by `engine/cpu/gemv.py` on fp32 weights and by `engine/cpu/gemv_fp8.py` on e4m3 bytes with
[128, 128] block scales, alternating, and the bytes each side holds: the ceiling the FP8 kernel gives a decode
step once the engine keeps the weights in FP8 (the rest of a step, attention and norms, is the same on both).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

BLOCK = (128, 128)
# every side's C kernels on wherever they build and check (switch "1"), so that a race one side's process lost to
# other load does not decide its path (`--auto`: the switches as the environment sets them, races deciding)
FORCED = {f"TRITON_VLM_CPU_{k}": "1" for k in ("GEMV", "DECODE", "FORWARD", "GEMV_FP8", "GEMV_BF16")}


def bf16_copy(base: Path) -> Path:
    """`base` with every floating tensor in bf16 (a plain bf16 release), built and cached beside it."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = base.with_name(base.name + "-bf16")
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("*.safetensors*", "*.bin", ".complete"))
        tensors = {}
        for f in sorted(base.glob("*.safetensors")):
            tensors |= load_file(str(f))
        save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.rename(out)
    return out


def fp8_bench_model() -> tuple[Path, Path]:
    """(the fp32 benchmark model, its block-wise FP8 copy), built and cached."""
    from bench.common.model import ensure_bench_model
    from triton_vlm.demo.fp8_checkpoint import VERSION, quantize_checkpoint

    base = ensure_bench_model(verbose=False)
    out = base.with_name(f"{base.name}-fp8-block128-v{VERSION}")
    if not (out / "model.safetensors").is_file():
        quantize_checkpoint(base, out, "fp8-block", BLOCK)
    return base, out


def measure(model_dir: Path, requests: int, tokens: int) -> dict:
    """One side, in this process (see the module docstring)."""
    from bench.engine.profile_engine import make_engine, prompt_ids, _ENGINE_DIRS
    from triton_vlm.params import GenerationParams, GenerationRequest

    torch.set_num_threads(1)
    from transformers import AutoTokenizer  # noqa: F401 - imported before `rss_before`: the same on both sides

    from triton_vlm.engine.engine import Engine  # noqa: F401
    rss_before, anon_before = rss_now(), anon_now()
    engine = make_engine(model_dir, max_rows=4, kv_tokens=4096)
    _ENGINE_DIRS[id(engine)] = model_dir
    ids = prompt_ids(engine)
    n_img, hidden = ids.count(engine.image_token_id), engine.model_config.hidden_size
    params = GenerationParams(max_tokens=tokens, min_tokens=tokens, stream=True)
    rates, firsts = [], []  # decode rates; prefill (submit to the first token) seconds
    for i in range(requests + 1):  # the first warms up
        stamps: list[float] = []
        done = [False]

        def on_result(res) -> None:
            stamps.append(time.perf_counter())
            done[0] = done[0] or res.final

        emb = torch.randn(1, n_img, hidden, generator=torch.Generator().manual_seed(i)) * 0.02
        t_submit = time.perf_counter()
        engine.submit(GenerationRequest(f"r{i}", list(ids), params, image_embeds=emb), on_result)
        while not done[0]:
            engine.step()
        if i:
            rates.append((tokens - 1) / (stamps[-1] - stamps[0]))
            firsts.append(stamps[0] - t_submit)
    return {"model": str(model_dir), "held": engine.model.weights_held(), "tok_s": sorted(rates)[len(rates) // 2],
            "rates": rates,
            "prompt_tokens": len(ids), "first_token_s": sorted(firsts)[len(firsts) // 2],
            "weight_bytes": weight_bytes(engine), "linear_bytes": linear_bytes(engine),
            "kv_bytes": engine.cache.k.numel() * engine.cache.k.element_size() * 2,
            "rss_before_load_bytes": rss_before, "rss_growth_bytes": rss_now() - rss_before,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "anon_growth_trimmed_bytes": trimmed_anon() - anon_before}


def trimmed_anon() -> int:
    """The process's anonymous resident memory after glibc's malloc_trim (what the server's KV profile does at
    load, `engine/profile.py`): the heap the load freed is given back, file pages (libraries) left out."""
    from triton_vlm.engine.profile import _malloc_trim

    _malloc_trim()
    return anon_now()


def anon_now() -> int:
    """Anonymous resident bytes (`/proc/self/smaps_rollup`)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_now() -> int:
    """The process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(engine) -> int:
    """Bytes of the language model's tensors as the engine holds them (fp32 packed weights; an FP8 checkpoint's
    projections as e4m3 bytes + fp32 scales where the FP8 gemv is chosen, else dequantized)."""
    from triton_vlm.engine.cpu import gemm

    return sum(gemm.nbytes(t) for t in {id(t): t for t in engine.model.tensors()}.values())


def linear_bytes(engine) -> int:
    """Bytes of the decoder layers' projections alone (what the checkpoint quantizes; not the embedding, lm_head)."""
    from triton_vlm.engine.cpu import gemm

    lins = [lin for layer in engine.model.layers for lin in layer.linears()]  # (bf16 ones: gemm.nbytes counts 2 B)
    return sum(gemm.nbytes(lin.weight) + (lin.fp8_packed.scale.numel() * 4 if lin.fp8_packed is not None else 0)
               for lin in lins)


def kernel_step(rounds: int = 30) -> dict:
    """One decode step's projection products at the benchmark model's shapes, fp32 gemv vs FP8 gemv (doc)."""
    from bench.common.model import BENCH_SPEC
    from triton_vlm.engine.cpu import gemm, gemv, gemv_fp8

    torch.set_num_threads(1)
    fp32k, fp8k = gemv.kernel(gemm.pack), gemv_fp8.kernel()
    if fp32k is None or fp8k is None:
        raise SystemExit("a gemv kernel does not run here (see the log)")
    h, inter, hd = BENCH_SPEC["text_hidden"], BENCH_SPEC["intermediate"], BENCH_SPEC["text_hidden"] // BENCH_SPEC["heads"]
    qkv = h + 2 * BENCH_SPEC["kv_heads"] * hd
    shapes = [(qkv, h), (h, h), (2 * inter, h), (h, inter)] * BENCH_SPEC["layers"]  # [N, K] per product
    g = torch.Generator().manual_seed(0)
    qs = [(torch.randn(n, k, generator=g) * 50).clamp(-440, 440).to(torch.float8_e4m3fn) for n, k in shapes]
    scales = [torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=g) * 1e-2 for n, k in shapes]
    w8 = [gemv_fp8.pack(q, s, BLOCK) for q, s in zip(qs, scales)]
    dense = [gemm.pack(q.float()) for q in qs]
    lays = [fp32k.layout(w) for w in dense]
    head = fp32k.layout(head_w := gemm.pack(torch.randn(BENCH_SPEC["vocab_size"], h, generator=g)))
    xs = {k: torch.randn(1, k, generator=g) for k in {k for _, k in shapes}}

    def step(fp8: bool) -> float:
        t0 = time.perf_counter()
        for i, (n, k) in enumerate(shapes):
            fp8k.run(xs[k], w8[i]) if fp8 else fp32k.run(xs[k], lays[i], None)
        fp32k.run(xs[h], head, None)
        return time.perf_counter() - t0

    times = {False: [], True: []}
    for _ in range(rounds):
        for fp8 in (False, True):
            times[fp8].append(step(fp8))
    med = {fp8: sorted(t)[len(t) // 2] for fp8, t in times.items()}
    del head_w
    return {"step_ms": {"fp32": med[False] * 1e3, "fp8": med[True] * 1e3}, "speedup": med[False] / med[True],
            "projection_bytes": {"fp32": sum(n * k * 4 for n, k in shapes), "fp8": sum(w.nbytes for w in w8)},
            "lm_head_bytes_fp32": BENCH_SPEC["vocab_size"] * h * 4, "fp8_race": vars(fp8k.race) if fp8k.race else None}


def step_times(rounds: int = 40, prompt: int = 29) -> dict:
    """The four sides' models in one process (`LlamaModel`, no engine), a decode step of one row and a prefill of
    `prompt` tokens timed alternately, side after side, `rounds` times: each side's fastest (other processes' load
    slows a side only in some rounds; the fastest is the one they left alone)."""
    import math

    from triton_vlm.engine.cpu import gemv_bf16
    from triton_vlm.engine.model.model import LlamaModel

    torch.set_num_threads(1)
    os.environ.update(FORCED)
    fp32, fp8 = fp8_bench_model()
    models = {}
    for name, path, bf16 in (("fp32", fp32, "1"), ("bf16", bf16_copy(fp32), "1"), ("fp8", fp8, "1"),
                             ("fp8-upcast", fp8, "0")):
        os.environ[gemv_bf16.ENV] = bf16
        gemv_bf16._once.reset()
        models[name] = LlamaModel.from_pretrained(path)
    ids = torch.randint(3, 8000, (1, prompt), generator=torch.Generator().manual_seed(0))
    best = {name: [math.inf, math.inf] for name in models}  # [decode step s, prefill s]
    for _ in range(rounds):
        for name, m in models.items():
            cache = m.new_cache(prompt // 4 + 4, 4)
            row = cache.new_row()
            t0 = time.perf_counter()
            m.forward(m.embed(ids), cache.plan([row], prompt), cache)
            t1 = time.perf_counter()
            m.forward(m.embed(ids[:, :1]), cache.plan([row], 1), cache)
            t2 = time.perf_counter()
            best[name] = [min(best[name][0], t2 - t1), min(best[name][1], t1 - t0)]
    return {name: {"held": models[name].weights_held(), "c_forward": models[name].c_forward() is not None,
                   "decode_step_ms": b[0] * 1e3, "tok_s": 1 / b[0], "prefill_ms": b[1] * 1e3}
            for name, b in best.items()}


def file_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the sides this many times, keep each's best")
    ap.add_argument("--auto", action="store_true", help="the kernels' switches as set (default: all forced on)")
    ap.add_argument("--kernels", action="store_true", help="time one decode step's products only (doc)")
    ap.add_argument("--steps", action="store_true", help="the sides' decode step and prefill alternated in one "
                    "process, fastest of --rounds (default 40)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this checkpoint only
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(Path(a.one), a.requests, a.tokens)))
        return 0
    if a.steps:
        out = {"sides": step_times(a.rounds if a.rounds > 1 else 40), "load_average": os.getloadavg()}
        print(json.dumps(out, indent=2))
        for name, r in out["sides"].items():
            print(f"{name} (held {r['held']}, C forward {r['c_forward']}): decode step {r['decode_step_ms']:.2f} ms "
                  f"({r['tok_s']:.1f} tok/s, {r['tok_s'] / out['sides']['fp32']['tok_s']:.2f}x fp32), prefill of 29 "
                  f"tokens {r['prefill_ms']:.1f} ms ({r['prefill_ms'] / out['sides']['fp32']['prefill_ms']:.2f}x)")
        return 0
    if a.kernels:
        out = kernel_step()
        out["load_average"] = os.getloadavg()
        print(json.dumps(out, indent=2))
        print(f"one decode step's products: fp32 gemv {out['step_ms']['fp32']:.2f} ms, fp8 gemv "
              f"{out['step_ms']['fp8']:.2f} ms ({out['speedup']:.2f}x); projection weights "
              f"{out['projection_bytes']['fp32'] / 2**20:.1f} vs {out['projection_bytes']['fp8'] / 2**20:.1f} MiB")
        return 0
    fp32, fp8 = fp8_bench_model()
    sides = {"fp32": (fp32, {}), "bf16": (bf16_copy(fp32), {}), "fp8": (fp8, {}),
             "fp8-upcast": (fp8, {"TRITON_VLM_CPU_GEMV_BF16": "0"})}
    out = {"load_average_before": os.getloadavg(), "rounds": a.rounds}
    for _ in range(a.rounds):  # the sides alternate; each keeps its fastest round's rate and prefill (other load)
        for name, (path, extra) in sides.items():
            env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if a.auto else FORCED), **extra}
            proc = subprocess.run([sys.executable, "-m", "bench.engine.fp8", "--one", str(path), "--requests",
                                   str(a.requests), "--tokens", str(a.tokens)], env=env, capture_output=True, text=True,
                                  check=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if name in out:
                got["tok_s_rounds"] = out[name]["tok_s_rounds"] + [got["tok_s"]]
                got["tok_s"], got["first_token_s"] = max(got["tok_s"], out[name]["tok_s"]), \
                    min(got["first_token_s"], out[name]["first_token_s"])
            else:
                got["tok_s_rounds"] = [got["tok_s"]]
            out[name] = got
    out["ratio"] = {name: ratios(out[name], out["fp32"]) for name in sides if name != "fp32"}
    out["checkpoint_bytes"] = {name: file_bytes(path) for name, (path, _) in sides.items()}
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    for name in sides:
        r = out[name]
        print(f"{name} (held {r['held']}): {r['tok_s']:.1f} tok/s one stream, peak RSS {r['max_rss_bytes'] / 2**20:.0f}"
              f" MiB (+{r['rss_growth_bytes'] / 2**20:.0f} MiB from loading the engine, of which KV cache "
              f"{r['kv_bytes'] / 2**20:.0f} MiB; anonymous after malloc_trim +{r['anon_growth_trimmed_bytes'] / 2**20:.0f}"
              f" MiB), weights {r['weight_bytes'] / 2**20:.1f} MiB (projections "
              f"{r['linear_bytes'] / 2**20:.1f} MiB), prefill of {r['prompt_tokens']} tokens "
              f"{r['first_token_s'] * 1e3:.0f} ms")
    for name, r in out["ratio"].items():
        print(f"{name} / fp32: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    return 0


def ratios(side: dict, fp32: dict) -> dict:
    """One side's figures over fp32's (rate: higher is better; bytes and time: lower is)."""
    return {"tok_s": side["tok_s"] / fp32["tok_s"],
            "weight_bytes": side["weight_bytes"] / max(1, fp32["weight_bytes"]),
            "linear_bytes": side["linear_bytes"] / max(1, fp32["linear_bytes"]),
            "rss_growth": side["rss_growth_bytes"] / max(1, fp32["rss_growth_bytes"]),
            "rss_growth_without_kv": (side["rss_growth_bytes"] - side["kv_bytes"])
            / max(1, fp32["rss_growth_bytes"] - fp32["kv_bytes"]),
            "anon_growth_trimmed_without_kv": (side["anon_growth_trimmed_bytes"] - side["kv_bytes"])
            / max(1, fp32["anon_growth_trimmed_bytes"] - fp32["kv_bytes"]),
            "max_rss": side["max_rss_bytes"] / fp32["max_rss_bytes"],
            "prefill_s": side["first_token_s"] / fp32["first_token_s"]}


if __name__ == "__main__":
    raise SystemExit(main())
