"""Process plumbing for the launcher: a server that dies with its launcher, its stubs, its shared memory.

Linux only (as tritonserver): reads `/proc` and uses `prctl(PR_SET_PDEATHSIG)`.

`PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process (prctl(2): "the
'parent' in this case is considered to be the thread that created this process"). A server restarted by the
supervisor's thread would get the signal as soon as that thread ends. So every supervised child is forked by
`spawn()`, on one daemon thread that lives as long as the launcher process: the signal then means what it
says, the launcher is gone. (Other ways were weighed: forking on the main thread needs the main thread free to
serve restarts; a watcher process or a pipe the child polls adds a process or needs the child's cooperation,
which tritonserver cannot give.)
"""
from __future__ import annotations

import ctypes
import os
import platform
import queue
import re
import signal
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
SHM_DIR = Path("/dev/shm")
STUB_NAME = "triton_python_backend_stub"


def die_with_parent(sig: int = signal.SIGTERM):
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when the thread that forked it ends, even by
    the launcher's SIGKILL, so a killed launcher never leaves its tritonserver behind. Fork through `spawn()`
    so that this thread lives as long as the process."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: the child only calls it

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


class _Spawner:
    """One daemon thread, started on first use and never ended, that runs every `spawn()`."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="triton-vlm-spawner", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return subprocess.Popen(args, **kwargs)
        done: Future = Future()
        self._jobs.put((done, args, kwargs))
        return done.result()

    def _run(self) -> None:
        while True:
            done, args, kwargs = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)


_SPAWNER = _Spawner()


def spawn(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)` forked by the launcher's one spawner thread, which ends only with the
    process: a child given `preexec_fn=die_with_parent()` dies with the launcher, not with the calling thread."""
    return _SPAWNER.popen(args, **kwargs)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: tuple[str, ...]
    rss_kb: int


def read_proc(pid: int) -> Proc | None:
    """One process from /proc, or None if it is gone (or a zombie)."""
    base = Path("/proc") / str(pid)
    try:
        stat = (base / "stat").read_text()
        argv = tuple(a for a in (base / "cmdline").read_bytes().decode(errors="replace").split("\0") if a)
        status = (base / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return Proc(pid=pid, ppid=int(fields[1]), argv=argv, rss_kb=rss)


# what a python stub answers with every thread's stack in the log (`triton/lifeline.py`, faulthandler)
STACKS_SIGNAL = signal.SIGUSR1

# wait4's syscall number, as /proc/<pid>/task/<tid>/syscall shows a thread blocked in it (glibc's waitpid)
WAIT4 = {"x86_64": 61, "aarch64": 260}.get(platform.machine())


def waited_on(pid: int) -> set[int]:
    """The pids that a thread of process `pid` is blocked waiting for in `wait4(pid, ...)` (empty where the
    architecture is unknown or /proc does not say: a process may read its descendants' syscall files)."""
    if WAIT4 is None:
        return set()
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] == str(WAIT4):
            target = int(fields[1], 16)
            if 0 < target < 2**31:  # a pid, not -1 (any child) or a process group
                out.add(target)
    return out


def all_procs() -> list[Proc]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            proc = read_proc(int(p.name))
            if proc is not None:
                out.append(proc)
    return out


def _ppid(pid: str) -> int | None:
    try:
        stat = (Path("/proc") / pid / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def children(pid: int) -> list[Proc]:
    """The live children of `pid`: one read (stat) of every process for its parent, the rest read only for the
    children. The supervisor asks this every 0.5 s, where reading three files of every process on the machine cost
    ~7.6 ms of CPU a scan (bench.peers.side_by_side's measurement at 89 processes)."""
    kids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p.name) == pid]
    return [p for k in kids if (p := read_proc(k)) is not None and p.ppid == pid]


def stub_model(proc: Proc) -> str | None:
    """The model a python-backend stub serves (its first argument is `<repo>/<model>/<version>/model.py`)."""
    if not proc.argv or not proc.argv[0].endswith(STUB_NAME) or len(proc.argv) < 2:
        return None
    parts = Path(proc.argv[1]).parts
    return parts[-3] if len(parts) >= 3 else None


def stubs_of(pid: int) -> dict[int, str]:
    """pid -> model name of every python-backend stub started by the server `pid`."""
    return {p.pid: m for p in children(pid) if (m := stub_model(p)) is not None}


def _remove(names) -> list[str]:
    removed = []
    for f in names:
        try:
            f.unlink()
            removed.append(f.name)
        except FileNotFoundError:
            pass
    return removed


def remove_shm(prefix: str) -> list[str]:
    """Remove the python backend's shared-memory regions named `<prefix>*` (left when a server is killed)."""
    if not prefix or not SHM_DIR.is_dir():
        return []
    return _remove(SHM_DIR.glob(prefix + "*"))


_OWNED = re.compile(r"^triton_vlm_(\d+)_")


def remove_stale_shm() -> list[str]:
    """Remove regions of our servers whose launcher (the pid in `triton_vlm_<pid>_...`) is gone: what a server
    killed before it could clean up (its launcher killed by SIGKILL, say) left behind."""
    if not SHM_DIR.is_dir():
        return []
    return _remove(f for f in SHM_DIR.glob("triton_vlm_*")
                   if (m := _OWNED.match(f.name)) and read_proc(int(m.group(1))) is None)
