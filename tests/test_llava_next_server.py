"""LLaVA-NeXT through one live tritonserver (the CPU default: onnxruntime vision on the exported graph, our
engine), against transformers' `generate()` in this process: images of every shape (square, wide, tall, tiny,
a one-pixel sliver, larger than every pinpoint) and several of different sizes in one prompt, beams 1-4 with
num_return_sequences, all sent at once so that vision and the engine batch them together; a request of two rows
with different images; streaming; a LoRA adapter sent over the wire; the embedding cache by image content;
truncation dropping a whole image."""
from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llava_next_cases import SIZES, Reference, png
from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server

VARIANT = "mistral"  # Mistral text model, two CLIP feature layers concatenated, 16-pixel tiles
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
MULTI = "USER: <image>\nand <image> then<image>\nCompare them. ASSISTANT:"
IMAGES = {name: png(size, seed=50 + i) for i, (name, size) in enumerate(SIZES.items())}
NEW = 8


@pytest.fixture(scope="module")
def next_server(llava_next_server):
    assert VARIANT == "mistral"  # the session's server (conftest) serves this variant
    return llava_next_server


@pytest.fixture(scope="module")
def ref(next_server):
    return Reference(next_server.model_path)


def _ask(server, prompt, images, **params):
    with VLMClient(server.grpc_url, timeout=120) as c:
        return c.generate(prompt, images, max_tokens=NEW, **params)


def test_every_shape_and_beam_equals_generate_in_one_batch(next_server, ref):
    cases = [(PROMPT, [IMAGES[k]], 1 + i % 4) for i, k in enumerate(SIZES)]
    cases += [(MULTI, [IMAGES["large"], IMAGES["tiny"], IMAGES["tall"]], 2),
              (MULTI, [IMAGES["sliver"], IMAGES["square"], IMAGES["wide"]], 4),
              ("USER: Say hello. ASSISTANT:", [], 3)]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: vision and the engine batch them together
        futures = [pool.submit(_ask, next_server, p, imgs, beam_width=b, num_return_sequences=b,
                               return_num_input_tokens=True) for p, imgs, b in cases]
        results = [f.result() for f in futures]
    for (prompt, images, beams), res in zip(cases, results):
        assert res.output_ids == ref.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams), \
            (prompt[:24], [len(i) for i in images], beams)
        assert res.num_input_tokens == ref.inputs(prompt, images)["input_ids"].shape[1]
    assert len({tuple(r.output_ids[0]) for r in results[:len(SIZES)]}) > 1, "the answers depend on the image"


def test_two_rows_with_different_images_in_one_request(next_server, ref):
    """A batched request (TensorRT-LLM's --batch-inputs): the rows' tiles, images and feature lengths differ."""
    from test_server_trtllm import by_row, prepare_inputs, send, stack

    rows = [(MULTI.replace("then<image>", "then"), [IMAGES["large"], IMAGES["tall"]]),
            (PROMPT, [IMAGES["tiny"], b""])]
    responses, err = send(next_server, stack([prepare_inputs(p, NEW, False, images=imgs) for p, imgs in rows]))
    assert err is None, err
    got = by_row(responses)
    for b, (prompt, images) in enumerate(rows):
        assert got[b]["ids"] == ref.generate(prompt, [i for i in images if i], NEW)[0]


def test_streamed_pieces_equal_generate(next_server, ref):
    with VLMClient(next_server.grpc_url, timeout=120) as c:
        pieces = list(c.stream(MULTI, [IMAGES["wide"], IMAGES["tall"], IMAGES["square"]], max_tokens=NEW))
        full = c.generate(MULTI, [IMAGES["wide"], IMAGES["tall"], IMAGES["square"]], max_tokens=NEW)
    assert [t for p in pieces for t in p.token_ids] == full.output_ids[0] == \
        ref.generate(MULTI, [IMAGES["wide"], IMAGES["tall"], IMAGES["square"]], NEW)[0]
    assert "".join(p.text for p in pieces) == full.texts[0]


def test_lora_adapter_over_the_wire_equals_peft(next_server, ref, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlavaNextForConditionalGeneration

    torch.manual_seed(5)
    base = LlavaNextForConditionalGeneration.from_pretrained(next_server.model_path)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    with torch.no_grad():  # fp16-exact weights: the wire's FP16 tensors carry the numbers PEFT uses
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_((p * (8.0 if "lora_B" in n else 1.0)).half().float())
    peft_model.save_pretrained(tmp_path / "adapter")
    adapted = PeftModel.from_pretrained(LlavaNextForConditionalGeneration.from_pretrained(next_server.model_path),
                                        tmp_path / "adapter").eval()
    images = [IMAGES["wide"], IMAGES["square"]]
    prompt = MULTI.replace("then<image>", "then")
    want = ref.generate(prompt, images, NEW, beams=2, model=adapted)
    assert want != ref.generate(prompt, images, NEW, beams=2), "the adapter must change the answer"
    got = _ask(next_server, prompt, images, beam_width=2, lora_task_id=77, lora_dir=str(tmp_path / "adapter"))
    assert got.output_ids == want


def _encoded(server) -> float:
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r'^triton_vlm_vision_images_encoded_total\{[^}]*\} ([0-9.e+]+)$', text, re.M).group(1))


def test_embeddings_cached_by_image_content(next_server):
    image = png((70, 40), seed=999)  # sent by no other test
    first = _ask(next_server, PROMPT, [image])
    before = _encoded(next_server)  # counted in vision's execute, before its response: visible now
    again = [_ask(next_server, PROMPT, [image]).output_ids for _ in range(3)]
    assert before >= 1 and _encoded(next_server) == before and all(a == first.output_ids for a in again)


def test_truncation_drops_a_whole_image_with_its_true_count(next_server, ref):
    """A prompt one large image too long: that image goes whole, with the text before it."""
    from triton_vlm.preprocess.checkpoint import ModelInfo

    info = ModelInfo.load(next_server.model_path)
    images, large = [IMAGES["large"], IMAGES["wide"]], info.image_tokens((260, 400))
    budget = info.context_length - NEW
    prompt = "USER: <image> and{} <image> ASSISTANT:"

    def ids_for(n: int) -> list[int]:
        return ref.inputs(prompt.format(" x" * n), images)["input_ids"][0].tolist()

    base, per = len(ids_for(0)), (len(ids_for(10)) - len(ids_for(0))) // 10
    n = (budget + large // 2 - base) // per  # filler: the prompt about half the large image over the budget
    ids = ids_for(n)
    before = ids.index(info.image_token_id) - 1  # text tokens before the large image (BOS not counted)
    assert budget + before < len(ids) <= budget + large, "over the budget by less than the large image"
    with VLMClient(next_server.grpc_url, timeout=120) as c:
        res = c.generate(prompt.format(" x" * n), images, max_tokens=NEW, return_num_input_tokens=True)
    assert res.dropped_images == 1
    assert res.num_input_tokens == len(ids) - before - large
