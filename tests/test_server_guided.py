"""Guided decoding through the ensemble with stock `tritonclient` (TensorRT-LLM's `guided_decoding_guide_type` /
`guided_decoding_guide`): the demo model knows no JSON, so every valid document it answers comes from the
constraint (live server, the session's one)."""
from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import pytest

pytestmark = pytest.mark.server

PROMPT = "USER: Describe a shape. ASSISTANT:"
SCHEMA = {
    "type": "object",
    "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                   "color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["shape", "color", "count"], "additionalProperties": False,
}


def generate(server, guide_type=None, guide=None, **params):
    """(text outputs, error) of one streamed ensemble request sent with plain tritonclient gRPC."""
    import tritonclient.grpc as grpcclient

    def inp(name, value, dtype, npt):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=npt))
        return t

    ins = [inp("text_input", PROMPT, "BYTES", object), inp("max_tokens", params.pop("max_tokens", 48), "INT32",
                                                           np.int32)]
    ins.append(inp("exclude_input_in_output", True, "BOOL", np.bool_))
    for k, v in params.items():
        if isinstance(v, float):
            ins.append(inp(k, v, "FP32", np.float32))
        elif k == "seed":
            ins.append(inp(k, v, "UINT64", np.uint64))
        else:
            ins.append(inp(k, v, "INT32", np.int32))
    if guide_type is not None:
        ins.append(inp("guided_decoding_guide_type", guide_type, "BYTES", object))
    if guide is not None:
        ins.append(inp("guided_decoding_guide", guide, "BYTES", object))
    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("ensemble", ins)
        result, err = q.get(timeout=120)
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    if err is not None:
        return None, err
    return [t.decode() for t in result.as_numpy("text_output").reshape(-1)], None


def test_json_schema_answers_parse_and_validate(triton_server):
    free, err = generate(triton_server, max_tokens=24)
    assert err is None and not free[0].lstrip().startswith("{")  # the model alone answers no JSON
    for beams in (1, 3):
        texts, err = generate(triton_server, "json_schema", json.dumps(SCHEMA), max_tokens=48, beam_width=beams,
                              num_return_sequences=beams)
        assert err is None, err
        assert len(texts) == beams
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_any_json(triton_server):
    (text,), err = generate(triton_server, "regex", r"(red|green|blue) (circle|square) [0-9]{2}")
    assert err is None and re.fullmatch(r"(red|green|blue) (circle|square) [0-9]{2}", text), (text, err)
    (text,), err = generate(triton_server, "choice", json.dumps(["a red circle", "a blue square"]))
    assert err is None and text in ("a red circle", "a blue square"), (text, err)
    (text,), err = generate(triton_server, "json", max_tokens=48)
    assert err is None and text.startswith("{"), (text, err)  # an object (it may be cut at max_tokens)


@pytest.mark.parametrize("guide_type,guide,needle", [
    ("json_schema", '{"type": "objectx"}', 'guided_decoding_guide is not a valid json_schema: Unsupported type'),
    ("regex", "a(b", "guided_decoding_guide is not a valid regex: Regex parsing error"),
    ("ebnf_grammar", "root ::= foo", 'Rule "foo" is not defined'),
    ("xml", "<a/>", "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                "dependentRequired": {"a": ["b"]}}),
     "guided_decoding_guide: the JSON schema keyword 'dependentRequired' at # is not supported"),
    ("json_schema", json.dumps({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}),
     "keyword 'uniqueItems' at #/properties/l is not supported"),
    (None, "a+", "guided_decoding_guide needs guided_decoding_guide_type"),
])
def test_invalid_guides_are_invalid_arg(triton_server, guide_type, guide, needle):
    """gRPC stream (whose errors carry no status code) and HTTP generate (INVALID_ARG is 400): the message names
    the input and the library's reason."""
    out, err = generate(triton_server, guide_type, guide)
    assert out is None and needle in err.message() and "Traceback" not in err.message(), (out, err)
    body = {"text_input": PROMPT, "max_tokens": 8, "guided_decoding_guide": guide}
    if guide_type is not None:
        body["guided_decoding_guide_type"] = guide_type
    req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/ensemble/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 400 and needle in json.loads(e.value.read())["error"]


def test_bounded_string_answers_hold_no_control_characters(triton_server):
    """A direct Triton client's schema with string lengths (xgrammar 0.2.8 alone lets raw control characters
    into such strings): the engine compiles them as patterns, so sampled answers are strict JSON."""
    schema = {"type": "object", "required": ["tag", "note"], "additionalProperties": False,
              "properties": {"tag": {"type": "string", "minLength": 2, "maxLength": 8},
                             "note": {"type": "string", "maxLength": 12}}}
    for seed in range(4):
        (text,), err = generate(triton_server, "json_schema", json.dumps(schema), max_tokens=40,
                                temperature=1.5, seed=seed)
        assert err is None, err
        assert not any(ord(ch) < 0x20 for ch in text), (seed, text)
        if text.endswith("}"):  # complete (not cut at max_tokens): strict JSON, valid
            jsonschema.validate(json.loads(text), schema)
