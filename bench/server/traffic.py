"""Mixed traffic against the live ensemble with stock `tritonclient` and plain HTTP, every answer checked.

What a new user throws at `make serve` on the demo model: gRPC streamed and not (one long-lived stream per
client thread, as `perf_analyzer --streaming` does), HTTP `/generate`, beam widths 1-4, 0-2 images (inline
`<img src="data:...">` or `<image>` + `images`), and with `adapters=True` a quarter of the single-image
requests through the demo LoRA adapters by `lora_name` (greedy: the adapters were trained for it). Every answer
is compared with the drawn image's truth (in French, or as a sentence, for the adapters).

`python -m bench.server.traffic --grpc localhost:8001 --http localhost:8000 -n 2000 -c 32` runs it by hand; the soak
test runs it against the server it starts.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from triton_vlm.demo import shapes

KINDS = ("grpc_stream", "grpc", "http")
MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    kind: str  # one of KINDS
    beam: int
    prompt: str
    images: tuple[bytes, ...]
    expected: str  # the answer without its leading space
    lora: str | None = None  # a demo adapter by name
    max_tokens: int = 8


@dataclass
class Report:
    ok: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hung: int = 0
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> str:
        lat = sorted(self.latencies) or [0.0]
        return (f"{self.ok} ok, {len(self.wrong)} wrong, {len(self.errors)} errors, {self.hung} hung; "
                f"latency p50 {lat[len(lat) // 2]:.2f} s, p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.2f} s")


def image_pool(n: int = 24, seed: int = 7) -> list[tuple[bytes, str, str]]:
    """(png bytes, shape, color), sizes 64-160 px (where the demo model is reliable)."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        shape, color = shapes.SHAPES[i % 3], list(shapes.COLORS)[(i // 3) % 4]
        img = shapes.draw(shape, color, (rng.randint(64, 160), rng.randint(64, 160)), rng)
        buf = io.BytesIO()
        img.save(buf, "PNG")
        pool.append((buf.getvalue(), shape, color))
    return pool


def make_cases(n: int, seed: int = 0, pool: list | None = None, adapters: bool = False) -> list[Case]:
    from triton_vlm.demo.adapters import ADAPTERS  # noqa: PLC0415

    rng = random.Random(seed)
    pool = pool or image_pool()
    out = []
    for _ in range(n):
        kind, beam, n_img = rng.choice(KINDS), rng.randint(1, 4), rng.choice((0, 1, 1, 2))
        if n_img == 0:
            q = rng.choice(["Say hello.", "Say goodbye."])
            out.append(Case(kind, beam, shapes.prompt(q, 0), (), shapes.TEXT_ONLY[q].strip()))
            continue
        picks = [rng.choice(pool) for _ in range(n_img)]
        lora = None
        if n_img == 1:
            q = rng.choice(list(shapes.QUESTIONS))
            expected = shapes.answer(q, picks[0][1], picks[0][2])
            if adapters and rng.random() < 0.25:
                lora, beam = rng.choice(sorted(ADAPTERS)), 1
                expected = ADAPTERS[lora](q, picks[0][1], picks[0][2])
        else:
            q = rng.choice(list(shapes.TWO_IMAGE_QUESTIONS))
            expected = shapes.TWO_IMAGE_QUESTIONS[q]([p[1] for p in picks], [p[2] for p in picks])
        prompt, images = shapes.prompt(q, n_img), tuple(p[0] for p in picks)
        if rng.random() < 0.5:  # the same images inline
            for img in images:
                tag = f'<img src="data:image/png;base64,{base64.b64encode(img).decode()}">'
                prompt = prompt.replace("<image>", tag, 1)
            images = ()
        out.append(Case(kind, beam, prompt, images, expected.strip(), lora, 16 if lora else MAX_TOKENS))
    return out


class GrpcWorker:
    """One `tritonclient.grpc` client with one long-lived bidirectional stream; one request at a time."""

    def __init__(self, url: str, model: str = "ensemble"):
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        self._g, self.model = grpcclient, model
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: "queue.Queue" = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self._n = 0

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()

    def generate(self, case: Case, timeout: float) -> str:
        g = self._g
        arrays = {"text_input": np.array([[case.prompt.encode()]], dtype=object),
                  "max_tokens": np.array([[case.max_tokens]], np.int32),
                  "beam_width": np.array([[case.beam]], np.int32),
                  "exclude_input_in_output": np.array([[True]]),
                  "stream": np.array([[case.kind == "grpc_stream"]])}
        if case.images:
            arrays["images"] = np.array([list(case.images)], dtype=object)
        if case.lora:
            arrays["lora_name"] = np.array([[case.lora.encode()]], dtype=object)
        inputs = []
        for name, arr in arrays.items():
            dtype = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}[arr.dtype]
            inp = g.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        self._n += 1
        rid = f"{id(self)}-{self._n}"
        self.client.async_stream_infer(self.model, inputs, request_id=rid, enable_empty_final_response=True)
        text, deadline = "", time.monotonic() + timeout
        while True:
            result, error = self.responses.get(timeout=max(0.001, deadline - time.monotonic()))
            if error is not None:
                raise RuntimeError(f"{error.status()}: {error.message()}")
            resp = result.get_response()
            if resp.id != rid:
                raise RuntimeError(f"response for request {resp.id!r} while waiting for {rid!r}")
            names = {o.name for o in resp.outputs}
            if "text_output" in names:
                pieces = result.as_numpy("text_output").reshape(-1)
                seq = result.as_numpy("sequence_index").reshape(-1) if "sequence_index" in names else [0]
                final = resp.parameters["triton_final_response"].bool_param
                if final or int(seq[0]) == 0:  # the final one: [0] is sequence 0's remainder
                    text += pieces[0].decode()
            if resp.parameters["triton_final_response"].bool_param:
                return text


def http_generate(url: str, case: Case, timeout: float) -> str:
    body = {"text_input": case.prompt, "max_tokens": case.max_tokens, "beam_width": case.beam,
            "exclude_input_in_output": True}
    if case.lora:
        body["lora_name"] = case.lora
    if case.images:
        body["images"] = [base64.b64encode(b).decode() for b in case.images]
    req = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
    text = out["text_output"]
    return text[0] if isinstance(text, list) else text


def run(grpc_url: str, http_url: str, cases: list[Case], concurrency: int, timeout: float = 60.0) -> Report:
    """Run `cases` with `concurrency` client threads; a request without its final answer in `timeout` s is hung."""
    report, lock = Report(), threading.Lock()
    todo: "queue.Queue[Case]" = queue.Queue()
    for c in cases:
        todo.put(c)

    def worker() -> None:
        w = None
        try:
            while True:
                try:
                    case = todo.get_nowait()
                except queue.Empty:
                    return
                t0 = time.monotonic()
                try:
                    if case.kind == "http":
                        got = http_generate(http_url, case, timeout)
                    else:
                        w = w or GrpcWorker(grpc_url)
                        got = w.generate(case, timeout)
                except queue.Empty:
                    with lock:
                        report.hung += 1
                    w.close()
                    w = None  # its stream may hold the hung request's late answer
                    continue
                except Exception as e:  # noqa: BLE001 - counted, never raised
                    with lock:
                        report.errors.append(f"{case.kind} beam {case.beam}: {e}"[:300])
                    continue
                with lock:
                    report.latencies.append(time.monotonic() - t0)
                    if got.strip() == case.expected:
                        report.ok += 1
                    else:
                        report.wrong.append(f"{case.kind} beam {case.beam}: {got!r} != {case.expected!r}")
        finally:
            if w is not None:
                w.close()

    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(worker) for _ in range(concurrency)]:
            f.result()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc", default="localhost:8001")
    ap.add_argument("--http", default="localhost:8000")
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-adapters", action="store_true", help="base model only (a server without the demo adapters)")
    args = ap.parse_args()
    t0 = time.monotonic()
    report = run(args.grpc, args.http, make_cases(args.n, args.seed, adapters=not args.no_adapters), args.concurrency)
    print(f"{args.n} requests at concurrency {args.concurrency} in {time.monotonic() - t0:.1f} s: {report.summary()}")
    for line in (report.wrong + report.errors)[:20]:
        print("  ", line)


if __name__ == "__main__":
    main()
