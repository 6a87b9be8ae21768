"""Small C kernels compiled once per machine and loaded with ctypes (`gemv.py`, `cpu_decode.py`).

`build(name, source, flags)` compiles `source` with the system C compiler (`cc`, or `$CC`) into
`<cache>/kernels/<name>-<hash>.so` and returns the path. The hash covers the source, the flags, the compiler's
version and the CPU's model name and flags, so a cached build is reused only on the kind of machine it was
made for (`-march=native` code must never run on an older CPU) and a changed source is rebuilt. The library is
written to a temporary name and renamed into place, so concurrent builds of the same key (two stubs starting
together) each leave a whole file. A ctypes call releases the GIL for the call's duration, as a torch op does.

Raises `RuntimeError` (no compiler, a failed build) or `subprocess.SubprocessError` (a compiler that hangs);
callers fall back to torch. `Once` holds a kernel built and checked once per process behind its switch.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Generic, Optional, TypeVar

from ..paths import cache_dir

log = logging.getLogger(__name__)
T = TypeVar("T")
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def machine_key() -> str:
    """Compiler path and version, CPU model and flags: a build is only reused on the machine kind it was made on."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu = [next((x for x in lines if x.startswith(field)), "") for field in ("model name", "flags")]
    return "\n".join([cc, version, *cpu])


def build(name: str, source: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` with BASE_FLAGS + `flags` (once per source, flags, compiler and CPU) -> the .so path."""
    key = machine_key()
    all_flags = [*BASE_FLAGS, *flags]
    digest = hashlib.sha256("\n".join([source, *all_flags, key]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    lib = out_dir / f"{name}-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = key.split("\n", 1)[0]
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src, obj = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        res = subprocess.run([cc, *all_flags, "-o", str(obj), str(src), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.replace(obj, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


class Once(Generic[T]):
    """A kernel loaded once per process: `get(*args)` calls `load(*args)` the first time (None: it cannot run
    here, and `load` logged why) unless the switch `env` is "0"; later calls return the same object."""

    def __init__(self, env: str, load: Callable[..., Optional[T]]):
        self.env, self._load = env, load
        self._lock = threading.Lock()
        self._value: Optional[T] = None
        self._tried = False

    def enabled(self) -> bool:
        """The switch: "1" (default) or "0"; anything else raises, naming the variable."""
        choice = os.environ.get(self.env, "1").strip()
        if choice not in ("0", "1"):
            raise ValueError(f"{self.env} must be 0 or 1, got {choice!r}")
        return choice == "1"

    def get(self, *args) -> Optional[T]:
        if self._tried:
            return self._value
        with self._lock:
            if not self._tried:
                self._value = self._load(*args) if self.enabled() else None
                self._tried = True
        return self._value

    def reset(self) -> None:
        """As if nothing had been loaded in this process (tests)."""
        with self._lock:
            self._value, self._tried = None, False


def load_checked(build: Callable[[], Path], make: Callable[[ctypes.CDLL], T], check: Callable[[T], Optional[str]],
                 what: str, fallback: str, on: str) -> Optional[T]:
    """`make(the library build() compiled)`, if `check` of it finds no reason against it (a check that raises
    is such a reason); else None. Each outcome is logged once: "<what> on: <on>", or why not and "<fallback>"."""
    try:
        kernel = make(ctypes.CDLL(str(build())))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.info("%s unavailable (%s); %s", what, e, fallback)
        return None
    try:
        reason = check(kernel)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot even be checked stays off
        reason = f"{type(e).__name__}: {e}"
    if reason is not None:
        log.warning("%s not used: %s; %s", what, reason, fallback)
        return None
    log.info("%s on: %s", what, on)
    return kernel
