"""Bursts of concurrent requests at one dynamically batched model (`preprocess`): the latency of each request.

    python -m bench.server.queue_stall                    # our model repository (~30 s on 2 CPUs)
    python -m bench.server.queue_stall --queue-size 1024  # preprocess with `default_queue_policy { max_queue_size }`

Why: with a queue policy (a `max_queue_size` or a queue timeout), Triton's dynamic batcher does not prefetch
payloads. It hands a batch on only while the instance is idle, and nothing wakes it when the instance becomes
idle again. A request that arrives while the one instance is busy waits for the next arrival, or for the
batcher's 500 ms idle wait (`DynamicBatchScheduler::WaitForPayloadSlotAvailable`, triton core). Our configs
therefore set no queue policy; overload is refused by the llm's `max_queue`.

Each burst sends 2-4 requests at once (one thread each, 0-10 ms apart), each with three new images, then
pauses `--pause` s with nothing in flight. Printed: requests, median / p99 / max latency, and how many took over
`--stall-ms`.
"""
from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from bench.server.chat import images
from bench.common.model import describe, ensure_bench_model

PROMPT = "USER: <image>\n<image>\n<image>\nWhat do these show? ASSISTANT:"


def with_queue_policy(dest: Path, size: int) -> Path:
    """A copy of our model repository whose preprocess has `default_queue_policy { max_queue_size: size }`."""
    from triton_vlm.server.repository import DEFAULT_MODEL_REPOSITORY  # noqa: PLC0415

    shutil.copytree(DEFAULT_MODEL_REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = dest / "preprocess" / "config.pbtxt"
    text, n = re.subn(r"dynamic_batching \{ (max_queue_delay_microseconds: \d+) \}",
                      rf"dynamic_batching {{ \1 default_queue_policy {{ max_queue_size: {size} }} }}",
                      cfg.read_text())
    if n != 1:
        raise SystemExit(f"{cfg}: no one-line dynamic_batching block to add the queue policy to")
    cfg.write_text(text)
    return dest


def inputs(imgs: list[bytes]):
    import tritonclient.grpc as grpcclient  # noqa: PLC0415
    from triton_vlm_client import protocol as P  # noqa: PLC0415
    from triton_vlm_client.request import build_tensors, wire_params  # noqa: PLC0415

    out = []
    for name, dtype, arr in build_tensors(PROMPT, imgs, wire_params(dict(max_tokens=8))):
        if name in (P.TEXT_INPUT, P.IMAGES, P.MAX_TOKENS):
            out.append(grpcclient.InferInput(name, list(arr.shape), dtype))
            out[-1].set_data_from_numpy(arr)
    return out


def bursts(url: str, n: int, pause: float, timeout: float) -> list[float]:
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    clients = [grpcclient.InferenceServerClient(url) for _ in range(4)]
    rng, out = random.Random(0), []
    try:
        for b in range(n):
            width = rng.randint(2, 4)
            delays = [rng.random() * 0.01 for _ in range(width)]
            res: list[Optional[float]] = [None] * width

            def one(i: int, b=b, delays=delays, res=res) -> None:
                time.sleep(delays[i])
                req = inputs(images(10 * b + i, 3))
                t0 = time.perf_counter()
                clients[i].infer("preprocess", req, client_timeout=timeout)
                res[i] = time.perf_counter() - t0

            threads = [threading.Thread(target=one, args=(i,)) for i in range(width)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if any(r is None for r in res):
                raise RuntimeError(f"burst {b}: a request failed (see the server log)")
            out += res
            time.sleep(pause)
    finally:
        for c in clients:
            c.close()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=200)
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between bursts (nothing in flight)")
    ap.add_argument("--queue-size", type=int, default=0, help="give preprocess this max_queue_size (0: as is)")
    ap.add_argument("--stall-ms", type=float, default=250.0)
    ap.add_argument("--timeout", type=float, default=10.0)
    s = ap.parse_args(argv)
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    model_dir = ensure_bench_model()
    print(describe(model_dir), flush=True)
    with tempfile.TemporaryDirectory(prefix="triton-vlm-bench-queue-") as tmp:
        kw = {"model_repository": with_queue_policy(Path(tmp) / "repo", s.queue_size)} if s.queue_size else {}
        with TritonServer(str(model_dir), free_port(), free_port(), free_port(), models=("preprocess",),
                          run_dir=Path(tmp) / "run", log_file=Path(tmp) / "server.log", **kw) as server:
            lat = bursts(server.grpc_url, s.bursts, s.pause, s.timeout)
    ms = sorted(1000 * x for x in lat)
    stalls = sum(x > s.stall_ms for x in ms)
    policy = f"max_queue_size {s.queue_size}" if s.queue_size else "our config (no queue policy)"
    print(f"preprocess, {policy}: {len(ms)} requests in {s.bursts} bursts; median {statistics.median(ms):.1f} ms, "
          f"p99 {ms[int(0.99 * (len(ms) - 1))]:.1f} ms, max {ms[-1]:.1f} ms; {stalls} over {s.stall_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
