"""`TritonServer`: one tritonserver process on a filled copy of the model repository.

It starts in its own process group (stop() ends its python stubs with it) and gets SIGTERM when the launcher
dies, even by SIGKILL (`procs.die_with_parent`); readiness means the server and every model report ready; a
stop leaves no process of its group and no shared-memory region behind. Also a context manager, used by the
tests and the benchmarks.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import REPO_ROOT
from . import cpu_layout, diagnose, front_half, gpu, procs, rundir
from .auth import ADMIN_HEADER, LOOPBACK, connect_host, restricted_args
from .install import prepare_server_tree, server_env
from .repository import DEFAULT_MODEL_REPOSITORY, prepare_model_repository

__all__ = ["ADMIN_HEADER", "TritonServer", "free_port", "python_instances"]


def python_instances(repo: Path) -> dict[str, int]:
    """model -> stub count of each python-backend model of a filled repository (its instance_group counts; one
    instance when none is given)."""
    out = {}
    for config in repo.glob("*/config.pbtxt"):
        text = config.read_text()
        if not re.search(r'^\s*backend:\s*"python"', text, re.M):
            continue
        groups = re.search(r"^\s*instance_group\s*\[(.*?)\]", text, re.M | re.S)
        counts = [int(c) for c in re.findall(r"count:\s*(\d+)", groups.group(1))] if groups else []
        out[config.parent.name] = sum(counts) if counts else 1
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a stub tritonserver waits on (wait4) this long while the server loads is wedged: `TritonServer.end_wedged_loads`
WEDGED_LOAD_S = 15.0


@dataclass
class TritonServer:
    """A tritonserver process on a filled copy of the model repository (a `supervisor.Supervised` child)."""

    model_path: str
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    params: dict[str, dict[str, str]] = field(default_factory=dict)
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    models: tuple[str, ...] | None = None
    renames: dict[str, str] = field(default_factory=dict)  # model -> served name (`repository.rename_model`)
    run_dir: Path | None = None  # None: a new `rundir` folder, removed by close()
    log_file: Path | None = None
    log_verbose: int = 0
    exit_timeout: int = 15
    tritonserver: str | None = None  # a system tritonserver binary (e.g. /opt/tritonserver/bin/tritonserver)
    cuda_pool_mb: int | None = None  # Triton's CUDA memory pool per GPU in use (None: sized by `gpu.pool_args`)
    proc: subprocess.Popen | None = None
    # the python backend's shared-memory regions are /dev/shm/<shm_prefix>*: unique per server, removed by stop()
    shm_prefix: str = ""
    admin_key: str = field(default_factory=lambda: os.environ.get("TRITON_VLM_ADMIN_KEY") or secrets.token_hex(16))
    # every API but health (inference, metadata, model config, statistics) needs `authorization: Bearer KEY`
    # (over gRPC the metadata `triton-grpc-protocol-authorization`); None: they stay open (`auth.py`)
    api_key: str | None = None
    name: str = "tritonserver"
    cpu_layout: "cpu_layout.CpuLayout | None" = None  # set by start(): the CPUs of the llm stub and of the rest
    front_half: "front_half.FrontHalf | None" = None  # set by start(): preprocess / vision instances, decode threads
    host: str = LOOPBACK  # the address HTTP, gRPC and metrics listen on (`auth.exposure_error` says when not)
    _own_run_dir: bool = field(default=False, repr=False)
    _log_offset: int = field(default=0, repr=False)  # where the log of the last start begins
    wedged_load_s: float = WEDGED_LOAD_S
    wedged: list[str] = field(default_factory=list)  # models whose wedged loads were ended (`end_wedged_loads`)
    wedged_starts: int = 0  # starts of this server (all, restarts included) that wedged while loading
    _waited: dict[int, float] = field(default_factory=dict, repr=False)  # stub pid -> since when it is waited on
    _wedge_checked: float = field(default=0.0, repr=False)

    @property
    def http_url(self) -> str:
        return f"{connect_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.metrics_port}/metrics"

    def model_params(self) -> dict[str, dict[str, str]]:
        """The parameters the models get: ours, the checkpoint path, the GPU defaults (`gpu.default_llm_dtype`)."""
        params = {k: dict(v) for k, v in self.params.items()}
        params.setdefault("*", {}).setdefault("model_path", str(self.model_path))
        return gpu.default_llm_dtype(self.model_path, params)

    def command(self, binary: Path, tree: Path, repo: Path, params: dict[str, dict[str, str]]) -> list[str]:
        """tritonserver's command line for the filled repository `repo`."""
        return [
            str(binary),
            f"--model-repository={repo}",
            f"--backend-directory={tree / 'backends'}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
            "--allow-cpu-metrics=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *gpu.pool_args(repo, self.model_path, params, self.cuda_pool_mb),
            # Triton's admin APIs (load/unload models, register shared memory, change log files or tracing) only
            # for clients that send the header `triton-vlm-admin-key: $TRITON_VLM_ADMIN_KEY` (random if unset);
            # with an API key, every other API but health only with `authorization: Bearer KEY` (`auth.py`).
            # Triton 2.51 reads these only from its command line, where local users can read them
            # (docs/security.md): the launcher, the front end and the clients get the keys from the environment.
            *restricted_args(self.admin_key, self.api_key),
        ]

    def start(self) -> "TritonServer":
        if self.tritonserver:  # e.g. NVIDIA's tritonserver container: its own binary, backends and stub
            binary = Path(self.tritonserver)
            tree = binary.parent.parent
            env = dict(os.environ, TRITON_VLM_REPO_ROOT=str(REPO_ROOT))
        else:
            tree = prepare_server_tree()
            binary = tree / "bin" / "tritonserver"
            env = server_env(tree)
        if self.run_dir is None:
            self.run_dir, self._own_run_dir = rundir.create(), True
        self.run_dir = Path(self.run_dir)
        params = self.model_params()
        device = params.get("llm", {}).get("device") or params.get("*", {}).get("device") or "cpu"
        threads = int(env.get("OMP_NUM_THREADS") or 1)
        # preprocess / vision instances and decode threads from the machine (`front_half.py`; ValueError: a bad
        # override, refused before anything starts)
        self.front_half = front_half.resolve(params, threads if device.startswith("cpu") else 0)
        repo = prepare_model_repository(self.run_dir / "model_repository", params, self.model_repository, self.models,
                                        self.renames, front=self.front_half)
        procs.remove_stale_shm()
        self.wedged, self._waited = [], {}
        self.shm_prefix = self.shm_prefix or f"triton_vlm_{os.getpid()}_{self.http_port}_"
        cmd = self.command(binary, tree, repo, params)
        self.cpu_layout = cpu_layout.plan(env.get(cpu_layout.MODE_ENV), device, threads)
        if self.cpu_layout is not None:  # vLLM's CPU layout: the llm stub on its own cores (`cpu_layout.py`)
            env = dict(env, **{cpu_layout.LLM_CPUS_ENV: ",".join(map(str, self.cpu_layout.llm))})
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115
        try:  # its own process group (stop() ends stubs with it); SIGTERM when the launcher dies, even by SIGKILL
            self._log_offset = out.tell() if out is not None else 0
            self.proc = procs.spawn(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True,
                                    preexec_fn=cpu_layout.preexec(self.cpu_layout, procs.die_with_parent()))
        finally:
            if out is not None:
                out.close()
        return self

    def is_ready(self) -> bool:
        """The server and every model of the repository report ready (the health endpoint alone can answer
        200 while python models are still loading). While not, a load Triton has given up on but waits for
        forever is ended (`end_wedged_loads`)."""
        urls = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in self._model_names()]
        try:
            for u in urls:
                with urllib.request.urlopen(f"http://{self.http_url}{u}", timeout=2) as r:
                    if r.status != 200:
                        self.end_wedged_loads()
                        return False
            return True
        except OSError:
            self.end_wedged_loads()
            return False

    def end_wedged_loads(self) -> list[str]:
        """Triton 2.51's python backend checks a loading stub's health flag every second; a stub whose health
        thread missed one check (a starved CPU) is declared unhealthy, and the backend then waits for that live
        stub to exit, forever (`StubLauncher::Launch`: waitpid, no timeout, the stub never told): the server
        never becomes ready. A stub tritonserver has waited on for `wedged_load_s` (a stub whose load failed
        exits within `lifeline.LOAD_FAILURE_GRACE_S`) is killed: its model's load fails with Triton's own error
        ("Stub process '...' is not healthy"), the server exits, and the supervisor starts it again. -> the
        models whose stubs were killed (also kept in `wedged`)."""
        now = time.monotonic()
        if self.proc is None or self.proc.poll() is not None or now - self._wedge_checked < 1.0:
            return []
        self._wedge_checked = now
        stubs = procs.stubs_of(self.proc.pid)
        waited = procs.waited_on(self.proc.pid) & stubs.keys()
        self._waited = {pid: self._waited.get(pid, now) for pid in waited}
        killed = []
        for pid, since in list(self._waited.items()):
            if now - since >= self.wedged_load_s:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                killed.append(stubs[pid])
                del self._waited[pid]
        if killed and not self.wedged:
            self.wedged_starts += 1
        self.wedged += killed
        return killed

    def _model_names(self) -> list[str]:
        repo = (self.run_dir or Path()) / "model_repository"
        return sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))

    def watched(self) -> dict[int, str]:
        """The python stubs (pid -> which) that must stay alive while the server serves."""
        if self.proc is None:
            return {}
        return {pid: f"the python stub of model {model}" for pid, model in procs.stubs_of(self.proc.pid).items()}

    def missing(self) -> list[str]:
        """The python stubs the filled repository's models should have running (their instance counts) and that
        are not running: a stub that died before anyone learnt its pid."""
        if self.proc is None or self.run_dir is None:
            return []
        live = Counter(procs.stubs_of(self.proc.pid).values())
        return [f"the python stub of model {model}" for model, n in
                sorted(python_instances(Path(self.run_dir) / "model_repository").items()) if live[model] < n]

    def failure_cause(self) -> str | None:
        """Why the last start failed, from its log: the models' load errors (see `diagnose`)."""
        return diagnose.failure_cause(diagnose.read_log(self.log_file, self._log_offset))

    def wait_ready(self, timeout: float = 300.0, abort: threading.Event | None = None,
                   wedge_restarts: int = 1) -> None:
        """Return once ready; RuntimeError (it exited) or TimeoutError naming the cause found in the log. A start
        whose load Triton gave up on (`end_wedged_loads`) is started again, `wedge_restarts` times."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (abort is not None and abort.is_set()):
            if self.proc is not None and self.proc.poll() is not None:
                if self.wedged and wedge_restarts > 0:
                    wedge_restarts -= 1
                    self.stop()
                    self.start()
                    continue
                raise RuntimeError(self._failure(f"tritonserver exited with code {self.proc.returncode} before "
                                                 "becoming ready"))
            if self.is_ready():
                return
            time.sleep(0.25)
        if abort is None or not abort.is_set():
            stuck = self.dump_stub_stacks()
            raise TimeoutError(self._failure(f"tritonserver not ready after {timeout:.0f} s" + (
                f"; the stacks of its stubs ({', '.join(stuck)}) are in its log" if stuck else "")))

    def dump_stub_stacks(self, settle: float = 1.0) -> list[str]:
        """Ask every python stub of this server for its threads' stacks (`procs.STACKS_SIGNAL`: faulthandler
        writes them to the server's log) -> the models whose stubs were asked."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        asked = []
        for pid, model in procs.stubs_of(self.proc.pid).items():
            try:
                os.kill(pid, procs.STACKS_SIGNAL)
                asked.append(model)
            except OSError:
                pass
        if asked:
            time.sleep(settle)  # faulthandler writes from the signal handler; give it the moment
        return sorted(asked)

    def _failure(self, what: str) -> str:
        cause = self.failure_cause()
        if self.wedged:
            cause = (f"tritonserver gave up on the loading stub of {', '.join(self.wedged)} (a health check missed: "
                     f"a starved CPU) and waited for it forever; the stub was ended" + (f"\n{cause}" if cause else ""))
        return what + (f"\n{cause}" if cause else "") + (f"\nlog: {self.log_file}" if self.log_file else "")

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT (graceful, bounded by the exit timeout), SIGKILL after `timeout`; then nothing of it is left:
        no process of its group (stubs) and no shared-memory region."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout or self.exit_timeout + 15)
            except subprocess.TimeoutExpired:
                _killpg(self.proc.pid)
                self.proc.wait(10)
        _killpg(self.proc.pid)  # stubs of a server that crashed or was killed
        procs.remove_shm(self.shm_prefix)
        return self.proc.returncode

    def close(self) -> None:
        """Stop, and remove the run folder if this server created it (a given `run_dir` stays)."""
        self.stop()
        if self._own_run_dir and self.run_dir is not None:
            rundir.remove(self.run_dir)
            self.run_dir, self._own_run_dir = None, False

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # keep the run folder (and a log in it) of a server that failed
            self.stop()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
