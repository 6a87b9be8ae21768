"""`OpenAIFrontend`: the OpenAI-compatible front end (`python -m triton_vlm.openai`) as a process beside
tritonserver, supervised like it (a `supervisor.Supervised` child).

It talks to the server over gRPC, so it starts once the server is ready and survives the server's restarts: its
`/health` answers 503 while Triton is down and 200 again once it is back. For the supervisor, the front end is
serving when its HTTP port answers `/health` at all (200 or 503); only the death of its process restarts it.
It gets SIGTERM when the launcher dies, even by SIGKILL (`procs.die_with_parent`), like the server.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import cpu_layout, procs
from .auth import LOOPBACK, bearer, connect_host


@dataclass
class OpenAIFrontend:
    grpc_url: str  # Triton's gRPC endpoint, host:port
    metrics_url: str  # Triton's metrics, re-exported on the front end's /metrics
    model_dir: str
    port: int = 9000
    host: str = LOOPBACK  # a non-loopback address needs api_key or insecure (`auth.exposure_error`)
    insecure: bool = False  # passed on as --insecure: listen on a non-loopback `host` without an API key
    lora_dir: str | None = None
    extra_args: tuple[str, ...] = ()  # e.g. ("--served-model-name", NAME)
    api_key: str | None = None  # passed as TRITON_VLM_API_KEY: a command line is readable by every local user
    log_file: Path | None = None
    exit_timeout: int = 10
    proc: subprocess.Popen | None = None
    name: str = "the OpenAI front end"
    cpu_layout: object = None  # `cpu_layout.CpuLayout`: the front end runs on its `rest` CPUs (None: every CPU)
    _log_offset: int = 0

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "triton_vlm.openai", "--triton", self.grpc_url, "--model-dir", self.model_dir,
               "--host", self.host, "--port", str(self.port), "--triton-metrics-url", self.metrics_url]
        if self.lora_dir:
            cmd += ["--lora-dir", self.lora_dir]
        if self.insecure:
            cmd.append("--insecure")
        return cmd + list(self.extra_args)

    def start(self) -> "OpenAIFrontend":
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115
        try:
            self._log_offset = out.tell() if out is not None else 0
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
            env.pop("TRITON_VLM_API_KEY", None)
            if self.api_key:
                env["TRITON_VLM_API_KEY"] = self.api_key
            self.proc = procs.spawn(self.command(), env=env,
                                    stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                    preexec_fn=cpu_layout.preexec(self.cpu_layout, procs.die_with_parent()))
        finally:
            if out is not None:
                out.close()
        return self

    def health(self) -> int | None:
        """The HTTP status of GET /health (200: Triton ready too; 503: Triton not ready), None: no answer. With an
        API key, /health needs it too."""
        headers = {"Authorization": bearer(self.api_key)} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.url}/health", headers=headers),
                                        timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def is_ready(self) -> bool:
        return self.health() in (200, 503)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Return once /health answers 200; RuntimeError (it exited) or TimeoutError with its log's end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}{self._log_tail()}")
            if self.health() == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s{self._log_tail()}")

    def watched(self) -> dict[int, str]:
        return {}

    def failure_cause(self) -> str | None:
        tail = self._log_tail()
        return tail.strip() or None

    def _log_tail(self, n: int = 2000) -> str:
        if self.log_file is None or not Path(self.log_file).exists():
            return ""
        with open(self.log_file, "rb") as f:
            f.seek(self._log_offset)
            text = f.read().decode(errors="replace")
        return "\n" + text[-n:] if text else ""

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL to its group after `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout or self.exit_timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        return self.proc.returncode
