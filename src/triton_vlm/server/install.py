"""The tritonserver tree and the environment it runs in.

The `tritonserver` shipped in the `nvidia-pytriton` wheel is copied once into a project-owned folder (server
binary, python backend, the python-backend stub for the running Python); the server and its python stubs run
with the venv's `bin` first on PATH and pyenv's shared libpython and pytriton's bundled libs on LD_LIBRARY_PATH.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from ..paths import REPO_ROOT, cache_dir


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
