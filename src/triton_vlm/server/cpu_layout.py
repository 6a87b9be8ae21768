"""Which CPUs the server's processes run on when the llm runs on a CPU: vLLM's CPU layout for ours.

vLLM's CPU backend binds its model worker's threads to their own cores and keeps the rest for everything else
(`reserve_cpu_num`). Without a layout, our llm stub's decode thread shares every core with tritonserver, the
other stubs, the OpenAI front end and a local client, and is preempted in the middle of its steps. Measured on a
2-core machine (`bench.peers.affinity_ab`, concurrency 16, `vllm bench serve`, alternating on one server): the llm stub alone
on the first core, everything else on the other, 1.37x the tokens/s of no layout (docs/performance.md).

`plan(mode, device, threads)` -> `CpuLayout` or None:
- mode `auto` (the default, `TRITON_VLM_CPU_LAYOUT`): a layout when the llm's device is `cpu` and this process may
  run on at least 2 CPUs; `none`: never (every process on every allowed CPU, as before);
- the llm gets the first `threads` allowed CPUs (its OpenMP threads, `install.server_env`), at most all but one; the
  other processes get the rest.
The launcher starts tritonserver and the front end on `rest` (`preexec`), so Triton's stubs inherit it, and passes
`llm` in `LLM_CPUS_ENV`; the llm stub moves every thread of its own process onto them first thing, before its
imports (`apply_llm_cpus`), so that what it measures while loading (the kernels' races) runs where the steps will,
and its imports (torch, transformers, the engine: ~15 CPU-seconds) do not share the one CPU the other stubs import
on (the demo server ready in 24.1 s when the stub moved after its first imports, 18.6-19.7 s now, on a 2-core
machine). Once the engine's thread runs, `keep_only` leaves that thread alone on the llm CPUs (OpenMP workers it
starts inherit them) and moves the stub's other threads (Triton's IPC thread, the responder, the cancel poller, the
lifeline) back to the CPUs the stub started on, as vLLM's worker computes on its cores while its engine core and API
server run on the reserved one: with several OpenMP threads, a responder preempting one of them stalls the whole
parallel region. On a 2-core machine, one server alternating (`vllm bench serve`, 3 rounds each, the machine
otherwise quiet) it is neutral within the noise: concurrency 16 440-476 vs 424-471 tokens/s, TPOT 26-29 vs 30-31 ms,
TTFT at concurrency 1 35-37 vs 36-39 ms (docs/performance.md).
The engine borrows the rest CPUs for its steps' extra OpenMP threads while few requests are in flight and they are
idle (`spare_cpus`, `engine/cpu/spare.py`).
A CPU the system refuses leaves that process as it was (logged): a layout never stops the server from starting.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("triton_vlm")
MODE_ENV = "TRITON_VLM_CPU_LAYOUT"
LLM_CPUS_ENV = "TRITON_VLM_LLM_CPUS"
MODES = ("auto", "none")


@dataclass(frozen=True)
class CpuLayout:
    llm: tuple[int, ...]  # the llm stub's CPUs
    rest: tuple[int, ...]  # every other process of the server

    def describe(self) -> str:
        return f"llm stub on CPU {_ranges(self.llm)}, the other processes on CPU {_ranges(self.rest)}"


def _ranges(cpus: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cpus)


def plan(mode: Optional[str], device: str, threads: int) -> Optional[CpuLayout]:
    mode = (mode or "auto").strip().lower()
    if mode not in MODES:
        log.warning("%s=%r is not one of %s; using none", MODE_ENV, mode, "/".join(MODES))
        return None
    if mode == "none" or not (device or "cpu").startswith("cpu") or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2:
        return None
    k = max(1, min(threads, len(cpus) - 1))
    return CpuLayout(cpus[:k], cpus[k:])


def preexec(layout: Optional[CpuLayout], then: Optional[Callable[[], None]] = None) -> Optional[Callable[[], None]]:
    """A `preexec_fn` that moves the child onto `layout.rest` (then runs `then`, e.g. `procs.die_with_parent()`)."""
    if layout is None:
        return then

    def run() -> None:
        try:
            os.sched_setaffinity(0, layout.rest)
        except OSError:
            pass  # the child keeps its parent's CPUs
        if then is not None:
            then()

    return run


_started_on: Optional[frozenset[int]] = None  # the llm stub's CPUs before `apply_llm_cpus` (the launcher's rest)
# the stub's own threads when `apply_llm_cpus` ran (the python backend's health and IPC threads, our watchdog): they
# must answer tritonserver within a second (a loading stub whose health flag misses one check is given up on,
# `process.TritonServer.end_wedged_loads`), so they may run on every CPU of the layout, never on one starved CPU
_own_threads: frozenset[int] = frozenset()
_applied: Optional[tuple[int, ...]] = None  # the llm CPUs `apply_llm_cpus` moved the stub onto


def apply_llm_cpus(environ=os.environ) -> Optional[tuple[int, ...]]:
    """In the llm stub: every thread of this process onto the CPUs the launcher reserved for it (threads started
    later inherit them); None when no layout was asked for or the system refused it."""
    global _started_on
    value = environ.get(LLM_CPUS_ENV, "").strip()
    if not value:
        return None
    try:
        cpus = tuple(int(c) for c in value.split(","))
        started_on = frozenset(os.sched_getaffinity(0))
        own = frozenset(t for t in _threads() if t != os.getpid())  # all but the main thread (the model's code)
        for tid in _threads():
            os.sched_setaffinity(tid, started_on | set(cpus) if tid in own else cpus)
    except (OSError, ValueError) as e:
        log.warning("llm: CPU layout %s=%r not applied (%s); running on every allowed CPU", LLM_CPUS_ENV, value, e)
        return None
    global _own_threads, _applied
    _started_on, _own_threads, _applied = started_on, own, cpus
    return cpus


def announce() -> None:
    """Log where `apply_llm_cpus` put the stub (it runs first thing, before the stub's logging is set up)."""
    if _applied is not None:
        log.info("llm: running on CPU %s (the other processes of the server on the rest)", _ranges(_applied))


def keep_only(compute: Optional[int], name: str = "llm-engine") -> bool:
    """After `apply_llm_cpus`, once the engine's thread runs: that thread (native id `compute`, named `name` for
    `top -H`) stays alone on the llm CPUs; every other thread of this process moves to the CPUs the stub started on
    (less the llm's, where the launcher's rest left any). False (nothing moved, or not all of it) without a layout,
    without the thread, or where the system refuses it (logged): never raises, a layout is only a speed path."""
    if _started_on is None or compute is None:
        return False
    try:
        llm = os.sched_getaffinity(compute)
        rest = set(_started_on) - llm or set(_started_on)
        if rest == llm:
            return False
        for tid in _threads():
            if tid != compute:
                try:
                    os.sched_setaffinity(tid, set(_started_on) | llm if tid in _own_threads else rest)
                except ProcessLookupError:
                    pass  # a thread that ended since the listing
    except OSError as e:
        log.warning("llm: the stub's threads were not (all) moved off the engine's CPUs (%s)", e)
        return False
    _name_thread(compute, name)
    log.info("llm: the engine's thread alone on CPU %s, the stub's other threads on CPU %s",
             _ranges(tuple(sorted(llm))), _ranges(tuple(sorted(rest))))
    return True


def spare_cpus(llm: tuple[int, ...]) -> tuple[int, ...]:
    """After `apply_llm_cpus`: the CPUs the stub started on, less the llm's (the launcher's rest), for the engine
    to borrow threads on while they are idle (`engine/cpu/spare.py`); () without a layout."""
    if _started_on is None:
        return ()
    return tuple(sorted(set(_started_on) - set(llm)))


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _name_thread(tid: int, name: str) -> None:
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass  # a name is only for people reading `top -H`
