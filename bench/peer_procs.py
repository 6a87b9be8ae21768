"""The processes of a server under test, for `bench.peer`: every descendant of the process it started (so that
stopping it leaves none behind, whatever process group each one chose), and the CPU seconds each one spent
during a client run (on a 2-core machine, where the client, the front end, the engine and the other hops share
the cores, that split says where a concurrency's time goes)."""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from triton_vlm.server import procs

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    pid: int
    label: str
    cpu_s: float  # user + system since the process started
    threads: int


def descendants(root: int) -> list[procs.Proc]:
    """`root` and every process below it (by parent pid), alive now."""
    table = procs.all_procs()
    kids: dict[int, list[procs.Proc]] = {}
    for p in table:
        kids.setdefault(p.ppid, []).append(p)
    out, todo = [], [p for p in table if p.pid == root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p.pid, []))
    return out


def label(p: procs.Proc) -> str:
    """A short name: the python-backend stub's model, vLLM's process title, or the program and its module."""
    if model := procs.stub_model(p):
        return f"stub {model}"
    argv = p.argv or ("?",)
    if argv[0].startswith("VLLM::"):
        return argv[0]
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return f"{module} {argv[argv.index('-m') + 2]}" if module.startswith("vllm.") and len(argv) > 3 else module
    return Path(argv[0]).name


def usage(p: procs.Proc) -> Usage | None:
    base = Path("/proc") / str(p.pid)
    try:
        fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
        threads = next(int(x.split()[1]) for x in (base / "status").read_text().splitlines()
                       if x.startswith("Threads:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return Usage(p.pid, label(p), (int(fields[11]) + int(fields[12])) / TICK, threads)  # utime, stime


def snapshot(root: int) -> dict[int, Usage]:
    return {u.pid: u for p in descendants(root) if (u := usage(p)) is not None}


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (the client runs are such children)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def split(before: dict[int, Usage], after: dict[int, Usage]) -> dict[str, float]:
    """CPU seconds per label spent between two snapshots (processes of the same label summed)."""
    out: dict[str, float] = {}
    for pid, u in after.items():
        spent = u.cpu_s - (before[pid].cpu_s if pid in before else 0.0)
        out[u.label] = round(out.get(u.label, 0.0) + spent, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
