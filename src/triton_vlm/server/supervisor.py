"""Keeps processes serving: restarts one when it dies or when a process it depends on (a python stub) dies.

Why a restart of the whole server, on this Triton (2.51, python backend):
- a dead stub of a decoupled model is never restarted by Triton, every later request fails with
  "Stub process 'llm_0_0' is not healthy", and `/v2/health/ready` and `/v2/models/llm/ready` keep saying
  ready (readiness is the model's load state, not the stub's health);
- its in-flight requests are never answered: the backend keeps their response factories, and only the end
  of the server process closes their connections (clients then get UNAVAILABLE at once);
- a model reload through the repository API would wait for those in-flight requests first, so it hangs too.
A restart answers every in-flight request within a few seconds, makes readiness false (nothing listens)
until every model is loaded again, and brings service back without a person.

Two bounds end the restarts (the supervisor then sets `failed` and the launcher exits non-zero):
- more than `max_restarts` within `window_s`: the process keeps dying after serving for a while;
- `max_failed_starts` starts in a row that never became ready, either dead while loading or not ready after
  `ready_timeout`: a process that cannot load at all (a hang while loading used to be restarted forever: each
  attempt took longer than the restart window, so restarts never accumulated in it).

The supervisor watches any number of children (`Supervised`: a tritonserver, and any process beside it), each
with its own bounds; one that gives up stops only itself and sets `failed`; the caller stops the others.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol


class Supervised(Protocol):
    """What the supervisor needs of a child (`process.TritonServer` is one)."""

    name: str  # in messages, e.g. "tritonserver"
    proc: Optional[subprocess.Popen]
    exit_timeout: int

    def start(self) -> object: ...

    def stop(self, timeout: float | None = None) -> int | None: ...

    def is_ready(self) -> bool: ...

    def watched(self) -> dict[int, str]:
        """pid -> description of each process that must stay alive while this child serves (e.g. its python
        stubs); read once the child is ready. `{}` for none."""
        ...

    def missing(self) -> list[str]:
        """The processes this child should have now and does not (e.g. a python stub that died before the
        supervisor saw the child ready, so never was in `watched`): descriptions, `[]` for none."""
        ...

    def failure_cause(self) -> str | None:
        """Why the last start failed (e.g. a model's load error from the log), or None if unknown."""
        ...


@dataclass
class _Watch:
    """The supervisor's state for one child."""

    child: Supervised
    started: float  # monotonic time of the last start
    ready: bool = False  # ready since the last start
    watched: dict[int, str] = field(default_factory=dict)  # learnt once ready
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts
    failed_starts: int = 0  # starts in a row that never became ready
    down_since: float | None = None  # when it went down, until it is ready again


class Supervisor:
    def __init__(self, *children: Supervised, say: Callable[[str], None] = print, interval: float = 0.5,
                 max_restarts: int = 5, window_s: float = 300.0, grace_s: float = 2.0,
                 ready_timeout: float = 600.0, max_failed_starts: int = 2):
        if not children:
            raise ValueError("Supervisor needs at least one child to watch")
        self.children = children
        self.say = say
        self.interval, self.max_restarts, self.window_s = interval, max_restarts, window_s
        self.grace_s, self.ready_timeout, self.max_failed_starts = grace_s, ready_timeout, max_failed_starts
        self.restart_count = 0  # all children together
        self.failed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triton-vlm-supervisor", daemon=True)

    @property
    def server(self) -> Supervised:
        """The first child (the tritonserver, for the launcher)."""
        return self.children[0]

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(max(c.exit_timeout for c in self.children) + 30)

    # --- the loop ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        now = time.monotonic()
        watches = [_Watch(c, started=now) for c in self.children]
        while watches and not self._stop.wait(self.interval):
            for w in list(watches):
                why = self._check(w)
                if why is None or self._stop.is_set():
                    continue
                if not self._restart(w, why):
                    watches.remove(w)
                    self.failed.set()

    def _check(self, w: _Watch) -> str | None:
        """Why `w`'s child needs a restart, or None."""
        proc = w.child.proc
        if proc is None:
            return None
        rc = proc.poll()
        if rc is not None:
            return f"{w.child.name} exited with {describe_exit(rc)}"
        if not w.ready:
            if w.child.is_ready():  # loaded: the processes it has now are those that must stay
                w.ready, w.failed_starts, w.watched = True, 0, w.child.watched()
                if w.down_since is not None:
                    self.say(f"triton-vlm: {w.child.name} is serving again after "
                             f"{time.monotonic() - w.down_since:.1f} s (restart {self.restart_count})")
                    w.down_since = None
                # a stub that died between the child's readiness and this check is not in `watched`: without
                # this, its death would go unseen and its requests never answered
                missing = w.child.missing() if hasattr(w.child, "missing") else []
                if missing:
                    return "; ".join(f"{d} died" for d in missing)
            elif time.monotonic() - w.started > self.ready_timeout:
                return f"{w.child.name} not ready after {self.ready_timeout:.0f} s"
            return None
        now = w.child.watched()
        dead = {p: d for p, d in w.watched.items() if p not in now}
        if dead:
            return "; ".join(f"{d} (pid {p}) died" for p, d in sorted(dead.items()))
        w.watched = {**w.watched, **now}
        return None

    def _restart(self, w: _Watch, why: str) -> bool:
        """Restart `w`'s child, or give up (stop it, False) when a bound is reached."""
        now = time.monotonic()
        if not w.ready:
            w.failed_starts += 1
        while w.restarts and now - w.restarts[0] > self.window_s:
            w.restarts.popleft()
        if w.failed_starts >= self.max_failed_starts or len(w.restarts) >= self.max_restarts:
            w.child.stop(timeout=self.grace_s)
            if w.failed_starts >= self.max_failed_starts:
                bound = f"{w.failed_starts} starts in a row never became ready"
            else:
                bound = f"{len(w.restarts)} restarts in the last {self.window_s:.0f} s"
            cause = w.child.failure_cause() if not w.ready else None
            self.say(f"triton-vlm: {why}; {bound}, giving up" + (f"\n{cause}" if cause else ""))
            return False
        w.restarts.append(now)
        self.restart_count += 1
        w.down_since = w.down_since or now
        self.say(f"triton-vlm: {why}; restarting {w.child.name} (restart {self.restart_count})")
        w.child.stop(timeout=self.grace_s)  # SIGINT, then SIGKILL after grace_s: hung requests end now
        w.started, w.ready, w.watched = time.monotonic(), False, {}
        try:
            w.child.start()
        except Exception as e:  # noqa: BLE001 - it cannot be started again (a file gone, a port taken)
            self.say(f"triton-vlm: restarting {w.child.name} failed ({type(e).__name__}: {e}), giving up")
            w.child.stop(timeout=self.grace_s)
            return False
        return True


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"
