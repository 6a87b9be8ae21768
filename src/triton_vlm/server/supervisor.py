"""Keeps a `TritonServer` serving: restarts it when it dies or when one of its python stubs dies.

Why a restart of the whole server, on this Triton (2.51, python backend):
- a dead stub of a decoupled model is never restarted by Triton, every later request fails with
  "Stub process 'llm_0_0' is not healthy", and `/v2/health/ready` and `/v2/models/llm/ready` keep saying
  ready (readiness is the model's load state, not the stub's health);
- its in-flight requests are never answered: the backend keeps their response factories, and only the end
  of the server process closes their connections (clients then get UNAVAILABLE at once);
- a model reload through the repository API would wait for those in-flight requests first, so it hangs too.
A restart answers every in-flight request within a few seconds, makes readiness false (nothing listens)
until every model is loaded again, and brings service back without a person. Restarts are bounded: more
than `max_restarts` within `window_s` means the server cannot run, and the supervisor gives up (`failed`).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from . import procs


class Supervisor:
    def __init__(self, server, *, say: Callable[[str], None] = print, interval: float = 0.5,
                 max_restarts: int = 5, window_s: float = 300.0, grace_s: float = 2.0,
                 ready_timeout: float = 600.0):
        self.server = server
        self.say = say
        self.interval, self.max_restarts, self.window_s = interval, max_restarts, window_s
        self.grace_s, self.ready_timeout = grace_s, ready_timeout
        self.restarts: deque[float] = deque()  # monotonic times of recent restarts
        self.restart_count = 0
        self.failed = threading.Event()
        self._down_since: float | None = None  # when the server went down, until it is ready again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triton-vlm-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.server.exit_timeout + 30)

    # --- the loop ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        stubs: dict[int, str] = {}  # stub pid -> model, learnt once the server is ready
        started = time.monotonic()
        while not self._stop.wait(self.interval):
            proc = self.server.proc
            if proc is None:
                continue
            rc = proc.poll()
            if rc is not None:
                why = f"tritonserver exited with {_describe_exit(rc)}"
            else:
                why, stubs = self._check_stubs(proc.pid, stubs, started)
            if why is None or self._stop.is_set():
                continue
            if not self._restart(why):
                return
            stubs, started = {}, time.monotonic()

    def _check_stubs(self, pid: int, known: dict[int, str], started: float) -> tuple[str | None, dict[int, str]]:
        """-> (why a restart is needed or None, the stubs now known)."""
        now = procs.stubs_of(pid)
        if not known:
            if self.server.is_ready():  # every model loaded: these are the stubs that must stay
                if self._down_since is not None:
                    self.say(f"triton-vlm: tritonserver is serving again after {time.monotonic() - self._down_since:.1f} s "
                             f"(restart {self.restart_count})")
                    self._down_since = None
                return None, now
            if time.monotonic() - started > self.ready_timeout:
                return f"tritonserver not ready after {self.ready_timeout:.0f} s", known
            return None, known
        dead = {p: m for p, m in known.items() if p not in now}
        if dead:
            names = ", ".join(f"{m} (pid {p})" for p, m in sorted(dead.items()))
            return f"the python stub of model {names} died", known
        return None, {**known, **now}

    def _restart(self, why: str) -> bool:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            self.say(f"triton-vlm: {why}; {len(self.restarts)} restarts in the last {self.window_s:.0f} s, "
                     "giving up")
            self.server.stop(timeout=self.grace_s)
            self.failed.set()
            return False
        self.restarts.append(now)
        self.restart_count += 1
        self._down_since = self._down_since or now
        self.say(f"triton-vlm: {why}; restarting tritonserver (restart {self.restart_count})")
        self.server.stop(timeout=self.grace_s)  # SIGINT, then SIGKILL after grace_s: hung requests end now
        self.server.start()
        return True


def _describe_exit(rc: int) -> str:
    if rc < 0:
        import signal  # noqa: PLC0415

        try:
            return f"signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"
