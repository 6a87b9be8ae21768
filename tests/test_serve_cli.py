"""`python -m triton_vlm.serve` (what `make serve` runs): starts, answers its own demo request, stops on SIGINT."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from triton_vlm.serve import free_port

pytestmark = pytest.mark.server


def test_serve_answers_and_stops_cleanly(demo_model, tmp_path):
    env = dict(os.environ, HTTP_PORT=str(free_port()), GRPC_PORT=str(free_port()), METRICS_PORT=str(free_port()),
               TRITON_VLM_LOG=str(tmp_path / "server.log"))
    env.pop("MODEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "triton_vlm.serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip().startswith("try:"):
                break
        out = "".join(lines)
        assert "request 'USER: <image>\\nDescribe the image. ASSISTANT:' + a blue triangle -> ' a blue triangle'" \
            in out, out
        assert f"http://localhost:{env['HTTP_PORT']}" in out and f"localhost:{env['GRPC_PORT']}" in out
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert "successfully unloaded 'llm'" in (tmp_path / "server.log").read_text()
