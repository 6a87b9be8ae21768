"""Start a real Triton Inference Server on our model repository.

`python -m triton_vlm.serve` (console script `triton-vlm-serve`):
1. locates the `tritonserver` shipped in the `nvidia-pytriton` wheel and copies its tree (server binary, python
   backend, the python-backend stub for the running Python) into a project-owned folder;
2. copies `model_repository/` into a run folder, filling each model's parameters (model path, device, limits);
3. starts the server with the environment the python stub needs (venv `bin` first on PATH, pyenv's shared
   libpython and pytriton's bundled libs on LD_LIBRARY_PATH);
4. waits for readiness, answers a demo request (with each demo LoRA adapter too), prints where it listens;
5. supervises the server (`supervisor.py`: restarts it when it or one of its stubs dies) and on SIGINT / SIGTERM
   shuts it down cleanly; the server gets SIGTERM if the launcher dies, even by SIGKILL (`procs.py`).

`TritonServer` is the same thing as a context manager, used by the tests and the benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import procs
from .supervisor import Supervisor

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_VLM_CACHE", Path.home() / ".cache" / "triton_vlm"))


def pytriton_server_dir() -> Path:
    try:
        import pytriton  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - install problem
        raise SystemExit("nvidia-pytriton is not installed: `pip install nvidia-pytriton` ships tritonserver") from e
    return Path(pytriton.__file__).parent / "tritonserver"


def prepare_server_tree(dest: Path | None = None) -> Path:
    """Copy pytriton's server tree into `dest` once and install the stub for this Python. Returns the tree."""
    src = pytriton_server_dir()
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"no python backend stub for Python {pyver} in {src}")
    import pytriton  # noqa: PLC0415

    version = getattr(pytriton, "__version__", "0")
    dest = dest or cache_dir() / f"tritonserver-{version}-py{pyver}"
    marker = dest / ".complete"
    if marker.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tritonserver-", dir=dest.parent))
    shutil.rmtree(tmp)
    shutil.copytree(src / "bin", tmp / "bin")
    shutil.copytree(src / "backends", tmp / "backends", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
    (tmp / "caches").mkdir()
    marker_tmp = tmp / ".complete"
    marker_tmp.write_text(str(src))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def server_env(tree: Path) -> dict[str, str]:
    """The environment the server and its python stubs need."""
    env = dict(os.environ)
    libs = Path(pytriton_server_dir()).parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [str(libs), libdir] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in ld if p)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # Three python stubs share the CPU; on small machines more than one thread each waits more than it works
    # (measured: 1.6x faster decoding with 1 thread than 2 on 2 cores). TRITON_VLM_THREADS overrides.
    cpus = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = os.environ.get("TRITON_VLM_THREADS") or str(1 if cpus <= 4 else cpus // 2)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TRITON_VLM_REPO_ROOT"] = str(REPO_ROOT)
    return env


_PARAM_RE = r'(key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'


def fill_parameters(config_text: str, values: dict[str, str]) -> str:
    """Set `parameters { key: K value: { string_value: "..." } }` entries that exist in a config.pbtxt."""
    for key, value in values.items():
        config_text = re.sub(_PARAM_RE.format(key=re.escape(key)), lambda m: f'{m.group(1)}{json.dumps(str(value))}',
                             config_text)
    return config_text


def declared_parameters(src: Path = DEFAULT_MODEL_REPOSITORY) -> dict[str, set[str]]:
    """model -> the parameter keys its config.pbtxt declares."""
    return {cfg.parent.name: set(re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"', cfg.read_text()))
            for cfg in sorted(src.glob("*/config.pbtxt"))}


def check_parameters(params: dict[str, dict[str, str]], src: Path = DEFAULT_MODEL_REPOSITORY) -> None:
    """ValueError for a parameter no model declares (it would be silently ignored), listing those that exist."""
    declared = declared_parameters(src)
    every = set().union(*declared.values())
    for model, values in params.items():
        if model != "*" and model not in declared:
            raise ValueError(f"--set {model}.*: there is no model {model!r}; models: {', '.join(declared)}")
        for key in values:
            known = every if model == "*" else declared[model]
            if key not in known:
                where = "any model" if model == "*" else f"model {model!r}"
                listing = "; ".join(f"{m}: {', '.join(sorted(k))}" for m, k in declared.items() if k)
                raise ValueError(f"--set {'' if model == '*' else model + '.'}{key}: {where} declares no parameter "
                                 f"{key!r}. Parameters: {listing}")


def prepare_model_repository(dest: Path, params: dict[str, dict[str, str]], src: Path = DEFAULT_MODEL_REPOSITORY,
                             models: tuple[str, ...] | None = None) -> Path:
    """Copy the model repository to `dest`, filling parameters per model (`params[model][key] = value`;
    `params["*"]` applies to every model that declares the key). A key no model declares is refused."""
    check_parameters(params, src)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for cfg in dest.glob("*/config.pbtxt"):
        model = cfg.parent.name
        if models is not None and model not in models:
            shutil.rmtree(cfg.parent)
            continue
        values = {**params.get("*", {}), **params.get(model, {})}
        text = fill_parameters(cfg.read_text(), values)
        if model in ("vision", "llm"):
            text = embeds_dtype(text, {**params.get("*", {}), **params.get("llm", {})}.get("dtype", "float32"))
        cfg.write_text(text)
    return dest


_EMBEDS_TYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


def embeds_dtype(config_text: str, llm_dtype: str) -> str:
    """`image_embeds` travels from vision to llm in the language model's dtype (half the bytes of FP32 for an
    fp16 model); vision's output and llm's input are declared alike."""
    if llm_dtype not in _EMBEDS_TYPE:
        raise ValueError(f"llm dtype must be one of {', '.join(_EMBEDS_TYPE)}, got {llm_dtype!r}")
    return re.sub(r'(name:\s*"image_embeds"\s*data_type:\s*)TYPE_\w+', rf"\g<1>{_EMBEDS_TYPE[llm_dtype]}",
                  config_text)


RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
ADMIN_HEADER = "triton-vlm-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TritonServer:
    """A tritonserver process on a filled copy of the model repository."""

    model_path: str
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    params: dict[str, dict[str, str]] = field(default_factory=dict)
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    models: tuple[str, ...] | None = None
    run_dir: Path | None = None
    log_file: Path | None = None
    log_verbose: int = 0
    exit_timeout: int = 15
    tritonserver: str | None = None  # a system tritonserver binary (e.g. /opt/tritonserver/bin/tritonserver)
    proc: subprocess.Popen | None = None
    # the python backend's shared-memory regions are /dev/shm/<shm_prefix>*: unique per server, removed by stop()
    shm_prefix: str = ""
    admin_key: str = field(default_factory=lambda: os.environ.get("TRITON_VLM_ADMIN_KEY") or secrets.token_hex(16))

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def start(self) -> "TritonServer":
        if self.tritonserver:  # e.g. NVIDIA's tritonserver container: its own binary, backends and stub
            binary = Path(self.tritonserver)
            tree = binary.parent.parent
            env = dict(os.environ, TRITON_VLM_REPO_ROOT=str(REPO_ROOT))
        else:
            tree = prepare_server_tree()
            binary = tree / "bin" / "tritonserver"
            env = server_env(tree)
        self.run_dir = Path(self.run_dir or tempfile.mkdtemp(prefix="triton-vlm-run-"))
        params = {k: dict(v) for k, v in self.params.items()}
        params.setdefault("*", {}).setdefault("model_path", str(self.model_path))
        repo = prepare_model_repository(self.run_dir / "model_repository", params, self.model_repository, self.models)
        procs.remove_stale_shm()
        self.shm_prefix = self.shm_prefix or f"triton_vlm_{os.getpid()}_{self.http_port}_"
        cmd = [
            str(binary),
            f"--model-repository={repo}",
            f"--backend-directory={tree / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
            "--allow-cpu-metrics=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            # Triton's admin APIs (load/unload models, register shared memory, change log files or tracing) only
            # for clients that send the header `triton-vlm-admin-key: $TRITON_VLM_ADMIN_KEY` (random if unset)
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
        ]
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115
        try:  # its own process group (stop() ends stubs with it); SIGTERM when the launcher dies, even by SIGKILL
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         start_new_session=True, preexec_fn=procs.die_with_parent())
        finally:
            if out is not None:
                out.close()
        return self

    def is_ready(self) -> bool:
        """The server and every model of the repository report ready (the health endpoint alone can answer
        200 while python models are still loading)."""
        urls = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in self._model_names()]
        try:
            for u in urls:
                with urllib.request.urlopen(f"http://{self.http_url}{u}", timeout=2) as r:
                    if r.status != 200:
                        return False
            return True
        except OSError:
            return False

    def _model_names(self) -> list[str]:
        repo = (self.run_dir or Path()) / "model_repository"
        return sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))

    def wait_ready(self, timeout: float = 300.0, abort: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (abort is not None and abort.is_set()):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} before becoming ready"
                                   + (f"; log: {self.log_file}" if self.log_file else ""))
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s" + (f"; log: {self.log_file}"
                                                                              if self.log_file else ""))

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

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def smoke_request(grpc_url: str, demo: bool) -> str:
    """Answer one request through the running server (proves the whole path works) and describe it."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    with VLMClient(grpc_url, protocol="grpc", timeout=120) as client:
        if demo:
            import io  # noqa: PLC0415
            import random  # noqa: PLC0415

            from .demo.shapes import draw  # noqa: PLC0415

            buf = io.BytesIO()
            draw("triangle", "blue", size=(96, 80), rng=random.Random(0)).save(buf, "PNG")
            prompt = "USER: <image>\nDescribe the image. ASSISTANT:"
            res = client.generate(prompt, [buf.getvalue()], max_tokens=8)
            return f"{prompt!r} + a blue triangle -> {res.texts[0]!r}"
        prompt = "USER: Hello! ASSISTANT:"
        res = client.generate(prompt, max_tokens=16)
        return f"{prompt!r} -> {res.texts[0]!r}"


def adapter_smoke_request(http_url: str, lora_name: str) -> str:
    """The demo question again, with one of the demo LoRA adapters (by name, over HTTP /generate)."""
    import base64  # noqa: PLC0415
    import io  # noqa: PLC0415
    import random  # noqa: PLC0415

    from .demo.shapes import draw  # noqa: PLC0415

    buf = io.BytesIO()
    draw("triangle", "blue", size=(96, 80), rng=random.Random(0)).save(buf, "PNG")
    prompt = "USER: <image>\nDescribe the image. ASSISTANT:"
    body = {"text_input": prompt, "images": [base64.b64encode(buf.getvalue()).decode()], "max_tokens": 12,
            "exclude_input_in_output": True, "lora_name": lora_name}
    req = urllib.request.Request(f"http://{http_url}/v2/models/ensemble/generate", json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.loads(r.read())["text_output"]
    return f"{prompt!r} + a blue triangle, lora_name {lora_name!r} -> {text!r}"


def _parse_set(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects MODEL.KEY=VALUE or KEY=VALUE, got {item!r}")
        model, dot, key = key.rpartition(".")
        out.setdefault(model if dot else "*", {})[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("MODEL") or None,
                    help="Hugging Face LLaVA checkpoint dir (default: the built-in demo model, built if missing)")
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--device", default=os.environ.get("DEVICE"), help="cpu or cuda (every model)")
    ap.add_argument("--set", action="append", default=[], metavar="[MODEL.]KEY=VALUE",
                    help="set a model parameter, e.g. llm.backend=hf or vision.vision_bits=16")
    ap.add_argument("--tritonserver", default=os.environ.get("TRITONSERVER"),
                    help="use this tritonserver binary (e.g. /opt/tritonserver/bin/tritonserver in NVIDIA's\n"
                         "container) instead of the one in nvidia-pytriton")
    ap.add_argument("--lora-dir", default=os.environ.get("LORA_DIR"),
                    help="LoRA adapter registry: one adapter per subfolder (PEFT, or TensorRT-LLM's .npy pair);\n"
                         "clients select one with lora_name (or its task id)")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--log-file", default=os.environ.get("TRITON_VLM_LOG"),
                    help="tritonserver's log (default: <run dir>/tritonserver.log; '-' = this terminal)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    args = ap.parse_args(argv)
    model, params = _model_and_params(args)
    run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-run-"))
    log_file = None if args.log_file == "-" else Path(args.log_file or run_dir / "tritonserver.log")
    server = TritonServer(str(model), args.http_port, args.grpc_port, args.metrics_port, params, run_dir=run_dir,
                          log_file=log_file, log_verbose=args.log_verbose, tritonserver=args.tritonserver)
    print(f"triton-vlm: starting tritonserver on {model}" + (f" (log: {log_file})" if log_file else ""),
          flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    server.start()
    try:
        server.wait_ready(args.timeout, abort=stopping)
    except (RuntimeError, TimeoutError) as e:
        if log_file and log_file.exists():
            sys.stderr.write(log_file.read_text(errors="replace")[-4000:])
        print(f"triton-vlm: {e}", file=sys.stderr)
        server.stop()
        return 1
    if stopping.is_set():
        server.stop()
        return 0
    _print_banner(args, model, log_file)
    supervisor = Supervisor(server, say=lambda m: print(m, flush=True), ready_timeout=args.timeout).start()
    while not stopping.wait(0.5) and not supervisor.failed.is_set():
        pass
    supervisor.stop()
    server.stop()
    return 1 if supervisor.failed.is_set() else 0


def _model_and_params(args) -> tuple[Path, dict[str, dict[str, str]]]:
    """The checkpoint (the demo model, built if missing, when none is given) and the model parameters of the
    command line; SystemExit with the reason for a bad one."""
    if args.model:
        model = Path(args.model).expanduser().resolve()
        if not (model / "config.json").exists():
            raise SystemExit(f"{model} is not a Hugging Face checkpoint directory (no config.json)")
    else:
        from .demo import ensure_demo_adapters, ensure_demo_model  # noqa: PLC0415

        model = ensure_demo_model()
        args.lora_dir = args.lora_dir or str(ensure_demo_adapters())  # the demo's adapters: french, sentence
    params = _parse_set(args.set)
    try:
        check_parameters(params)
    except ValueError as e:
        raise SystemExit(f"triton-vlm: {e}") from None
    if args.device:
        params.setdefault("*", {})["device"] = args.device
    if args.lora_dir:
        lora_dir = Path(args.lora_dir).expanduser().resolve()
        if not lora_dir.is_dir():
            raise SystemExit(f"--lora-dir {lora_dir} is not a folder")
        params.setdefault("*", {})["lora_dir"] = str(lora_dir)  # llm loads adapters, preprocess checks names
    return model, params


def _print_banner(args, model: Path, log_file: Path | None) -> None:
    try:
        answer = smoke_request(f"localhost:{args.grpc_port}", demo=not args.model)
        if not args.model:  # the demo adapters too
            for name in ("french", "sentence"):
                answer += "\n  request " + adapter_smoke_request(f"localhost:{args.http_port}", name)
    except Exception as e:  # noqa: BLE001 - report, keep serving
        answer = f"FAILED: {e}"
    print(f"triton-vlm: serving {model}\n"
          f"  request {answer}\n"
          f"  HTTP    http://localhost:{args.http_port}  (POST /v2/models/ensemble/generate)\n"
          f"  gRPC    localhost:{args.grpc_port}\n"
          f"  metrics http://localhost:{args.metrics_port}/metrics\n"
          + (f"  log     {log_file}\n" if log_file else "")
          + (f"  LoRA    {args.lora_dir} (pass \"lora_name\")\n" if args.lora_dir else "") +
          "  restart tritonserver is restarted if it or one of its models' processes dies\n"
          f"  try:    .venv/bin/triton-vlm-client --url localhost:{args.grpc_port} \"USER: <image>\\nWhat color is "
          f"the shape? ASSISTANT:\" --image some.png", flush=True)


if __name__ == "__main__":
    sys.exit(main())
