"""Qwen2-VL and Qwen2.5-VL through one live tritonserver each (the CPU default: onnxruntime vision on the exported
tower, our engine with M-RoPE), against transformers' `generate()` in this process: images of many sizes and
aspect ratios (tiny, larger than max_pixels, 150:1) and several in one prompt, in the checkpoint's own prompt format
and as `<image>` markers, beams 1-4 with num_return_sequences, sent at once so that vision and the engine batch
them; penalties; streaming; a request of two rows; a LoRA adapter sent over the wire against PEFT; a 250:1 image
refused as the processor refuses it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from qwen_vl_cases import NATIVE, NATIVE_VIDEO, SIZES, Reference, build, mp4, png
from triton_vlm_client import VLMClient, VLMClientError

pytestmark = pytest.mark.server

PROMPT = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
MULTI = f"<|im_start|>user\n{NATIVE}and <image> then{NATIVE}compare them.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
IMAGES = {name: png(size, seed=70 + i) for i, (name, size) in enumerate(SIZES.items())}
NEW = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    from conftest import _start_server, _stop_server

    model = build(tmp_path_factory.mktemp("qwen-vl"), request.param)
    server = _start_server(tmp_path_factory, model, {}, f"{request.param}-server")
    yield server, Reference(model)
    _stop_server(server)


def _ask(server, prompt, images, **params):
    with VLMClient(server.grpc_url, timeout=180) as c:
        return c.generate(prompt, images, max_tokens=params.pop("max_tokens", NEW), **params)


def test_every_size_and_beam_equals_generate_in_one_batch(qwen):
    server, ref = qwen
    cases = [(PROMPT, [IMAGES[k]], 1 + i % 4) for i, k in enumerate(SIZES)]
    cases += [(MULTI, [IMAGES["large"], IMAGES["tiny"], IMAGES["tall"]], 2),
              (MULTI, [IMAGES["sliver"], IMAGES["small"], IMAGES["wide"]], 1), (TEXT, [], 3)]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: vision and the engine batch them together
        futures = [pool.submit(_ask, server, p, imgs, beam_width=b, num_return_sequences=b,
                               return_num_input_tokens=True) for p, imgs, b in cases]
        results = [f.result() for f in futures]
    for (prompt, images, beams), res in zip(cases, results):
        assert res.output_ids == ref.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams), \
            (prompt[:30], [len(i) for i in images], beams)
        assert res.num_input_tokens == ref.inputs(prompt, images)["input_ids"].shape[1]
    assert len({tuple(r.output_ids[0]) for r in results[:len(SIZES)]}) > 2, "the answers depend on the image"


def test_penalties_equal_generate(qwen):
    server, ref = qwen
    images = [IMAGES["small"], IMAGES["wide"], IMAGES["tall"]]
    got = _ask(server, MULTI, images, max_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2)
    want = ref.generate(MULTI, images, 12, repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert got.output_ids == want and want != ref.generate(MULTI, images, 12)


def test_streamed_pieces_equal_generate(qwen):
    server, ref = qwen
    images = [IMAGES["wide"], IMAGES["tall"], IMAGES["small"]]
    with VLMClient(server.grpc_url, timeout=180) as c:
        pieces = list(c.stream(MULTI, images, max_tokens=NEW))
        full = c.generate(MULTI, images, max_tokens=NEW)
    assert [t for p in pieces for t in p.token_ids] == full.output_ids[0] == ref.generate(MULTI, images, NEW)[0]
    assert "".join(p.text for p in pieces) == full.texts[0]


def test_two_rows_with_different_images_in_one_request(qwen):
    from test_server_trtllm import by_row, prepare_inputs, send, stack

    server, ref = qwen
    rows = [(MULTI.replace(" then" + NATIVE, " then"), [IMAGES["large"], IMAGES["tall"]]),
            (PROMPT, [IMAGES["tiny"], b""])]
    responses, err = send(server, stack([prepare_inputs(p, NEW, False, images=imgs) for p, imgs in rows]))
    assert err is None, err
    got = by_row(responses)
    for b, (prompt, images) in enumerate(rows):
        assert got[b]["ids"] == ref.generate(prompt, [i for i in images if i], NEW)[0]


def test_lora_adapter_over_the_wire_equals_peft(qwen, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    server, ref = qwen
    torch.manual_seed(5)
    base = AutoModelForImageTextToText.from_pretrained(server.model_path)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    with torch.no_grad():  # fp16-exact weights: the wire's FP16 tensors carry the numbers PEFT uses
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_((p * (8.0 if "lora_B" in n else 1.0)).half().float())
    peft_model.save_pretrained(tmp_path / "adapter")
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(server.model_path),
                                        tmp_path / "adapter").eval()
    images = [IMAGES["wide"], IMAGES["small"]]
    prompt = MULTI.replace(" then" + NATIVE, " then")
    want = ref.generate(prompt, images, NEW, beams=2, model=adapted)
    assert want != ref.generate(prompt, images, NEW, beams=2), "the adapter must change the answer"
    got = _ask(server, prompt, images, beam_width=2, lora_task_id=77, lora_dir=str(tmp_path / "adapter"))
    assert got.output_ids == want


def test_extreme_aspect_ratio_is_refused_and_the_server_answers_after(qwen):
    from test_server import raw_generate

    server, ref = qwen
    out, err = raw_generate(server, "http", PROMPT, [png((500, 2), seed=3)], {"max_tokens": 4})  # HTTP 400
    assert out is None and "aspect ratio" in err and "200" in err and "250" in err, err
    with pytest.raises(VLMClientError) as ei:  # gRPC: the same message
        _ask(server, PROMPT, [png((2, 500), seed=3)])
    assert "aspect ratio" in ei.value.message
    assert _ask(server, PROMPT, [IMAGES["small"]]).output_ids == ref.generate(PROMPT, [IMAGES["small"]], NEW)


VIDEOS = [mp4(10, (64, 48), seed=1), mp4(7, (40, 90), seed=2, fps=2), mp4(30, (120, 80), seed=3, fps=8)]
VPROMPT = f"<|im_start|>user\n<video> then {NATIVE_VIDEO} and <image>: what happens?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("beams", [1, 3])
def test_videos_equal_generate_on_the_same_frames(qwen, beams):
    """Two videos (frame counts and rates that sample differently) and an image in one prompt: transformers'
    generate() on the same sampled frames' pixels (pixel_values_videos, video_grid_thw, Qwen2.5-VL's
    second_per_grid_ts) gives the server's tokens."""
    server, ref = qwen
    for videos in (VIDEOS[:2], VIDEOS[1:]):
        with VLMClient(server.grpc_url, timeout=180) as c:
            got = c.generate(VPROMPT, [IMAGES["small"]], videos=videos, max_tokens=NEW, beam_width=beams,
                             num_return_sequences=beams, return_num_input_tokens=True)
        want = ref.generate(VPROMPT, [IMAGES["small"]], NEW, beams=beams, num_return_sequences=beams, videos=videos)
        assert got.output_ids == want
        assert got.num_input_tokens == ref.inputs(VPROMPT, [IMAGES["small"]], videos)["input_ids"].shape[1]


def test_bad_videos_are_refused_by_name(qwen):
    server, _ = qwen
    for videos, needle in (([b"not a video at all"], "videos[0]"), ([], "1 <video> markers but 0 videos")):
        with pytest.raises(VLMClientError) as ei:
            with VLMClient(server.grpc_url, timeout=60) as c:
                c.generate("<video> what?", videos=videos, max_tokens=2)
        assert needle in ei.value.message, ei.value.message
