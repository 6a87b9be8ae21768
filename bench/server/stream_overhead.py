"""What streaming costs per token: one greedy request at a time, streamed and not, alternating on one server.

    python -m bench.server.stream_overhead               # 12 rounds of 64 tokens (~1 min on 2 CPUs)

Each round sends the same greedy request (the throughput benchmark's prompt and first image, `min_tokens =
max_tokens`) twice: streamed (the time between its first and last token responses / the tokens in between)
and not streamed (its latency minus the streamed requests' median time to the first token, / the tokens after
the first). Alternating within one server keeps the machine's drift out of the difference. Printed per mode: the
median ms per token and what that is as a fraction of the memory bandwidth measured at start
(`bench.common.bandwidth`); the difference is what delivering each token as its own response costs the decode.

Why it matters: the llm's responses are built and sent by the responder thread (`triton/responder.py`) while the
engine thread decodes, in one Python process. Every token's response makes the two threads trade the GIL, and
on these 2-vCPU machines each trade costs the engine a wake-up of an idle vCPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common.bandwidth import fraction, measure_bandwidth, token_bytes
from bench.common.model import describe, ensure_bench_model
from bench.server.throughput import PROMPT, make_images, stream_one


def rounds(url: str, n: int, tokens: int, timeout: float) -> tuple[list[float], list[float], list[float]]:
    """-> (streamed s/token, non-streamed latencies s, streamed first-token times s), one of each per round."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    client = VLMClient(url, protocol="grpc", timeout=timeout)
    image = make_images()[0]
    for _ in range(2):  # warm-up
        client.generate(PROMPT, [image], max_tokens=tokens, min_tokens=tokens)
        stream_one(client, image, tokens)
    per_token, latency, first = [], [], []
    for _ in range(n):
        s = stream_one(client, image, tokens)
        per_token.append(1.0 / s["tok_s"])
        first.append(s["first_s"])
        t0 = time.perf_counter()
        res = client.generate(PROMPT, [image], max_tokens=tokens, min_tokens=tokens, exclude_input_in_output=True)
        latency.append(time.perf_counter() - t0)
        if len(res.output_ids[0]) != tokens:
            raise RuntimeError(f"a non-streamed request returned {len(res.output_ids[0])} tokens, not {tokens}")
    return per_token, latency, first


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=120.0)
    s = ap.parse_args(argv)
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    model_dir = ensure_bench_model()
    print(describe(model_dir), flush=True)
    bw = measure_bandwidth()
    print(f"bandwidth: {bw.gb_s:.2f} GB/s ({bw.method})", flush=True)
    with tempfile.TemporaryDirectory(prefix="triton-vlm-bench-stream-") as tmp:
        with TritonServer(str(model_dir), free_port(), free_port(), free_port(), params={"llm": {"backend": "engine"}},
                          run_dir=Path(tmp) / "run", log_file=Path(tmp) / "server.log") as server:
            from triton_vlm_client import VLMClient  # noqa: PLC0415

            prompt = VLMClient(server.grpc_url, protocol="grpc").generate(
                PROMPT, [make_images()[0]], max_tokens=1, return_num_input_tokens=True).num_input_tokens
            per_token, latency, first = rounds(server.grpc_url, s.rounds, s.tokens, s.timeout)
    tb = token_bytes(model_dir, prompt, s.tokens)
    ttft = statistics.median(first)
    streamed = statistics.median(per_token)
    plain = statistics.median((x - ttft) / (s.tokens - 1) for x in latency)
    for name, sec in (("streamed", streamed), ("not streamed", plain)):
        rate = 1.0 / sec
        print(f"{name:>12}: {1000 * sec:.2f} ms/token = {rate:.1f} tok/s x {tb.total / 1e6:.2f} MB = "
              f"{100 * fraction(rate, tb, bw):.1f}% of {bw.gb_s:.2f} GB/s", flush=True)
    print(f"streaming costs {1000 * (streamed - plain):.2f} ms per token ({s.rounds} rounds of {s.tokens} tokens, "
          f"median time to first token {1000 * ttft:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
