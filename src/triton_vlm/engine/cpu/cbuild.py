"""Small C kernels (`csrc/*.c`) compiled once per machine, loaded with ctypes, and used only where they are right
and faster (`gemv.py`, `cpu_decode.py`, `cpu_forward.py`).

`build(name, source, flags)` compiles `csrc/<source>` with the system C compiler (`cc`, or `$CC`) into
`<cache>/kernels/<name>-<hash>.so` and returns the path. The hash covers every file of `csrc/`, the flags, the
compiler's version and the CPU's model name and flags, so a cached build is reused only on the kind of machine
it was made for (`-march=native` code must never run on an older CPU) and a changed source is rebuilt.
`$TRITON_VLM_CFLAGS` adds flags (e.g. `-march=x86-64-v3` for an image that runs on many CPUs, or sanitizers in
the tests). The library is written to a temporary name and renamed into place, so concurrent builds of the same
key (two stubs starting together) each leave a whole file. A ctypes call releases the GIL, as a torch op does.

A kernel is an optional speed path: `load_checked` turns ANY exception while building, loading, checking or
timing it (a compiler that prints bytes the locale cannot decode, no compiler, a read-only cache, a check that
disagrees or raises) into "off" with one log line naming why, and the model loads with the torch path. The
compiler's output is read as bytes and decoded with errors="replace" (the python stub's preferred encoding is
ASCII where no locale is set).

The switch of each kernel (`Once.mode`): "auto" (default) uses a checked kernel only where it is measurably
faster than the torch path it replaces on this machine (`race`, timed at first load and cached beside the
build); "1" uses it wherever it is built and checked (tests, comparisons); "0" never.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Optional, TypeVar

from ...paths import cache_dir

log = logging.getLogger(__name__)
T = TypeVar("T")
CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
FLAGS_ENV = "TRITON_VLM_CFLAGS"
MODES = ("auto", "1", "0")


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr decoded with errors="replace"): never a UnicodeDecodeError, whatever the
    locale and whatever the compiler prints."""
    res = subprocess.run(argv, capture_output=True, timeout=timeout)
    return res.returncode, (res.stdout + res.stderr).decode("utf-8", errors="replace")


def machine_key() -> str:
    """Compiler path and version, CPU model and flags: a build is only reused on the machine kind it was made on."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = _run([cc, "--version"], 30)[1]
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    cpu = [next((x for x in lines if x.startswith(field)), "") for field in ("model name", "flags", "Features")]
    return "\n".join([cc, version, *cpu])


def extra_flags() -> tuple[str, ...]:
    return tuple(shlex.split(os.environ.get(FLAGS_ENV, "")))


def sources_digest() -> str:
    """Every file of csrc/ (a header change rebuilds every kernel that includes it)."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".c", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def build(name: str, source: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile csrc/`source` with BASE_FLAGS + `flags` + $TRITON_VLM_CFLAGS (once per sources, flags, compiler and
    CPU) -> the .so path. Raises RuntimeError (no compiler, a failed build) or OSError (a cache it cannot write)."""
    key = machine_key()
    all_flags = [*BASE_FLAGS, *flags, *extra_flags()]
    digest = hashlib.sha256("\n".join([sources_digest(), source, *all_flags, key]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    lib = out_dir / f"{name}-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = key.split("\n", 1)[0]
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj = Path(tmp) / f"{name}.so"
        rc, out = _run([cc, *all_flags, f"-I{CSRC}", "-o", str(obj), str(CSRC / source), "-lm"], 120)
        if rc != 0:
            raise RuntimeError(f"{cc} failed: {out.strip()[:500]}")
        if out.strip():
            log.debug("%s: %s", name, out.strip()[:500])
        os.replace(obj, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def mode(env: str) -> str:
    """A kernel's switch: "auto" (default: used where measured faster), "1" (used wherever checked) or "0" (off).
    Any other value is logged, naming the variable, and counts as "0"."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in MODES:
        log.warning("%s must be auto, 1 or 0, got %r: the kernel stays off", env, choice)
        return "0"
    return choice


class Once(Generic[T]):
    """A kernel loaded once per process: `get(*args)` calls `load(*args)` the first time (None: it cannot run
    here, and `load` logged why) unless the switch `env` is "0"; later calls return the same object. A `load`
    that raises anyway counts as None, with a log line: an optional speed path never stops a model loading."""

    def __init__(self, env: str, load: Callable[..., Optional[T]]):
        self.env, self._load = env, load
        self._lock = threading.Lock()
        self._value: Optional[T] = None
        self._tried = False

    def mode(self) -> str:
        return mode(self.env)

    def enabled(self) -> bool:
        return self.mode() != "0"

    def get(self, *args) -> Optional[T]:
        if self._tried:
            return self._value
        with self._lock:
            if not self._tried:
                try:
                    self._value = self._load(*args) if self.enabled() else None
                except Exception as e:  # noqa: BLE001 - module doc: any failure leaves the torch path
                    log.warning("%s: kernel off (%s: %s)", self.env, type(e).__name__, e)
                    self._value = None
                self._tried = True
        return self._value

    def reset(self) -> None:
        """As if nothing had been loaded in this process (tests)."""
        with self._lock:
            self._value, self._tried = None, False


@dataclass(frozen=True)
class Race:
    """Seconds per call of a kernel and of the torch path it replaces (the fastest of alternating rounds)."""
    kernel_s: float
    torch_s: float

    @property
    def faster(self) -> bool:
        return self.kernel_s < self.torch_s

    def describe(self, torch_name: str) -> str:
        return f"{self.kernel_s * 1e3:.3f} ms vs {torch_name} {self.torch_s * 1e3:.3f} ms"


def race(kernel: Callable[[], object], torch_path: Callable[[], object], rounds: int = 7, budget_s: float = 0.2) -> Race:
    """Both callables once to warm up, then alternating timed calls (at least 3 rounds, at most `rounds`, within
    about `budget_s`): the fastest of each, so load on the other cores pulls neither side more than the other."""
    kernel(), torch_path()
    best = [float("inf"), float("inf")]
    start = time.perf_counter()
    for i in range(rounds):
        for j, fn in enumerate((kernel, torch_path)):
            t0 = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return Race(best[0], best[1])


def cached_race(lib: Path, key: str, measure: Callable[[], Race]) -> Race:
    """`measure()`, once per build and `key` (the shape it was timed on): kept as JSON beside the library, so a
    restart on the same machine reuses the choice. A cache that cannot be read or written is measured again."""
    path = lib.with_name(f"{lib.stem}.{hashlib.sha256(key.encode()).hexdigest()[:12]}.race.json")
    try:
        got = json.loads(path.read_text())
        return Race(float(got["kernel_s"]), float(got["torch_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = measure()
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"kernel_s": found.kernel_s, "torch_s": found.torch_s}))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("timing of %s not cached: %s", lib.name, e)
    return found


class Chosen:
    """For a checked kernel: `chosen` says whether to use it: its switch was "1" at load, or "auto" and it won the
    race `load_checked` ran. Decided once at load: it is read by every decode-sized product, where even an
    environment lookup (~3 us for an unset variable) would cost a one-stream step 4%."""
    env = ""
    race: Optional[Race] = None
    chosen = False


@dataclass(frozen=True)
class Spec:
    """What `load_checked` says about one kernel in its log lines."""
    env: str  # its switch
    what: str  # "decode gemv kernel"
    fallback: str  # what runs instead: "oneDNN runs every product"
    on: str  # what it does when used
    torch_name: str = "torch"  # the path it races


def load_checked(build: Callable[[], Path], make: Callable[[ctypes.CDLL], T], check: Callable[[T], Optional[str]],
                 spec: Spec, timing: Optional[Callable[[T], Race]] = None) -> Optional[T]:
    """`make(the library build() compiled)` if `check` of it finds no reason against it, else None. With `timing`
    (a `Chosen` kernel), its race against the torch path is run (or read from the cache beside the build) and
    kept on it: `kernel.chosen`. Any exception (module doc) is a reason against it. Each outcome is logged once,
    naming why and, when timed, both figures."""
    stage = "build"
    try:
        lib = build()
        stage = "load"
        kernel = make(ctypes.CDLL(str(lib)))
        stage = "check"
        reason = check(kernel)
        if reason is None and timing is not None:
            stage = "timing"
            kernel.env, kernel.race = spec.env, cached_race(lib, spec.what, lambda: timing(kernel))
            kernel.chosen = mode(spec.env) == "1" or kernel.race.faster
    except Exception as e:  # noqa: BLE001 - module doc: any failure leaves the torch path
        reason = f"{stage} failed: {type(e).__name__}: {e}"
    if reason is not None:
        log.warning("%s not used: %s; %s", spec.what, reason, spec.fallback)
        return None
    if timing is None:
        log.info("%s on: %s", spec.what, spec.on)
    elif kernel.chosen:
        log.info("%s on: %s (%s)", spec.what, spec.on, kernel.race.describe(spec.torch_name))
    else:  # checked: callers built on it (the whole forward) may still run it, and race it themselves
        log.warning("%s not used: slower than %s here (%s); %s", spec.what, spec.torch_name,
                    kernel.race.describe(spec.torch_name), spec.fallback)
    return kernel
