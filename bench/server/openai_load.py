"""Load test of the OpenAI front end next to the same requests over gRPC straight to the ensemble.

    python -m bench.server.openai_load                                   # starts Triton + the front end on the demo model
    python -m bench.server.openai_load --triton localhost:8001 --openai http://localhost:9000   # running ones

Closed-loop clients at each concurrency send streamed chats: one image of the demo task (a pool of 24 drawn
shapes) and one of its questions, `max_tokens` 8, every answer checked against the drawn image. The same
requests go three ways:

- `grpc ensemble`: the rendered prompt + image straight to the ensemble (gRPC streaming, as the front end's
  `ensemble` route sends them) - the baseline;
- `openai`: `POST /v1/chat/completions` (SSE) to the front end, default route (`pipeline`: preprocess -> vision
  -> llm from the front end, so a disconnect cancels the generation);
- `openai, ensemble route`: the front end started with `--route ensemble` (one call to the ensemble).

The HTTP client is a few lines of asyncio (keep-alive connections, chunked SSE read to `[DONE]`): it costs less
CPU per request than the gRPC client (0.3 vs 1.4 ms measured), and on a 2-core machine the client, the front end
and Triton share the cores. NVIDIA's `aiperf` (PyPI) runs offline here, but it installs ~60 packages (pandas,
pyarrow, scipy, dash, ...), runs several worker processes that on 2 cores take CPU from the server, and cannot
send the gRPC baseline; `--aiperf PATH` adds its view of the front end (synthetic prompts and 96x96 images,
`--tokenizer` = the checkpoint folder; run without HF_HUB_OFFLINE, whose code path treats a folder as a hub id).
Writes `bench/results/openai_load.{md,json}`.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_vlm.demo import shapes
from triton_vlm.openai.triton import add_input, add_scalar, bytes_tensor, parse_llm

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
MAX_TOKENS = 8


def image_pool(n: int = 24, seed: int = 3) -> list[tuple[bytes, str, str, str]]:
    """(PNG bytes, question, expected answer, the prompt the demo's chat template renders)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        img, shape, color = shapes.random_example(rng, (96, 96))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        question = (shapes.QUESTION_COLOR, shapes.QUESTION_SHAPE, shapes.QUESTION_DESCRIBE)[i % 3]
        out.append((buf.getvalue(), question, shapes.answer(question, shape, color), shapes.prompt(question)))
    return out


# --- the gRPC baseline ---------------------------------------------------------------------------------------
def _ensemble_request(image: bytes, prompt: str):
    req = service_pb2.ModelInferRequest(model_name="ensemble", id=uuid.uuid4().hex)
    add_scalar(req, "text_input", prompt)
    add_input(req, "images", "BYTES", [1, 1], bytes_tensor([image]))
    for name, value in (("max_tokens", MAX_TOKENS), ("exclude_input_in_output", True), ("stream", True)):
        add_scalar(req, name, value)
    return req


class GrpcEnsemble:
    name = "grpc ensemble"

    def __init__(self, url: str):
        self.channel = grpc.aio.insecure_channel(url)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    async def ask(self, image: bytes, prompt: str, question: str) -> str:
        call = self.stub.ModelStreamInfer(iter([_ensemble_request(image, prompt)]),
                                          metadata=(("triton_grpc_error", "true"),))
        text = b""
        async for msg in call:
            r = parse_llm(msg.infer_response)
            text += b"".join(r.texts)
            if r.final:
                break
        call.cancel()
        return text.decode()

    async def close(self):
        await self.channel.close()


# --- the OpenAI front end, over a minimal HTTP/1.1 client -----------------------------------------------------
class OpenAIChat:
    def __init__(self, base: str, name: str = "openai"):
        u = urllib.parse.urlsplit(base)
        self.host, self.port, self.name = u.hostname, u.port or 80, name
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def ask(self, image: bytes, prompt: str, question: str) -> str:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        body = json.dumps({"model": "demo-v3", "stream": True, "max_tokens": MAX_TOKENS, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status = b""
        while self.idle and not status:  # a kept-alive connection the server may have closed meanwhile
            reader, writer = self.idle.pop()
            writer.write(request)
            status = await reader.readline()
        if not status:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(request)
            status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        text, buf = [], b""
        while True:  # chunked transfer encoding of the SSE body
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[6:]
                if data != b"[DONE]":
                    choices = json.loads(data)["choices"]
                    if choices:
                        text.append(choices[0]["delta"].get("content") or "")
        self.idle.append((reader, writer))
        return "".join(text)

    async def close(self):
        for _, w in self.idle:
            w.close()


async def measure(target, pool, concurrency: int, seconds: float) -> dict:
    for i in range(3):  # warm-up
        await target.ask(pool[i][0], pool[i][3], pool[i][1])
    lat, wrong, stop = [], 0, time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker():
        nonlocal wrong
        while time.perf_counter() < stop:
            image, question, expected, prompt = pool[next(counter) % len(pool)]
            t0 = time.perf_counter()
            got = await target.ask(image, prompt, question)
            lat.append(time.perf_counter() - t0)
            wrong += got != expected

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    return {"path": target.name, "concurrency": concurrency, "requests": len(lat), "wrong": wrong,
            "requests_per_s": len(lat) / elapsed, "mean_ms": 1000 * statistics.fmean(lat),
            "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def start_frontend(triton: str, model_dir: Path, route: str, log: Path) -> tuple[subprocess.Popen, str]:
    from triton_vlm.server.process import free_port  # noqa: PLC0415

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triton_vlm.openai", "--triton", triton, "--model-dir",
                             str(model_dir), "--port", str(port), "--host", "127.0.0.1", "--route", route,
                             "--log-level", "warning"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the front end did not start; see {log}") from None
            time.sleep(0.5)


def run_aiperf(aiperf: str, url: str, model: Path, concurrency: int, work: Path) -> dict:
    """One `aiperf profile` point against the front end: its request throughput and mean latency."""
    out = work / f"aiperf-c{concurrency}"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run([aiperf, "profile", "--model", "demo-v3", "--url", url, "--endpoint-type", "chat", "--streaming",
                    "--tokenizer", str(model), "--concurrency", str(concurrency), "--request-count",
                    str(max(100, 40 * concurrency)), "--warmup-request-count", str(2 * concurrency),
                    "--synthetic-input-tokens-mean", "16", "--output-tokens-mean", str(MAX_TOKENS),
                    "--image-width-mean", "96", "--image-height-mean", "96", "--image-batch-size", "1",
                    "--ui-type", "none", "--artifact-dir", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    data = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    lat = data["request_latency"]
    return {"path": "openai (aiperf)", "concurrency": concurrency, "requests": int(data["request_count"]["avg"]),
            "wrong": 0, "requests_per_s": data["request_throughput"]["avg"], "mean_ms": lat["avg"],
            "p50_ms": lat["p50"], "p99_ms": lat["p99"]}


def markdown(points: list[dict], header: str) -> str:
    base = {p["concurrency"]: p for p in points if p["path"] == "grpc ensemble"}
    rows = [header, "", "| path | concurrency | requests/s | vs gRPC | mean ms | added ms (mean) | p50 ms | p99 ms "
            "| wrong |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        b = base.get(p["concurrency"])
        ratio = f"{p['requests_per_s'] / b['requests_per_s']:.2f}x" if b else ""
        added = f"{p['mean_ms'] - b['mean_ms']:+.1f}" if b else ""
        rows.append(f"| {p['path']} | {p['concurrency']} | {p['requests_per_s']:.1f} | {ratio} | {p['mean_ms']:.1f} "
                    f"| {added} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | {p['wrong']} |")
    return "\n".join(rows) + "\n"


async def sweep(triton: str, urls: list[tuple[str, str]], pool, levels, seconds, rounds) -> list[dict]:
    """Each (target, concurrency) `rounds` times, interleaved so drift on a shared machine hits all alike;
    the best round is kept."""
    targets = [GrpcEnsemble(triton)] + [OpenAIChat(u, name) for u, name in urls]
    best: dict[tuple[str, int], dict] = {}
    for _ in range(rounds):
        for c in levels:
            for t in targets:
                p = await measure(t, pool, c, seconds)
                key = (p["path"], c)
                if key not in best or p["requests_per_s"] > best[key]["requests_per_s"]:
                    best[key] = p
                print(f"{p['path']:24s} c={c:2d} {p['requests_per_s']:7.1f} req/s mean {p['mean_ms']:6.1f} ms "
                      f"({p['requests']} requests, {p['wrong']} wrong)", flush=True)
    for t in targets:
        await t.close()
    return [best[(t.name, c)] for c in levels for t in targets]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", help="gRPC host:port of a running server (default: start one on the demo model)")
    ap.add_argument("--openai", help="URL of a running front end (default: start one, and one with --route ensemble)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--seconds", type=float, default=10.0, help="per point and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--aiperf", help="an aiperf executable: also measure the front end with it")
    args = ap.parse_args(argv)
    from triton_vlm.demo import ensure_demo_model  # noqa: PLC0415

    model = ensure_demo_model()
    work = Path(tempfile.mkdtemp(prefix="triton-vlm-openai-load-"))
    server, procs = None, []
    try:
        triton = args.triton
        if triton is None:
            from triton_vlm.server.process import TritonServer, free_port  # noqa: PLC0415

            server = TritonServer(str(model), free_port(), free_port(), free_port(), run_dir=work,
                                  log_file=work / "server.log").__enter__()
            triton = server.grpc_url
        urls = [(args.openai, "openai")] if args.openai else []
        if not urls:
            for route, name in (("pipeline", "openai"), ("ensemble", "openai, ensemble route")):
                proc, url = start_frontend(triton, model, route, work / f"frontend-{route}.log")
                procs.append(proc)
                urls.append((url, name))
        levels = [int(x) for x in args.concurrency.split(",")]
        points = asyncio.run(sweep(triton, urls, image_pool(), levels, args.seconds, args.rounds))
        if args.aiperf:
            points += [run_aiperf(args.aiperf, urls[0][0], model, c, work) for c in levels]
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        if server is not None:
            server.stop()
    header = (f"Streamed chats, one 96x96 image + a demo question, max_tokens {MAX_TOKENS}, demo model, "
              f"{os.cpu_count()} CPUs (client, front end and Triton share them); best of {args.rounds} rounds of "
              f"{args.seconds:g} s per point")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "openai_load.json").write_text(json.dumps({"header": header, "points": points}, indent=2))
    (args.out / "openai_load.md").write_text(markdown(points, header))
    print(markdown(points, header))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if any(p["wrong"] for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
