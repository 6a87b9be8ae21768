"""What many open requests cost one other stream: the llm model's cancellation polling, measured through the server.

    python -m bench.server.cancel_poll                     # 1, 256 and 1,024 open requests
    python -m bench.server.cancel_poll --open 1 1024 --probes 20
    python -m bench.server.cancel_poll --src /path/to/other/checkout/src   # the same, on another version of the code

One real tritonserver with the llm model only, on the demo model and its two registry adapters, llm parameters
`max_loras 1`, `max_queue 4096`. For each N in `--open`:

1. N "background" requests are sent straight to `llm` on one gRPC stream: not streamed, `max_tokens =
   min_tokens = 400`, adapters alternating `french` / `sentence`. With one device adapter slot, one of them runs
   and the rest wait for the slot (`engine/policy.py`: a request waiting only for an adapter slot is passed by
   base-model requests, never by one with an adapter). So N requests are live in the llm model (each one is
   polled for cancellation) while the engine computes one row for them and sends nothing for them.
2. Probes: base-model requests, streamed, `max_tokens = min_tokens = 32`, one at a time. Per probe the time to
   its first response (TTFT) and the gaps between its responses, client side: whatever delays the thread that
   sends responses shows up here.
3. The background stream is cancelled (`stop_stream(cancel_requests=True)`): the time from then to the llm
   model's last "cancelled by the client" log line (Triton's log time stamps) = how prompt cancellation is with
   N open (a few background requests finished during the probes; the others are all cancelled).

Measured (2-core machine shared with other work, load average 3-8; median of 7 runs of each version, run
alternately, 30 probes a row, `--src` pointing at copies of one tree differing only in `triton/responder.py`):
before, every live request's `is_cancelled()` asked on the sending thread every 50 ms; after, asked by a poller
thread in bounded batches.

| open requests | TTFT p50 ms before / after | TTFT p99 ms | gap p99 ms | probe tok/s | cancel all s |
|---:|---:|---:|---:|---:|---:|
| 1 | 5.1 / 5.1 | 12.4 / 15.4 | 6.4 / 5.7 | 996 / 868 | - |
| 256 | 5.9 / 5.4 | 64.0 / 16.0 | 18.3 / 6.2 | 503 / 647 | 0.15 / 0.50 |
| 1,024 | 39.6 / 5.1 | 72.3 / 16.6 | 40.5 / 8.0 | 204 / 615 | 0.47 / 0.87 |

(Every row has one background request running beside the probes, with a LoRA adapter. After, probe tok/s still
falls from 1 to 1,024 open: the poller's round trips, 1,280 a second at most, use CPU on these 2 cores.)
Instrumented copies logged, before: a sweep of 1,024 live requests 40-55 ms on the sending
thread (up to 240 ms mean when the machine was busiest); after: 1,280 round trips a second at most, 80-250 us
each on the poller thread.

Prints one table (and `--json PATH` writes the rows). The machine's load changes the absolute figures: compare
rows of one run, or two versions run back to back (`--src`: the llm model imports `triton_vlm` from there).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np

PROMPT_IDS = [1, 50, 60, 70, 80, 90]
CANCEL_LINE = "cancelled by the client;"
_STAMP = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")


@dataclass
class Row:
    open_requests: int
    probes: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    probe_tok_s: float
    cancel_all_s: Optional[float]  # stop_stream -> the llm model's last "cancelled by the client" log line


def _inputs(arrays: dict):
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    types = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(object): "BYTES"}
    out = []
    for name, arr in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), types[arr.dtype])
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def _request(max_tokens: int, stream: bool, lora: Optional[str] = None):
    arrays = {"input_ids": np.array([PROMPT_IDS], np.int32), "max_tokens": np.array([[max_tokens]], np.int32),
              "min_tokens": np.array([[max_tokens]], np.int32), "stream": np.array([[stream]])}
    if lora is not None:
        arrays["lora_name"] = np.array([[lora.encode()]], dtype=object)
    return _inputs(arrays)


def _gauges(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("triton_vlm_engine_") and "{" in line:
            out[line.split("{", 1)[0][len("triton_vlm_engine_"):]] = float(line.rsplit(" ", 1)[1])
    return out


def _open(metrics_port: int) -> float:
    """Requests the engine holds (waiting + running; the gauges are refreshed every 0.5 s)."""
    g = _gauges(metrics_port)
    return g.get("waiting_requests", 0) + g.get("running_requests", 0)


def _cancel_stamps(log_file: Path) -> list[float]:
    """Wall-clock times of the llm model's "cancelled by the client" log lines (Triton's `I1123 12:34:47.591261`
    prefix: month, day and local time)."""
    year, out = time.localtime().tm_year, []
    for line in log_file.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m and CANCEL_LINE in line:
            mo, d, hh, mm, ss = m.groups()
            out.append(datetime(year, int(mo), int(d), int(hh), int(mm)).timestamp() + float(ss))
    return out


def _wait(cond, timeout: float, what: str, step: float = 0.05) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(step)
    return time.monotonic() - t0


def probe(url: str, n: int, max_tokens: int) -> tuple[list[float], list[float], float]:
    """n streamed base-model requests, one at a time -> (TTFTs, gaps between responses, tokens/s), seconds."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    ttfts, gaps, tokens, busy = [], [], 0, 0.0
    try:
        for i in range(n):
            t0 = time.perf_counter()
            client.async_stream_infer("llm", _request(max_tokens, True), request_id=f"probe{i}",
                                      enable_empty_final_response=True)
            times = []
            while True:
                t, result, error = events.get(timeout=60)
                if error is not None:
                    raise RuntimeError(f"probe {i}: {error}")
                times.append(t)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            ttfts.append(times[0] - t0)
            gaps.extend(np.diff(times).tolist())
            tokens += max_tokens
            busy += times[-1] - t0
    finally:
        client.stop_stream()
        client.close()
    return ttfts, gaps, tokens / busy


def run_row(server, n_open: int, n_probes: int, max_tokens: int, log_file: Path) -> Row:
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    bg = grpcclient.InferenceServerClient(server.grpc_url)
    finished: list = []  # background requests that ran to the end (one at a time) before the cancellation
    bg.start_stream(callback=lambda result, error: finished.append(error))
    cancels_before = len(_cancel_stamps(log_file))
    for i in range(n_open):
        bg.async_stream_infer("llm", _request(400, False, ("french", "sentence")[i % 2]), request_id=f"bg{i}")
    _wait(lambda: _open(server.metrics_port) + len(finished) >= n_open, 120, f"{n_open} requests open", 0.2)
    ttfts, gaps, tok_s = probe(server.grpc_url, n_probes, max_tokens)
    t_cancel = time.time()
    bg.stop_stream(cancel_requests=True)
    bg.close()
    _wait(lambda: _open(server.metrics_port) == 0, 120, "an idle engine", 0.2)
    stamps = _cancel_stamps(log_file)[cancels_before:]  # the ones of this row (some finished before the cancel)
    cancel_s = max(stamps) - t_cancel if n_open and stamps else None
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3)  # noqa: E731
    return Row(n_open, n_probes, ms(ttfts, 50), ms(ttfts, 99), ms(gaps, 50), ms(gaps, 99), max(gaps) * 1e3,
               tok_s, cancel_s)


def table(rows: list[Row]) -> str:
    head = ("| open requests | TTFT p50 ms | TTFT p99 ms | gap p50 ms | gap p99 ms | gap max ms | probe tok/s "
            "| cancel all s |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"| {r.open_requests} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | {r.gap_p50_ms:.2f} | "
             f"{r.gap_p99_ms:.1f} | {r.gap_max_ms:.1f} | {r.probe_tok_s:.0f} | "
             f"{'-' if r.cancel_all_s is None else f'{r.cancel_all_s:.2f}'} |" for r in rows]
    return "\n".join([head, *lines])


def _repository(dest: Path, src: Optional[Path]) -> Path:
    """The project's model repository; with `src`, a copy whose llm model imports triton_vlm from `src`."""
    from triton_vlm.server.repository import DEFAULT_MODEL_REPOSITORY  # noqa: PLC0415

    if src is None:
        return DEFAULT_MODEL_REPOSITORY
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    model_py = dest / "llm" / "1" / "model.py"
    model_py.write_text(f"import sys\nsys.path.insert(0, {str(src.resolve())!r})\n" + model_py.read_text())
    return dest


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open", type=int, nargs="+", default=[1, 256, 1024],
                    help="background requests per row (1: the baseline, one background row running)")
    ap.add_argument("--probes", type=int, default=30, help="probe requests per row")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per probe")
    ap.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the server's processes")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--src", type=Path, help="a `src` folder to import triton_vlm from in the llm model")
    a = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.torch_threads)
    from triton_vlm.demo import ensure_demo_adapters, ensure_demo_model  # noqa: PLC0415
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    model, adapters = ensure_demo_model(), ensure_demo_adapters()
    run_dir = Path(tempfile.mkdtemp(prefix="triton-vlm-bench-cancel-"))
    log_file = run_dir / "server.log"
    params = {"llm": {"lora_dir": str(adapters), "max_loras": "1", "max_queue": "4096"}}
    repo = _repository(run_dir / "source", a.src)
    print(f"starting tritonserver (llm only; log {log_file}) ...", flush=True)
    rows: list[Row] = []
    with TritonServer(str(model), free_port(), free_port(), free_port(), params=params, models=("llm",),
                      model_repository=repo, run_dir=run_dir, log_file=log_file) as server:
        probe(server.grpc_url, 3, a.max_tokens)  # warm-up
        for n in a.open:
            row = run_row(server, n, a.probes, a.max_tokens, log_file)
            print(f"{n} open: {row}", flush=True)
            rows.append(row)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
