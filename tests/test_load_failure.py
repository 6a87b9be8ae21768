"""A model whose `initialize` fails never keeps the server loading forever (`lifeline.loading`), through tritonserver.

The python backend waits, without a timeout, for the stub of a failed `initialize` to exit, and the stub's
interpreter joins every non-daemon thread on its way out. The model here starts one that never ends, then fails,
as a load that dies after its thread pool started would: without `lifeline.loading` this server never becomes
ready and never exits (it hung the suite under load); with it, the stub is ended within the grace and the server
reports the failed load, naming the model and the error.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from triton_vlm.server import procs
from triton_vlm.server.process import TritonServer, free_port

pytestmark = pytest.mark.server

GRACE_S = 2.0

CONFIG = """name: "stuck"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "model_path" value: { string_value: "" } }
"""

MODEL = f'''import threading

from triton_vlm.triton import lifeline


class TritonPythonModel:
    def initialize(self, args):
        with lifeline.loading("stuck", grace={GRACE_S}):
            threading.Thread(target=threading.Event().wait, name="never-ends").start()  # non-daemon, never ends
            raise RuntimeError("the load failed after a thread started")

    def execute(self, requests):
        return []
'''


def _server(tmp_path: Path, model: str, **kw) -> TritonServer:
    """A tritonserver (not started) serving one python model `stuck` whose model.py is `model`."""
    repo = tmp_path / "repo"
    (repo / "stuck" / "1").mkdir(parents=True)
    (repo / "stuck" / "config.pbtxt").write_text(CONFIG)
    (repo / "stuck" / "1" / "model.py").write_text(model)
    return TritonServer(model_path=str(tmp_path), model_repository=repo, models=("stuck",), http_port=free_port(),
                        grpc_port=free_port(), metrics_port=free_port(), log_file=tmp_path / "server.log",
                        run_dir=tmp_path / "run", **kw)


def test_failed_load_with_a_live_thread_ends_the_server(tmp_path: Path):
    server = _server(tmp_path, MODEL, exit_timeout=5)
    log = server.log_file
    t0 = time.monotonic()
    server.start()
    try:
        with pytest.raises(RuntimeError, match="exited with code") as failed:
            server.wait_ready(60)  # before the fix: "not ready after 60 s" (TimeoutError), the stub alive
        took = time.monotonic() - t0
        assert "the load failed after a thread started" in str(failed.value)
        assert took < 40, f"the failed load took {took:.0f} s to end the server"
        text = log.read_text(errors="replace")
        assert "triton_vlm: stuck failed to load (RuntimeError" in text  # our line, with the traceback
        assert "Traceback (most recent call last)" in text
        assert "never-ends" in text or "threading.py" in text  # the watchdog's dump names the thread that held it
        assert not procs.stubs_of(server.proc.pid), "the stub outlived its server"
    finally:
        server.stop()
        server.close()


HUNG = '''import threading

from triton_vlm.triton import lifeline

lifeline.exit_with_parent()


class TritonPythonModel:
    def initialize(self, args):
        threading.Event().wait()  # a load that never returns

    def execute(self, requests):
        return []
'''


def test_a_load_that_never_returns_leaves_every_stubs_stack_in_the_log(tmp_path: Path):
    """A server not ready in time asks its stubs for their stacks before the launcher gives up on it
    (`TritonServer.dump_stub_stacks`, faulthandler on SIGUSR1 in every stub): the log says where the load hangs."""
    server = _server(tmp_path, HUNG, exit_timeout=3)
    log = server.log_file
    server.start()
    try:
        with pytest.raises(TimeoutError, match=r"stacks of its stubs \(stuck\) are in its log"):
            server.wait_ready(5)
        text = log.read_text(errors="replace")
        assert "Thread 0x" in text and "model.py\", line 10 in initialize" in text, text[-3000:]
    finally:
        server.stop(5)
        server.close()


FROZEN = '''import json
import os
import subprocess
import time
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        first = Path(params["model_path"]["string_value"]) / "frozen-once"  # the test's folder: kept by a restart
        if not first.exists():  # the first load only: the whole stub frozen for 2.5 s, as a starved CPU can hold
            first.write_text("")  # its health thread; Triton's 1 s check fails and it gives up on the stub
            subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 2.5; kill -CONT {os.getpid()}"])
            time.sleep(4)

    def execute(self, requests):
        return []
'''


def test_a_load_triton_gave_up_on_is_ended_and_started_again(tmp_path: Path):
    """Triton 2.51 declares a loading stub that missed one 1 s health check unhealthy and then waits for that live
    stub to exit, forever (the suite's servers hung so under load). The launcher sees tritonserver blocked in
    wait4() on a live stub and ends it (`TritonServer.end_wedged_loads`); `wait_ready` starts the server again,
    and this model loads the second time."""
    server = _server(tmp_path, FROZEN, exit_timeout=3, wedged_load_s=3.0)
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(60)  # without the check: "not ready after 60 s", the stub alive and waited on forever
        assert time.monotonic() - t0 < 40 and server.wedged_starts == 1
        text = server.log_file.read_text(errors="replace")
        assert "Stub process 'stuck_0_0' is not healthy" in text and text.count("loading: stuck:1") == 2
    finally:
        server.stop(5)
        server.close()
