"""The server's CPU layout (vLLM's for ours): the llm stub on its own CPUs, every other process on the rest, on a
live server; and the plan's rules."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from triton_vlm.server import cpu_layout

pytestmark = pytest.mark.server


def test_plan_rules(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_layout.plan("auto", "cpu", 1) == cpu_layout.CpuLayout((0,), (1, 2, 3))
    assert cpu_layout.plan(None, "cpu", 2) == cpu_layout.CpuLayout((0, 1), (2, 3))
    assert cpu_layout.plan("auto", "cpu", 8) == cpu_layout.CpuLayout((0, 1, 2), (3,))  # always one for the rest
    assert cpu_layout.plan("none", "cpu", 1) is None
    assert cpu_layout.plan("auto", "cuda", 1) is None  # a GPU engine: no layout
    assert cpu_layout.plan("bogus", "cpu", 1) is None  # logged, treated as none
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpu_layout.plan("auto", "cpu", 1) is None  # one CPU: nothing to split


def test_a_refused_layout_leaves_the_stub_as_it_was():
    assert cpu_layout.apply_llm_cpus({cpu_layout.LLM_CPUS_ENV: "99999"}) is None
    assert cpu_layout.apply_llm_cpus({cpu_layout.LLM_CPUS_ENV: "x"}) is None
    assert cpu_layout.apply_llm_cpus({}) is None


_KEEP_ONLY = textwrap.dedent("""
    import json, os, threading, time
    from triton_vlm.server import cpu_layout
    stop = threading.Event()
    own = threading.Thread(target=stop.wait); own.start()  # e.g. the python backend's health thread
    llm = cpu_layout.apply_llm_cpus({cpu_layout.LLM_CPUS_ENV: os.environ["LLM"]})
    worker = threading.Thread(target=stop.wait)  # the engine's thread
    other = threading.Thread(target=stop.wait)   # e.g. the responder, started before keep_only
    worker.start(); other.start()
    kept = cpu_layout.keep_only(worker.native_id)
    late = {}
    def started_later():
        late["cpus"] = sorted(os.sched_getaffinity(0))
    t = threading.Thread(target=started_later); t.start(); t.join()
    out = {"llm": llm, "kept": kept, "own": sorted(os.sched_getaffinity(own.native_id)), "worker": sorted(os.sched_getaffinity(worker.native_id)),
           "other": sorted(os.sched_getaffinity(other.native_id)), "main": sorted(os.sched_getaffinity(0)),
           "late": late["cpus"], "name": open(f"/proc/self/task/{worker.native_id}/comm").read().strip()}
    stop.set()
    print(json.dumps(out))
""")


def test_keep_only_leaves_the_engine_thread_alone_on_the_llm_cpus():
    """In a process of its own (affinity is per thread): the compute thread stays on the llm CPU, every other
    thread (and one started later by another) goes back to the CPUs the process started on, less the llm's; the
    threads the stub had before the model's code ran (the python backend's health thread) may run on all of them."""
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, LLM=str(cpus[0]))
    out = json.loads(subprocess.run([sys.executable, "-c", _KEEP_ONLY], env=env, capture_output=True, text=True,
                                    check=True, timeout=60).stdout)
    assert out["llm"] == [cpus[0]]
    if len(cpus) < 2:  # one CPU: nowhere else to go, nothing moves
        assert out["kept"] is False and out["other"] == [cpus[0]]
        return
    assert out["kept"] is True and out["name"] == "llm-engine"
    assert out["worker"] == [cpus[0]]
    assert out["other"] == out["main"] == out["late"] == cpus[1:]
    assert out["own"] == cpus  # the stub's own threads (Triton's health thread) on every CPU, never one starved


def test_keep_only_without_a_layout_or_a_thread_moves_nothing():
    code = ("import os, threading; from triton_vlm.server import cpu_layout; "
            "print(cpu_layout.keep_only(threading.get_native_id()), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split(maxsplit=1) == ["False", str(sorted(os.sched_getaffinity(0))) + "\n"]
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os; from triton_vlm.server import cpu_layout; "
            f"cpu_layout.apply_llm_cpus({{cpu_layout.LLM_CPUS_ENV: '{cpus[0]}'}}); "
            "print(cpu_layout.keep_only(None), cpu_layout.keep_only(2**22 + 1))")  # no thread; none (> PID_MAX_LIMIT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_live_server_processes_run_where_the_layout_says(triton_server):
    from triton_vlm.server import procs

    layout = triton_server.cpu_layout
    if len(os.sched_getaffinity(0)) < 2:  # one CPU: nothing to split, every process stays where it was
        assert layout is None
        return
    assert layout is not None and set(layout.llm).isdisjoint(layout.rest)
    stubs = procs.stubs_of(triton_server.proc.pid)  # pid -> model name
    assert "llm" in stubs.values()
    assert os.sched_getaffinity(triton_server.proc.pid) == set(layout.rest)
    for pid, model in stubs.items():
        threads = {int(t): _comm(pid, t) for t in os.listdir(f"/proc/{pid}/task")}
        if model != "llm":
            assert all(os.sched_getaffinity(t) == set(layout.rest) for t in threads), model
            continue
        # the llm stub: the engine's thread alone on the llm CPUs; Triton's IPC thread (the process's main
        # thread) and the responder with the rest
        engine = [t for t, name in threads.items() if name == "llm-engine"]
        assert len(engine) == 1, threads
        assert os.sched_getaffinity(engine[0]) == set(layout.llm)
        assert os.sched_getaffinity(pid) == set(layout.rest)
        assert sum(os.sched_getaffinity(t) == set(layout.rest) for t in threads) >= 3  # main, responder, poller
        # the OpenMP workers the engine's thread lends its steps while the rest is idle (engine/cpu/spare.py)
        spare = [t for t, name in threads.items() if name == "llm-spare"]
        assert all(os.sched_getaffinity(t) == set(layout.rest) for t in spare), threads
        assert bool(spare) == torch.backends.openmp.is_available(), threads


def _comm(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().strip()
