"""The decode step with its pointwise work fused by `torch.compile` (issue 39 item 2), chosen by measurement.

On an H200 the one-stream decode step of a 7B model under CUDA graphs spent ~39% of its device time in the cuBLAS
gemv kernels and the rest in ~40 small kernels a layer (bench/gpu/runs/2026-11-28-h200.md): the RMSNorm's cast /
square / mean / rsqrt / scale, the rotary embedding's mul / roll / add, the K/V writes, a gather of each row's
keys and values into a contiguous copy for SDPA, SiLU and its product, the residual adds. gpt-fast-class decoders
fuse those with inductor. Here three small functions are compiled (`torch.compile`, the rows, keys and pool slots
marked dynamic: one compile serves every CUDA graph bucket, rows 1 and rows > 1 apart; the model's dimensions static;
the products stay cuBLAS', outside them):
- `add_rms_norm`, `silu_mul`: `model.py`'s own functions (the same formula), each one kernel;
- `decode_attend` (below): one layer's attention core for a decode step (q_len 1): the rotary embedding on q and k,
  the new K/V written to the pool (`index_copy_`, done in place by inductor), then attention over the row's own slots
  written as a product + sum reductions that read the pool through the row's slot indices: inductor fuses that
  gather into the reductions' loads, so no contiguous K/V copy is made (the eager path's `index_select` writes and
  then SDPA reads one). Scores and softmax in fp32; GQA by viewing q as [kv_heads, group].
The step runs these inside the captured decode graphs (`cuda_graph.py`); a prefill chunk, a ragged forward, M-RoPE's
3-D positions and DeepStack keep the eager path; under `TRITON_VLM_ATTENTION=flex` the attention stays flex's.

`TRITON_VLM_DECODE_FUSION` (`choose`, at load, logged with the reason, kept in `LlamaModel.fusion`):
- `auto` (default): on CUDA, after a check (one decode step, fused vs eager logits within the dtype's tolerance),
  one decode step of one row in the model's real shapes is timed three ways, eager, fused, and with only the norms
  and the gate fused (the attention core eager: gather + SDPA), each as a captured CUDA graph replayed (CUDA events,
  the best of 2 rounds of `RACE_REPS` replays; uncaptured when the engine runs without graphs), and the fastest
  kept. On a CPU `auto` is off: no compile at CPU server start (and the C decode kernels stay);
- `on`: fused wherever the check passes (also on a CPU, where it takes the place of the C decode kernels: tests);
- `off`: the eager path.
Any failure to compile, in the check or in the race keeps the eager path and logs why: an optional speed path never
stops a model loading. A compiled call that raises while serving (`FusedCallFailed`: not a CUDA fault nor out of
memory, which propagate as anywhere; not inside a graph capture, whose failure `cuda_graph.py` handles) is logged,
the step recomputed eagerly and fusion turned off for the process.
Not measured on a GPU yet: the GPU check's `fusion_*` rows (bench/gpu/check.py) do that.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .faults import is_device_fault

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_DECODE_FUSION"
MODES = ("auto", "on", "off")
# off until a GPU check has measured the fused step (it has never run on a device; its compiles at load, inductor's
# worker processes inside a Triton stub and its race at one row are unmeasured there): `auto` races it at load
DEFAULT = "off"
BACKEND = "inductor"  # torch.compile's backend; "none": the same functions uncompiled (CPU tests, the GPU check's
# CPU rehearsal: inductor's C++ compiles take minutes on 2 cores)
# dynamo's budget of compiles per function (default 8), process-wide: a function's compiles are kept per code object,
# so every engine of a process (and every dtype) counts in the same budget: rows 1 or more x with or without a
# residual x the inputs made inside inference mode or not x the dtype
RECOMPILE_LIMIT = 64
RACE_KEYS = 512  # keys of the raced row (its scratch cache: RACE_KEYS / block_size blocks)
RACE_REPS = 20  # replays timed per round
CHECK_RTOL = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}  # |fused - eager| / |eager|, logits


def mode() -> str:
    """The value of TRITON_VLM_DECODE_FUSION (`DEFAULT` where unset); anything else is refused at load, naming the variable."""
    wanted = os.environ.get(ENV, DEFAULT).strip().lower() or DEFAULT
    if wanted not in MODES:
        raise ValueError(f"{ENV}={wanted!r}: expected one of {', '.join(MODES)}")
    return wanted


def decode_attend(qkv: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, write_slots: torch.Tensor,
                  read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  heads: int, kv_heads: int) -> torch.Tensor:
    """`attention.attend_torch` for q_len 1 without the gathered K/V copy: qkv [rows, 1, (heads + 2 kv) * hd];
    cos, sin_rot [rows, 1, 1, hd]; write_slots [rows]; read_slots [rows, T]; mask [rows, 1, 1, T] (bool); kc, vc
    [slots, kv_heads, hd] (the new K/V written) -> [rows, 1, heads * hd]."""
    rows, hd = qkv.shape[0], kc.shape[-1]
    group = heads // kv_heads
    x = qkv.view(rows, heads + 2 * kv_heads, hd)
    qk = x[:, :heads + kv_heads]  # `attention.apply_rotary`'s formula, in the model's dtype
    qk = qk * cos.view(rows, 1, hd) + torch.roll(qk, hd // 2, dims=-1) * sin_rot.view(rows, 1, hd)
    kc.index_copy_(0, write_slots, qk[:, heads:])
    vc.index_copy_(0, write_slots, x[:, heads + kv_heads:])
    q = qk[:, :heads].reshape(rows, 1, kv_heads, group, hd).float()
    keys = kc[read_slots].float()[:, :, :, None]  # [rows, T, kv, 1, hd]: read in place by the reduction
    scores = (q * keys).sum(-1) * hd ** -0.5  # [rows, T, kv, group]
    scores = scores.masked_fill(~mask.view(rows, -1, 1, 1), float("-inf"))
    p = torch.softmax(scores, dim=1)
    out = (p[..., None] * vc[read_slots].float()[:, :, :, None]).sum(1)  # [rows, kv, group, hd]
    return out.to(qkv.dtype).reshape(rows, 1, heads * hd)


class Fused:
    """One model's compiled decode functions (module doc); `add_rms_norm` / `silu_mul` as `model._layers` takes
    them, `attend` as its `attend` callback's core. Compiled with the dimensions that vary between buckets and
    caches marked dynamic before each call (rows; keys; the pool's slots) and the model's own (hidden, heads, head
    dim, intermediate) static, so the kernels are specialised to them: one compile per shape class (rows 1 or more,
    a residual or none), not per bucket."""

    def __init__(self, add_rms_norm: Callable, silu_mul: Callable, heads: int, kv_heads: int,
                 backend: Optional[str] = None):
        self.backend = backend = backend or BACKEND
        if backend != "none":
            # past its recompile budget dynamo would run a function uncompiled: `decode_attend` then materialises
            # [rows, T, kv_heads, group, hd] in fp32. Raise instead (`model._fused_layers` then turns fusion off);
            # the same process-wide settings as flex's (`flex_paged.RECOMPILE_LIMIT`)
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        compile = (lambda fn: fn) if backend == "none" else \
            (lambda fn: torch.compile(fn, fullgraph=True, backend=backend))
        self._norm, self._act = compile(add_rms_norm), compile(silu_mul)
        self._core = compile(_core(heads, kv_heads))
        self.heads, self.kv_heads = heads, kv_heads
        self.core = True  # the attention core fused too (`attend`); False: the eager one (`auto`'s race may pick it)

    def add_rms_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        _dynamic(0, x, delta)
        return _call(self._norm, x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _dynamic(0, gate_up)
        return _call(self._act, gate_up)

    def attend(self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], write_slots: torch.Tensor,
               read_slots: torch.Tensor, mask: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        _dynamic(0, qkv, *tables, write_slots, read_slots, mask, kc, vc)  # rows; the pool's slots
        _dynamic(1, read_slots)  # keys
        _dynamic(3, mask)
        return _call(self._core, qkv, *tables, write_slots, read_slots, mask, kc, vc)


class FusedCallFailed(RuntimeError):
    """A compiled function raised (a compile, a guard past the recompile budget, a kernel): `model._fused_layers`
    then recomputes the step eagerly. Not for CUDA faults or out-of-memory, which propagate as they are."""


def _call(fn: Callable, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        if is_device_fault(e) or isinstance(e, torch.OutOfMemoryError):
            raise
        raise FusedCallFailed(f"{type(e).__name__}: {e}"[:500]) from e


def _core(heads: int, kv_heads: int) -> Callable:
    """`decode_attend` with the model's head counts as constants (closed over: dynamo guards them, the kernels are
    specialised to them)."""
    def attend(qkv, cos, sin_rot, write_slots, read_slots, mask, kc, vc):
        return decode_attend(qkv, cos, sin_rot, write_slots, read_slots, mask, kc, vc, heads, kv_heads)
    return attend


def _dynamic(dim: int, *tensors: Optional[torch.Tensor]) -> None:
    """Mark dimension `dim` of each tensor dynamic for the next compile (size 0 or 1 still specialises)."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dim)


@dataclass(frozen=True)
class Choice:
    """What `choose` decided: fused or not (and whether the attention core too, `core`), why, and the race's times
    of one decode step (None where it did not race): eager, fused, and `pointwise_ms` with the norms and the gate
    fused but the eager attention core (gather + SDPA)."""

    on: bool
    reason: str
    eager_ms: Optional[float] = None
    fused_ms: Optional[float] = None
    pointwise_ms: Optional[float] = None
    core: bool = True

    def describe(self) -> str:
        what = ("fused" + ("" if self.core else " norms and gate, SDPA attention")) if self.on else "eager"
        times = "" if self.eager_ms is None else f"; one decode step {self.fused_ms:.3f} ms fused vs " \
            f"{self.eager_ms:.3f} ms eager, {self.pointwise_ms:.3f} ms with only the norms and gate fused"
        return f"{what} ({self.reason}{times})"


def choose(model, block_size: int, keys: int = RACE_KEYS, graphs: bool = True,
           wanted: Optional[str] = None) -> Choice:
    """Decide at load (module doc) and set `model.fused` (a `Fused`, or None) -> the choice, logged.
    `model`: a `LlamaModel`; `keys`: the raced row's keys; `graphs`: the engine replays CUDA graphs (race them)."""
    wanted = wanted or mode()
    model.fused = None
    dev = model.device
    if wanted == "off":
        return _logged(Choice(False, f"{ENV}=off"))
    if wanted == "auto" and dev.type != "cuda":
        return _logged(Choice(False, f"{ENV}=auto on {dev.type}: nothing compiled at start"))
    try:
        choice = _decide(model, wanted, block_size, keys, graphs)
    except Exception as e:  # noqa: BLE001 - any failure keeps the eager path
        from .cuda_graph import _capture_error  # noqa: PLC0415 - cuda_graph.py imports model.py, which imports this

        if is_device_fault(e) and not _capture_error(e):  # a failed capture leaves the context intact
            raise
        model.fused = None
        choice = Choice(False, f"{ENV}={wanted} but fusion failed: {type(e).__name__}: {e}"[:500])
    if dev.type == "cuda":  # the scratch caches' blocks back before the KV cache is sized
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    return _logged(choice)


def _decide(model, wanted: str, block_size: int, keys: int, graphs: bool) -> Choice:
    """`choose` past the switch: compile, check, and for `auto` race; raises where any of it fails."""
    t0 = time.perf_counter()
    fns = Fused(_model_fn("add_rms_norm"), _model_fn("silu_mul"), model.config.num_heads, model.config.num_kv_heads)
    err = check(model, fns, block_size, min(40, keys))
    tol = CHECK_RTOL.get(model.dtype, 6e-2)
    if not err <= tol:
        return Choice(False, f"{ENV}={wanted} but the check failed: fused logits differ from eager by {err:.3g} "
                             f"(relative; allowed {tol:g})")
    if wanted == "on":
        model.fused = fns
        return Choice(True, f"{ENV}=on: check passed ({err:.2g} relative), compiled in "
                            f"{time.perf_counter() - t0:.1f} s")
    times = race(model, fns, block_size, keys, graphs)
    best = min(times, key=times.get)  # eager, fused or pointwise (the attention core eager)
    fns.core = best == "fused"
    model.fused = None if best == "eager" else fns
    how = "CUDA graphs replayed" if graphs and model.device.type == "cuda" else "uncaptured"
    return Choice(best != "eager", f"{ENV}={wanted}: check passed ({err:.2g} relative), raced one row of {keys} keys, "
                                   f"{how}, {time.perf_counter() - t0:.1f} s with compiles", times["eager"],
                  times["fused"], times["pointwise"], fns.core)


def _model_fn(name: str) -> Callable:
    from . import model  # noqa: PLC0415 - model.py imports this module

    return getattr(model, name)


def _logged(choice: Choice) -> Choice:
    log.info("decode fusion: %s", choice.describe())
    return choice


def _scratch_step(model, block_size: int, keys: int, fill: bool = False, rows: int = 1):
    """A decode step of `rows` rows (row r at position keys - 1 - r) on a scratch cache -> step(), which returns its
    logits [rows, vocab]. `fill`: random keys and values (the check; the race times zeros)."""
    cache = model.new_cache(rows * -(-keys // block_size) + 1, block_size)
    held = [cache.new_row() for _ in range(rows)]
    for r, row in enumerate(held):
        cache.append(row, keys - 1 - r)
    batch = cache.plan(held, 1)  # writes the same slots at every call, with the same values
    with torch.inference_mode():  # as the engine's steps (a tensor made outside would be another compile's guard)
        x = model.embed(torch.arange(1, rows + 1)[:, None])  # [rows, 1, hidden]
    if fill:  # keys of unit size, not the empty pool's zeros
        g = torch.Generator(device="cpu").manual_seed(0)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(cache.k.dtype))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(cache.v.dtype))
    return lambda: model.forward(x, batch, cache)


def check(model, fns: Fused, block_size: int, keys: int = 40) -> float:
    """A decode step of one row and one of 3 ragged rows, fused vs eager, on scratch caches -> the larger max |diff| /
    max |eager| of their logits. (Both shape classes compile here, before the engine's memory profile.)"""
    errs = []
    for rows in (1, 3):
        step = _scratch_step(model, block_size, keys, fill=True, rows=rows)
        try:
            model.fused = None
            want = step()
            model.fused = fns
            got = step()
        finally:
            model.fused = None
        errs.append(float((got - want).abs().max() / want.abs().max().clamp_min(1e-6)))
    return max(errs)


def race(model, fns: Fused, block_size: int, keys: int = RACE_KEYS, graphs: bool = True,
         rounds: int = 2) -> dict[str, float]:
    """ms of one decode step of one row holding `keys` keys, {"eager", "fused", "pointwise"} (the norms and the
    gate fused, the attention core eager): each captured as a CUDA graph and replayed (CUDA events) on CUDA with
    `graphs`, else called (wall clock); the best of `rounds` rounds, the sides alternating. `fns` left as given."""
    step = _scratch_step(model, block_size, keys)
    pointwise = copy.copy(fns)
    pointwise.core = False
    timers = {}
    try:
        for side, fused in (("eager", None), ("fused", copy.copy(fns)), ("pointwise", pointwise)):
            if fused is not None:
                fused.core = side == "fused"
            model.fused = fused
            timers[side] = _graph_timer(step, model.device) if graphs and model.device.type == "cuda" \
                else _wall_timer(step, model.device)
        best = {side: float("inf") for side in timers}
        for _ in range(rounds):
            for side, timer in timers.items():
                best[side] = min(best[side], timer())
    finally:
        model.fused = None
        timers.clear()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
            torch.cuda.empty_cache()
    return best


def _graph_timer(step: Callable, device: torch.device) -> Callable[[], float]:
    """`step` captured as a CUDA graph (two warm-up runs on a side stream first, as `cuda_graph.py`) -> a timer of
    RACE_REPS replays (ms per replay)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()

    def timed() -> float:
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(RACE_REPS):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / RACE_REPS
    return timed


def _wall_timer(step: Callable, device: torch.device) -> Callable[[], float]:
    step()  # compiles / warms

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 1e3 * (time.perf_counter() - t0) / 3
    return timed
