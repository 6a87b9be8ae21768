"""The machine a figure was measured on, named in every results file: CPU model, the vector ISA the kernels are
built for, cores, and the C kernels' switches and races (`triton_vlm.engine.cpu.cbuild`), so a table read on another
machine says where it came from."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

ISA_ORDER = ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon")  # the widest first


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    for field in ("model name", "Model", "CPU part"):
        found = next((x.split(":", 1)[1].strip() for x in lines if x.startswith(field)), None)
        if found:
            return found
    return platform.machine()


def isa() -> str:
    """The widest vector ISA of this CPU among those the kernels have a path for (`csrc/vec.h`)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    flags = set(next((x.split(":", 1)[1].split() for x in text.splitlines() if x.startswith(("flags", "Features"))),
                     []))
    return next((f"{platform.machine()} {f}" for f in ISA_ORDER if f in flags), platform.machine())


def kernel_races() -> dict:
    """Each C kernel race cached on this machine (`<cache>/kernels/*.race.json`): kernel vs torch ms."""
    from triton_vlm.paths import cache_dir

    out = {}
    for f in sorted((cache_dir() / "kernels").glob("*.race.json")):
        try:
            got = json.loads(f.read_text())
            out[f.name.split("-")[0]] = f"{got['kernel_s'] * 1e3:.3f} vs {got['torch_s'] * 1e3:.3f} ms"
        except (OSError, ValueError, KeyError):
            continue
    return out


def describe() -> dict:
    switches = {k: os.environ.get(k, "auto") for k in ("TRITON_VLM_CPU_GEMV", "TRITON_VLM_CPU_DECODE",
                                                       "TRITON_VLM_CPU_FORWARD")}
    return {"cpu_model": cpu_model(), "isa": isa(), "cpus": os.cpu_count(), "kernel_switches": switches}


def line(meta: dict) -> str:
    """`- cpu: AMD EPYC ... (x86_64 avx512f), 2 CPUs; kernels: ...` for a results file."""
    m = meta.get("machine") or {}
    races = meta["kernel_races"] if "kernel_races" in meta else kernel_races()
    bw = meta.get("bandwidth") or {}
    measured = f", measured bandwidth {bw['gb_s']:.2f} GB/s" if "gb_s" in bw else ""
    return (f"- cpu: {m.get('cpu_model', '?')} ({m.get('isa', '?')}), {m.get('cpus', '?')} CPUs{measured}; kernel "
            f"switches {m.get('kernel_switches', {})}; kernel races on this machine (kernel vs torch): "
            f"{races or 'none cached'}")
