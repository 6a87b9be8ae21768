"""What per-request LoRA costs the engine: tok/s with adapters mixed in every batch / tok/s without.

    python -m bench.engine.lora_overhead            # the benchmark model (bench.common.model), in-process, no Triton

16 concurrent requests (a 29-token prompt each, `max_tokens = min_tokens = 32`), beam_width 1 and 4, run
through `Engine.generate` twice: once on the base model, once with 4 distinct adapters (ranks 8, 16, 8, 16 on
all seven projections of every layer) cycling over the requests, so every prefill and decode batch mixes them.
Best of `--repeats` runs each; one torch thread (as the served stubs). Prints both and the ratio.

`--profile` then runs the adapter case once more with timers on the adapter code (`engine/lora/lora.py`): the A GEMM
(`F.linear` on the stacked A), building the stacks (`_stack`), and the rest of `LoraBatch.add` (the mask, B's
GEMM fused with the sum (`addmm_`), lookups), as shares of the run's wall time.
"""
from __future__ import annotations

import argparse
import time

import torch

from triton_vlm.lora.format import Adapter, LoraModule, module_shape

from bench.common.model import ensure_bench_model

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(name: str, spec, rank: int, seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(spec.num_layers):
        for m in MODULES:
            n_in, n_out = module_shape(spec, m)
            mods[(layer, m)] = LoraModule(torch.randn(rank, n_in, generator=g) * 0.02,
                                          torch.randn(n_out, rank, generator=g) * 0.02, 2.0)
    return Adapter(name, mods)


def run(engine, adapters, beam: int, n: int, tag: str) -> float:
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    reqs = [GenerationRequest(f"{tag}{i}", [1] + [100 + (7 * i + j) % 4000 for j in range(28)],
                              GenerationParams(max_tokens=32, min_tokens=32, beam_width=beam),
                              adapter=adapters[i % len(adapters)] if adapters else None) for i in range(n)]
    t0 = time.perf_counter()
    engine.generate(reqs)
    return n * 32 / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also time the parts of the adapter code")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    engine = Engine(ensure_bench_model(), EngineConfig(max_rows=64, kv_cache_tokens=16384))
    spec = engine.model_config
    adapters = [random_adapter(f"a{i}", spec, r, i) for i, r in enumerate((8, 16, 8, 16))]
    run(engine, adapters, 1, 4, "warm")
    print(f"{'beam':>4} {'base tok/s':>11} {'lora tok/s':>11} {'lora/base':>9}")
    for beam in (1, 4):
        base = max(run(engine, None, beam, args.concurrency, f"b{beam}{k}") for k in range(args.repeats))
        lora = max(run(engine, adapters, beam, args.concurrency, f"l{beam}{k}") for k in range(args.repeats))
        print(f"{beam:>4} {base:>11.1f} {lora:>11.1f} {lora / base:>8.2f}x", flush=True)
    if args.profile:
        for beam in (1, 4):
            profile(engine, adapters, beam, args.concurrency)
    return 0


class _Timed:
    """Wraps a function, summing its wall time."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def profile(engine, adapters, beam: int, n: int) -> None:
    """Where the adapter time goes, as shares of one adapter run's wall time."""
    import types  # noqa: PLC0415

    from triton_vlm.engine.lora import lora as L  # noqa: PLC0415

    saved = (L.F, L._stack, L.LoraBatch.add)
    linear, stack, delta = _Timed(torch.nn.functional.linear), _Timed(L._stack), _Timed(L.LoraBatch.add)
    L.F = types.SimpleNamespace(linear=linear)
    L._stack, L.LoraBatch.add = stack, lambda self, *a: delta(self, *a)
    engine.scheduler.runner.lora_stacks = L.StackCache()  # stacks are built (and timed) again
    try:
        t0 = time.perf_counter()
        run(engine, adapters, beam, n, f"p{beam}")
        total = time.perf_counter() - t0
    finally:
        L.F, L._stack, L.LoraBatch.add = saved
    other = delta.seconds - linear.seconds - stack.seconds
    print(f"profile beam {beam}: run {total:.2f} s; adapters {delta.seconds / total:.1%} ({delta.calls} calls): "
          f"A GEMM {linear.seconds / total:.1%}, stacking {stack.seconds / total:.1%} ({stack.calls} stacks), "
          f"mask + B GEMM and sum + lookups {other / total:.1%}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
