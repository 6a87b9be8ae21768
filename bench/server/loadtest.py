"""Load test as Triton users run one: NVIDIA's `perf_analyzer` against the ensemble, a concurrency sweep.

    python -m bench.server.loadtest                       # starts a server on the demo model, sweeps 1 2 4 8 16
    python -m bench.server.loadtest --url localhost:8001  # against a running server (`make serve`)

`perf_analyzer` is the real binary of the `tritonclient` 2.51.0 wheel (the 2.73 wheel ships an empty
placeholder): downloaded once with `pip download` and cached in `$TRITON_VLM_CACHE/perf_analyzer-2.51.0`, with
the two libraries it needs (`libb64.so.0d`, `libcudart.so.12`) linked from the `nvidia-pytriton` wheel.

Requests (`--input-data`, cycled): the demo task's questions with one image inline (`<img src="data:...">`),
one image as `<image>` + `images`, and text only; streamed over gRPC (`-i grpc --streaming`, the ensemble is
decoupled), `max_tokens` 8. For each concurrency perf_analyzer measures until three windows are stable; the
sweep is written to `bench/results/loadtest.{md,json,png}`: requests/s, streamed responses/s and the request
latency percentiles (send to final response) perf_analyzer measured.
"""
from __future__ import annotations

import argparse
import base64
import csv
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from triton_vlm.demo import shapes
from triton_vlm.paths import cache_dir

PA_VERSION = "2.51.0"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def ensure_perf_analyzer() -> tuple[Path, dict[str, str]]:
    """(binary, environment) of perf_analyzer, fetched from the tritonclient wheel once."""
    import pytriton  # noqa: PLC0415

    home = cache_dir() / f"perf_analyzer-{PA_VERSION}"
    binary, libdir = home / "perf_analyzer", home / "lib"
    bundled = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    if not binary.exists():
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            f"tritonclient=={PA_VERSION}", "-d", d], check=True)
            import zipfile  # noqa: PLC0415

            wheel = next(Path(d).glob("tritonclient-*.whl"))
            with zipfile.ZipFile(wheel) as z, open(binary.with_suffix(".tmp"), "wb") as out:
                out.write(z.read(f"tritonclient-{PA_VERSION}.data/data/bin/perf_analyzer"))
        binary.with_suffix(".tmp").chmod(0o755)
        binary.with_suffix(".tmp").rename(binary)
    libdir.mkdir(exist_ok=True)
    for link, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
        target = next(bundled.glob(pattern), None)
        if target is None:
            raise SystemExit(f"no {pattern} in {bundled}: perf_analyzer cannot start")
        if not (libdir / link).exists():
            (libdir / link).symlink_to(target)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([str(libdir), str(bundled)]))
    return binary, env


def input_data(n: int = 24, seed: int = 0) -> dict:
    """perf_analyzer's --input-data: a mix of inline images, `images` and text-only prompts."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        shape, color = rng.choice(shapes.SHAPES), rng.choice(list(shapes.COLORS))
        buf = io.BytesIO()
        shapes.draw(shape, color, (rng.randint(64, 160), rng.randint(64, 160)), rng).save(buf, "PNG")
        b64 = base64.b64encode(buf.getvalue()).decode()
        question = rng.choice(list(shapes.QUESTIONS))
        row = {"max_tokens": {"content": [8], "shape": [1]}, "stream": {"content": [True], "shape": [1]},
               "exclude_input_in_output": {"content": [True], "shape": [1]}}
        if i % 3 == 0:
            text = shapes.prompt(question).replace("<image>", f'<img src="data:image/png;base64,{b64}">')
        elif i % 3 == 1:
            text = shapes.prompt(question)
            row["images"] = {"content": [b64], "shape": [1]}
        else:
            text = shapes.prompt("Say hello.", 0)
        row["text_input"] = {"content": [text], "shape": [1]}
        rows.append(row)
    return {"data": rows}


def run_point(binary: Path, env: dict, url: str, data: Path, concurrency: int, out_csv: Path,
              timeout: float) -> dict:
    cmd = [str(binary), "-m", "ensemble", "-u", url, "-i", "grpc", "--streaming", "--input-data", str(data),
           f"--concurrency-range={concurrency}:{concurrency}", "--measurement-mode=count_windows",
           f"--measurement-request-count={max(40, 10 * concurrency)}", "--stability-percentage=25",
           "--max-trials=6", "--percentile=99", "-f", str(out_csv)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    with open(out_csv) as f:
        row = next(csv.DictReader(f))
    us = lambda k: float(row[k]) / 1e6  # noqa: E731 - microseconds -> seconds
    return {"concurrency": concurrency, "requests_per_s": float(row["Inferences/Second"]),
            "responses_per_s": float(row["Response Throughput"]), "p50_s": us("p50 latency"),
            "p90_s": us("p90 latency"), "p99_s": us("p99 latency")}


def markdown(points: list[dict], header: str) -> str:
    lines = [header, "", "| concurrency | requests/s | streamed responses/s | p50 s | p90 s | p99 s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p['concurrency']} | {p['requests_per_s']:.1f} | {p['responses_per_s']:.1f} | "
                     f"{p['p50_s']:.3f} | {p['p90_s']:.3f} | {p['p99_s']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    c = [p["concurrency"] for p in points]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(c, [p["requests_per_s"] for p in points], "o-")
    ax[0].set(xscale="log", xlabel="concurrency", ylabel="requests/s", title="throughput")
    for k in ("p50_s", "p90_s", "p99_s"):
        ax[1].plot(c, [p[k] for p in points], "o-", label=k[:-2])
    ax[1].set(xscale="log", xlabel="concurrency", ylabel="seconds", title="latency (perf_analyzer)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one on the demo model)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per concurrency point")
    args = ap.parse_args(argv)
    binary, env = ensure_perf_analyzer()
    work = Path(tempfile.mkdtemp(prefix="triton-vlm-loadtest-"))
    data = work / "data.json"
    data.write_text(json.dumps(input_data()))
    server = None
    try:
        url = args.url
        if url is None:
            from triton_vlm.demo import ensure_demo_model  # noqa: PLC0415
            from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

            server = TritonServer(str(ensure_demo_model()), free_port(), free_port(), free_port(), run_dir=work,
                                  log_file=work / "server.log").__enter__()
            url = server.grpc_url
        points = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            points.append(run_point(binary, env, url, data, c, work / f"c{c}.csv", args.timeout))
            print(f"concurrency {c:3d}: {points[-1]['requests_per_s']:7.1f} requests/s, "
                  f"p50 {points[-1]['p50_s']:.3f} s, p99 {points[-1]['p99_s']:.3f} s", flush=True)
    finally:
        if server is not None:
            server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"perf_analyzer {PA_VERSION}, ensemble over gRPC streaming, demo model, max_tokens 8, "
              f"{os.cpu_count()} CPUs")
    (args.out / "loadtest.json").write_text(json.dumps({"header": header, "points": points}, indent=2))
    (args.out / "loadtest.md").write_text(markdown(points, header))
    plot(points, args.out / "loadtest.png")
    print(markdown(points, header))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
