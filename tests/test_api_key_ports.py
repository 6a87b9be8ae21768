"""With `--api-key`, every port that serves inference needs the key: the OpenAI API (its own tests), and Triton's
HTTP and gRPC for every API but health (`triton_vlm.server.auth`). Checked on a real launcher
(`python -m triton_vlm.server`, the key in $TRITON_VLM_API_KEY) with stock clients: raw HTTP, `tritonclient.grpc`,
the official `openai` client, and our `triton-vlm-client` CLI. The first tests need no server."""
from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_vlm.server import auth
from triton_vlm.server.cli import example_image
from triton_vlm.server.process import TritonServer, free_port

from listen_support import bound_addresses, connects, outside_address

KEY = "k3y-with:colon=and/slash"  # ':' and '=' are the separators of Triton's option: they must survive
ADMIN = "adm1n-key"
# every category of Triton 2.51's --http-restricted-api / --grpc-restricted-protocol (tritonserver --help)
TRITON_CATEGORIES = {"health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
                     "statistics", "trace", "logging"}
PROMPT = "USER: <image>\nWhat color is the shape? ASSISTANT:"


# --- without a server -------------------------------------------------------------------------------------------
def test_each_category_has_one_key_and_only_health_is_open():
    groups = (auth.ADMIN_APIS, auth.API_KEY_APIS, auth.OPEN_APIS)
    assert sorted(c for g in groups for c in g) == sorted(TRITON_CATEGORIES)  # each once: Triton refuses twice
    args = auth.restricted_args(ADMIN, KEY)
    assert args == [f"--http-restricted-api=model-repository,shared-memory,logging,trace:{auth.ADMIN_HEADER}={ADMIN}",
                    f"--http-restricted-api=inference,metadata,model-config,statistics:authorization=Bearer {KEY}",
                    f"--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:"
                    f"{auth.ADMIN_HEADER}={ADMIN}",
                    f"--grpc-restricted-protocol=inference,metadata,model-config,statistics:"
                    f"authorization=Bearer {KEY}"]
    assert auth.restricted_args(ADMIN, None) == args[::2]  # no API key: only the admin APIs are restricted


@pytest.mark.parametrize("key", ["two words", "new\nline", "caf\u00e9", ""])
def test_a_key_that_cannot_go_in_a_header_is_refused(key):
    with pytest.raises(ValueError, match="printable ASCII characters without spaces"):
        auth.check_key(key)
    if key:  # the launcher says so before starting anything ("" is no key)
        out = subprocess.run([sys.executable, "-m", "triton_vlm.server", "--api-key", key, "--openai-port", "0"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "triton-vlm: --api-key must be 1 or more printable ASCII" in out.stderr, out


def test_the_client_sends_the_key_the_server_checks(monkeypatch):
    from triton_vlm_client import VLMClient
    from triton_vlm_client import protocol as P

    assert (P.API_KEY_ENV, P.HTTP_AUTH_HEADER, P.GRPC_AUTH_HEADER) == \
        (auth.ENV_API_KEY, auth.API_KEY_HEADER, auth.GRPC_API_KEY_HEADER)
    monkeypatch.setenv(P.API_KEY_ENV, KEY)
    assert VLMClient(protocol="grpc")._headers() == {"triton-grpc-protocol-authorization": f"Bearer {KEY}"}
    assert VLMClient(protocol="http")._headers() == {"authorization": f"Bearer {KEY}"}
    assert VLMClient(protocol="http", api_key="")._headers() == {}  # "" sends none, whatever the environment
    with pytest.raises(ValueError, match="printable ASCII"):
        VLMClient(api_key="a b")


# --- a live launcher with a key ---------------------------------------------------------------------------------
@dataclass
class Launched:
    proc: subprocess.Popen
    env: dict
    lines: list

    def port(self, name: str) -> int:
        return int(self.env[f"{name.upper()}_PORT"])

    def tritonserver(self):
        from triton_vlm.server import procs

        [server] = [p for p in procs.children(self.proc.pid) if p.argv and p.argv[0].endswith("tritonserver")]
        return server


@pytest.fixture(scope="module")
def keyed(demo_model, demo_adapters, tmp_path_factory, launched):
    """`python -m triton_vlm.server` with the key in the environment (never on its command line), up and past
    its own demo requests (which need the key on Triton's gRPC and HTTP ports)."""
    tmp = tmp_path_factory.mktemp("keyed")
    env = dict(os.environ, HTTP_PORT=str(free_port()), GRPC_PORT=str(free_port()), METRICS_PORT=str(free_port()),
               OPENAI_PORT=str(free_port()), TMPDIR=str(tmp), TRITON_VLM_LOG=str(tmp / "server.log"),
               TRITON_VLM_API_KEY=KEY, TRITON_VLM_ADMIN_KEY=ADMIN)
    env.pop("MODEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "triton_vlm.server", "--host", "0.0.0.0"], env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    launched.add(proc.pid)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (lines and lines[-1].strip().startswith("try:")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        assert "+ a blue triangle -> ' a blue triangle'" in out and "FAILED" not in out, out
        assert "API key required" in out and "listen  0.0.0.0: other machines may connect, with the API key" in out
        yield Launched(proc, env, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _http(port: int, method: str, path: str, body: bytes | None = None, *, host: str = "localhost",
          **headers) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _generate_body() -> bytes:
    import base64

    image = base64.b64encode(example_image().read_bytes()).decode()
    return json.dumps({"text_input": PROMPT, "images": [image], "max_tokens": 4,
                       "exclude_input_in_output": True}).encode()


RESTRICTED = "This API is restricted, expecting header 'authorization'"


@pytest.mark.server
def test_triton_http_needs_the_key_for_all_but_health(keyed):
    port = keyed.port("http")
    body = _generate_body()
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"x-api-key": KEY}):
        status, raw = _http(port, "POST", "/v2/models/ensemble/generate", body, **headers)
        assert (status, json.loads(raw)) == (403, {"error": RESTRICTED}), headers
    for path in ("/v2", "/v2/models/ensemble", "/v2/models/llm/config", "/v2/models/stats"):
        assert _http(port, "GET", path)[0] == 403, path
        assert _http(port, "GET", path, Authorization=f"Bearer {KEY}")[0] == 200, path  # case-insensitive name
    status, raw = _http(port, "POST", "/v2/models/ensemble/generate", body, authorization=f"Bearer {KEY}")
    assert status == 200 and json.loads(raw)["text_output"].strip() == "blue", raw
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/ensemble/ready"):  # probes need no key
        assert _http(port, "GET", path)[0] == 200, path
    # the admin APIs keep the admin key: the API key does not open them
    assert _http(port, "POST", "/v2/repository/index", b"{}", authorization=f"Bearer {KEY}")[0] == 403
    assert _http(port, "POST", "/v2/repository/index", b"{}", **{auth.ADMIN_HEADER: ADMIN})[0] == 200


def _stream_infer(url: str, headers) -> str:
    """One request on a fresh client's stream with stock tritonclient: the answer, or raises the stream's error."""
    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=object))
    image = grpcclient.InferInput("images", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[example_image().read_bytes()]], dtype=object))
    inputs = [text, image]
    for name, dtype, value in (("max_tokens", "INT32", np.int32(4)), ("exclude_input_in_output", "BOOL", True)):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np.bool_ if dtype == "BOOL" else np.int32))
        inputs.append(t)
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    try:
        try:
            client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        except InferenceServerException:  # the stream already ended: tritonclient hands the cause to the callback
            raise got.get(timeout=10)[1] from None
        answer = ""
        while True:
            result, error = got.get(timeout=120)
            if error is not None:
                raise error
            if "text_output" in {o.name for o in result.get_response().outputs}:
                answer += result.as_numpy("text_output").reshape(-1)[0].decode()
            final = result.get_response().parameters.get("triton_final_response")
            if final is None or final.bool_param:
                return answer
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


@pytest.mark.server
def test_triton_grpc_needs_the_key_for_all_but_health(keyed):
    url = f"localhost:{keyed.port('grpc')}"
    client = grpcclient.InferenceServerClient(url)
    good = {auth.GRPC_API_KEY_HEADER: f"Bearer {KEY}"}
    try:
        # no key, a wrong one, and the key under the plain `authorization` name Triton 2.51 does not read
        for headers in (None, {auth.GRPC_API_KEY_HEADER: "Bearer wrong"}, {"authorization": f"Bearer {KEY}"}):
            with pytest.raises(InferenceServerException) as e:
                _stream_infer(url, headers)
            assert e.value.status() == "StatusCode.UNAVAILABLE", (headers, e.value)
            assert "expecting header 'triton-grpc-protocol-authorization'" in e.value.message(), e.value
            for call in (lambda: client.get_model_metadata("ensemble", headers=headers),
                         lambda: client.get_model_config("llm", headers=headers),
                         lambda: client.get_inference_statistics("ensemble", headers=headers)):
                with pytest.raises(InferenceServerException, match="restricted"):
                    call()
        assert _stream_infer(url, good).strip() == "blue"
        assert client.get_model_config("llm", headers=good).config.name == "llm"
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
        with pytest.raises(InferenceServerException, match="restricted"):  # the admin key's, not this key's
            client.get_model_repository_index(headers=good)
    finally:
        client.close()


@pytest.mark.server
def test_openai_front_end_reaches_triton_with_the_key(keyed):
    """The front end's own gRPC client sends the key: without it Triton would refuse every request."""
    import openai

    url = f"http://localhost:{keyed.port('openai')}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    image = "data:image/png;base64," + __import__("base64").b64encode(example_image().read_bytes()).decode()
    reply = client.chat.completions.create(model="demo-v3", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What color is the shape?"}]}])
    assert reply.choices[0].message.content.strip() == "blue"


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_cli_sends_the_key_from_env_or_option(keyed, protocol):
    url = f"localhost:{keyed.port(protocol)}"
    cmd = [sys.executable, "-m", "triton_vlm_client", PROMPT, "--image", str(example_image()), "--max-tokens", "4",
           "--protocol", protocol, "--url", url]
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_API_KEY}

    def run(*extra: str, **more: str):
        return subprocess.run(cmd + list(extra), env={**env, **more}, capture_output=True, text=True, timeout=120)

    for out in (run(**{auth.ENV_API_KEY: KEY}), run("--api-key", KEY)):
        assert out.returncode == 0 and out.stdout.strip() == "blue", out
    for out in (run(), run("--api-key", "wrong", **{auth.ENV_API_KEY: KEY})):  # the option wins over the env
        assert out.returncode == 1 and "restricted, expecting header" in out.stderr, out


@pytest.mark.server
def test_deeply_nested_body_without_the_key_is_refused_before_it_is_parsed(keyed):
    """5 MB of `[` kills tritonserver 2.51 once its JSON parser reads it (docs/security.md); without the key the
    request is refused (403) before that: the same tritonserver keeps serving, no restart."""
    before = keyed.tritonserver().pid
    for path in ("/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream", "/v2/models/llm/infer"):
        status, raw = _http(keyed.port("http"), "POST", path, b"[" * (5 << 20))
        assert (status, json.loads(raw)) == (403, {"error": RESTRICTED}), path
    # answered 403 before parsing: a parse would have killed it before it answered; it still serves with the key
    status, raw = _http(keyed.port("http"), "POST", "/v2/models/ensemble/generate", _generate_body(),
                        authorization=f"Bearer {KEY}")
    assert status == 200 and json.loads(raw)["text_output"].strip() == "blue", raw
    assert keyed.tritonserver().pid == before
    assert _http(keyed.port("http"), "GET", "/v2/health/ready")[0] == 200
    assert keyed.proc.poll() is None


@pytest.mark.server
def test_with_a_key_every_interface_listens_and_health_and_metrics_need_it(keyed):
    """Launched with --host 0.0.0.0 and a key: every port listens on every interface, reached here from a
    non-loopback address of this machine when it has one; the OpenAI port's /health and /metrics (adapter names,
    the deployment's state) need the key, and no answer without it names an internal address or an adapter."""
    ports = [keyed.port(n) for n in ("http", "grpc", "metrics", "openai")]
    bound = {p: bound_addresses(p) for p in ports}  # gRPC's dual-stack socket: "::", IPv4 included
    assert all(bound[p] and bound[p] <= {"0.0.0.0", "::"} for p in ports), bound
    host = outside_address() or "localhost"
    assert all(connects(host, p) for p in ports), (host, ports)
    port = keyed.port("openai")
    for path in ("/health", "/metrics", "/v1/models"):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            status, raw = _http(port, "GET", path, host=host, **headers)
            assert status == 401, (path, headers, raw)
            assert b"localhost" not in raw and b"french" not in raw and b"lora" not in raw.lower(), raw
    status, raw = _http(port, "GET", "/health", host=host, authorization=f"Bearer {KEY}")
    assert (status, json.loads(raw)) == (200, {"status": "ok"})  # Triton's address is not in it
    status, raw = _http(port, "GET", "/metrics", host=host, authorization=f"Bearer {KEY}")
    assert status == 200 and b"triton_vlm_lora_requests_info{" in raw and b"triton_vlm_openai_requests_total" in raw


@pytest.mark.server
def test_the_key_is_on_no_command_line_but_tritonservers(keyed):
    """The launcher and the front end get the key from the environment; Triton 2.51 reads its restricted-API
    options only from its arguments, so its command line is the one that holds it (docs/security.md)."""
    from triton_vlm.server import procs

    frontend = [p for p in procs.children(keyed.proc.pid) if "triton_vlm.openai" in " ".join(p.argv)]
    assert len(frontend) == 1
    for p in (procs.read_proc(keyed.proc.pid), *frontend):
        assert KEY not in " ".join(p.argv), p.argv
    assert f"--http-restricted-api=inference,metadata,model-config,statistics:authorization=Bearer {KEY}" in \
        keyed.tritonserver().argv


def test_triton_server_without_a_key_restricts_only_the_admin_apis(tmp_path):
    server = TritonServer("model", admin_key=ADMIN)
    cmd = server.command(tmp_path / "bin" / "tritonserver", tmp_path, tmp_path / "repo", {})
    assert [a for a in cmd if "restricted" in a] == auth.restricted_args(ADMIN, None)
    server.api_key = KEY
    cmd = server.command(tmp_path / "bin" / "tritonserver", tmp_path, tmp_path / "repo", {})
    assert [a for a in cmd if "restricted" in a] == auth.restricted_args(ADMIN, KEY)


@pytest.mark.parametrize("host,key,insecure,refused", [
    ("127.0.0.1", None, False, False), ("localhost", None, False, False), ("::1", None, False, False),
    ("127.0.0.2", None, False, False), ("0.0.0.0", None, False, True), ("::", None, False, True),
    ("192.0.2.2", None, False, True), ("example.org", None, False, True), ("0.0.0.0", KEY, False, False),
    ("0.0.0.0", None, True, False),
])
def test_only_loopback_listens_without_a_key_or_insecure(host, key, insecure, refused):
    assert (auth.exposure_error(host, key, insecure) is not None) == refused
    assert auth.connect_host(host) == ("localhost" if host in ("127.0.0.1", "localhost", "::1", "127.0.0.2", "0.0.0.0",
                                                               "::") else host)


def test_every_port_of_tritonserver_listens_on_the_host(tmp_path):
    server = TritonServer("model", admin_key=ADMIN)
    cmd = server.command(tmp_path / "bin" / "tritonserver", tmp_path, tmp_path / "repo", {})
    assert [a for a in cmd if "-address=" in a] == [f"--{n}-address=127.0.0.1" for n in ("http", "grpc", "metrics")]
    server.host = "0.0.0.0"
    cmd = server.command(tmp_path / "bin" / "tritonserver", tmp_path, tmp_path / "repo", {})
    assert [a for a in cmd if "-address=" in a] == [f"--{n}-address=0.0.0.0" for n in ("http", "grpc", "metrics")]
    assert server.grpc_url == f"localhost:{server.grpc_port}"  # this machine's clients reach it on loopback


# --- last: the launcher's restarts, then the launcher killed (it ends the keyed launcher) ----------------------
def _wait_for_line(proc, lines: list[str], needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r} within {timeout:.0f} s:\n{''.join(lines)}")


@pytest.mark.server
def test_launcher_restarts_a_dead_server_and_takes_it_down_when_killed(keyed):
    """`python -m triton_vlm.server` (the keyed launcher: its own launch cost the suite ~30 s in test_serve_cli)
    restarts a dead tritonserver (still keyed) and a dead OpenAI front end; killed by SIGKILL itself, it leaves no
    server, stub, front end or shared memory behind. It ends the module's launcher: the module's last test."""
    from triton_vlm.server import procs

    proc, env, lines = keyed.proc, keyed.env, keyed.lines
    server = keyed.tritonserver()
    os.kill(server.pid, signal.SIGKILL)  # a crash of tritonserver itself
    line = _wait_for_line(proc, lines, "restarting tritonserver", 30)
    assert "tritonserver exited with signal 9 (SIGKILL)" in line, line
    deadline = time.monotonic() + 60
    new: list = []
    while time.monotonic() < deadline and not new:
        new = [p for p in procs.children(proc.pid) if p.argv and p.argv[0].endswith("tritonserver")]
        time.sleep(0.2)
    assert new and new[0].pid != server.pid
    while time.monotonic() < deadline and len(procs.stubs_of(new[0].pid)) < 4:
        time.sleep(0.2)
    stubs = procs.stubs_of(new[0].pid)
    assert sorted(stubs.values()) == ["llm", "preprocess", "tensorrt_llm", "vision"], stubs
    _wait_for_line(proc, lines, "serving again", 60)
    # the restarted server still needs the key
    assert _http(keyed.port("http"), "GET", "/v2/models/ensemble")[0] == 403
    status, raw = _http(keyed.port("http"), "POST", "/v2/models/ensemble/generate", _generate_body(),
                        authorization=f"Bearer {KEY}")
    assert status == 200 and json.loads(raw)["text_output"].strip() == "blue", raw
    # the OpenAI front end: a dead one is restarted too, and it answers again
    [frontend] = [p for p in procs.children(proc.pid) if "triton_vlm.openai" in " ".join(p.argv)]
    os.kill(frontend.pid, signal.SIGKILL)
    _wait_for_line(proc, lines, "restarting the OpenAI front end", 30)
    _wait_for_line(proc, lines, "the OpenAI front end is serving again", 60)
    req = urllib.request.Request(f"http://localhost:{env['OPENAI_PORT']}/v1/models",
                                 headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "demo-v3"
    [frontend] = [p for p in procs.children(proc.pid) if "triton_vlm.openai" in " ".join(p.argv)]
    prefix = next(a.rsplit("=", 1)[1] for a in new[0].argv if "shm-region-prefix-name" in a)
    assert list(procs.SHM_DIR.glob(prefix + "*")), "the new server's shared memory is missing"

    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies without a word: its server must not stay
    proc.wait(10)
    leftovers = [new[0].pid, *stubs, frontend.pid]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(procs.read_proc(p) for p in leftovers):
        time.sleep(0.2)
    assert not [p for p in leftovers if procs.read_proc(p)], "server or stubs outlived the launcher"
    assert not list(procs.SHM_DIR.glob(prefix + "*")), "shared memory left behind"
