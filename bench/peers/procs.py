"""The processes of a server under test, for `bench.peers.side_by_side`: every descendant of the process it started (so that
stopping it leaves none behind, whatever process group each one chose), and the CPU seconds each one spent
during a client run (on a 2-core machine, where the client, the front end, the engine and the other hops share
the cores, that split says where a concurrency's time goes)."""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from triton_vlm.server import procs

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    pid: int
    label: str
    cpu_s: float  # user + system since the process started
    threads: int


def descendants(root: int) -> list[procs.Proc]:
    """`root` and every process below it (by parent pid), alive now."""
    table = procs.all_procs()
    kids: dict[int, list[procs.Proc]] = {}
    for p in table:
        kids.setdefault(p.ppid, []).append(p)
    out, todo = [], [p for p in table if p.pid == root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p.pid, []))
    return out


def label(p: procs.Proc) -> str:
    """A short name: the python-backend stub's model, vLLM's process title, or the program and its module."""
    if model := procs.stub_model(p):
        return f"stub {model}"
    argv = p.argv or ("?",)
    if argv[0].startswith("VLLM::"):
        return argv[0]
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return f"{module} {argv[argv.index('-m') + 2]}" if module.startswith("vllm.") and len(argv) > 3 else module
    return Path(argv[0]).name


def usage(p: procs.Proc) -> Usage | None:
    base = Path("/proc") / str(p.pid)
    try:
        fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
        threads = next(int(x.split()[1]) for x in (base / "status").read_text().splitlines()
                       if x.startswith("Threads:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return Usage(p.pid, label(p), (int(fields[11]) + int(fields[12])) / TICK, threads)  # utime, stime


def snapshot(root: int) -> dict[int, Usage]:
    return {u.pid: u for p in descendants(root) if (u := usage(p)) is not None}


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (the client runs are such children)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def split(before: dict[int, Usage], after: dict[int, Usage]) -> dict[str, float]:
    """CPU seconds per label spent between two snapshots (processes of the same label summed)."""
    out: dict[str, float] = {}
    for pid, u in after.items():
        spent = u.cpu_s - (before[pid].cpu_s if pid in before else 0.0)
        out[u.label] = round(out.get(u.label, 0.0) + spent, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_exec_count", "nv_inference_request_duration_us",
                   "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
                   "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us")


def parse_triton_metrics(text: str) -> dict[str, dict[str, float]]:
    """model -> counter -> value, for Triton's per-model inference counters (Prometheus text format)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in TRITON_COUNTERS or 'model="' not in rest:
            continue
        model = rest.split('model="', 1)[1].split('"', 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        out.setdefault(model, {})[name] = out.get(model, {}).get(name, 0.0) + value
    return out


def scrape_triton(url: str) -> dict[str, dict[str, float]]:
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_triton_metrics(r.read().decode())
    except OSError:
        return {}


def triton_per_request(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per model, over the requests between two scrapes: requests, executions, and mean ms per request of the
    request (Triton's view: queue + compute; for a decoupled model until its last response), queue and compute
    (input, infer, output) times."""
    out = {}
    for model, now in after.items():
        was = before.get(model, {})
        d = {k: v - was.get(k, 0.0) for k, v in now.items()}
        n = d.get("nv_inference_request_success", 0.0)
        if n <= 0:
            continue
        out[model] = {"requests": n, "executions": d.get("nv_inference_exec_count", 0.0)} | {
            k.removeprefix("nv_inference_").removesuffix("_duration_us") + "_ms": round(v / n / 1000, 3)
            for k, v in d.items() if k.endswith("_duration_us")}
    return out


STAGES = {  # histogram -> the stage it times (ours: the front end's and the llm model's own histograms)
    "triton_vlm_openai_time_to_first_token_seconds": "front end TTFT",
    "triton_vlm_time_to_first_token_seconds": "llm TTFT",
    "triton_vlm_queue_seconds": "llm queue",
    "triton_vlm_time_per_output_token_seconds": "llm TPOT",
}


def parse_histogram_sums(text: str) -> dict[str, tuple[float, float]]:
    """stage -> (sum, count) of the `STAGES` histograms in Prometheus text, summed over their labels."""
    out: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix, i in (("_sum", 0), ("_count", 1)):
            if name.endswith(suffix) and (stage := STAGES.get(name.removesuffix(suffix))):
                got = list(out.get(stage, (0.0, 0.0)))
                got[i] += float(line.rsplit(" ", 1)[1])
                out[stage] = (got[0], got[1])
    return out


def scrape_histograms(*urls: str) -> dict[str, tuple[float, float]]:
    import urllib.request  # noqa: PLC0415

    out: dict[str, tuple[float, float]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                out |= parse_histogram_sums(r.read().decode())
        except OSError:
            continue
    return out


def stage_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """stage -> mean ms over the observations between two scrapes."""
    out = {}
    for stage, (s, n) in after.items():
        s0, n0 = before.get(stage, (0.0, 0.0))
        if n > n0:
            out[stage] = round(1000 * (s - s0) / (n - n0), 2)
    return out


def affinity_plan(labels: dict[int, str], cpus: list[int], engine_label: str = "stub llm") -> dict[int, set[int]]:
    """vLLM's CPU layout for ours (`--pin-llm`): the process labelled `engine_label` on the first CPU, every other
    one on the rest; {} with fewer than 2 CPUs."""
    if len(cpus) < 2:
        return {}
    first, rest = {cpus[0]}, set(cpus[1:])
    return {pid: first if label == engine_label else rest for pid, label in labels.items()}


def apply_affinity(plan: dict[int, set[int]]) -> int:
    """Set every thread of each process of `plan` to its CPUs (threads started later inherit them); returns the
    threads set."""
    done = 0
    for pid, cpus in plan.items():
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                done += 1
            except OSError:
                pass
    return done


ENGINE_GAUGES = ("prefill_steps", "prefill_tokens", "prefill_seconds", "decode_steps", "decode_rows", "decode_seconds",
                 "spare_steps")


def parse_engine_gauges(text: str) -> dict[str, float]:
    """The llm's step-time gauges (`triton_vlm_engine_<ENGINE_GAUGES>`, cumulative) in Prometheus text, summed
    over instances."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("triton_vlm_engine_")
        if name in ENGINE_GAUGES and not line.startswith("#"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def scrape_engine(url: str) -> dict[str, float]:
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_engine_gauges(r.read().decode())
    except OSError:
        return {}


def engine_line(before: dict[str, float], after: dict[str, float], duration_s: float) -> str:
    """Where the engine's time went over a run of `duration_s` seconds, from two scrapes of its gauges; "" when
    they did not move."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_GAUGES}
    if d["prefill_steps"] <= 0 and d["decode_steps"] <= 0:
        return ""
    busy = d["prefill_seconds"] + d["decode_seconds"]
    pre = (f"prefill {d['prefill_seconds']:.2f} s in {d['prefill_steps']:.0f} steps "
           f"({d['prefill_tokens'] / max(1.0, d['prefill_steps']):.0f} prompt tokens a step, "
           f"{1000 * d['prefill_seconds'] / max(1.0, d['prefill_tokens']):.2f} ms a token)")
    dec = (f"decode {d['decode_seconds']:.2f} s in {d['decode_steps']:.0f} steps "
           f"({d['decode_rows'] / max(1.0, d['decode_steps']):.1f} rows a step, "
           f"{1000 * d['decode_seconds'] / max(1.0, d['decode_steps']):.1f} ms a step)")
    share = f"{100 * busy / duration_s:.0f}% of the run's {duration_s:.2f} s"
    return f"engine computing {busy:.2f} s = {share}: {pre}; {dec}; {d['spare_steps']:.0f} steps borrowed a spare CPU"
