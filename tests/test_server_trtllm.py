"""Requests shaped as TensorRT-LLM's clients send them, through a live tritonserver with stock `tritonclient`.

- `--batch-inputs` of tensorrtllm_backend's `end_to_end_grpc_client.py`: every input of two bs-1 requests
  stacked with `np.concatenate(axis=0)` into one request of batch 2, `batch_index` requested. Each row is
  answered as its own sequence set (responses carry `batch_index`), streamed and not, with exactly the tokens
  the row gets when sent alone; rows may carry different numbers of images; a bad row refuses the request
  naming the row.
- `presence_penalty` / `frequency_penalty` (OpenAI's semantics) against the `transformers` baseline running the
  same processor in this process, and their range check.
- `return_num_input_tokens` / `return_num_output_tokens` as Triton's OpenAI front end sends them.
"""
from __future__ import annotations

import base64
import io
import queue
import random

import numpy as np
import pytest

from triton_vlm.demo.shapes import draw

pytestmark = pytest.mark.server

DESCRIBE = "USER: <image>\nDescribe the image. ASSISTANT:"
HELLO = "USER: Say hello. ASSISTANT:"


def png(shape: str, color: str, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    draw(shape, color, size=(64, 64), rng=random.Random(seed)).save(buf, "PNG")
    return buf.getvalue()


def inline(data: bytes) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def prepare_inputs(prompt: str, output_len: int, streaming: bool, **extra) -> dict[str, np.ndarray]:
    """A bs-1 request as `end_to_end_grpc_client.prepare_inputs` builds it ([1, 1] scalars, [1, n] lists)."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like(np.array([[prompt]])).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
    }
    dtypes = {float: np.float32, int: np.int32, bool: bool}
    for name, value in extra.items():
        inputs[name] = np.array([value], dtype=object) if isinstance(value, list) else \
            np.array([[value]], dtype=dtypes[type(value)])
    return inputs


def stack(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`--batch-inputs`: each input of the bs-1 requests concatenated along the batch axis."""
    return {key: np.concatenate([r[key] for r in requests], axis=0) for key in requests[0]}


def send(server, inputs: dict[str, np.ndarray], outputs=("text_output", "output_ids", "sequence_length",
                                                         "batch_index", "sequence_index")):
    """One request on a gRPC stream (as the TensorRT-LLM client sends it); -> (responses as dicts, error)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    responses = []
    try:
        tensors = []
        for name, arr in inputs.items():
            t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            t.set_data_from_numpy(arr)
            tensors.append(t)
        client.async_stream_infer("ensemble", tensors, enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                return responses, error.message()
            response = result.get_response()
            out = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if out:
                responses.append(out)
            final = response.parameters.get("triton_final_response")
            if final is None or final.bool_param:
                return responses, None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def by_row(responses) -> dict[int, dict]:
    """Per batch_index: the concatenated text and new ids of sequence 0 (streamed pieces joined)."""
    rows: dict[int, dict] = {}
    for r in responses:
        b = int(r["batch_index"].reshape(-1)[0])
        assert r["text_output"].shape[0] == 1, "each response answers one row (batch dim 1)"
        row = rows.setdefault(b, {"text": "", "ids": [], "responses": 0})
        row["text"] += r["text_output"].reshape(-1)[0].decode()
        n = int(r["sequence_length"].reshape(-1)[0])
        row["ids"] += r["output_ids"][0, 0, :n].tolist()
        row["responses"] += 1
    return rows


@pytest.mark.parametrize("streaming", [False, True])
def test_batch_inputs_rows_equal_the_prompts_sent_alone(triton_server, streaming):
    """Two prompts stacked (one with an inline image, one text only): both rows answered, each equal to its
    prompt sent alone."""
    prompts = [DESCRIBE.replace("<image>", inline(png("triangle", "blue", 3))), HELLO]
    bs1 = [prepare_inputs(p, 8, streaming) for p in prompts]
    alone = []
    for inputs in bs1:
        responses, err = send(triton_server, inputs)
        assert err is None, err
        alone.append(by_row(responses)[0])
    assert alone[0]["text"].strip() == "a blue triangle" and alone[1]["text"].strip() == "hello"
    responses, err = send(triton_server, stack(bs1))
    assert err is None, err
    rows = by_row(responses)
    assert sorted(rows) == [0, 1]
    for b in (0, 1):
        assert rows[b]["ids"] == alone[b]["ids"] and rows[b]["text"] == alone[b]["text"]
    if streaming:
        assert all(rows[b]["responses"] >= 2 for b in (0, 1)), "each row streamed in several pieces"
    else:
        assert all(rows[b]["responses"] == 1 for b in (0, 1))


def test_batch_rows_with_different_image_counts_through_images(triton_server):
    """`images` [2, 2]: row 0 has two images, row 1 one (padded with an empty entry)."""
    red, green, blue = png("circle", "red", 1), png("square", "green", 2), png("triangle", "blue", 3)
    two = "USER: <image>\nDescribe the image. <image>\nDescribe the image. ASSISTANT:"
    bs1 = [prepare_inputs(two, 6, False, images=[red, green]), prepare_inputs(DESCRIBE, 6, False, images=[blue, b""])]
    alone0, err = send(triton_server, bs1[0])
    assert err is None, err
    single = prepare_inputs(DESCRIBE, 6, False, images=[blue])
    alone1, err = send(triton_server, single)
    assert err is None, err
    responses, err = send(triton_server, stack(bs1))
    assert err is None, err
    rows = by_row(responses)
    assert rows[0]["ids"] == by_row(alone0)[0]["ids"]
    assert rows[1]["ids"] == by_row(alone1)[0]["ids"] and rows[1]["text"].strip() == "a blue triangle"


@pytest.mark.parametrize("bad,needle", [
    (dict(text_input=DESCRIBE, images=[b"not an image"]), "row 1 of the batch: "),
    (dict(presence_penalty=2.5), "row 1 of the batch: presence_penalty must be a finite number >= -2.0 and "
                                 "<= 2.0, got 2.5"),
])
def test_a_bad_row_refuses_the_request_naming_the_row(triton_server, bad, needle):
    good = prepare_inputs(HELLO, 4, False, presence_penalty=0.0, images=[b""])
    bad = dict(bad)
    row1 = prepare_inputs(bad.pop("text_input", HELLO), 4, False, presence_penalty=bad.pop("presence_penalty", 0.0),
                          images=bad.pop("images", [b""]))
    responses, err = send(triton_server, stack([good, row1]))
    assert not responses and err is not None and needle in err, err  # (a stream's errors carry no status code)
    responses, err = send(triton_server, prepare_inputs(HELLO, 4, False))  # the server answers the next request
    assert err is None and by_row(responses)[0]["text"].strip() == "hello"


# --- presence / frequency penalties ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_baseline(demo_model):
    from triton_vlm.baseline.generate import HFGenerator

    return HFGenerator(demo_model)


def _hf_ids(hf, prompt_ids: list[int], **params) -> list[int]:
    from triton_vlm.params import GenerationParams, GenerationRequest

    got = []
    req = GenerationRequest("ref", list(prompt_ids), GenerationParams(**params))
    hf.run(req, got.append)
    return got[-1].sequences[0].token_ids


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=2.0), dict(presence_penalty=1.5),
                                       dict(presence_penalty=-2.0, frequency_penalty=0.5)])
def test_penalties_match_the_transformers_baseline(triton_server, hf_baseline, penalties):
    """Greedy, 12 tokens forced (min_tokens): the demo model repeats itself, so the penalties bite."""
    def generate(**extra):
        inputs = prepare_inputs(HELLO, 12, False, min_tokens=12, **extra)
        inputs["exclude_input_in_output"] = np.array([[False]])
        responses, err = send(triton_server, inputs)
        assert err is None, err
        [r] = responses
        return r["output_ids"][0, 0, :int(r["sequence_length"].reshape(-1)[0])].tolist()

    plain = generate()
    penalised = generate(**penalties)
    prompt_len = len(plain) - 12
    assert penalised[:prompt_len] == plain[:prompt_len]
    assert penalised[prompt_len:] != plain[prompt_len:], "the penalties changed the answer"
    assert penalised[prompt_len:] == _hf_ids(hf_baseline, plain[:prompt_len], max_tokens=12, min_tokens=12,
                                             **penalties)
    assert plain[prompt_len:] == _hf_ids(hf_baseline, plain[:prompt_len], max_tokens=12, min_tokens=12)


def test_penalties_out_of_range_are_invalid_arg(triton_server):
    for name, value in (("presence_penalty", -2.5), ("frequency_penalty", 3.0)):
        responses, err = send(triton_server, prepare_inputs(HELLO, 4, False, **{name: value}))
        assert not responses and err is not None and f"{name} must be a finite number >= -2.0 and <= 2.0" in err


# --- token counts, as Triton's OpenAI front end asks for them ----------------------------------------------
@pytest.mark.parametrize("streaming", [False, True])
def test_num_input_and_output_tokens(triton_server, demo_model, streaming):
    """The tensors Triton's OpenAI front end sends a TensorRT-LLM-style model (`_create_trtllm_generate_request`,
    all [1, 1]); it sums num_output_tokens over a stream and takes num_input_tokens from any response."""
    prompt = DESCRIBE.replace("<image>", inline(png("circle", "yellow", 5)))
    inputs = {"text_input": np.array([[prompt]], dtype=object), "stream": np.bool_([[streaming]]),
              "max_tokens": np.int32([[8]]), "stop_words": np.array([["circle"]], dtype=object),
              "top_p": np.float32([[1.0]]), "frequency_penalty": np.float32([[0.0]]),
              "presence_penalty": np.float32([[0.0]]), "seed": np.uint64([[7]]), "temperature": np.float32([[0.0]]),
              "exclude_input_in_output": np.bool_([[True]]), "return_num_input_tokens": np.bool_([[True]]),
              "return_num_output_tokens": np.bool_([[True]])}
    responses, err = send(triton_server, inputs, outputs=("text_output", "num_input_tokens", "num_output_tokens"))
    assert err is None, err
    text = "".join(r["text_output"].reshape(-1)[0].decode() for r in responses)
    assert text == " a yellow circle"
    n_in = {int(r["num_input_tokens"].reshape(-1)[0]) for r in responses}
    n_out = sum(int(r["num_output_tokens"].reshape(-1)[0]) for r in responses)
    assert all(r["num_input_tokens"].dtype == np.int32 for r in responses)
    # the same request with the prompt echoed: its ids are the prompt's (image tokens included) + the new ones
    echo = prepare_inputs(prompt, 8, False)
    echo["exclude_input_in_output"] = np.array([[False]])
    [full], err = send(triton_server, echo)
    new = prepare_inputs(prompt, 8, False)
    [only_new], err = send(triton_server, new)
    n_new = int(only_new["sequence_length"].reshape(-1)[0])
    assert n_in == {int(full["sequence_length"].reshape(-1)[0]) - n_new} and n_out == n_new
    from triton_vlm.preprocess.checkpoint import ModelInfo

    assert min(n_in) > ModelInfo.load(demo_model).num_image_tokens, "the image's placeholder tokens are counted"
    plain, err = send(triton_server, {k: v for k, v in inputs.items() if not k.startswith("return_num")},
                      outputs=("text_output",))
    assert err is None and all("num_input_tokens" not in r for r in plain)


# --- top-k log probs per generated token (OpenAI's top_logprobs) -------------------------------------------
TOP = ("text_output", "output_ids", "sequence_length", "output_log_probs", "output_top_log_probs",
       "output_top_log_prob_ids")


@pytest.mark.parametrize("sampling", [False, True])
def test_top_log_probs_streamed_and_not(triton_server, sampling):
    """k = 5: greedy picks each step's most likely token, so the top-1 is the answer; sampling (seeded) too is
    reproducible; the streamed pieces' arrays concatenate to the non-streamed ones."""
    extra = dict(temperature=1.0, seed=11) if sampling else {}

    def ask(streaming):
        inputs = prepare_inputs(DESCRIBE.replace("<image>", inline(png("square", "red", 4))), 8, streaming,
                                return_top_log_probs=5, return_log_probs=True, **extra)
        if sampling:
            inputs["seed"] = np.array([[11]], dtype=np.uint64)
        responses, err = send(triton_server, inputs, outputs=TOP)
        assert err is None, err
        ids = np.concatenate([r["output_ids"][0, 0, :int(r["sequence_length"].reshape(-1)[0])] for r in responses])
        lps = np.concatenate([r["output_log_probs"][0, 0, :int(r["sequence_length"].reshape(-1)[0])]
                              for r in responses])
        top = np.concatenate([r["output_top_log_probs"][0, 0] for r in responses])  # [new_tokens, 5]
        top_ids = np.concatenate([r["output_top_log_prob_ids"][0, 0] for r in responses])
        return ids, lps, top, top_ids

    ids, lps, top, top_ids = ask(False)
    assert top.shape == top_ids.shape == (len(ids), 5)
    assert (np.diff(top, axis=1) <= 0).all() and (top <= 0).all(), "best first, log probs"
    for t, lp, row_ids, row_lp in zip(ids, lps, top_ids, top):  # the chosen token, where it ranks in the top k
        if t in row_ids:
            assert row_lp[list(row_ids).index(t)] == pytest.approx(lp, abs=1e-5)
        else:
            assert lp <= row_lp[-1] + 1e-5
    if not sampling:
        assert top_ids[:, 0].tolist() == ids.tolist()
    s_ids, s_lps, s_top, s_top_ids = ask(True)
    assert s_ids.tolist() == ids.tolist() and s_top_ids.tolist() == top_ids.tolist()
    np.testing.assert_allclose(s_top, top, atol=1e-6)
    np.testing.assert_allclose(s_lps, lps, atol=1e-6)


def test_top_log_probs_refused_with_beam_search_and_above_20(triton_server):
    for extra, needle in ((dict(return_top_log_probs=2), "return_top_log_probs needs beam_width 1"),
                          (dict(return_top_log_probs=21), "return_top_log_probs must be in [0, 20], got 21")):
        inputs = prepare_inputs(HELLO, 4, False, **extra)
        if "needs beam" in needle:
            inputs["beam_width"] = np.array([[2]], dtype=np.int32)
        responses, err = send(triton_server, inputs)
        assert not responses and err is not None and needle in err, err
