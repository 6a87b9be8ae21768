"""The launcher's parts without a live server: supervisor bounds, process ties, GPU settings, log diagnosis, run
folders, the printed client command."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_vlm.server import diagnose, gpu, procs, rundir
from triton_vlm.server.cli import EXAMPLE_PROMPT, try_command
from triton_vlm.server.process import TritonServer
from triton_vlm.server.repository import prepare_model_repository
from triton_vlm.server.supervisor import Supervisor


class FakeServer:
    """A `Supervised` child: a `sleep` process, ready only on its first start (as a server that loaded once
    and then hangs while loading after each restart)."""

    name = "fake-server"
    exit_timeout = 1

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.seen_ready = threading.Event()  # the supervisor has seen it ready

    def start(self) -> "FakeServer":
        self.proc = procs.spawn(["sleep", "60"])
        self.starts += 1
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        return None if self.proc is None else self.proc.returncode

    def is_ready(self) -> bool:
        ready = self.loads_every_time or self.starts == 1
        if ready:
            self.seen_ready.set()
        return ready

    loads_every_time = False

    def watched(self) -> dict[int, str]:
        return {}

    missing_stubs: list[str] = []  # what `missing()` reports (a stub that died before the supervisor looked)

    def missing(self) -> list[str]:
        return self.missing_stubs if self.starts == 1 else []

    def failure_cause(self) -> str | None:
        return "model 'llm' failed to load: stuck"


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_supervisor_gives_up_on_a_server_that_never_becomes_ready_again():
    """A restart that hangs while loading counts as a failed start; two in a row end the restarts (they used to
    go on forever: each took longer than the restart window)."""
    server = FakeServer().start()
    said: list[str] = []
    sup = Supervisor(server, say=said.append, interval=0.02, ready_timeout=0.3, window_s=0.1).start()
    try:
        assert server.seen_ready.wait(5)
        server.proc.kill()  # it dies once while serving: restarted, then never ready again
        assert _wait(sup.failed.is_set, 15), said
    finally:
        sup.stop()
        server.stop()
    assert server.starts == 3, said  # the first start and two restarts, no more
    assert "fake-server exited with signal 9 (SIGKILL); restarting fake-server (restart 1)" in said[0], said
    assert said[1] == "triton-vlm: fake-server not ready after 0 s; restarting fake-server (restart 2)", said
    assert said[-1] == ("triton-vlm: fake-server not ready after 0 s; 2 starts in a row never became ready, "
                        "giving up\nmodel 'llm' failed to load: stuck"), said
    assert server.proc.poll() is not None, "the server was left running after giving up"


def test_supervisor_restarts_a_server_that_serves_between_deaths():
    """Deaths after serving are restarted up to max_restarts within the window."""
    server = FakeServer()
    server.loads_every_time = True
    server.start()
    said: list[str] = []
    sup = Supervisor(server, say=said.append, interval=0.02, max_restarts=2, window_s=60).start()
    try:
        assert server.seen_ready.wait(5)
        for n in (1, 2):
            server.proc.kill()
            assert _wait(lambda: sum("serving again" in m for m in said) == n, 10), said  # noqa: B023
        assert server.starts == 3
        server.proc.kill()
        assert _wait(sup.failed.is_set, 10), said
    finally:
        sup.stop()
        server.stop()
    assert said[-1].endswith("2 restarts in the last 60 s, giving up"), said


def test_a_child_spawned_for_a_thread_outlives_that_thread():
    """PR_SET_PDEATHSIG follows the forking thread: `spawn()` forks on a thread that lives as long as the
    process, so a server restarted by the supervisor's thread survives the end of that thread."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(p=procs.spawn(["sleep", "30"],
                                                                  preexec_fn=procs.die_with_parent())))
    t.start()
    t.join()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            box["p"].wait(1.0)
    finally:
        box["p"].kill()
        box["p"].wait(10)


def test_a_child_popened_by_a_thread_dies_with_that_thread():
    """Why `spawn()` exists: the same Popen straight from a short-lived thread gets SIGTERM when it ends."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(p=subprocess.Popen(["sleep", "30"],
                                                                       preexec_fn=procs.die_with_parent())))
    t.start()
    t.join()
    try:
        assert box["p"].wait(10) == -signal.SIGTERM
    finally:
        if box["p"].poll() is None:
            box["p"].kill()
            box["p"].wait(10)


def test_a_child_spawned_for_a_thread_dies_with_the_launcher_process():
    script = ("import threading, time\nfrom triton_vlm.server import procs\n"
              "t = threading.Thread(target=lambda: print(procs.spawn(['sleep', '60'], "
              "preexec_fn=procs.die_with_parent()).pid, flush=True))\nt.start(); t.join(); time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        assert procs.read_proc(child) is not None
        launcher.kill()
        launcher.wait(10)
        assert _wait(lambda: procs.read_proc(child) is None, 10), "the child outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


# --- GPU settings ---------------------------------------------------------------------------------------------
def _llava_7b_config(d: Path, **top) -> Path:
    """llava-1.5-7b-hf's config.json, abridged as it ships (a sparse text_config: hidden_size is Llama's
    default 4096)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
           "text_config": {"model_type": "llama", "torch_dtype": "float16", "vocab_size": 32064,
                           "max_position_embeddings": 4096, "rms_norm_eps": 1e-05},
           "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14,
                             "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                             "num_hidden_layers": 24, "projection_dim": 768, "vocab_size": 32000},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "torch_dtype": "float16",
           **top}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_llm_dtype_defaults_to_the_checkpoint_dtype_on_cuda_only(tmp_path):
    ckpt = _llava_7b_config(tmp_path / "ckpt")
    assert gpu.default_llm_dtype(ckpt, {"*": {"device": "cuda"}})["llm"]["dtype"] == "float16"
    assert gpu.default_llm_dtype(ckpt, {"llm": {"device": "cuda:1"}})["llm"]["dtype"] == "float16"
    assert "llm" not in gpu.default_llm_dtype(ckpt, {"*": {"device": "cpu"}})  # CPU: float32 stays
    assert "llm" not in gpu.default_llm_dtype(ckpt, {})
    given = {"*": {"device": "cuda", "dtype": "float32"}}
    assert gpu.default_llm_dtype(ckpt, given) == given  # an explicit dtype wins
    bf16 = _llava_7b_config(tmp_path / "bf16", text_config={"model_type": "llama", "torch_dtype": "bfloat16"})
    assert gpu.default_llm_dtype(bf16, {"*": {"device": "cuda"}})["llm"]["dtype"] == "bfloat16"


def test_cuda_pool_is_sized_for_a_batch_of_image_embeds(tmp_path):
    ckpt = _llava_7b_config(tmp_path / "ckpt")
    params = gpu.default_llm_dtype(ckpt, {"*": {"device": "cuda", "model_path": str(ckpt)}})
    repo = prepare_model_repository(tmp_path / "repo", params)
    # vision max_batch_size 64 x preprocess max_images 8 x (336/14)^2 + 1 tokens x hidden 4096 x 2 bytes (fp16)
    assert gpu.embeds_pool_bytes(repo, ckpt, "float16") == 64 * 8 * 577 * 4096 * 2
    small = prepare_model_repository(tmp_path / "small", {**params, "preprocess": {"max_images": "1"}})
    assert gpu.embeds_pool_bytes(small, ckpt, "float16") == 302514176  # 64 x 1 image: 288.5 MiB
    tiny = prepare_model_repository(tmp_path / "tiny", {**params, "preprocess": {"max_images": "0"}})
    assert gpu.embeds_pool_bytes(tiny, ckpt, "float16") == gpu.POOL_FLOOR
    assert gpu.embeds_pool_bytes(repo, ckpt, "float32") == gpu.POOL_CAP


def test_server_command_line_has_the_cuda_pool_only_on_a_gpu(tmp_path):
    ckpt = _llava_7b_config(tmp_path / "ckpt")
    tree = tmp_path / "tree"

    def command(params, pool_mb=None):
        server = TritonServer(str(ckpt), params=params, cuda_pool_mb=pool_mb, shm_prefix="x_")
        p = server.model_params()
        repo = prepare_model_repository(tmp_path / "repo", p)
        return server.command(tree / "bin" / "tritonserver", tree, repo, p), repo

    cmd, repo = command({"*": {"device": "cuda"}})
    assert f"--cuda-memory-pool-byte-size=0:{64 * 8 * 577 * 4096 * 2}" in cmd
    assert 'name: "image_embeds"\n    data_type: TYPE_FP16' in (repo / "llm" / "config.pbtxt").read_text()
    cmd, _ = command({"llm": {"device": "cuda:1"}, "vision": {"device": "cuda:0"}}, pool_mb=512)
    assert [a for a in cmd if "cuda-memory-pool" in a] == [f"--cuda-memory-pool-byte-size={g}:{512 << 20}"
                                                            for g in (0, 1)]
    cmd, repo = command({"*": {"device": "cpu"}})
    assert not [a for a in cmd if "cuda-memory-pool" in a]
    assert 'name: "image_embeds"\n    data_type: TYPE_FP32' in (repo / "llm" / "config.pbtxt").read_text()


# --- diagnosis of a failed start -------------------------------------------------------------------------------
LOG = r'''I1123 12:34:23.121936 6546 pb_stub.cc:366] "Failed to initialize Python stub: AssertionError: x"
E1123 12:34:15.626057 6546 server.cc:241] "CudaDriverHelper has not been initialized."
E1123 12:34:24.821003 6546 model_lifecycle.cc:642] "failed to load 'llm' version 1: Internal: AssertionError: Torch not compiled with CUDA enabled\n\nAt:\n  /venv/torch/cuda/__init__.py(522): _lazy_init\n  /src/triton_vlm/engine/model/weights.py(62): take\n"
I1123 12:34:24.821037 6546 model_lifecycle.cc:777] "failed to load 'llm'"
E1123 12:34:24.885942 6546 model_repository_manager.cc:703] "Invalid argument: ensemble 'ensemble' depends on 'llm' which has no loaded version."
error: creating server: Internal - failed to load all models
'''


def test_the_failing_models_error_is_found_in_the_log():
    assert diagnose.failure_cause(LOG) == (
        "model 'llm' failed to load: AssertionError: Torch not compiled with CUDA enabled\n"
        "  at /venv/torch/cuda/__init__.py(522): _lazy_init\n"
        "  at /src/triton_vlm/engine/model/weights.py(62): take")


def test_without_a_model_failure_the_notable_error_lines_are_shown():
    log = LOG.replace("failed to load 'llm' version 1", "x") + \
        'E1123 12:34:25.0 6546 grpc_server.cc:2463] "Failed to listen on: 0.0.0.0:8001"\n'
    cause = diagnose.failure_cause(log)
    assert cause is not None and cause.endswith("Failed to listen on: 0.0.0.0:8001"), cause
    assert "CudaDriverHelper" not in cause and "depends on" not in cause
    assert diagnose.failure_cause("I1123 all fine\n") is None


# --- run folders -----------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_run_folders_of_dead_launchers_are_pruned_to_the_newest_few(tmp_path):
    dead = _dead_pid()
    folders = []
    for i in range(8):
        d = tmp_path / f"{rundir.PREFIX}{i}"
        d.mkdir()
        (d / rundir.PID_FILE).write_text(f"{dead}\n")
        os.utime(d, (1000 + i, 1000 + i))
        folders.append(d)
    alive = tmp_path / f"{rundir.PREFIX}alive"
    alive.mkdir()
    (alive / rundir.PID_FILE).write_text(f"{os.getpid()}\n")
    os.utime(alive, (1, 1))  # the oldest, but its launcher runs
    legacy_young = tmp_path / f"{rundir.PREFIX}legacy"  # no pid file, just made: maybe a launcher starting
    legacy_young.mkdir()
    legacy_old = tmp_path / f"{rundir.PREFIX}legacy-old"
    legacy_old.mkdir()
    os.utime(legacy_old, (2, 2))
    new = rundir.create(tmp_path)
    assert (new / rundir.PID_FILE).read_text() == f"{os.getpid()}\n"
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = sorted([d.name for d in folders[-rundir.KEEP:]] + [alive.name, legacy_young.name, new.name])
    assert left == kept, left
    rundir.remove(new)
    assert not new.exists()


# --- the printed client command --------------------------------------------------------------------------------
def test_the_try_command_passes_a_real_newline_and_an_existing_image(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path))
    cmd = try_command("localhost:8001")
    # run it through bash with the client replaced by a printer of its arguments
    client = cmd.split(" ", 1)[0]
    probe = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    out = subprocess.run(["bash", "-c", probe + cmd[len(client):]], capture_output=True, text=True, check=True)
    argv = json.loads(out.stdout)
    assert argv[:3] == ["--url", "localhost:8001", EXAMPLE_PROMPT] and "\n" in argv[2], argv
    assert argv[3] == "--image" and Path(argv[4]).is_file() and Path(argv[4]).read_bytes()[:4] == b"\x89PNG"


# --- the session's leftover check ------------------------------------------------------------------------------
def test_leftover_check_counts_only_processes_of_this_session():
    """Servers of other sessions on this machine (other users of it, other test runs) are not ours."""
    import conftest

    fake = ["bash", "-c", "exec -a /opt/x/bin/tritonserver sleep 30"]
    other = subprocess.Popen(fake, env={k: v for k, v in os.environ.items() if k != conftest.SESSION_MARK})
    mine = subprocess.Popen(fake)
    try:
        def named(pid: int) -> bool:  # exec'd as "tritonserver" (argv is empty for a moment during exec)
            p = procs.read_proc(pid)
            return p is not None and bool(p.argv) and p.argv[0].endswith("tritonserver")

        assert _wait(lambda: named(other.pid) and named(mine.pid), 10), (procs.read_proc(other.pid),
                                                                        procs.read_proc(mine.pid))
        assert conftest._ours(procs.read_proc(mine.pid)), os.environ[conftest.SESSION_MARK]
        assert not conftest._ours(procs.read_proc(other.pid))
    finally:
        for p in (other, mine):
            p.kill()
            p.wait(10)


def test_supervisor_restarts_a_server_whose_stub_died_before_it_looked():
    """A stub killed between the server's readiness and the supervisor's first look was never in `watched`: its
    death went unseen and its requests hung until the server was stopped. `missing()` (the stubs the repository's
    models should have) catches it at that first look."""
    server = FakeServer()
    server.loads_every_time = True
    server.missing_stubs = ["the python stub of model llm"]
    server.start()
    said: list[str] = []
    sup = Supervisor(server, say=said.append, interval=0.02).start()
    try:
        assert _wait(lambda: server.starts == 2 and any("serving again" in m for m in said), 10), said
    finally:
        sup.stop()
        server.stop()
    assert said[0] == "triton-vlm: the python stub of model llm died; restarting fake-server (restart 1)", said
    assert server.starts == 2, said  # the new start has every stub: no further restart


def test_python_instances_counts_the_stubs_of_the_repository(tmp_path):
    from triton_vlm.server.process import python_instances

    for name, text in {"a": 'backend: "python"\ninstance_group [ { count: 2, kind: KIND_CPU } ]\n',
                       "b": 'backend: "python"\n', "c": 'platform: "ensemble"\n',
                       "d": 'backend: "python"\ninstance_group [\n  { count: 1, kind: KIND_CPU },\n'
                            '  { count: 3, kind: KIND_CPU }\n]\n'}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(text)
    assert python_instances(tmp_path) == {"a": 2, "b": 1, "d": 4}


def test_children_are_the_live_children_and_nothing_else():
    """`procs.children` (the supervisor's scan, every 0.5 s): exactly this process's live children, a grandchild and
    a reaped child left out."""
    import subprocess
    import sys

    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    grand = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '30']); "
                              "time.sleep(30)"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        assert _wait(lambda: len(procs.children(grand.pid)) == 1, 10)
        found = {p.pid: p for p in procs.children(os.getpid())}
        assert {k.pid for k in kids} | {grand.pid} <= set(found) and gone.pid not in found
        assert all(p.ppid == os.getpid() for p in found.values())
        assert found[kids[0].pid].argv == ("sleep", "30")
    finally:
        for p in procs.children(grand.pid):
            os.kill(p.pid, 9)
        for k in (*kids, grand):
            k.kill()
            k.wait()
