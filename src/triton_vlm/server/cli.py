"""`python -m triton_vlm.server` (console script `triton-vlm-serve`): start a real Triton Inference Server on
our model repository.

1. installs the tritonserver tree (`install.py`) and fills a run copy of `model_repository/` (`repository.py`);
2. starts the server (`process.py`), waits for readiness, answers a demo request (with each demo LoRA adapter
   too) and prints where it listens;
3. supervises the server (`supervisor.py`: restarts it when it or one of its stubs dies) and on SIGINT / SIGTERM
   shuts it down cleanly; the server gets SIGTERM if the launcher dies, even by SIGKILL (`procs.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from ..paths import cache_dir
from . import cpu_layout, rundir
from .auth import (API_KEY_HEADER, ENV_API_KEY, ENV_HOST, EXPOSE_HINT, LOOPBACK, bearer, check_key, connect_host,
                   exposure_error, is_loopback)
from .frontend import OpenAIFrontend
from .process import TritonServer
from .repository import check_parameters
from .supervisor import Supervised, Supervisor


def _demo_png() -> bytes:
    """The demo request's image: a blue triangle the demo model was trained on, as PNG."""
    import io  # noqa: PLC0415
    import random  # noqa: PLC0415

    from ..demo.shapes import draw  # noqa: PLC0415

    buf = io.BytesIO()
    draw("triangle", "blue", size=(96, 80), rng=random.Random(0)).save(buf, "PNG")
    return buf.getvalue()


def smoke_request(grpc_url: str, demo: bool, api_key: str | None = None) -> str:
    """Answer one request through the running server (proves the whole path works) and describe it."""
    from triton_vlm_client import VLMClient  # noqa: PLC0415

    with VLMClient(grpc_url, protocol="grpc", timeout=120, api_key=api_key or "") as client:
        if demo:
            prompt = "USER: <image>\nDescribe the image. ASSISTANT:"
            res = client.generate(prompt, [_demo_png()], max_tokens=8)
            return f"{prompt!r} + a blue triangle -> {res.texts[0]!r}"
        prompt = "USER: Hello! ASSISTANT:"
        res = client.generate(prompt, max_tokens=16)
        return f"{prompt!r} -> {res.texts[0]!r}"


def adapter_smoke_request(http_url: str, lora_name: str, api_key: str | None = None) -> str:
    """The demo question again, with one of the demo LoRA adapters (by name, over HTTP /generate)."""
    import base64  # noqa: PLC0415

    prompt = "USER: <image>\nDescribe the image. ASSISTANT:"
    body = {"text_input": prompt, "images": [base64.b64encode(_demo_png()).decode()], "max_tokens": 12,
            "exclude_input_in_output": True, "lora_name": lora_name}
    headers = {API_KEY_HEADER: bearer(api_key)} if api_key else {}
    req = urllib.request.Request(f"http://{http_url}/v2/models/ensemble/generate", json.dumps(body).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.loads(r.read())["text_output"]
    return f"{prompt!r} + a blue triangle, lora_name {lora_name!r} -> {text!r}"


def _parse_set(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects MODEL.KEY=VALUE or KEY=VALUE, got {item!r}")
        model, dot, key = key.rpartition(".")
        out.setdefault(model if dot else "*", {})[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="triton-vlm-serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("MODEL") or None,
                    help="Hugging Face LLaVA checkpoint dir (default: the built-in demo model, built if missing)")
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--device", default=os.environ.get("DEVICE"), help="cpu or cuda (every model)")
    ap.add_argument("--set", action="append", default=[], metavar="[MODEL.]KEY=VALUE",
                    help="set a model parameter, e.g. llm.backend=hf or vision.vision_bits=16")
    ap.add_argument("--tritonserver", default=os.environ.get("TRITONSERVER"),
                    help="use this tritonserver binary (e.g. /opt/tritonserver/bin/tritonserver in NVIDIA's\n"
                         "container) instead of the one in nvidia-pytriton")
    ap.add_argument("--lora-dir", default=os.environ.get("LORA_DIR"),
                    help="LoRA adapter registry: one adapter per subfolder (PEFT, or TensorRT-LLM's .npy pair);\n"
                         "clients select one with lora_name (or its task id)")
    ap.add_argument("--llmapi-model-name", default=os.environ.get("LLMAPI_MODEL_NAME") or "tensorrt_llm",
                    help="the name TensorRT-LLM's llmapi interface is served under (default tensorrt_llm)")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--log-file", default=os.environ.get("TRITON_VLM_LOG"),
                    help="tritonserver's log (default: <run dir>/tritonserver.log; '-' = this terminal)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness, at the start and after each restart")
    ap.add_argument("--openai-port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)),
                    help="the OpenAI-compatible API (python -m triton_vlm.openai) beside Triton; 0: none")
    ap.add_argument("--api-key", default=os.environ.get(ENV_API_KEY),
                    help="every port that serves inference requires 'Authorization: Bearer KEY' (also\n"
                         "$TRITON_VLM_API_KEY, which keeps it off this command line): the OpenAI API, and\n"
                         "Triton's HTTP and gRPC for all but health (gRPC metadata\n"
                         "'triton-grpc-protocol-authorization'); docs/security.md")
    ap.add_argument("--host", default=os.environ.get(ENV_HOST) or LOOPBACK,
                    help=f"the address every port listens on (also ${ENV_HOST}); default {LOOPBACK}: this machine\n"
                         "only. --host 0.0.0.0 (every interface) needs --api-key, or --insecure")
    ap.add_argument("--insecure", action="store_true",
                    help="allow a --host other than loopback without --api-key: whoever reaches it may use every\n"
                         "model and Triton's own APIs (docs/security.md)")
    ap.add_argument("--served-model-name", default=None,
                    help="the base model's id in the OpenAI API (default: the checkpoint folder's name)")
    ap.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                    help="the OpenAI API's parser of the model's tool calls (tool_choice 'auto'; docs/interfaces.md: Tools)")
    ap.add_argument("--cuda-pool-mb", type=int, default=None,
                    help="Triton's CUDA memory pool per GPU in MiB (default: sized for image_embeds traffic)")
    args = ap.parse_args(argv)
    if args.api_key:
        try:
            check_key(args.api_key)
        except ValueError as e:
            raise SystemExit(f"triton-vlm: {e}") from None
    refused = exposure_error(args.host, args.api_key, args.insecure)
    if refused:
        raise SystemExit(f"triton-vlm: {refused}")
    model, params = _model_and_params(args)
    run_dir = rundir.create()  # removed at a clean stop; kept (with the log) when the server failed
    log_file = None if args.log_file == "-" else Path(args.log_file or run_dir / "tritonserver.log")
    server = TritonServer(str(model), args.http_port, args.grpc_port, args.metrics_port, params, run_dir=run_dir,
                          log_file=log_file, log_verbose=args.log_verbose, tritonserver=args.tritonserver,
                          cuda_pool_mb=args.cuda_pool_mb, api_key=args.api_key or None, host=args.host,
                          renames={} if args.llmapi_model_name == "tensorrt_llm" else
                          {"tensorrt_llm": args.llmapi_model_name})
    print(f"triton-vlm: starting tritonserver on {model}" + (f" (log: {log_file})" if log_file else ""),
          flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        server.start()
    except (ValueError, OSError) as e:  # a checkpoint the GPU sizing cannot read, a parameter refused
        print(f"triton-vlm: cannot start tritonserver: {e}", file=sys.stderr)
        rundir.remove(run_dir)
        return 1
    try:
        server.wait_ready(args.timeout, abort=stopping)
    except (RuntimeError, TimeoutError) as e:
        if server.failure_cause() is None and log_file and log_file.exists():  # no cause found: the log's end
            sys.stderr.write(log_file.read_text(errors="replace")[-4000:])
        print(f"triton-vlm: {e}", file=sys.stderr)
        server.stop()
        return 1
    children: list[Supervised] = [server]
    if args.openai_port and not stopping.is_set():
        frontend = _start_frontend(args, server, model, run_dir)
        if frontend is None:
            server.stop()
            return 1
        children.append(frontend)
    if not stopping.is_set():
        _print_banner(args, server, model, log_file)
        rc = _supervise(stopping, args.timeout, *children)
    else:
        rc = 0
    for child in reversed(children):
        child.stop()
    if rc == 0:
        rundir.remove(run_dir)
    return rc


def _start_frontend(args, server: TritonServer, model: Path, run_dir: Path) -> OpenAIFrontend | None:
    """The OpenAI-compatible front end on `--openai-port`, once it answers /health; None (said why) if not."""
    extra: list[str] = []  # the API key travels in the environment (TRITON_VLM_API_KEY), not on a command line
    if args.served_model_name:
        extra += ["--served-model-name", args.served_model_name]
    if args.tool_call_parser:
        extra += ["--tool-call-parser", args.tool_call_parser]
    frontend = OpenAIFrontend(server.grpc_url, server.metrics_url, str(model), port=args.openai_port,
                              host=args.host, insecure=args.insecure, lora_dir=args.lora_dir, extra_args=tuple(extra),
                              log_file=run_dir / "openai.log", api_key=args.api_key, cpu_layout=server.cpu_layout)
    try:
        frontend.start().wait_ready(min(args.timeout, 120.0))
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"triton-vlm: cannot start the OpenAI front end on port {args.openai_port}: {e}", file=sys.stderr)
        frontend.stop()
        return None
    return frontend


def _supervise(stopping: threading.Event, ready_timeout: float, *children: Supervised) -> int:
    """Keep `children` (started and ready: the tritonserver, and any process serving beside it) running until
    SIGINT / SIGTERM (0) or until the supervisor gives up on one of them (1); then stop them all."""
    supervisor = Supervisor(*children, say=lambda m: print(m, flush=True), ready_timeout=ready_timeout).start()
    while not stopping.wait(0.5) and not supervisor.failed.is_set():
        pass
    supervisor.stop()
    for child in reversed(children):
        child.stop()
    return 1 if supervisor.failed.is_set() else 0


def _model_and_params(args) -> tuple[Path, dict[str, dict[str, str]]]:
    """The checkpoint (the demo model, built if missing, when none is given) and the model parameters of the
    command line; SystemExit with the reason for a bad one. The settings are checked first: a typo is refused at
    once, not after the checkpoint is read (or the demo model built: minutes on a fresh machine)."""
    params = _parse_set(args.set)
    try:
        check_parameters(params)
    except ValueError as e:
        raise SystemExit(f"triton-vlm: {e}") from None
    if args.model:
        model = Path(args.model).expanduser().resolve()
        if not (model / "config.json").exists():
            raise SystemExit(f"{model} is not a Hugging Face checkpoint directory (no config.json)")
        from ..spec import CheckpointError, CheckpointSpec  # noqa: PLC0415 - transformers' config parsing

        try:  # a checkpoint the engine cannot read exactly is refused here, before tritonserver starts
            CheckpointSpec.load(model)
        except CheckpointError as e:
            raise SystemExit(f"triton-vlm: cannot serve {e}") from None
    else:
        from ..demo import ensure_demo_adapters, ensure_demo_model  # noqa: PLC0415

        model = ensure_demo_model()
        args.lora_dir = args.lora_dir or str(ensure_demo_adapters())  # the demo's adapters: french, sentence
    if args.device:
        params.setdefault("*", {})["device"] = args.device
    if args.lora_dir:
        lora_dir = Path(args.lora_dir).expanduser().resolve()
        if not lora_dir.is_dir():
            raise SystemExit(f"--lora-dir {lora_dir} is not a folder")
        params.setdefault("*", {})["lora_dir"] = str(lora_dir)  # llm loads adapters, preprocess checks names
    return model, params


def _print_banner(args, server: TritonServer, model: Path, log_file: Path | None) -> None:
    layout, here = server.cpu_layout, connect_host(args.host)
    try:
        answer = smoke_request(server.grpc_url, demo=not args.model, api_key=args.api_key)
        if not args.model:  # the demo adapters too
            for name in ("french", "sentence"):
                answer += "\n  request " + adapter_smoke_request(server.http_url, name, args.api_key)
    except Exception as e:  # noqa: BLE001 - report, keep serving
        answer = f"FAILED: {e}"
    print(f"triton-vlm: serving {model}\n"
          f"  request {answer}\n"
          f"  HTTP    http://{server.http_url}  (POST /v2/models/ensemble/generate)\n"
          f"  gRPC    {server.grpc_url}\n"
          f"  metrics {server.metrics_url}\n"
          + (f"  OpenAI  http://{here}:{args.openai_port}/v1  (chat/completions, completions, models; "
             f"/metrics)\n" if args.openai_port else "")
          + f"  listen  {_listening(args)}\n"
          + (f"  log     {log_file}\n" if log_file else "")
          + (f"  CPUs    {layout.describe()} ({cpu_layout.MODE_ENV}=none: every process on every CPU)\n"
             if layout is not None else "")
          + (f"  front   {server.front_half.describe()} (--set preprocess.instance_count=N, ...)\n"
             if server.front_half is not None else "")
          + (f"  LoRA    {args.lora_dir} (pass \"lora_name\")\n" if args.lora_dir else "")
          + ("  API key required on the OpenAI API (/health and /metrics too) and on Triton's HTTP and gRPC (all\n"
             "          but health); the client and curl below read it from $TRITON_VLM_API_KEY\n"
             if args.api_key else "") +
          "  restart tritonserver is restarted if it or one of its models' processes dies\n"
          f"  try:    {try_command(server.grpc_url)}"
          + (f"\n          {openai_try_command(f'{here}:{args.openai_port}', model, bool(args.api_key))}"
             if args.openai_port else ""),
          flush=True)


def _listening(args) -> str:
    """Where the ports listen, and how to change it."""
    if is_loopback(args.host):
        return f"{args.host} only (this machine); {EXPOSE_HINT}"
    return (f"{args.host}: " + ("other machines may connect, with the API key" if args.api_key else
                                "other machines may connect, and NO API KEY is required (--insecure)")
            + "; Triton's metrics port needs no key (Triton has none for it)")


EXAMPLE_PROMPT = "USER: <image>\nWhat color is the shape? ASSISTANT:"


def example_image() -> Path:
    """The demo request's image (a blue triangle) as a file, written once to `<cache>/examples/`."""
    path = cache_dir() / "examples" / "blue-triangle.png"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(_demo_png())
        tmp.replace(path)
    return path


def try_command(grpc_url: str) -> str:
    """A client command line that works as printed in bash: the venv's client by its path, the prompt's newline
    written `$'\\n'` (in "..." bash would pass a backslash and an n), an image that exists."""
    client = Path(sys.executable).parent / "triton-vlm-client"
    prompt = "$'" + EXAMPLE_PROMPT.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return (f"{shlex.quote(str(client)) if client.exists() else 'triton-vlm-client'} --url {grpc_url} "
            f"{prompt} --image {shlex.quote(str(example_image()))}")



def openai_try_command(address: str, model: Path, api_key: bool) -> str:
    """A curl command line for the OpenAI API that works as printed in bash: a chat message with the example
    image as a data: URL (base64 of the file, inlined by the shell)."""
    image = shlex.quote(str(example_image()))
    body = ('{"model": "' + model.name + '", "max_tokens": 8, "messages": [{"role": "user", "content": ['
            '{"type": "image_url", "image_url": {"url": "data:image/png;base64,\'"$(base64 -w0 ' + image + ')"\'"}},'
            ' {"type": "text", "text": "What color is the shape?"}]}]}')
    auth = ' -H "Authorization: Bearer $TRITON_VLM_API_KEY"' if api_key else ""
    return (f"curl -s {address}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")
