"""Spare CPUs lent to the engine's steps (`engine/cpu/spare.py`): the lending rule on /proc/stat samples, the
load and race gates, and the engine end to end: its OpenMP workers on the spare CPUs only, steps that borrowed
them, and the same greedy tokens as without them."""
from __future__ import annotations

import os

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.cpu import spare
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.params import GenerationParams, GenerationRequest


def test_lend_counts_idle_share_and_the_workers_own_time():
    before = {1: (100, 1000), 2: (100, 1000)}
    # cpu 1 idle 8 of 10 ticks, cpu 2 idle 1 of 10: 0.9 free -> one thread (each full IDLE_MIN 0.25 lends one)
    assert spare.lend(before, {1: (108, 1010), 2: (101, 1010)}, 0, 2) == 1
    assert spare.lend(before, {1: (110, 1010), 2: (110, 1010)}, 0, 2) == 2  # both idle
    assert spare.lend(before, {1: (101, 1010), 2: (101, 1010)}, 0, 2) == 0  # both busy with others
    # busy only with the steps' own workers (10 of 10 ticks of one CPU): that CPU counts as free
    assert spare.lend(before, {1: (100, 1010), 2: (101, 1010)}, 10, 2) == 1
    assert spare.lend(before, {1: (110, 1010)}, 0, 1) == 1 and spare.lend(before, before, 0, 2) == 0  # no ticks


def test_threads_gates_on_load_and_on_the_race():
    s = spare.SpareThreads((0,), (), torch.get_num_threads(), 64, 128)
    s.used = True
    assert s.threads(spare.REQUESTS_PER_CPU + 1) == s.base  # busy: no CPU lends
    assert s.threads(1) == s.base + 1  # the first look lends (nothing measured against yet)
    s.used = False
    assert s.threads(1) == s.base  # the race was lost for good


def test_a_lost_race_is_run_again_until_won_or_given_up(monkeypatch):
    s = spare.SpareThreads((0,), (), 1, 64, 128)
    times = iter([(1.0, 0.95), (1.0, 0.5)])  # busy spare CPU: 1.05x; then idle: 2x
    monkeypatch.setattr(s, "_race", lambda *a: next(times))
    s.retry()
    assert s.pending() and s.used is None
    s.retry()
    assert s.used is True and not s.pending() and s.races == 2
    lost = spare.SpareThreads((0,), (), 1, 64, 128)
    monkeypatch.setattr(lost, "_race", lambda *a: (1.0, 1.0))
    for _ in range(spare.MAX_RACES):
        lost.retry()
    assert lost.used is False and lost.threads(1) == 1
    broken = spare.SpareThreads((0,), (), 1, 64, 128)
    monkeypatch.setattr(broken, "_race", lambda *a: 1 / 0)
    broken.retry()
    assert broken.used is False


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, processor = build_random_llava_objects(seed=7, max_position_embeddings=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties are rare
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def generate(path, spare_cpus, prompts) -> tuple[Engine, dict[str, list[int]]]:
    eng = Engine(path, EngineConfig(max_rows=4, kv_cache_tokens=1024, spare_cpus=spare_cpus))
    eng.start()
    try:
        reqs = [GenerationRequest(f"r{i}", p, GenerationParams(max_tokens=8, min_tokens=8))
                for i, p in enumerate(prompts)]
        out = {rid: res[-1].sequences[0].token_ids for rid, res in eng.generate(reqs).items()}
    finally:
        eng.shutdown()
    return eng, out


def test_engine_borrows_the_spare_cpu_and_gives_the_same_tokens(ckpt, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not torch.backends.openmp.is_available():
        pytest.skip("needs 2 CPUs (one for the engine's thread, one to lend) and a torch built with OpenMP")
    monkeypatch.setenv(spare.ENV, "1")  # lend without the race (it is timing, and this test is about behaviour)
    prompts = [[1] + list(range(5, 5 + n)) for n in (40, 9)]
    _, want = generate(ckpt, (), prompts)
    eng, got = generate(ckpt, (cpus[-1],), prompts)
    assert got == want
    s = eng.spare
    assert s is not None and s.used and s.lent_steps >= 1
    assert eng.stats().spare_steps == s.lent_steps  # the gauge triton_vlm_engine_spare_steps
    assert s.workers and all(os.sched_getaffinity(t) == {cpus[-1]} for t in s.workers if _alive(t))


def test_spare_threads_off(ckpt, monkeypatch):
    monkeypatch.setenv(spare.ENV, "0")
    eng, _ = generate(ckpt, (sorted(os.sched_getaffinity(0))[-1],), [[1, 5, 6, 7]])
    assert eng.spare is None and eng.stats().spare_steps == 0


def _alive(tid: int) -> bool:
    return os.path.exists(f"/proc/self/task/{tid}")
