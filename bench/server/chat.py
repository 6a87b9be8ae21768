"""Chat benchmark: prefix caching on vs off, through the server, in one run.

    python -m bench.server.chat                       # 4 chats x 6 turns, 3 rounds, both modes (~2 min on 2 CPUs)
    python -m bench.server.chat --chats 2 --turns 3 --rounds 1   # smaller

Each chat is a conversation of `--turns` turns; every turn adds a question with a new image and resends the
whole history, images included (what a chat UI or the OpenAI chat API sends): turn t carries t images, the t-1
earlier questions and answers, and the new question. The `--chats` chats run at the same time (one client thread
each, a turn is sent when the previous answer is complete; `--one-at-a-time`: one chat after another);
`--rounds` times, with new images each round. Every answer is streamed with `max_tokens ==
min_tokens` (the benchmark model is random: fixed lengths on both sides).

The same chats run on two servers of the benchmark model (`bench.common.model`), both up for the whole run: llm
parameter `enable_prefix_caching` 1 and 0; the rounds alternate between them (on/off, off/on, ...) so that both
see the same load on a shared machine. Measured per turn: time to first token (client side, send to
the first streamed piece), and from the server's `num_input_tokens` / `num_cached_tokens`, the prompt tokens
the engine computed (prefill). Printed: prefill tokens computed over all turns in both modes and their
reduction, the mean time to first token of the last `--last-turns` turns of every chat in both modes and their
ratio (off / on), and whether the answers are identical (greedy: prefix caching must not change a token).
Writes `bench/results/chat.json`.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from bench.common.model import describe, ensure_bench_model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "chat.json"
QUESTIONS = ["Describe the image in detail.", "What shape is in this one?", "Which color is it?",
             "Compare it with the first image.", "Is there anything unusual here?", "Summarize what you saw so far.",
             "What is in the background?", "Count the shapes."]


@dataclass
class Turn:
    chat: int
    turn: int  # 1-based
    ttft_s: float
    e2e_s: float
    input_tokens: int
    cached_tokens: int
    answer: str

    @property
    def computed(self) -> int:
        return self.input_tokens - self.cached_tokens


def images(chat: int, turns: int) -> list[bytes]:
    """One PNG per turn, distinct across chats and turns, the same every run."""
    from triton_vlm.demo.shapes import COLORS, SHAPES, draw  # noqa: PLC0415

    rng, out = random.Random(1000 + chat), []
    for t in range(turns):
        buf = io.BytesIO()
        draw(SHAPES[(chat + t) % len(SHAPES)], list(COLORS)[(3 * chat + t) % len(COLORS)], size=(64, 64),
             rng=rng).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def stream_turn(url: str, prompt: str, imgs: list[bytes], max_tokens: int, timeout: float):
    """One streamed request -> (ttft s, e2e s, answer text, num_input_tokens, num_cached_tokens)."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415
    from triton_vlm_client import protocol as P  # noqa: PLC0415
    from triton_vlm_client.request import build_tensors, wire_params  # noqa: PLC0415

    params = wire_params(dict(max_tokens=max_tokens, min_tokens=max_tokens, return_num_input_tokens=True))
    inputs = []
    for name, dtype, arr in build_tensors(prompt, imgs, params, stream=True):
        inputs.append(grpcclient.InferInput(name, list(arr.shape), dtype))
        inputs[-1].set_data_from_numpy(arr)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)),
                        stream_timeout=timeout)
    ttft, text, n_in, n_cached, pieces = None, b"", 0, 0, []
    try:
        t0 = time.perf_counter()
        client.async_stream_infer(P.MODEL, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        while True:
            t, result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"request failed: {error}")
            resp = result.get_response()
            names = {o.name for o in resp.outputs}
            if P.TEXT_OUTPUT in names:
                if ttft is None:
                    ttft = t - t0
                pieces.append(b"".join(x if isinstance(x, bytes) else str(x).encode()
                                       for x in result.as_numpy(P.TEXT_OUTPUT).reshape(-1)[:1]))
                n_in = int(result.as_numpy(P.NUM_INPUT_TOKENS).reshape(-1)[0])
                n_cached = int(result.as_numpy(P.NUM_CACHED_TOKENS).reshape(-1)[0])
            final = resp.parameters.get("triton_final_response")
            if final is None or final.bool_param:
                return ttft, t - t0, b"".join(pieces).decode("utf-8", "replace"), n_in, n_cached
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def scrape(port: int) -> dict[str, float]:
    """Triton's and our metrics, summed over label sets that differ only in labels other than `model`:
    "name{model}" -> value."""
    import re  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^([a-z_]+)\{([^}]*)\} (\S+)$', text, re.M):
        model = re.search(r'model="([^"]+)"', m.group(2))
        key = f"{m.group(1)}{{{model.group(1) if model else ''}}}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds per request inside each model (Triton's request duration: queue + compute) and the llm's own
    time to first token (from its receipt of the request)."""
    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    out = {}
    for model in ("preprocess", "vision"):
        n = d(f"nv_inference_request_success{{{model}}}")
        out[f"{model}_s"] = d(f"nv_inference_request_duration_us{{{model}}}") / 1e6 / n if n else float("nan")
    n = d("triton_vlm_time_to_first_token_seconds_count{llm}")
    out["llm_ttft_s"] = d("triton_vlm_time_to_first_token_seconds_sum{llm}") / n if n else float("nan")
    return out


def run_chat(url: str, chat: int, s: argparse.Namespace, out: list[Turn], lock: threading.Lock) -> None:
    history, imgs = "", images(chat, s.turns)
    for t in range(1, s.turns + 1):
        question = QUESTIONS[(chat + t) % len(QUESTIONS)]
        prompt = f"{history}USER: <image>\n{question} ASSISTANT:"
        ttft, e2e, answer, n_in, n_cached = stream_turn(url, prompt, imgs[:t], s.max_tokens, s.timeout)
        with lock:
            out.append(Turn(chat, t, ttft, e2e, n_in, n_cached, answer))
        history = f"{prompt} {answer} "


def start(stack: ExitStack, model_dir: Path, caching: bool, s: argparse.Namespace):
    from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

    params = {"llm": {"enable_prefix_caching": "1" if caching else "0", "kv_cache_tokens": str(s.kv_cache_tokens),
                      "max_rows": "64"}}
    run_dir = Path(tempfile.mkdtemp(prefix=f"triton-vlm-bench-chat-{int(caching)}-"))
    print(f"== starting tritonserver, prefix caching {'on' if caching else 'off'} (log {run_dir / 'server.log'})",
          flush=True)
    server = stack.enter_context(TritonServer(str(model_dir), free_port(), free_port(), free_port(), params=params,
                                              run_dir=run_dir, log_file=run_dir / "server.log"))
    run_round(server, 900, s, [])  # warm-up: one round of other chats (concurrent batch shapes seen once)
    return server


def run_round(server, first_chat: int, s: argparse.Namespace, turns: list[Turn]) -> float:
    """The `--chats` chats numbered from `first_chat`, at the same time; returns the round's seconds."""
    lock, errors = threading.Lock(), []

    def chat(i: int) -> None:
        try:
            run_chat(server.grpc_url, i, s, turns, lock)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(first_chat + i,), daemon=True) for i in range(s.chats)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
        if getattr(s, "one_at_a_time", False):  # each chat alone: TTFT without the other chats' work
            th.join()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} chats failed; first: {errors[0]!r}")
    return time.perf_counter() - t0


def run_both(model_dir: Path, s: argparse.Namespace) -> dict[bool, tuple[list[Turn], dict[str, float]]]:
    """Both servers up at once; the rounds alternate between them (on/off, then off/on, ...), so that both modes
    see the same load on a shared machine. Each round has new chats (other images): nothing is shared across
    rounds, and the same chats run in both modes."""
    with ExitStack() as stack:
        servers = {caching: start(stack, model_dir, caching, s) for caching in (True, False)}
        turns: dict[bool, list[Turn]] = {True: [], False: []}
        before = {c: scrape(srv.metrics_port) for c, srv in servers.items()}
        for r in range(s.rounds):
            for caching in ((True, False) if r % 2 == 0 else (False, True)):
                dt = run_round(servers[caching], r * s.chats, s, turns[caching])
                print(f"   round {r + 1}, prefix caching {'on ' if caching else 'off'}: {s.chats * s.turns} turns in "
                      f"{dt:.1f} s", flush=True)
        out = {}
        for caching, srv in servers.items():
            parts = breakdown(before[caching], scrape(srv.metrics_port))
            out[caching] = (sorted(turns[caching], key=lambda x: (x.chat, x.turn)), parts)
    return out


def summary(on: list[Turn], off: list[Turn], last: int, turns: int) -> dict:
    def ttft_last(ts):
        return statistics.mean(x.ttft_s for x in ts if x.turn > turns - last)

    computed_on, computed_off = sum(x.computed for x in on), sum(x.computed for x in off)
    return dict(
        prompt_tokens=sum(x.input_tokens for x in on),
        prefill_tokens_on=computed_on, prefill_tokens_off=computed_off,
        prefill_reduction=1 - computed_on / computed_off,
        ttft_last_on_s=ttft_last(on), ttft_last_off_s=ttft_last(off),
        ttft_ratio=ttft_last(off) / ttft_last(on),
        answers_identical=[x.answer for x in on] == [x.answer for x in off],
    )


def per_turn_table(on: list[Turn], off: list[Turn], turns: int) -> str:
    lines = ["turn | prompt tokens | computed on | computed off | TTFT on s | TTFT off s",
             "---: | ---: | ---: | ---: | ---: | ---:"]
    for t in range(1, turns + 1):
        a, b = [x for x in on if x.turn == t], [x for x in off if x.turn == t]
        lines.append(f"{t} | {sum(x.input_tokens for x in a)} | {sum(x.computed for x in a)} | "
                     f"{sum(x.computed for x in b)} | {statistics.mean(x.ttft_s for x in a):.3f} | "
                     f"{statistics.mean(x.ttft_s for x in b):.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--last-turns", type=int, default=2, help="time to first token averaged over these turns")
    ap.add_argument("--rounds", type=int, default=3, help="the chats run this many times (new images each time)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the server (0: its default)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="run a round's chats one after another instead of at once (each turn's TTFT without "
                         "the other chats' turns prefilled or decoded beside it)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    s = ap.parse_args(argv)
    if s.torch_threads:  # inherited by tritonserver and its python stubs
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(s.torch_threads)
    model_dir = ensure_bench_model()
    print(describe(model_dir), flush=True)
    print(f"{s.chats} chats {'one at a time' if s.one_at_a_time else 'at once'} x {s.turns} turns x {s.rounds} "
          f"rounds, {s.max_tokens} tokens per answer, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)", flush=True)
    both = run_both(model_dir, s)
    (on, parts_on), (off, parts_off) = both[True], both[False]
    res = summary(on, off, s.last_turns, s.turns)
    res.update({f"{k}_on": v for k, v in parts_on.items()}, **{f"{k}_off": v for k, v in parts_off.items()})
    print(per_turn_table(on, off, s.turns))
    print(f"\nprefill tokens computed: {res['prefill_tokens_on']} with prefix caching, {res['prefill_tokens_off']} "
          f"without ({res['prompt_tokens']} prompt tokens sent): {100 * res['prefill_reduction']:.1f}% fewer")
    print(f"time to first token, last {s.last_turns} turns: {res['ttft_last_on_s'] * 1000:.1f} ms with, "
          f"{res['ttft_last_off_s'] * 1000:.1f} ms without: {res['ttft_ratio']:.2f}x")
    print(f"inside the llm (from its receipt of the request), all turns: {res['llm_ttft_s_on'] * 1000:.1f} ms with, "
          f"{res['llm_ttft_s_off'] * 1000:.1f} ms without: {res['llm_ttft_s_off'] / res['llm_ttft_s_on']:.2f}x; "
          f"preprocess {res['preprocess_s_on'] * 1000:.1f} / {res['preprocess_s_off'] * 1000:.1f} ms, vision "
          f"{res['vision_s_on'] * 1000:.1f} / {res['vision_s_off'] * 1000:.1f} ms per turn (with / without)")
    print(f"answers identical with and without: {res['answers_identical']}")
    s.out.parent.mkdir(parents=True, exist_ok=True)
    s.out.write_text(json.dumps(dict(settings={k: str(v) for k, v in vars(s).items()}, summary=res,
                                     on=[asdict(x) for x in on], off=[asdict(x) for x in off]), indent=1))
    print(f"wrote {s.out}")
    return 0 if res["answers_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
