"""The server's CPU layout (vLLM's for ours): the llm stub on its own CPUs, every other process on the rest, on a
live server; and the plan's rules."""
from __future__ import annotations

import os

import pytest

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
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        want = set(layout.llm) if model == "llm" else set(layout.rest)
        assert all(os.sched_getaffinity(t) == want for t in threads), (model, want)
