"""A plain request's latency while a huge JSON schema compiles (issue 34: within 1.5x of its baseline).

    python -m bench.server.guide_stall                 # demo model, a 40,000-value enum (~3 min of compiling here)
    python -m bench.server.guide_stall --values 10000  # a smaller enum (~15 s)

One real `tritonserver` (the ensemble and its three steps) with `guide_compile_timeout_s` long enough that the
compile runs to its end. Measured through Triton's gRPC, one request at a time: `--requests` plain requests alone
(the baseline), then the enum schema sent on a thread of its own, and, once the llm's `grammar_waiting` gauge says
it is compiling, `--requests` plain requests more. Printed: both medians, their ratio, the compile's own time and
the machine; exit status 1 when the ratio is over `--target`.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

PROMPT = "USER: Say hello. ASSISTANT:"


def _request(url: str, guide: str | None = None, timeout: float = 900.0) -> float:
    """One streamed ensemble request (8 tokens; a JSON-schema guide when given): its seconds to the final answer."""
    import queue

    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    def inp(name, value, dtype, npt):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=npt))
        return t

    ins = [inp("text_input", PROMPT, "BYTES", object), inp("max_tokens", 8 if guide is None else 24, "INT32", np.int32)]
    if guide is not None:
        ins += [inp("guided_decoding_guide_type", "json_schema", "BYTES", object),
                inp("guided_decoding_guide", guide, "BYTES", object)]
    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    t0 = time.perf_counter()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("ensemble", ins)
        _, err = q.get(timeout=timeout)
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    if err is not None and guide is None:
        raise RuntimeError(f"a plain request failed: {err}")
    return time.perf_counter() - t0


def _waiting(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(r"^triton_vlm_engine_grammar_waiting\{[^}]*\} (\S+)", text, re.M)
    return float(m.group(1)) if m else 0.0


def measure(url: str, metrics_port: int, values: int, requests: int) -> dict:
    schema = {"type": "object", "required": ["v"], "additionalProperties": False,
              "properties": {"v": {"enum": [f"value-{i:05d}-{time.time_ns() % 997}" for i in range(values)]}}}
    _request(url)  # warm
    alone = [_request(url) for _ in range(requests)]
    compile_s: list[float] = []
    big = threading.Thread(target=lambda: compile_s.append(_request(url, json.dumps(schema))), daemon=True)
    big.start()
    deadline = time.monotonic() + 60
    while _waiting(metrics_port) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    during = [_request(url) for _ in range(requests)]
    compiling_at_end = big.is_alive()
    big.join(1200)
    base, load = statistics.median(alone), statistics.median(during)
    return {"alone_ms": [round(x * 1e3, 1) for x in alone], "during_ms": [round(x * 1e3, 1) for x in during],
            "baseline_ms": base * 1e3, "during_median_ms": load * 1e3, "ratio": load / base,
            "still_compiling_after_the_last": compiling_at_end, "guided_request_s": compile_s[0] if compile_s else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=40000, help="values of the enum (40,000: ~880 KB of schema)")
    ap.add_argument("--requests", type=int, default=15, help="plain requests alone, then during the compile")
    ap.add_argument("--target", type=float, default=1.5, help="the ratio during / alone to stay within")
    args = ap.parse_args(argv)

    from triton_vlm.demo import ensure_demo_model  # noqa: PLC0415
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    from bench.common.machine import describe, line  # noqa: PLC0415

    model = ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="guide-stall-") as tmp:
        server = TritonServer(str(model), free_port(), free_port(), free_port(), run_dir=Path(tmp),
                              params={"llm": {"guide_compile_timeout_s": "1200"}}, exit_timeout=10,
                              models=("ensemble", "preprocess", "vision", "llm"), log_file=Path(tmp) / "server.log")
        with server:
            r = measure(server.grpc_url, server.metrics_port, args.values, args.requests)
    print(f"machine: {line({'machine': describe()})}")
    print(f"enum of {args.values} values; plain requests (8 tokens, gRPC, one at a time): alone median "
          f"{r['baseline_ms']:.1f} ms, while the schema compiles {r['during_median_ms']:.1f} ms = {r['ratio']:.2f}x "
          f"(target <= {args.target}x); the guided request took {r['guided_request_s']:.1f} s; "
          f"still compiling after the last plain request: {r['still_compiling_after_the_last']}")
    print(json.dumps(r))
    return 0 if r["ratio"] <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
