"""Spare CPUs for the engine's steps: more intra-op threads while the CPUs beside the engine's are idle.

On a CPU the llm's steps run on the engine's thread, alone on its CPUs (`server/cpu_layout.py`, vLLM's layout);
the server's other processes (tritonserver, preprocess, vision, the front end) and often the client share the
rest. Under load those CPUs are busy, and a second thread for the steps only slows both down (measured: no gain
at concurrency 16 on 2 cores). At low load they are idle, and a prompt's prefill (a few large GEMMs per layer)
runs nearly twice as fast on two: 38 tokens of the benchmark model in 16.4 instead of 26.6 ms on the 2-core
machine, so the first token comes that much sooner.

`SpareThreads.start(cpus)` (on the engine's thread, at its start; `cpus`: the CPUs beside the engine's that it may
borrow, from the launcher's layout):
- starts the OpenMP workers of that thread (torch's intra-op pool: an OpenMP team belongs to the thread that
  opens it) and moves each new worker onto `cpus`, so that a step's extra threads run there and never on the
  engine's own CPUs;
- races one GEMM of the model's MLP shape on 1 thread against 1 + len(cpus), best of a few rounds: used only
  once the extra threads measured >= `MIN_SPEEDUP` faster here (`cbuild`'s rule: a speed path is chosen by
  measurement on the machine it runs on). At start the spare CPUs are often busy (the server's other models
  load there; measured: 1.74 vs 1.65 ms, where an idle CPU gives 1.74 vs 0.89), so a lost race is run again
  at the next step that could borrow them (they look idle then) and while the engine is idle (every `RETRY_S`), up
  to `MAX_RACES`. Any failure leaves one thread
  (logged): never raises.

`step(in_flight)` (a context for each step, with the requests the engine holds): the extra threads are for low
load, where the rest of the pipeline waits on the step. The CPUs' recent idle time alone cannot tell that: at
concurrency 1 the CPU beside the engine's is busy with the request's own preprocessing and streaming right before
and after its prefill, and idle during it. So with more than `REQUESTS_PER_CPU` requests in flight per spare CPU
none lends; below that `threads()` reads the CPUs' idle time from /proc/stat and the workers' own CPU time from
/proc/self/task (the steps' own extra threads do not count as load), and each full `IDLE_MIN` of idle share since
the last look (at least `WINDOW_S` ago; else the last decision) lends one thread (`lend`): a CPU kept busy by
someone else (another tenant's process) lends nothing. Torch's thread count is set for the step and set back
after it. Numerics: oneDNN and SDPA split rows and columns, not the sums over `in` (a token's logits are those
of one thread up to the GEMM blocking, as a different batch size already changes; tests/engine compare with
transformers).

`TRITON_VLM_SPARE_THREADS=0` turns it off.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)

ENV = "TRITON_VLM_SPARE_THREADS"
ENGINE_NAME = "llm-engine"  # the engine's thread, as `server/cpu_layout.keep_only` names it
IDLE_MIN = 0.25  # a spare CPU lends a thread when at least this much of it was idle (for others) since the last look
REQUESTS_PER_CPU = 2  # more requests in flight than this per spare CPU: none lends (the server's other work grows
# with them: preprocess, vision, the responses, the front end, often the clients)
WINDOW_S = 0.1  # the shortest interval between two looks (/proc/stat counts 10 ms ticks); a step inside
# it keeps the last decision
MIN_SPEEDUP = 1.2  # the extra threads must measure at least this much faster in a race
MAX_RACES = 8  # races lost before the spare CPUs are given up for good
RETRY_S = 2.0  # an idle engine races again after this long


def _proc_stat_idle(cpus: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """cpu -> (idle ticks, all ticks) from /proc/stat (idle + iowait count as idle)."""
    out: dict[int, tuple[int, int]] = {}
    wanted = {f"cpu{c}": c for c in cpus}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name in wanted:
                ticks = [int(v) for v in fields[:8]]
                out[wanted[name]] = (ticks[3] + ticks[4], sum(ticks))
    return out


def _thread_ticks(tids: tuple[int, ...]) -> int:
    """utime + stime of these threads of this process (a thread gone counts 0)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def _name(tid: int, name: str) -> None:
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass  # a name is only for people reading `top -H`


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class SpareThreads:
    def __init__(self, cpus: tuple[int, ...], workers: tuple[int, ...], base: int, hidden: int, width: int):
        self.cpus, self.workers, self.base = cpus, workers, base
        self.shape = (min(hidden, 1024), min(width, 4096))  # the race's GEMM: [64, hidden] x [hidden, width]
        self.used: Optional[bool] = None  # None: no race decided yet (`retry` while the engine is idle)
        self.races = 0
        self._last: Optional[tuple[float, dict[int, tuple[int, int]], int]] = None
        self._threads = base
        self.lent_steps = 0  # steps that ran with extra threads (stats, tests)

    @classmethod
    def start(cls, cpus: tuple[int, ...], hidden: int, width: int) -> Optional["SpareThreads"]:
        """On the engine's thread: the workers started and moved onto `cpus`, then a first race (module doc) on a
        GEMM of the model's gate/up shape. None where it is off or cannot run; `TRITON_VLM_SPARE_THREADS=1`: used
        without a race (tests, comparisons)."""
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if not cpus or mode == "0" or not hasattr(os, "sched_setaffinity"):
            return None
        try:
            base = torch.get_num_threads()
            workers = _start_workers(base + len(cpus))
            if not workers:  # a torch without OpenMP, or a runtime that started none: nothing to place
                log.info("spare CPUs %s not used: no OpenMP worker thread started", cpus)
                return None
            for tid in workers:
                os.sched_setaffinity(tid, cpus)
                _name(tid, "llm-spare")
            spare = cls(tuple(cpus), workers, base, hidden, width)
        except Exception as e:  # noqa: BLE001 - an optional speed path: one thread
            log.warning("spare CPUs %s not used: %s: %s", cpus, type(e).__name__, e)
            return None
        if mode == "1":
            spare.used = True
            log.info("spare CPUs %s lend threads to the steps while idle (%s=1: no race)", cpus, ENV)
        else:
            spare.retry()
        return spare

    def pending(self) -> bool:
        """No race has decided yet: the engine calls `retry` when idle, every `RETRY_S`."""
        return self.used is None

    def retry(self) -> None:
        """One race: won -> used; lost -> tried again later (the spare CPUs may have been busy: at start the
        server's other models load there), off for good after `MAX_RACES` lost."""
        self.races += 1
        try:
            one, more = self._race(*self.shape)
        except Exception as e:  # noqa: BLE001 - an optional speed path: one thread
            self.used = False
            log.warning("spare CPUs %s not used: the race failed (%s: %s)", self.cpus, type(e).__name__, e)
            return
        times = f"a GEMM took {one:.2f} ms on {self.base} thread(s), {more:.2f} ms on {self.base + len(self.cpus)}"
        if one >= MIN_SPEEDUP * more:
            self.used = True
            log.info("spare CPUs %s lend threads to the steps while idle: %s", self.cpus, times)
        elif self.races >= MAX_RACES:
            self.used = False
            log.info("spare CPUs %s not used: %s (race %d of %d)", self.cpus, times, self.races, MAX_RACES)
        else:
            log.info("spare CPUs %s: %s; racing again when the engine is idle", self.cpus, times)

    def _race(self, hidden: int, width: int, rounds: int = 3) -> tuple[float, float]:
        """(ms on `base` threads, ms on base + spare) of [64, hidden] x [hidden, width], best of `rounds` each."""
        from . import gemm  # noqa: PLC0415

        w = torch.randn(width, hidden) * 0.02
        w = gemm.pack(w) if gemm.packing_enabled(torch.device("cpu"), torch.float32) else w
        x = torch.randn(64, 1, hidden)
        best = [float("inf"), float("inf")]
        for _ in range(rounds):
            for i, n in enumerate((self.base, self.base + len(self.cpus))):
                torch.set_num_threads(n)
                try:
                    gemm.linear(x, w, None)
                    t0 = time.perf_counter()
                    for _ in range(3):
                        gemm.linear(x, w, None)
                    best[i] = min(best[i], 1e3 * (time.perf_counter() - t0) / 3)
                finally:
                    torch.set_num_threads(self.base)
        return best[0], best[1]

    def threads(self, in_flight: int) -> int:
        """Threads for the coming step with `in_flight` requests in the engine: base + what `lend` gives. While
        no race has decided, the first step that could borrow runs one first (its CPUs look idle now)."""
        if self.used is False or in_flight > REQUESTS_PER_CPU * len(self.cpus):
            return self.base  # busy: the server's other work (and the clients) need those CPUs
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= WINDOW_S:
            try:
                idle, own = _proc_stat_idle(self.cpus), _thread_ticks(self.workers)
            except OSError:
                return self.base
            self._threads = self.base + (len(self.cpus) if self._last is None else
                                         lend(self._last[1], idle, own - self._last[2], len(self.cpus)))
            self._last = (now, idle, own)
        if self._threads > self.base and self.used is None:
            self.retry()
        return self._threads if self.used else self.base

    @contextmanager
    def step(self, in_flight: int) -> Iterator[int]:
        n = self.threads(in_flight)
        if n == self.base:
            yield n
            return
        self.lent_steps += 1
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(self.base)


def lend(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], own_ticks: int, most: int) -> int:
    """Threads the spare CPUs can lend: their idle fractions between two /proc/stat looks (cpu -> (idle, all)
    ticks), plus the share the steps' own workers used (`own_ticks`: it was free for them), summed; each full
    `IDLE_MIN` of it lends one thread, at most `most`."""
    free, spans = 0.0, []
    for cpu, (idle1, all1) in after.items():
        idle0, all0 = before.get(cpu, (idle1, all1))
        if all1 > all0:
            free += (idle1 - idle0) / (all1 - all0)
            spans.append(all1 - all0)
    if not spans:
        return 0
    free += own_ticks / (sum(spans) / len(spans))
    return max(0, min(most, int(free + 1 - IDLE_MIN)))


def _start_workers(n: int) -> tuple[int, ...]:
    """Open an OpenMP team of `n` threads on this thread (torch's pool) -> the native ids of the threads it started.
    A new thread takes its creator's name: this thread is named `llm-engine` first (as the launcher's layout names
    it), so that threads other parts of the process start meanwhile are not taken for workers."""
    me = threading.get_native_id()
    _name(me, ENGINE_NAME)
    before = _tids()
    base = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        x = torch.randn(n * 65536)
        for _ in range(3):
            (x * 2).sum()  # elementwise work above torch's grain size runs on the team
    finally:
        torch.set_num_threads(base)
    return tuple(sorted(t for t in _tids() - before - {me} if _comm(t) == ENGINE_NAME))


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
