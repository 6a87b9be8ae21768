"""Small C kernels compiled once per machine and loaded with ctypes (`gemv.py`, `cpu_decode.py`).

`build(name, source, flags)` compiles `source` with the system C compiler (`cc`, or `$CC`) into
`<cache>/kernels/<name>-<hash>.so` and returns the path. The hash covers the source, the flags, the compiler's
version and the CPU's model name and flags, so a cached build is reused only on the kind of machine it was
made for (`-march=native` code must never run on an older CPU) and a changed source is rebuilt. The library is
written to a temporary name and renamed into place, so concurrent builds of the same key (two stubs starting
together) each leave a whole file. A ctypes call releases the GIL for the call's duration, as a torch op does.

Raises `RuntimeError` (no compiler, a failed build) or `subprocess.SubprocessError` (a compiler that hangs);
callers fall back to torch.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..paths import cache_dir

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
