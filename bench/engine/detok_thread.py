"""Detokenization on the engine's thread vs on a delivery thread of its own (issue 34), in-process.

    python -m bench.engine.detok_thread                 # bench model, concurrency 16, 96 streamed requests of 32 tokens
    python -m bench.engine.detok_thread --rounds 3      # alternate the two modes 3 times each

For each mode (`EngineConfig.delivery_thread` False: results' text made inside the step, as before; True: on the
delivery thread, `engine/delivery.py`) one engine on the benchmark model (`bench.common.model`) is started and
`--concurrency` client threads run a closed loop of streamed text requests (`min_tokens == max_tokens`, so every
request generates exactly that many tokens) after a warm-up. Reported per mode: output tok/s (tokens of all
requests / wall time), the engine's busy share (its `StepTimes` prefill + decode seconds / wall time), and the
CPU seconds per 1,000 tokens of the engine's thread and of the delivery thread (/proc thread times).
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path


def thread_cpu(tid) -> float:
    """CPU seconds (user + system) of one thread of this process; 0 for none."""
    if tid is None:
        return 0.0
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mode(model_dir: Path, delivery_thread: bool, args) -> dict:
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    eng = Engine(model_dir, EngineConfig(max_rows=64, kv_cache_tokens=64 * 256, delivery_thread=delivery_thread,
                                         cuda_graphs=False))
    eng.start()
    prompt = eng.tokenizer("A short prompt about the weather and the sea today").input_ids
    counter = iter(range(10**9))
    lock = threading.Lock()

    def one() -> int:
        with lock:
            rid = f"r{next(counter)}"
        done, tokens = threading.Event(), [0]

        def on_result(res):
            if not res.final:  # the streamed pieces hold every token once (the final result repeats them all)
                tokens[0] += sum(len(s.token_ids) for s in res.sequences)
            else:
                done.set()

        p = GenerationParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, stream=True)
        eng.submit(GenerationRequest(rid, list(prompt), p), on_result)
        done.wait()
        return tokens[0]

    def loop(n: int, total: list) -> None:
        for _ in range(n):
            total.append(one())

    def run(n_requests: int) -> tuple[float, int]:
        per = n_requests // args.concurrency
        totals: list = []
        threads = [threading.Thread(target=loop, args=(per, totals)) for _ in range(args.concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, sum(totals)

    run(args.concurrency)  # warm-up
    s0, e0 = eng.stats(), thread_cpu(eng.thread_id)
    d = eng.delivery._thread
    d0 = thread_cpu(d.native_id if d is not None else None)
    wall, tokens = run(args.requests)
    s1, e1 = eng.stats(), thread_cpu(eng.thread_id)
    d1 = thread_cpu(d.native_id if d is not None else None)
    eng.shutdown()
    busy = (s1.prefill_seconds + s1.decode_seconds) - (s0.prefill_seconds + s0.decode_seconds)
    return {"mode": "delivery thread" if delivery_thread else "in the step", "tok/s": tokens / wall,
            "busy share": busy / wall, "engine CPU s / 1k tok": 1e3 * (e1 - e0) / tokens,
            "delivery CPU s / 1k tok": 1e3 * (d1 - d0) / tokens, "tokens": tokens, "wall s": wall,
            "step ms": 1e3 * (s1.decode_seconds - s0.decode_seconds) / max(1, s1.decode_steps - s0.decode_steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the benchmark model)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.model is None:
        from bench.common.model import ensure_bench_model

        args.model = ensure_bench_model(verbose=False)
    for r in range(args.rounds):
        for mode in (False, True):
            res = run_mode(args.model, mode, args)
            print(f"round {r + 1} " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
