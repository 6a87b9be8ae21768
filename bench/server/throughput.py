"""Throughput / latency benchmark: our engine vs the `transformers` generate() baseline, both through Triton.

    python -m bench.server.throughput            # full: concurrency 1 4 16 32 x beam_width 1 4, both backends
    python -m bench.server.throughput --quick    # smoke run: concurrency 1 16, fewer requests, quick-* outputs

For each backend (llm parameter `backend`: "engine" = ours, "hf" = baseline) one real tritonserver is started
on the benchmark model (`bench.common.model`, built and cached on first use), warmed up, and then for every
(beam_width, concurrency) row `concurrency` client threads run a closed loop (each sends its next request as
soon as the previous one returns) until the row's requests are done or its time budget is spent. Every request
is one image + a short prompt with `max_tokens == min_tokens`, so each generates exactly `max_tokens` tokens.

Counted per request: the new tokens of the returned (best) sequence (`num_return_sequences` 1); beam search's
other beams are work but not output, so they are not counted. tok/s = tokens of all completed requests / the
row's wall time (first send to last response). Latency = send to final response, client side.

One stream (`--stream-requests`, after the warm-up, before the rows): greedy requests streamed one at a time
(decoupled gRPC streaming, `VLMClient.stream`); each request's decode rate is (tokens - those of its first
response) / (arrival of the last token - arrival of the first), the median over the requests is compared with
the bytes a decode step reads and with the single-thread memory bandwidth measured at start, before any server
(`bench/common/bandwidth.py`): `one stream: X tok/s x Y MB/token = Z GB/s = F% of the measured W GB/s`.

Engine capacity: max_rows 128 by default, so that 32 beam-4 requests (128 rows) run at once; with 64, 16 beam-4
requests fill every row and concurrency 32 only queues. kv_cache_tokens defaults to max_rows x (128 +
max_tokens), every row holding a private 128-token prompt; the run prints what the largest row's requests
reserve at the real prompt length (`kv_cache.blocks_needed`) next to it.

Writes `<out>/results.json` (after every row, so an interrupted run keeps what it measured), `results.md` and
`throughput.png` (`quick-*` with --quick). Every request has a timeout, every row a time budget, and the server is
stopped on every exit path (exceptions, Ctrl-C, SIGTERM).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bench.common import machine
from bench.common.bandwidth import describe_bytes, fraction, fraction_line, measure_bandwidth, token_bytes
from bench.common.model import describe, ensure_bench_model, parameter_counts
from bench.common.report import (BASELINE, OURS, RowResult, console_table, markdown, plot, plot_title, stream_lines,
                     target_lines)

PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


@dataclass
class Settings:
    backends: list[str]
    concurrency: list[int]
    beams: list[int]
    max_tokens: int
    requests_factor: int  # requests per row = max(min_requests, requests_factor * concurrency)
    min_requests: int
    row_seconds: float  # no new request is sent after this many seconds into a row
    timeout: float  # per request
    max_rows: int
    kv_cache_tokens: int
    torch_threads: int  # OMP_NUM_THREADS of the server's processes (0 = the server's default, all cores)
    stream_requests: int  # one-stream measurement: greedy streamed requests, one at a time (0 = none)
    stream_tokens: int
    bandwidth_mib: int
    out: Path
    prefix: str
    mode: str
    command: str

    def requests_for(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_factor * concurrency)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv: Optional[list[str]]) -> Settings:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,16, 2x requests, 60 s rows")
    ap.add_argument("--backends", default="engine,hf", help="comma list of engine, hf (default both)")
    ap.add_argument("--concurrency", type=_ints, default=None, help="default 1,4,16,32 (quick: 1,16)")
    ap.add_argument("--beams", type=_ints, default=None, help="beam widths, default 1,4")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    ap.add_argument("--requests-factor", type=int, default=None, help="requests per row = factor x concurrency "
                    "(default 3, quick 2)")
    ap.add_argument("--min-requests", type=int, default=None, help="at least this many per row (default 8, "
                    "quick 4)")
    ap.add_argument("--row-seconds", type=float, default=None, help="time budget per row (default 240, quick 90)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    ap.add_argument("--max-rows", type=int, default=128, help="engine max_rows (beams decoded per step; default "
                    "128: 32 beam-4 requests at once)")
    ap.add_argument("--kv-cache-tokens", type=int, default=0,
                    help="engine KV cache size in tokens (default max_rows x (128 + max_tokens))")
    ap.add_argument("--stream-requests", type=int, default=None,
                    help="one-stream measurement: greedy streamed requests one at a time per backend (default 9, "
                         "quick 3; 0 = skip)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens per one-stream request (default 64)")
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="buffer of the memory bandwidth measurement")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for every server process, both backends (default 1: the client, "
                         "tritonserver and three python stubs share 2 cores, and 2 OpenMP threads spin-waiting on a "
                         "busy core make matmuls 10-50x slower; 0 = the server's default, all cores)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    a = ap.parse_args(argv)
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in (OURS, BASELINE)]
    if bad or not backends:
        ap.error(f"--backends takes engine and/or hf, got {a.backends!r}")
    if a.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    q = a.quick
    return Settings(
        backends=backends,
        concurrency=a.concurrency or ([1, 16] if q else [1, 4, 16, 32]),
        beams=a.beams or [1, 4],
        max_tokens=a.max_tokens,
        requests_factor=a.requests_factor or (2 if q else 3),
        min_requests=a.min_requests or (4 if q else 8),
        row_seconds=a.row_seconds or (90.0 if q else 240.0),
        timeout=a.timeout,
        max_rows=a.max_rows,
        kv_cache_tokens=a.kv_cache_tokens or -(-a.max_rows * (128 + a.max_tokens) // 16) * 16,
        torch_threads=a.torch_threads,
        stream_requests=(3 if q else 9) if a.stream_requests is None else a.stream_requests,
        stream_tokens=a.stream_tokens,
        bandwidth_mib=a.bandwidth_mib,
        out=a.out,
        prefix="quick-" if q else "",
        mode="quick" if q else "full",
        command=shlex.join(["python", "-m", "bench.server.throughput"] + list(sys.argv[1:] if argv is None else argv)),
    )


def make_images(n: int = 8, seed: int = 0) -> list[bytes]:
    """`n` PNG images of coloured shapes (64x64), the same every run."""
    from triton_vlm.demo.shapes import COLORS, SHAPES, draw  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        draw(SHAPES[i % len(SHAPES)], list(COLORS)[i % len(COLORS)], size=(64, 64), rng=rng).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


class Requester:
    """Sends one benchmark request and returns (latency s, new tokens of the best sequence)."""

    def __init__(self, grpc_url: str, max_tokens: int, timeout: float):
        from triton_vlm_client import VLMClient  # noqa: PLC0415

        self.client = VLMClient(grpc_url, protocol="grpc", timeout=timeout)
        self.max_tokens = max_tokens
        self.images = make_images()

    def __call__(self, i: int, beam_width: int) -> tuple[float, int]:
        img = self.images[i % len(self.images)]
        t0 = time.perf_counter()
        res = self.client.generate(PROMPT, [img], max_tokens=self.max_tokens, min_tokens=self.max_tokens,
                                   beam_width=beam_width, exclude_input_in_output=True)
        dt = time.perf_counter() - t0
        return dt, int(res.sequence_lengths[0]) if res.sequence_lengths else len(res.output_ids[0])


def stream_one(client, image: bytes, tokens: int) -> dict:
    """One greedy streamed request: arrival time and token count of every response carrying tokens."""
    t0 = time.perf_counter()
    times, counts = [], []
    for piece in client.stream(PROMPT, [image], max_tokens=tokens, min_tokens=tokens, beam_width=1,
                               exclude_input_in_output=True):
        if piece.token_ids:
            times.append(time.perf_counter())
            counts.append(len(piece.token_ids))
    if len(times) < 2:
        raise RuntimeError(f"{len(times)} responses with tokens: no inter-token interval to measure")
    return dict(tokens=sum(counts), responses=len(times), first_s=times[0] - t0, decode_s=times[-1] - times[0],
                tok_s=(sum(counts) - counts[0]) / (times[-1] - times[0]))


def one_stream(grpc_url: str, n: int, tokens: int, timeout: float) -> dict:
    """`n` greedy requests streamed one after another; the median decode rate after the first token, and the
    server's prompt length (from one non-streamed request)."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    client = VLMClient(grpc_url, protocol="grpc", timeout=timeout)
    images = make_images()
    prompt = client.generate(PROMPT, [images[0]], max_tokens=1, exclude_input_in_output=True,
                             return_num_input_tokens=True).num_input_tokens
    if prompt is None:
        raise RuntimeError("the server did not return num_input_tokens")
    runs = [stream_one(client, images[i % len(images)], tokens) for i in range(n)]
    return dict(requests=n, tokens=tokens, prompt_tokens=prompt, tok_s=statistics.median(r["tok_s"] for r in runs),
                first_s=statistics.median(r["first_s"] for r in runs), runs=runs)


def run_row(send: Callable[[int, int], tuple[float, int]], backend: str, beam: int, concurrency: int,
            n_requests: int, budget_s: float, alive: Callable[[], bool]) -> RowResult:
    """Closed loop: `concurrency` threads take tickets 0..n_requests-1 until none are left or the budget is
    spent (a request already sent is waited for; each has its own timeout)."""
    lock = threading.Lock()
    tickets = iter(range(n_requests))
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    t_start = time.perf_counter()
    deadline = t_start + budget_s
    t_last = [t_start]

    def worker() -> None:
        while True:
            with lock:
                i = next(tickets, None)
            if i is None or time.perf_counter() > deadline or not alive():
                return
            try:
                dt, n = send(i, beam)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    t_last[0] = time.perf_counter()
                continue
            with lock:
                latencies.append(dt)
                tokens.append(n)
                t_last[0] = time.perf_counter()

    threads = [threading.Thread(target=worker, daemon=True, name=f"bench-client-{k}") for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return RowResult.from_samples(backend, beam, concurrency, latencies, tokens, errors, t_last[0] - t_start)


def warm_up(send: Callable[[int, int], tuple[float, int]], beams: list[int]) -> None:
    """A few sequential requests per beam width, then a small concurrent burst (first-call costs out of the
    measurements)."""
    for beam in beams:
        for i in range(2):
            send(i, beam)
    for beam in beams:
        run_row(send, "warmup", beam, 4, 4, 300.0, lambda: True)


def capacity(s: Settings, prompt_tokens: int) -> dict:
    """Rows and KV blocks the largest (beam, concurrency) row needs at once vs the engine's max_rows and KV
    cache (the engine reserves `kv_cache.blocks_needed` per request at admission)."""
    from triton_vlm.engine.engine import EngineConfig  # noqa: PLC0415
    from triton_vlm.engine.kv.kv_cache import blocks_needed  # noqa: PLC0415

    beam, conc, block = max(s.beams), max(s.concurrency), EngineConfig.block_size
    need = conc * blocks_needed(prompt_tokens, s.max_tokens, beam, block) * block
    rows = conc * beam
    text = (f"capacity: {conc} beam-{beam} requests need {rows} rows (max_rows {s.max_rows}) and reserve {need} KV "
            f"tokens at the {prompt_tokens}-token prompt (kv_cache_tokens {s.kv_cache_tokens}: "
            f"{s.kv_cache_tokens / need:.1f}x)")
    if rows > s.max_rows or need > s.kv_cache_tokens:
        text += " -- WARNING: they cannot all run at once"
    return dict(rows=rows, kv_tokens=need, text=text)


def bandwidth_again(meta: dict, mib: int) -> None:
    """Measure the bandwidth again after the last server stopped; the better of the two measurements becomes the
    run's bandwidth (a busy moment on the shared machine only lowers a measurement) and the one-stream fractions
    are taken against it."""
    start = meta["bandwidth"]
    end = measure_bandwidth(mib).to_dict()
    print(f"\nbandwidth again, after the servers: {end['gb_s']:.2f} GB/s (at start {start['gb_s']:.2f})", flush=True)
    best = dict(max(start, end, key=lambda b: b["gb_s"]))
    best["measured"] = [round(start["gb_s"], 2), round(end["gb_s"], 2)]
    meta.update(bandwidth=best, bandwidth_start=start, bandwidth_end=end)
    for res in meta["one_stream"].values():
        if "gb_s" in res:
            res["fraction"] = res["gb_s"] / best["gb_s"]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _sigterm(signum, frame):  # the `with TritonServer` blocks stop the server on the way out
    raise KeyboardInterrupt(f"signal {signum}")


def run_backend(backend: str, s: Settings, model_dir: Path, on_row: Callable[[RowResult], None],
                on_stream: Callable[[str, dict], None]) -> None:
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    params = {"llm": {"backend": backend}}
    if backend == OURS:
        params["llm"].update(max_rows=str(s.max_rows), kv_cache_tokens=str(s.kv_cache_tokens))
    run_dir = Path(tempfile.mkdtemp(prefix=f"triton-vlm-bench-{backend}-"))
    log_file = run_dir / "server.log"
    ports = [free_port() for _ in range(3)]
    print(f"\n== {backend}: starting tritonserver (log {log_file}) ...", flush=True)
    t0 = time.perf_counter()
    with TritonServer(str(model_dir), *ports, params=params, run_dir=run_dir, log_file=log_file) as server:
        print(f"   ready in {time.perf_counter() - t0:.1f} s; warming up ...", flush=True)
        send = Requester(server.grpc_url, s.max_tokens, s.timeout)
        alive = lambda: server.proc is not None and server.proc.poll() is None  # noqa: E731
        warm_up(send, s.beams)
        if s.stream_requests:
            print(f"   one stream: {s.stream_requests} greedy requests x {s.stream_tokens} tokens, streamed one at "
                  f"a time ... (load {load_average()})", flush=True)
            try:
                on_stream(backend, one_stream(server.grpc_url, s.stream_requests, s.stream_tokens, s.timeout))
            except Exception as e:  # noqa: BLE001 - reported; the rows still run
                print(f"     one stream failed: {type(e).__name__}: {e}", flush=True)
                on_stream(backend, {"error": f"{type(e).__name__}: {e}"[:300]})
        for beam in s.beams:
            for conc in s.concurrency:
                if not alive():
                    raise RuntimeError(f"tritonserver died; see {log_file}")
                n = s.requests_for(conc)
                print(f"   beam {beam} concurrency {conc:>2}: {n} requests ... (load {load_average()})", flush=True)
                row = run_row(send, backend, beam, conc, n, s.row_seconds, alive)
                note = f", {row.errors} errors (first: {row.first_error})" if row.errors else ""
                odd = "" if row.requests == 0 or row.tokens == row.requests * s.max_tokens else \
                    f"  WARNING: {row.tokens_per_request:.1f} tokens/request, expected {s.max_tokens}"
                print(f"     {row.requests} done in {row.seconds:.1f} s: {row.tokens_per_s:.1f} tok/s, p50 "
                      f"{row.p50_s:.2f} s, p99 {row.p99_s:.2f} s{note}{odd}", flush=True)
                on_row(row)
    print(f"   {backend}: server stopped", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    if s.torch_threads:  # inherited by tritonserver and its python stubs (server_env only sets a default)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(s.torch_threads)
    print(f"measuring the memory bandwidth (load {load_average()}) ...", flush=True)
    bw = measure_bandwidth(s.bandwidth_mib)  # before any server: the machine as quiet as it gets
    print(f"bandwidth: {bw.gb_s:.2f} GB/s ({bw.method}; passes {bw.passes_gb_s})", flush=True)
    model_dir = ensure_bench_model()
    model_desc = describe(model_dir)
    print(model_desc, flush=True)
    meta = dict(model=model_desc, model_dir=str(model_dir), cpus=os.cpu_count(),
                omp_threads=os.environ.get("OMP_NUM_THREADS", os.cpu_count()), load_before=load_average(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"), mode=s.mode, prompt=PROMPT, max_tokens=s.max_tokens,
                min_requests=s.min_requests, requests_factor=s.requests_factor, row_seconds=s.row_seconds,
                max_rows=s.max_rows, kv_cache_tokens=s.kv_cache_tokens, backends=s.backends,
                lm_params_m=round(parameter_counts(model_dir)["language_model"] / 1e6, 2), command=s.command,
                bandwidth=bw.to_dict(), stream_requests=s.stream_requests, stream_tokens=s.stream_tokens,
                one_stream={}, machine=machine.describe())
    print(f"load average before: {meta['load_before']} ({os.cpu_count()} CPUs)", flush=True)
    s.out.mkdir(parents=True, exist_ok=True)
    json_path = s.out / f"{s.prefix}results.json"
    rows: list[RowResult] = []

    def save() -> None:
        meta["load_after"] = load_average()
        json_path.write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]}, indent=1))

    def on_row(row: RowResult) -> None:
        rows.append(row)
        save()

    def on_stream(backend: str, res: dict) -> None:
        meta["one_stream"][backend] = res
        if "error" not in res:
            tb = token_bytes(model_dir, res["prompt_tokens"], s.stream_tokens)
            if "token_bytes" not in meta:
                print(f"     {describe_bytes(tb)}", flush=True)
            meta["token_bytes"] = tb.to_dict()
            res["gb_s"], res["fraction"] = res["tok_s"] * tb.total / 1e9, fraction(res["tok_s"], tb, bw)
            print("     " + fraction_line(f"one stream ({backend})", res["tok_s"], tb, bw)
                  + f"; first token after {res['first_s']:.3f} s (median of {res['requests']})", flush=True)
            if "capacity" not in meta:
                meta["capacity"] = capacity(s, res["prompt_tokens"])
                print(f"     {meta['capacity']['text']}", flush=True)
        save()

    status = 0
    try:
        for backend in s.backends:
            run_backend(backend, s, model_dir, on_row, on_stream)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e}); writing what was measured", file=sys.stderr)
        status = 130
    except Exception as e:  # noqa: BLE001 - still write the partial report
        print(f"\nbenchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
        status = 1
    if status == 0 and s.stream_requests:
        bandwidth_again(meta, s.bandwidth_mib)
    if not rows:
        return status or 1
    meta["kernel_races"] = machine.kernel_races()  # what the servers' first loads measured on this machine
    save()
    md_path, png_path = s.out / f"{s.prefix}results.md", s.out / f"{s.prefix}throughput.png"
    md_path.write_text(markdown(rows, meta))
    plot(rows, png_path, title=plot_title(meta))
    print("\n" + console_table(rows))
    print("\n".join([""] + stream_lines(meta) + target_lines(rows, meta)))
    print(f"\nload average after: {meta['load_after']}\nwrote {md_path}, {png_path}, {json_path}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
