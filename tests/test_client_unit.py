"""Unit tests of the client package (triton_vlm_client) without a Triton server: request building, helpers,
response / SSE parsing, CLI parsing and output, and both transports against in-process fakes (a stdlib HTTP
server imitating Triton's generate extension; a fake tritonclient gRPC client fed real protobuf responses)."""
from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import triton_vlm_client as tvc
from triton_vlm_client import GenerateResult, StreamPiece, VLMClient, VLMClientError, cli
from triton_vlm_client import protocol as P
from triton_vlm_client.request import (build_json, build_tensors, early_stopping_wire, ensure_image_markers,
                                       inline_image, load_image, normalize_params)
from triton_vlm_client.response import PieceDecoder, iter_sse, json_error, parse_result

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # content is opaque to the client


# ---------------------------------------------------------------- parameters


def test_normalize_params_client_defaults_and_only_set_inputs():
    assert normalize_params({}) == {P.MAX_TOKENS: 64, P.EXCLUDE_INPUT_IN_OUTPUT: True}
    got = normalize_params({"max_tokens": 5, "top_k": 3, "temperature": 1, "seed": 2**64 - 1})
    assert got == {"max_tokens": 5, "top_k": 3, "temperature": 1.0, "seed": 2**64 - 1, "exclude_input_in_output": True}
    assert isinstance(got["temperature"], float)
    # None = not sent (server default), also for the client defaults
    assert normalize_params({"exclude_input_in_output": None, "top_p": None}) == {"max_tokens": 64}
    # keys come out in protocol order
    got = normalize_params({"top_p": 0.5, "bad_words": ["x"], "beam_width": 2})
    assert list(got) == [n for n in P.PARAM_NAMES if n in got]


@pytest.mark.parametrize("value,wire", [(False, 0), (True, 1), ("never", 2), ("NEVER", 2), ("true", 1),
                                        ("false", 0), (0, 0), (1, 1), (2, 2), (np.bool_(True), 1)])
def test_early_stopping_wire(value, wire):
    assert early_stopping_wire(value) == wire
    assert normalize_params({"early_stopping": value})["early_stopping"] == wire


@pytest.mark.parametrize("params,err", [
    ({"max_token": 3}, TypeError), ({"stream": True}, TypeError), ({"images": []}, TypeError),
    ({"max_tokens": "3"}, TypeError), ({"max_tokens": 2.0}, TypeError), ({"max_tokens": True}, TypeError),
    ({"max_tokens": 2**31}, ValueError), ({"seed": -1}, ValueError), ({"temperature": "hot"}, TypeError),
    ({"return_log_probs": 1}, TypeError), ({"early_stopping": "sometimes"}, ValueError),
    ({"early_stopping": 3}, ValueError), ({"bad_words": ["ok", 3]}, TypeError),
])
def test_normalize_params_rejects_bad_values(params, err):
    with pytest.raises(err) as e:
        normalize_params(params)
    assert next(iter(params)).split("_")[0] in str(e.value) or "unknown" in str(e.value)


def test_words_accept_a_string_and_drop_empty_lists():
    assert normalize_params({"stop_words": "end"})["stop_words"] == ["end"]
    assert "bad_words" not in normalize_params({"bad_words": []})


# ---------------------------------------------------------------- wire formats


def test_build_tensors_names_dtypes_shapes():
    params = normalize_params({"max_tokens": 7, "beam_width": 2, "length_penalty": 0.5, "seed": 9,
                               "return_log_probs": True, "stop_words": ["a", "bc"], "early_stopping": "never"})
    tensors = build_tensors("hi <image> <image>", [b"img1", PNG], params, stream=True)
    by = {name: (dtype, arr) for name, dtype, arr in tensors}
    assert [n for n, _, _ in tensors] == [t.name for t in P.INPUTS if t.name in by]  # protocol order
    assert set(by) == {"text_input", "images", "stop_words", "max_tokens", "beam_width", "length_penalty",
                       "early_stopping", "seed", "return_log_probs", "exclude_input_in_output", "stream"}
    for name, (dtype, arr) in by.items():
        assert dtype == P.INPUTS_BY_NAME[name].dtype, name
        if P.INPUTS_BY_NAME[name].dims == (1,):
            assert arr.shape == (1, 1), name
    assert by["images"][1].shape == (1, 2) and by["images"][1].dtype == object
    assert by["images"][1][0, 1] == PNG
    assert by["stop_words"][1].tolist() == [[b"a", b"bc"]]
    assert by["text_input"][1].tolist() == [["hi <image> <image>".encode()]]
    expect = {"max_tokens": (np.int32, 7), "beam_width": (np.int32, 2), "length_penalty": (np.float32, 0.5),
              "early_stopping": (np.int32, 2), "seed": (np.uint64, 9), "return_log_probs": (np.bool_, True),
              "exclude_input_in_output": (np.bool_, True), "stream": (np.bool_, True)}
    for name, (np_type, value) in expect.items():
        assert by[name][1].dtype == np_type and by[name][1][0, 0] == value, name


def test_build_tensors_minimal_request_sends_no_optional_input():
    tensors = build_tensors("héllo", [], normalize_params({"exclude_input_in_output": None}))
    assert [n for n, _, _ in tensors] == ["text_input", "max_tokens"]
    assert tensors[0][2][0, 0].decode() == "héllo"
    with pytest.raises(TypeError):
        build_tensors(b"bytes prompt", [], {})


def test_build_json_body():
    body = build_json("q", [b"\x00\xffabc", PNG], normalize_params({"bad_words": "x", "temperature": 0.5}),
                      stream=True)
    assert json.loads(json.dumps(body)) == body
    assert body == {"text_input": "q", "images": [base64.b64encode(b"\x00\xffabc").decode(),
                                                  base64.b64encode(PNG).decode()],
                    "max_tokens": 64, "bad_words": ["x"], "temperature": 0.5, "exclude_input_in_output": True,
                    "stream": True}
    assert "stream" not in build_json("q", [], {}) and "images" not in build_json("q", [], {})


def test_protocol_tables_are_consistent():
    assert len({t.name for t in P.INPUTS}) == len(P.INPUTS)
    # LoRA weight tensors are not keyword parameters (yet); lora_name and lora_task_id are
    assert set(P.PARAM_NAMES) == {t.name for t in P.INPUTS} - {"text_input", "images", "stream", "lora_weights",
                                                               "lora_config"}
    assert P.INPUTS_BY_NAME["early_stopping"] == ("early_stopping", "INT32", (1,))
    assert P.OUTPUTS_BY_NAME["output_ids"].dims == (-1, -1)


# ---------------------------------------------------------------- images


def test_load_and_inline_image(tmp_path):
    f = tmp_path / "x.png"
    f.write_bytes(PNG)
    assert load_image(f) == load_image(str(f)) == load_image(PNG) == load_image(bytearray(PNG)) == PNG
    tag = inline_image(f)
    # the pattern text-generation-webui splits prompts on
    m = re.fullmatch(r'<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)">', tag)
    assert m and base64.b64decode(m.group(1)) == PNG
    assert inline_image(PNG, mime="image/png").startswith('<img src="data:image/png;base64,')
    with pytest.raises(TypeError):
        load_image(123)
    with pytest.raises(ValueError):
        load_image(b"")
    with pytest.raises(FileNotFoundError):
        load_image(tmp_path / "missing.jpg")


def test_ensure_image_markers():
    assert ensure_image_markers("describe", 2) == "<image>\n<image>\ndescribe"
    assert ensure_image_markers("<image> and", 2) == "<image>\n<image> and"
    assert ensure_image_markers("<image><image>", 2) == "<image><image>"
    assert ensure_image_markers("x", 0) == "x"


# ---------------------------------------------------------------- responses


def test_parse_result_from_http_json_scalars_and_lists():
    one = {"text_output": "ans", "output_ids": 5, "sequence_length": 1, "cum_log_probs": -0.5,
           "output_log_probs": -0.5, "dropped_images": 1, "model_name": "ensemble"}
    r = parse_result(one)
    assert (r.texts, r.output_ids, r.sequence_lengths, r.dropped_images) == (["ans"], [[5]], [1], 1)
    assert r.cum_log_probs is None and r.output_log_probs is None and r.text == "ans"
    assert r.num_input_tokens is None and r.num_output_tokens is None
    counted = parse_result({**one, "num_input_tokens": 12, "num_output_tokens": [1]})
    assert (counted.num_input_tokens, counted.num_output_tokens) == (12, 1)
    two = {"text_output": ["a", "bb"], "output_ids": [1, 2, -1, 3, 4, 5], "sequence_length": [2, 3],
           "cum_log_probs": [-1.0, -2.0], "output_log_probs": [-0.5, -0.5, 0.0, -1.0, -0.5, -0.5]}
    r = parse_result(two, log_probs=True)
    assert r.output_ids == [[1, 2], [3, 4, 5]] and r.sequence_lengths == [2, 3]
    assert r.cum_log_probs == [-1.0, -2.0] and r.output_log_probs == [[-0.5, -0.5, 0.0], [-1.0, -0.5, -0.5]]
    assert json.loads(json.dumps(r.to_dict()))["texts"] == ["a", "bb"]


def test_parse_result_from_numpy_outputs():
    outputs = {"text_output": [b"caf\xc3\xa9", b"x"], "output_ids": np.array([[[7, 8, 0], [9, 0, 0]]]).reshape(-1).tolist(),
               "sequence_length": [3, 1]}
    r = parse_result(outputs)
    assert r.texts == ["café", "x"] and r.output_ids == [[7, 8, 0], [9]]
    with pytest.raises(VLMClientError):
        parse_result({"output_ids": [1]})


def test_piece_decoder_joins_split_utf8_and_routes_sequences():
    data = "é🙂".encode()
    dec = PieceDecoder()
    pieces = []
    for i in range(len(data)):
        pieces += dec.pieces({"text_output": [data[i:i + 1]], "sequence_index": [1]})
    assert [p.text for p in pieces] == ["é", "🙂"] and {p.sequence_index for p in pieces} == {1}
    assert dec.pieces({}) == []  # empty final response
    both = dec.pieces({"text_output": ["a", "b"], "output_ids": [1, 2], "sequence_length": [1, 1]})
    assert [(p.text, p.sequence_index, p.token_ids) for p in both] == [("a", 0, [1]), ("b", 1, [2])]
    lp = PieceDecoder(log_probs=True).pieces({"text_output": "t", "output_ids": 4, "sequence_length": 1,
                                              "output_log_probs": -0.25, "sequence_index": 0})
    assert lp == [StreamPiece("t", 0, [4], [-0.25])]


def test_iter_sse():
    raw = (b'data: {"a": 1}\n\n: comment\n\nevent: x\r\ndata: {"b":\r\ndata: 2}\r\n\r\n'
           b'data:{"c": 3}\n\n\ndata: {"d": 4}')
    assert list(iter_sse(io.BytesIO(raw))) == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]
    with pytest.raises(VLMClientError, match="bad server-sent event"):
        list(iter_sse([b"data: {nope\n", b"\n"]))


def test_json_error_and_error_codes():
    assert json_error(b'{"error": "bad max_tokens"}') == "bad max_tokens"
    assert json_error(b'data: {"error": "boom"}\n\n') == "boom"
    assert json_error(b'{"text_output": "x"}') is None and json_error(b"<html>") is None
    assert VLMClientError(400, "m").code == "INVALID_ARGUMENT"
    assert VLMClientError(404, "m").code == "NOT_FOUND"
    assert VLMClientError("StatusCode.UNAVAILABLE", "m").code == "UNAVAILABLE"
    assert VLMClientError(None, "m").code == "UNKNOWN" and str(VLMClientError(None, "m")) == "m"
    e = VLMClientError("StatusCode.INVALID_ARGUMENT", "why")
    assert (e.status, e.message) == ("StatusCode.INVALID_ARGUMENT", "why") and "why" in str(e)


# ---------------------------------------------------------------- CLI


def _ns(*argv):
    return cli.build_parser().parse_args(["prompt", *argv])


def test_cli_params_defaults():
    ns = _ns()
    assert cli.params_from_args(ns) == {"max_tokens": 64, "exclude_input_in_output": True}
    assert (ns.protocol, ns.url, ns.model, ns.stream, ns.json, ns.image) == ("grpc", None, "ensemble", False, False, [])


def test_cli_params_all_options():
    ns = _ns("--image", "a.jpg", "--image", "b.png", "--max-tokens", "9", "--beam-width", "3",
             "--num-return-sequences", "2", "--length-penalty", "0.7", "--early-stopping", "never",
             "--min-tokens", "2", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
             "--frequency-penalty", "-0.25", "--no-repeat-ngram-size", "3",
             "--bad-word", "x", "--bad-word", "y z", "--stop-word", "END", "--end-id", "2", "--pad-id", "0",
             "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "42", "--return-log-probs",
             "--include-input", "--protocol", "http", "--url", "h:1", "--model", "m", "--timeout", "3")
    assert cli.params_from_args(ns) == {
        "max_tokens": 9, "exclude_input_in_output": False, "beam_width": 3, "num_return_sequences": 2,
        "length_penalty": 0.7, "min_tokens": 2, "repetition_penalty": 1.2, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "no_repeat_ngram_size": 3,
        "end_id": 2, "pad_id": 0, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 42,
        "return_log_probs": True, "early_stopping": "never", "bad_words": ["x", "y z"], "stop_words": ["END"]}
    assert ns.image == ["a.jpg", "b.png"] and (ns.protocol, ns.url, ns.model, ns.timeout) == ("http", "h:1", "m", 3.0)
    # every CLI parameter is a valid API parameter
    assert normalize_params(cli.params_from_args(ns))["early_stopping"] == 2
    assert cli.params_from_args(_ns("--early-stopping", "false"))["early_stopping"] is False


def test_cli_rejects_bad_arguments(capsys):
    for argv in (["p", "--early-stopping", "maybe"], ["p", "--max-tokens", "x"], ["p", "--protocol", "ftp"],
                 ["p", "--include-input", "--exclude-input-in-output"], []):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(argv)
        assert e.value.code == 2


def test_cli_prompt_markers_and_stdin():
    assert cli.prompt_from_args(_ns("--image", "a", "--image", "b")) == "<image>\n<image>\nprompt"
    ns = cli.build_parser().parse_args(["-", "--image", "a"])
    assert cli.prompt_from_args(ns, stdin=io.StringIO("<image> what?")) == "<image> what?"


class _FakeClient:
    """Stands in for VLMClient inside cli.main."""

    calls: list = []
    result = GenerateResult(texts=["first", "second"], output_ids=[[1], [2, 3]], sequence_lengths=[1, 2],
                            cum_log_probs=[-1.0, -2.0], output_log_probs=[[-1.0], [-1.0, -1.0]])
    error: Exception | None = None

    def __init__(self, url, protocol, model, timeout, api_key=None):
        self.args = (url, protocol, model, timeout)

    def generate(self, prompt, images, **params):
        _FakeClient.calls.append((self.args, prompt, list(images), params))
        if self.error:
            raise self.error
        return self.result

    def stream(self, prompt, images, **params):
        _FakeClient.calls.append((self.args, prompt, list(images), params))
        yield StreamPiece("fir", 0, [1])
        yield StreamPiece("sec", 1, [2])
        yield StreamPiece("st", 0, [3])
        if self.error:
            raise self.error


@pytest.fixture
def fake_cli(monkeypatch):
    _FakeClient.calls, _FakeClient.error = [], None
    monkeypatch.setattr(cli, "VLMClient", _FakeClient)
    return _FakeClient


def test_cli_json_output_shape(fake_cli, capsys):
    assert cli.main(["hi", "--json", "--max-tokens", "3", "--protocol", "http"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"texts", "output_ids", "sequence_lengths", "cum_log_probs", "output_log_probs",
                        "dropped_images", "num_input_tokens", "num_output_tokens", "num_cached_tokens"}
    assert out["texts"] == ["first", "second"] and out["output_ids"] == [[1], [2, 3]]
    (args, prompt, images, params), = fake_cli.calls
    assert args == (None, "http", "ensemble", 60.0) and prompt == "hi" and params["max_tokens"] == 3


def test_cli_plain_and_stream_output(fake_cli, capsys, tmp_path):
    img = tmp_path / "i.png"
    img.write_bytes(PNG)
    assert cli.main(["hi", "--image", str(img)]) == 0
    assert capsys.readouterr().out == "=== sequence 0 ===\nfirst\n=== sequence 1 ===\nsecond\n"
    assert fake_cli.calls[-1][1:3] == ("<image>\nhi", [str(img)])
    assert cli.main(["hi", "--stream"]) == 0
    assert capsys.readouterr().out == "first\n=== sequence 1 ===\nsec\n"
    assert cli.main(["hi", "--stream", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"text": "fir", "sequence_index": 0, "token_ids": [1], "log_probs": None} and len(lines) == 3


def test_cli_error_exit_codes(fake_cli, capsys):
    fake_cli.error = VLMClientError(400, "max_tokens must be >= 1, got 0")
    assert cli.main(["hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "max_tokens must be >= 1, got 0" in captured.err and "(400)" in captured.err
    assert cli.main(["hi", "--stream"]) == 1
    assert "max_tokens must be >= 1" in capsys.readouterr().err


def test_cli_missing_image_exit_code_2(capsys, tmp_path):
    assert cli.main(["hi", "--image", str(tmp_path / "none.jpg"), "--url", "localhost:1"]) == 2
    assert "none.jpg" in capsys.readouterr().err


def test_client_constructor():
    assert VLMClient().url == "localhost:8001" and VLMClient(protocol="http").url == "localhost:8000"
    assert VLMClient("h:9", protocol="HTTP").protocol == "http"
    with pytest.raises(ValueError):
        VLMClient(protocol="websocket")
    with pytest.raises(ValueError):
        VLMClient(timeout=0)
    assert tvc.DEFAULT_MAX_TOKENS == 64


# ---------------------------------------------------------------- HTTP transport against a fake server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests: list = []

    def log_message(self, *a):
        pass

    def _send(self, status, body: bytes, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200 if self.path == "/v2/models/ensemble/ready" else 400, b"")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append((self.path, body))
        prompt = body["text_input"]
        if self.path.endswith("/generate"):
            if prompt == "bad":
                return self._send(400, b'{"error":"in ensemble \'ensemble\', max_tokens must be >= 1, got 0"}')
            if prompt == "multi":
                return self._send(200, b'{"error":"generate expects model to produce exactly 1 response"}')
            if prompt == "slow":
                time.sleep(3)
            return self._send(200, json.dumps({"text_output": "ok " + prompt, "output_ids": [1, 2],
                                               "sequence_length": 2, "dropped_images": 0}).encode())
        # generate_stream: chunked SSE
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"text_output": w, "output_ids": i, "sequence_length": 1, "sequence_index": 0}
                  for i, w in enumerate(["Hel", "lo", " wörld"])]
        for k, ev in enumerate(events):
            if prompt == "midway" and k == 1:
                ev = {"error": "stopped midway"}
            if prompt == "slow" and k == 1:
                time.sleep(3)
            chunk = f"data: {json.dumps(ev)}\n\n".encode()
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # the client hung up on a "slow" request: expected
        pass


@pytest.fixture(scope="module")
def http_server():
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_generate(http_server):
    _Handler.requests.clear()
    client = VLMClient(http_server, protocol="http", timeout=5)
    r = client.generate("<image> q", images=[PNG], max_tokens=4, stop_words=["x"])
    assert r.texts == ["ok <image> q"] and r.output_ids == [[1, 2]]
    (path, body), = _Handler.requests
    assert path == "/v2/models/ensemble/generate"
    assert body == {"text_input": "<image> q", "images": [base64.b64encode(PNG).decode()], "max_tokens": 4,
                    "stop_words": ["x"], "exclude_input_in_output": True}
    assert VLMClient("http://" + http_server + "/", protocol="http").generate("p").text == "ok p"
    assert client.ready() and not VLMClient(http_server, protocol="http", model="other").ready()


def test_http_stream(http_server):
    client = VLMClient(http_server, protocol="http", timeout=5)
    pieces = list(client.stream("p", max_tokens=3))
    assert "".join(p.text for p in pieces) == "Hello wörld"
    assert [p.token_ids for p in pieces] == [[0], [1], [2]]
    path, body = _Handler.requests[-1]
    assert path == "/v2/models/ensemble/generate_stream" and body["stream"] is True


def test_http_errors_carry_server_message(http_server):
    client = VLMClient(http_server, protocol="http", timeout=5)
    with pytest.raises(VLMClientError) as e:
        client.generate("bad")
    assert e.value.status == 400 and e.value.code == "INVALID_ARGUMENT" and "max_tokens must be >= 1" in e.value.message
    with pytest.raises(VLMClientError, match="exactly 1 response"):
        client.generate("multi")
    got = []
    with pytest.raises(VLMClientError, match="stopped midway"):
        for piece in client.stream("midway"):
            got.append(piece.text)
    assert got == ["Hel"]
    with pytest.raises(VLMClientError) as e:
        VLMClient("127.0.0.1:1", protocol="http", timeout=2).generate("p")
    assert e.value.code == "UNAVAILABLE"


def test_http_timeouts_are_bounded(http_server):
    client = VLMClient(http_server, protocol="http", timeout=0.5)
    for call in (lambda: client.generate("slow"), lambda: list(client.stream("slow"))):
        t0 = time.monotonic()
        with pytest.raises(VLMClientError) as e:
            call()
        assert e.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 2.0


# ---------------------------------------------------------------- gRPC transport against a fake client


def _grpc_result(outputs: dict, final: bool):
    """A real tritonclient InferResult around a protobuf response, as the stream callback receives it."""
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    resp = service_pb2.ModelInferResponse(model_name="ensemble", id="x")
    for name, arr in outputs.items():
        out = resp.outputs.add(name=name, datatype=np_to_triton_dtype(arr.dtype), shape=list(arr.shape))
        resp.raw_output_contents.append(serialize_byte_tensor(arr).item() if arr.dtype == object
                                        else arr.tobytes())
        assert out.name == name
    resp.parameters["triton_final_response"].bool_param = final
    return InferResult(resp)


class _FakeGrpc:
    """Replaces tritonclient.grpc.InferenceServerClient; `script(inputs)` returns [(result, error), ...]."""

    instances: list = []
    script = None

    def __init__(self, url, *a, **k):
        self.url, self.calls = url, []
        _FakeGrpc.instances.append(self)

    def start_stream(self, callback, stream_timeout=None, **k):
        self.callback, self.stream_timeout = callback, stream_timeout
        self.calls.append("start_stream")

    def async_stream_infer(self, model_name, inputs, request_id="", enable_empty_final_response=False, **k):
        self.model, self.inputs, self.empty_final = model_name, inputs, enable_empty_final_response
        self.calls.append("async_stream_infer")
        for result, error in _FakeGrpc.script(inputs):
            self.callback(result=result, error=error)

    def stop_stream(self, cancel_requests=False):
        self.calls.append(("stop_stream", cancel_requests))

    def close(self):
        self.calls.append("close")


@pytest.fixture
def fake_grpc(monkeypatch):
    import tritonclient.grpc as grpcclient

    _FakeGrpc.instances = []
    monkeypatch.setattr(grpcclient, "InferenceServerClient", _FakeGrpc)
    return _FakeGrpc


def _text(*texts):
    return np.array([[t.encode() for t in texts]], dtype=object)


def test_grpc_generate_uses_the_stream_api(fake_grpc):
    final = {"text_output": _text("a b", "c"), "output_ids": np.array([[[5, 6], [7, -1]]], np.int32),
             "sequence_length": np.array([[2, 1]], np.int32), "cum_log_probs": np.array([[-1, -2]], np.float32),
             "output_log_probs": np.array([[[-0.5, -0.5], [-2, 0]]], np.float32),
             "dropped_images": np.array([[0]], np.int32)}
    fake_grpc.script = lambda inputs: [(_grpc_result(final, False), None), (_grpc_result({}, True), None)]
    r = VLMClient("grpc://h:1", timeout=5).generate("q", images=[PNG], beam_width=2, num_return_sequences=2,
                                                   return_log_probs=True)
    assert r.texts == ["a b", "c"] and r.output_ids == [[5, 6], [7]] and r.sequence_lengths == [2, 1]
    assert r.cum_log_probs == [-1.0, -2.0] and r.output_log_probs == [[-0.5, -0.5], [-2.0, 0.0]]
    c, = fake_grpc.instances
    assert c.url == "h:1" and c.model == "ensemble" and c.empty_final is True
    assert c.calls == ["start_stream", "async_stream_infer", ("stop_stream", True), "close"]
    sent = {i.name(): (i.datatype(), i.shape()) for i in c.inputs}
    assert sent == {"text_input": ("BYTES", [1, 1]), "images": ("BYTES", [1, 1]), "max_tokens": ("INT32", [1, 1]),
                    "beam_width": ("INT32", [1, 1]), "num_return_sequences": ("INT32", [1, 1]),
                    "return_log_probs": ("BOOL", [1, 1]), "exclude_input_in_output": ("BOOL", [1, 1])}


def test_grpc_stream_pieces_and_early_close(fake_grpc):
    data = "naïve 🙂".encode()
    chunks = [data[:3], data[3:8], data[8:]]  # splits inside ï and inside 🙂

    def script(inputs):
        assert any(i.name() == "stream" for i in inputs)
        out = [(_grpc_result({"text_output": np.array([[c]], dtype=object),
                              "output_ids": np.array([[[k]]], np.int32),
                              "sequence_length": np.array([[1]], np.int32),
                              "sequence_index": np.array([[0]], np.int32)}, False), None)
               for k, c in enumerate(chunks)]
        return out + [(_grpc_result({}, True), None)]

    fake_grpc.script = script
    client = VLMClient(timeout=5)
    pieces = list(client.stream("q"))
    assert "".join(p.text for p in pieces) == "naïve 🙂" and [p.token_ids for p in pieces] == [[0], [1], [2]]
    it = client.stream("q")
    next(it)
    it.close()  # the request is cancelled and the client closed
    assert fake_grpc.instances[-1].calls[-2:] == [("stop_stream", True), "close"]


def test_grpc_errors_and_timeout(fake_grpc):
    from tritonclient.utils import InferenceServerException

    fake_grpc.script = lambda inputs: [(None, InferenceServerException("in ensemble 'ensemble', bad", None))]
    with pytest.raises(VLMClientError) as e:
        VLMClient(timeout=5).generate("q")
    assert e.value.message == "in ensemble 'ensemble', bad" and e.value.status is None
    fake_grpc.script = lambda inputs: [(None, InferenceServerException("refused", "StatusCode.UNAVAILABLE"))]
    with pytest.raises(VLMClientError) as e:
        VLMClient(timeout=5).generate("q")
    assert e.value.status == "StatusCode.UNAVAILABLE" and e.value.code == "UNAVAILABLE"
    # a response that never becomes final: bounded by the timeout
    fake_grpc.script = lambda inputs: [(_grpc_result({"text_output": _text("x")}, False), None)]
    t0 = time.monotonic()
    with pytest.raises(VLMClientError) as e:
        VLMClient(timeout=0.3).generate("q")
    assert e.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 2.0
    assert fake_grpc.instances[-1].calls[-2:] == [("stop_stream", True), "close"]
