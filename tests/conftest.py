"""Shared fixtures: the demo model (built once, cached) and a live tritonserver on it.

The server is the real `tritonserver` from nvidia-pytriton started by `triton_vlm.server.process.TritonServer` on free
ports; tests talk to it with `tritonclient` over gRPC and HTTP. Its log goes to `<tmp>/server.log` and is
printed when the server fails to start.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from triton_vlm.server import procs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _capabilities() -> set[str]:
    """What this machine has of the marks that need hardware or a library: `gpu` (CUDA), `tensorrt` (a CUDA GPU and
    the TensorRT package, which CI and the lent GPU machines lack)."""
    import importlib.util

    import torch

    found = set()
    if torch.cuda.is_available():
        found.add("gpu")
        if importlib.util.find_spec("tensorrt") is not None:
            found.add("tensorrt")
    return found


def pytest_collection_modifyitems(config, items):
    """GPU (and TensorRT) tests run only where the machine has them: selected, never skipped, where it does."""
    have = _capabilities()
    need = {"gpu", "tensorrt"} - have
    drop = [i for i in items if need & set(i.keywords)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if not need & set(i.keywords)]


# A test that needs a C kernel skips with a reason starting KERNEL_SKIP where the kernel cannot build (no cc, no
# usable packing). On a machine that builds them (CI's: .ci/run sets TRITON_VLM_REQUIRE_KERNELS=1) such a skip
# is a failure: the kernels' tests cannot go green there by testing nothing.
KERNEL_SKIP = "C kernel not built here"
REQUIRE_KERNELS = "TRITON_VLM_REQUIRE_KERNELS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and os.environ.get(REQUIRE_KERNELS) == "1" and KERNEL_SKIP in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_KERNELS}=1 and the kernel is missing: {report.longrepr}"


# Every process this session starts inherits this variable (tritonserver, its stubs, launcher subprocesses): the
# leftover check below looks only at those, so servers of other sessions on the same machine never fail it.
SESSION_MARK = "TRITON_VLM_TEST_SESSION"
if os.environ.get(SESSION_MARK, "").split("-")[0] != str(os.getpid()):  # set once per session process
    os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"


def _environ_has_mark(pid: int) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode() in env.split(b"\0")


def _server_like(p: procs.Proc) -> bool:
    return bool(p.argv) and (p.argv[0].endswith("tritonserver") or p.argv[0].endswith(procs.STUB_NAME))


def _ours(p: procs.Proc) -> bool:
    return _server_like(p) and _environ_has_mark(p.pid)


_LAUNCHERS: set[int] = set()  # pids of launcher subprocesses this session started (their shm prefix names them)


@pytest.fixture(scope="session")
def launched() -> set[int]:
    """Add the pid of every launcher subprocess a test starts: its shared memory is then checked as ours."""
    return _LAUNCHERS


def _shm() -> set[str]:
    """Shared-memory regions of this session's servers: `triton_vlm_<launcher pid>_*` for this process or a
    launcher it started."""
    if not procs.SHM_DIR.is_dir():
        return set()
    owners = {os.getpid(), *_LAUNCHERS}
    return {f.name for f in procs.SHM_DIR.glob("triton_vlm_*")
            if (m := re.match(r"triton_vlm_(\d+)_", f.name)) and int(m.group(1)) in owners}


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    """After every test: no tritonserver or python stub started by this session is alive, and no shared-memory
    region of its servers is left (set up first, so torn down after every server fixture)."""
    before = {p.pid for p in procs.all_procs() if _ours(p)}
    shm_before = _shm()
    yield
    _wait_for_stops()
    if _STOP_ERRORS:
        pytest.fail("; ".join(_STOP_ERRORS))
    deadline = time.monotonic() + 20
    while True:
        left = [p for p in procs.all_procs() if _ours(p) and p.pid not in before]
        shm_left = _shm() - shm_before
        if not left and not shm_left:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    pytest.fail(f"the test session left processes {[(p.pid, p.argv[:2]) for p in left]} and shared-memory "
                f"regions {sorted(shm_left)} behind")


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from triton_vlm.demo import ensure_demo_model

    return ensure_demo_model()


# what a test server serves unless it asks for more: the ensemble and its three steps. The `tensorrt_llm` model (one
# more python stub per server) is served by the session's `triton_server`, the launcher's tests and the servers
# built with `TritonServer` directly, which serve the whole repository.
ENSEMBLE_MODELS = ("ensemble", "preprocess", "vision", "llm")


def _start_server(tmp_path_factory, model: Path, params: dict, name: str,
                  models: tuple[str, ...] | None = ENSEMBLE_MODELS):
    [server] = _start_servers(tmp_path_factory, [(model, params, name)], models)
    return server


def _start_servers(tmp_path_factory, specs: list[tuple[Path, dict, str]],
                   models: tuple[str, ...] | None = ENSEMBLE_MODELS) -> list:
    """Servers of (model, params, name) started together (their stubs load side by side), each ready and
    supervised; none is left running when one fails to start."""
    from triton_vlm.server.process import TritonServer, free_port
    from triton_vlm.server.supervisor import Supervisor

    servers = []
    try:
        for model, params, name in specs:
            run_dir = tmp_path_factory.mktemp(name)
            servers.append(TritonServer(str(model), free_port(), free_port(), free_port(), params=params,
                                        run_dir=run_dir, log_file=run_dir / "server.log", exit_timeout=10,
                                        models=models).start())
        for server in servers:
            try:
                server.wait_ready(300)
            except BaseException:
                log = server.log_file.read_text(errors="replace")[-6000:]
                raise RuntimeError(f"tritonserver did not start; log tail:\n{log}") from None
    except BaseException:
        for server in servers:
            server.stop()
        raise
    for server in servers:
        server.supervisor = Supervisor(server, say=lambda m: print(m, flush=True)).start()
    return servers


# Servers being stopped in the background (`_stop_server`) and what went wrong stopping them: `no_leftovers` waits
# for every one before it checks that nothing is left.
_STOPPING: list[threading.Thread] = []
_STOP_ERRORS: list[str] = []


def _stop_server(server) -> None:
    """Stop supervising at once, and the server itself in the background: its stubs' finalize and exit and
    tritonserver's unload ticks (3-5 s, mostly waiting) overlap the next tests. The session's `no_leftovers`
    waits for every stop and fails on a stop that raised or left anything behind."""
    server.supervisor.stop()

    def stop() -> None:
        try:
            server.stop()
        except BaseException as e:  # noqa: BLE001 - reported by no_leftovers
            _STOP_ERRORS.append(f"stopping the server in {server.run_dir}: {type(e).__name__}: {e}")

    thread = threading.Thread(target=stop, name=f"stop-{server.http_port}", daemon=True)
    thread.start()
    _STOPPING.append(thread)


def _wait_for_stops(timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for thread in _STOPPING:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in _STOPPING):
        _STOP_ERRORS.append(f"a server stop still running after {timeout:.0f} s")


@pytest.fixture(scope="session")
def demo_adapters(demo_model) -> Path:
    from triton_vlm.demo import ensure_demo_adapters

    return ensure_demo_adapters()


@pytest.fixture(scope="session")
def image_host(tmp_path_factory):
    """A local http server for image URLs: (its base URL, the folder it serves)."""
    import functools
    import http.server
    import threading

    folder = tmp_path_factory.mktemp("images")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", folder
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory) -> Path:
    """The folder the shared server reads `lora_path` adapters from (tests put adapters in it)."""
    return tmp_path_factory.mktemp("lora-root")


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, demo_model, demo_adapters, image_host, lora_root):
    """The model repository as shipped (our engine), serving the demo model and its LoRA adapters; the
    `tensorrt_llm` model reads `lora_path` under `lora_root` and image URLs of the local `image_host`."""
    port = image_host[0].rsplit(":", 1)[1]
    params = {"*": {"lora_dir": str(demo_adapters), "lora_root": str(lora_root)},
              "tensorrt_llm": {"allowed_image_domains": "127.0.0.1", "allowed_image_ports": port,
                               "allow_private_image_hosts": "1"}}
    server = _start_server(tmp_path_factory, demo_model, params, "server", models=None)  # the whole repository
    yield server
    _stop_server(server)


@pytest.fixture(scope="session")
def hf_server(tmp_path_factory, demo_model, demo_adapters):
    """The same repository with the `transformers` generate() backend (the baseline; adapters through peft)."""
    server = _start_server(tmp_path_factory, demo_model,
                           {"*": {"lora_dir": str(demo_adapters)}, "llm": {"backend": "hf"}}, "hf-server")
    yield server
    _stop_server(server)


@pytest.fixture(scope="session")
def llava_next_server(tmp_path_factory):
    """A LLaVA-NeXT checkpoint (Mistral text model, `llava_next_cases.py`) served once for test_llava_next_server
    (through tritonclient) and test_llava_next_openai (through a front end on it): one start, not two."""
    from llava_next_cases import build

    model = build(tmp_path_factory.mktemp("next-mistral"), "mistral")
    server = _start_server(tmp_path_factory, model, {}, "next-server")
    yield server
    _stop_server(server)


@pytest.fixture(autouse=True)
def _engine_kernels_wherever_checked(request, monkeypatch):
    """tests/engine checks the C kernels' results wherever they build and check (switch "1"); whether they are
    also the faster path on this machine (switch "auto", the default) is tested in test_kernels_anywhere.py. (A
    conftest.py of its own in tests/engine would shadow this module's name for the tests that import it.)"""
    if Path(str(request.node.fspath)).parent.name == "engine":
        from triton_vlm.engine.cpu import cpu_decode, cpu_forward, gemv

        for env in (gemv.ENV, cpu_decode.ENV, cpu_forward.ENV):
            monkeypatch.setenv(env, "1")
