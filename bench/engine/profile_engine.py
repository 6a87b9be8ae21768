"""Where the engine's step time goes: `triton_vlm.engine.Engine` driven directly (no Triton), closed loop.

    python -m bench.engine.profile_engine                      # 16 concurrent requests, beam 1 and 4, 32 tokens each
    python -m bench.engine.profile_engine --beams 4 --ops      # + torch.profiler's top aten ops

`concurrency` requests are kept in flight (a finished one is replaced by a new one until `--requests` have
been sent); `Engine.step()` is called in this thread. Each request is the benchmark prompt with its image
placeholders expanded and random image features (the vision tower is not part of the engine).

One stream first (`--stream-requests`, before any timer is installed): greedy requests one at a time, the rate
of the decode-only steps (a step that ran a prefill chunk is left out) x the bytes one decode step must read
(`bench.common.bandwidth.token_bytes`) against a single-thread memory bandwidth measured at start
(`bench.common.bandwidth.measure_bandwidth`), printed as `... = F% of the measured W GB/s`.

Time attribution: the engine's own functions are wrapped (at run time, nothing in the engine is edited) with
timers that charge each call's *exclusive* time (its time minus that of wrapped calls inside it) to a
category, so the categories add up to the measured step time:

- whole forward in C  a decode forward of 1-4 rows without adapters as one C call (`cpu_forward.py`): the
                      projections, attention, norms and activations below all happen inside it
- attn q/k/v/o proj   the attention `Linear`s (q/k/v fused, o)
- attn core           rope, KV write, attention over the row's slots: torch ops (`attention.attend_torch`: index_copy,
                      index_select gathers, scaled_dot_product_attention) or the C decode kernel (`cpu_decode.py`)
- mlp gate/up/down    the MLP `Linear`s (gate/up fused, down)
- norms/residual/act  RMSNorms, residual adds, SiLU * up, last-position slice (rest of `LlamaModel.forward`)
- lm_head             the output projection (+ fp32 cast)
- embed / image merge token embedding lookup, image feature merge at prefill
- kv plan             `KVCache.plan`: block appends, copy-on-write, slot tables, masks (python + small tensors)
- kv fork/free        beam reordering: block-table forks and frees
- decoder             `Decoder.step` and the batched greedy, beam and sampling steps (`OutputProcessor.step_greedy`,
                      `step_beams`, `step_samples`): logits
                      processors, greedy argmax / beam top-k bookkeeping, stop checks, the device read-back
- finalize+detok      `Decoder.finalize` and detokenization of finished requests
- scheduler python    the rest of `Scheduler.step` (admission, batching lists, per-request slicing)
- engine loop         the rest of `Engine.step` (inbox, locks, result callbacks: here resubmission)
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.common.bandwidth import Bandwidth, describe_bytes, fraction_line, measure_bandwidth, token_bytes
from bench.common.model import describe, ensure_bench_model
from bench.server.throughput import PROMPT


class Timers:
    """Exclusive wall time per category, over nested wrapped calls."""

    def __init__(self):
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [category, child time]
        self.enabled = True

    def wrap(self, owner: Any, name: str, category: Callable[..., str] | str) -> None:
        orig = getattr(owner, name)
        timers = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not timers.enabled:
                return orig(*args, **kwargs)
            cat = category(*args) if callable(category) else category
            frame = [cat, 0.0]
            timers._stack.append(frame)
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                timers._stack.pop()
                timers.excl[cat] += dt - frame[1]
                timers.calls[cat] += 1
                if timers._stack:
                    timers._stack[-1][1] += dt

        setattr(owner, name, wrapper)


ATTN_PROJ = {"qkv_proj", "o_proj"}  # `model.Layer`'s projections (q/k/v and gate/up fused)
MLP_PROJ = {"gate_up_proj", "down_proj"}


def instrument(timers: Timers) -> None:
    from triton_vlm.engine.search import decoder as dec_mod  # noqa: PLC0415
    from triton_vlm.engine import engine as eng_mod  # noqa: PLC0415
    from triton_vlm.engine.model import attention as attn_mod  # noqa: PLC0415
    from triton_vlm.engine.cpu import cpu_decode as cpu_attn_mod  # noqa: PLC0415
    from triton_vlm.engine.cpu import cpu_forward as cpu_fwd_mod  # noqa: PLC0415
    from triton_vlm.engine.kv import kv_cache as kv_mod  # noqa: PLC0415
    from triton_vlm.engine.model import model as model_mod  # noqa: PLC0415
    from triton_vlm.engine import output as out_mod  # noqa: PLC0415
    from triton_vlm.engine import runner as runner_mod  # noqa: PLC0415
    from triton_vlm.engine import scheduler as sch_mod  # noqa: PLC0415

    def linear_cat(self, *_):
        if self.module in ATTN_PROJ:
            return "attn q/k/v/o proj"
        if self.module in MLP_PROJ:
            return "mlp gate/up/down"
        return "lm_head"

    timers.wrap(model_mod.Linear, "__call__", linear_cat)
    timers.wrap(attn_mod, "attend_torch", "attn core")
    timers.wrap(cpu_fwd_mod.Forward, "run", "whole forward in C")
    timers.wrap(cpu_attn_mod.Kernel, "step", "attn core")
    timers.wrap(cpu_attn_mod.DecodeStep, "attend", "attn core")
    timers.wrap(model_mod.LlamaModel, "forward", "norms/residual/act")
    timers.wrap(model_mod.LlamaModel, "embed", "embed / image merge")
    timers.wrap(runner_mod, "merge_image_embeds", "embed / image merge")
    timers.wrap(kv_mod.KVCache, "plan", "kv plan")
    timers.wrap(kv_mod.KVCache, "fork", "kv fork/free")
    timers.wrap(kv_mod.KVCache, "free", "kv fork/free")
    timers.wrap(dec_mod.Decoder, "step", "decoder")
    timers.wrap(out_mod.OutputProcessor, "step_greedy", "decoder")
    timers.wrap(out_mod.OutputProcessor, "step_beams", "decoder")
    timers.wrap(out_mod.OutputProcessor, "step_samples", "decoder")
    timers.wrap(dec_mod.Decoder, "finalize", "finalize+detok")
    timers.wrap(out_mod.OutputProcessor, "_piece", "finalize+detok")
    timers.wrap(sch_mod.Scheduler, "step", "scheduler python")
    timers.wrap(eng_mod.Engine, "step", "engine loop")
    timers.wrap(eng_mod.Engine, "_decode_text", "finalize+detok")


ORDER = ["whole forward in C", "attn q/k/v/o proj", "attn core", "mlp gate/up/down", "norms/residual/act", "lm_head",
         "embed / image merge", "kv plan", "kv fork/free", "decoder", "finalize+detok", "scheduler python",
         "engine loop"]


@dataclass
class RunStats:
    beam: int
    concurrency: int
    requests: int = 0
    tokens: int = 0
    steps: int = 0
    decode_rows: list[int] = field(default_factory=list)  # rows per decode forward
    seconds: float = 0.0
    # steps that ran decode forwards only (no prefill chunk): their wall time and returned-sequence tokens
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: float = 0.0
    excl: dict[str, float] = field(default_factory=dict)


def make_engine(model_dir: Path, max_rows: int, kv_tokens: int):
    try:
        from triton_vlm.engine import Engine, EngineConfig  # noqa: PLC0415
    except ImportError:  # the package does not export them yet
        from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    return Engine(model_dir, EngineConfig(max_rows=max_rows, kv_cache_tokens=kv_tokens))


def prompt_ids(engine) -> list[int]:
    """The benchmark prompt's ids with its `<image>` expanded to the model's image token count."""
    from triton_vlm.demo.checkpoint import num_image_tokens  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    cfg = AutoConfig.from_pretrained(engine_dir(engine), local_files_only=True)
    n = num_image_tokens(cfg)
    img = engine.image_token_id
    ids = engine.tokenizer(PROMPT)["input_ids"]
    out: list[int] = []
    for t in ids:
        out.extend([img] * n if t == img else [t])
    return out


_ENGINE_DIRS: dict[int, Path] = {}


def engine_dir(engine) -> Path:
    return _ENGINE_DIRS[id(engine)]


def run(engine, timers: Timers, beam: int, concurrency: int, n_requests: int, max_tokens: int,
        budget_s: float) -> RunStats:
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    ids = prompt_ids(engine)
    n_img = ids.count(engine.image_token_id)
    hidden = engine.model_config.hidden_size
    params = GenerationParams(max_tokens=max_tokens, min_tokens=max_tokens, beam_width=beam)
    stats = RunStats(beam, concurrency)
    sent = [0]
    errors: list[str] = []
    rng = torch.Generator().manual_seed(0)

    def new_request() -> None:
        i = sent[0]
        sent[0] += 1
        emb = torch.randn(1, n_img, hidden, generator=rng) * 0.02  # [images, tokens, hidden]
        engine.submit(GenerationRequest(f"p{beam}-{i}", list(ids), params, image_embeds=emb), on_result)

    def on_result(res) -> None:  # runs inside engine.step(); exceptions there are only logged
        if not res.final:
            return
        if res.error is not None:
            errors.append(f"request {res.request_id} failed: {res.error!r}")
            return
        stats.requests += 1
        stats.tokens += len(res.sequences[0].token_ids) if res.sequences else 0
        if sent[0] < n_requests and time.perf_counter() < deadline:
            new_request()

    # count rows per decode forward
    orig_plan = engine.cache.plan

    prefill = [False]  # a prefill chunk ran in the current step

    def plan(rows, q_len):
        if q_len == 1:
            stats.decode_rows.append(len(rows))
        else:
            prefill[0] = True
        return orig_plan(rows, q_len)

    engine.cache.plan = plan
    timers.excl.clear()
    timers.calls.clear()
    deadline = time.perf_counter() + budget_s
    t0 = time.perf_counter()
    for _ in range(min(concurrency, n_requests)):
        new_request()
    more = True
    while more:
        prefill[0], n_rows = False, len(stats.decode_rows)
        t_step = time.perf_counter()
        more = engine.step()
        dt = time.perf_counter() - t_step
        stats.steps += 1
        if errors:
            raise RuntimeError(errors[0])
        if len(stats.decode_rows) > n_rows and not prefill[0]:  # decode only: rows / beam tokens returned
            stats.decode_steps += 1
            stats.decode_seconds += dt
            stats.decode_tokens += sum(stats.decode_rows[n_rows:]) / beam
    stats.seconds = time.perf_counter() - t0
    del engine.cache.plan
    stats.excl = dict(timers.excl)
    return stats


def decode_rate(s: RunStats) -> float:
    """Tokens per second of the returned sequences over the decode-only steps (prefill steps left out)."""
    return s.decode_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0


def one_stream(engine, model_dir: Path, n_requests: int, max_tokens: int, bw: Bandwidth) -> str:
    """Greedy requests one at a time through `Engine.step()`, before any timer is installed: the decode-only
    steps' rate against the memory bandwidth (`bench.common.bandwidth`)."""
    stats = run(engine, Timers(), 1, 1, n_requests, max_tokens, 120.0)
    tb = token_bytes(model_dir, len(prompt_ids(engine)), max_tokens, engine.config.dtype)
    return "\n".join([
        f"one stream in-process (beam 1, concurrency 1, {stats.requests} requests x {max_tokens} tokens, "
        f"{stats.decode_steps} decode-only steps of {1000 * stats.decode_seconds / max(1, stats.decode_steps):.2f} ms, "
        f"no timers installed)",
        f"  {describe_bytes(tb)}",
        f"  {bw.method} (load average {bw.load_1min}): passes {bw.passes_gb_s} GB/s",
        "  " + fraction_line("one stream (in-process, decode steps)", decode_rate(stats), tb, bw)])


def report(s: RunStats) -> str:
    total = sum(s.excl.values()) or 1.0
    rows = s.decode_rows
    lines = [f"beam_width {s.beam}, concurrency {s.concurrency}: {s.requests} requests, {s.tokens} tokens in "
             f"{s.seconds:.2f} s = {s.tokens / s.seconds:.1f} tok/s; {s.steps} steps, "
             f"{1000 * s.seconds / max(1, s.steps):.1f} ms/step, "
             f"{sum(rows) / max(1, len(rows)):.1f} rows per decode forward (max {max(rows, default=0)})",
             f"  decode-only steps: {s.decode_steps}, {1000 * s.decode_seconds / max(1, s.decode_steps):.1f} ms/step, "
             f"{decode_rate(s):.1f} tok/s (returned-sequence tokens; timers included)",
             f"  {'category':<22}{'ms/step':>9}{'share':>8}"]
    for cat in ORDER + sorted(set(s.excl) - set(ORDER)):
        if cat in s.excl:
            ms = 1000 * s.excl[cat] / max(1, s.steps)
            lines.append(f"  {cat:<22}{ms:>9.2f}{100 * s.excl[cat] / total:>7.1f}%")
    model = sum(s.excl.get(c, 0.0) for c in ORDER[:7])
    lines.append(f"  -> model forward {100 * model / total:.1f}%, bookkeeping (kv/decoder/scheduler/loop) "
                 f"{100 * (total - model) / total:.1f}%")
    return "\n".join(lines)


def op_profile(engine, beam: int, concurrency: int, max_tokens: int, top: int) -> str:
    """torch.profiler over a short closed-loop run: the aten ops with the largest self CPU time."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    timers = Timers()
    timers.enabled = False
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(engine, timers, beam, concurrency, concurrency, max_tokens, 120.0)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--beams", default="1,4", help="comma list of beam widths")
    ap.add_argument("--requests", type=int, default=0, help="requests per beam width (default 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine 2 OpenMP threads spin-wait on a busy "
                         "core and matmuls get 10-50x slower; 0 = torch's default)")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds per beam width before no new requests")
    ap.add_argument("--ops", action="store_true", help="also print torch.profiler's top aten ops per beam width")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--stream-requests", type=int, default=4,
                    help="greedy requests one at a time, before the timers, for the one-stream decode rate against "
                         "the measured memory bandwidth (bench/common/bandwidth.py; 0 = skip)")
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="buffer of the bandwidth measurement")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    beams = [int(b) for b in args.beams.split(",") if b.strip()]
    bw = measure_bandwidth(args.bandwidth_mib) if args.stream_requests else None  # before the engine's memory
    model_dir = ensure_bench_model()
    print(describe(model_dir))
    print(f"torch threads {torch.get_num_threads()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    kv_tokens = -(-args.max_rows * (128 + args.max_tokens) // 16) * 16
    engine = make_engine(model_dir, args.max_rows, kv_tokens)
    _ENGINE_DIRS[id(engine)] = model_dir
    if args.stream_requests:  # before the timers: the engine's own speed
        run(engine, Timers(), 1, 1, 2, min(8, args.max_tokens), 60.0)  # warm-up
        print(one_stream(engine, model_dir, args.stream_requests, args.max_tokens, bw), flush=True)
    timers = Timers()
    instrument(timers)
    n = args.requests or 2 * args.concurrency
    for beam in beams:  # warm-up: first-call costs (allocator, lazy init) out of the numbers
        run(engine, timers, beam, min(4, args.concurrency), min(4, n), min(8, args.max_tokens), 60.0)
    for beam in beams:
        stats = run(engine, timers, beam, args.concurrency, n, args.max_tokens, args.budget)
        print()
        print(report(stats))
        if args.ops:
            print(op_profile(engine, beam, args.concurrency, args.max_tokens, args.top))
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
