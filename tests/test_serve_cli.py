"""`python -m triton_vlm.server` (what `make serve` runs): starts, answers its own demo request, stops on SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from triton_vlm.server.process import free_port

from listen_support import bound_addresses, connects, outside_address

pytestmark = pytest.mark.server


def _launch(tmp_path, launched: set[int], *args: str, log: bool = True) -> tuple[dict, subprocess.Popen]:
    """`python -m triton_vlm.server` (what `make serve` runs) on free ports, its output piped, its run folder
    in `tmp_path/tmp` (TMPDIR)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, HTTP_PORT=str(free_port()), GRPC_PORT=str(free_port()), METRICS_PORT=str(free_port()),
               OPENAI_PORT=str(free_port()), TMPDIR=str(tmp_path / "tmp"))
    if log:
        env["TRITON_VLM_LOG"] = str(tmp_path / "server.log")
    else:
        env.pop("TRITON_VLM_LOG", None)
    env.pop("MODEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "triton_vlm.server", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    launched.add(proc.pid)  # its servers' shared memory is named after it: the session checks it is removed
    return env, proc


def test_serve_answers_and_stops_cleanly(demo_model, tmp_path, launched):
    env, proc = _launch(tmp_path, launched)
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
        # no key: every port on loopback only, and the banner says how to listen on every interface
        assert "listen  127.0.0.1 only (this machine); to listen on every interface: --host 0.0.0.0 with an API " \
            "key" in out and "--insecure" in out, out
        ports = [int(env[f"{n}_PORT"]) for n in ("HTTP", "GRPC", "METRICS", "OPENAI")]
        assert {p: bound_addresses(p) for p in ports} == dict.fromkeys(ports, {"127.0.0.1"})
        outside = outside_address()
        if outside is not None:  # a client on the network is refused on every port
            assert not [p for p in ports if connects(outside, p)], (outside, ports)
        # the printed command works as printed (bash, the venv's client, an image that exists)
        hint = lines[-1].split("try:", 1)[1].strip()
        answer = subprocess.run(["bash", "-c", hint], capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and answer.stdout.strip() == "blue", (hint, answer)
        # the OpenAI API beside it, and its printed curl command (a chat with the image as a data: URL)
        assert f"OpenAI  http://localhost:{env['OPENAI_PORT']}/v1" in out, out
        curl = proc.stdout.readline().strip()
        assert curl.startswith(f"curl -s localhost:{env['OPENAI_PORT']}/v1/chat/completions"), curl
        reply = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert reply.returncode == 0, reply
        assert json.loads(reply.stdout)["choices"][0]["message"]["content"].strip() == "blue", reply.stdout
        [run_dir] = (tmp_path / "tmp").glob("triton-vlm-run-*")
        assert (run_dir / "launcher.pid").read_text().strip() == str(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        # every stub's finalize and exit well inside tritonserver's exit timeout: the interpreters' final
        # collections over torch's heap used to take 8-10 s per stub (`lifeline.settle_heap`)
        assert time.monotonic() - t0 < 8, f"a clean stop took {time.monotonic() - t0:.1f} s"
        assert not run_dir.exists(), "a clean stop leaves its run folder"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    log = (tmp_path / "server.log").read_text()
    assert "successfully unloaded 'llm'" in log and "Exit timeout expired" not in log, log[-3000:]


@pytest.mark.parametrize("setting,message", [
    ("vision.vision_backnd=onnxruntime", "model 'vision' declares no parameter 'vision_backnd'. Parameters: llm:"),
    ("visio.vision_backend=onnxruntime", "there is no model 'visio'; models: ensemble, llm, preprocess, tensorrt_llm, vision"),
    ("no_such_key=1", "any model declares no parameter 'no_such_key'"),
])
def test_launcher_refuses_a_setting_no_model_declares(setting, message, tmp_path):
    """A typo in --set used to start the server silently with the default; now nothing starts, and it is refused
    first: in an empty cache the demo model (minutes to build) is not built before the typo is named."""
    env = dict(os.environ, TRITON_VLM_CACHE=str(tmp_path / "empty-cache"))
    proc = subprocess.run([sys.executable, "-m", "triton_vlm.server", "--set", setting], capture_output=True,
                          text=True, timeout=60, env=env)
    assert not (tmp_path / "empty-cache").exists() or not list((tmp_path / "empty-cache").iterdir())
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "vision_backend" in proc.stderr or "models:" in proc.stderr  # the keys that exist are listed


@pytest.mark.parametrize("module", ["triton_vlm.server", "triton_vlm.openai"])
def test_every_interface_without_a_key_is_refused_at_start(module, tmp_path):
    """--host 0.0.0.0 with no API key stops before anything starts, saying why and what to pass; --insecure
    (an explicit choice) or a key lets it through to the next check."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_VLM_API_KEY", "TRITON_VLM_HOST")}
    proc = subprocess.run([sys.executable, "-m", module, "--host", "0.0.0.0"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc
    assert "--host 0.0.0.0 would let anyone who reaches this machine use every model" in proc.stderr, proc.stderr
    assert "give one (--api-key KEY or $TRITON_VLM_API_KEY), or pass --insecure" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written
    if module == "triton_vlm.server":  # $TRITON_VLM_HOST names the host too; --insecure passes the check
        proc = subprocess.run([sys.executable, "-m", module, "--insecure", "--model", str(tmp_path / "none")],
                              env={**env, "TRITON_VLM_HOST": "0.0.0.0"}, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "is not a Hugging Face checkpoint directory" in proc.stderr, proc.stderr


def test_a_failed_start_names_the_failing_models_error(demo_model, tmp_path, launched):
    """Not the end of Triton's log (its shutdown), but the model that failed and why; the run folder and its
    log stay."""
    _, proc = _launch(tmp_path, launched, "--set", "llm.backend=nonsense", log=False)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 1, out
    assert ("tritonserver exited with code 1 before becoming ready\nmodel 'llm' failed to load: ValueError: llm "
            "parameter backend must be 'engine' or 'hf', got 'nonsense'\n  at ") in out, out
    assert "Found 0 live models" not in out, "the log's shutdown end was printed"
    [run_dir] = (tmp_path / "tmp").glob("triton-vlm-run-*")
    assert f"log: {run_dir / 'tritonserver.log'}" in out and "failed to load 'llm'" in \
        (run_dir / "tritonserver.log").read_text()
