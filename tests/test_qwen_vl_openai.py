"""The OpenAI API on a Qwen2.5-VL checkpoint: one live tritonserver serving the tiny random checkpoint (its chat
template writes `<|vision_start|><|image_pad|><|vision_end|>` per image) and one front end, driven by the official
`openai` client with images of several sizes as data: URLs. The answers equal transformers' `generate()` on the
prompt the same template renders: greedy, beam search (n sequences), streamed text equal to the unstreamed, usage
counting each image's own number of tokens; the family's image marker typed into message text is refused.

The checkpoint is served as llm-compressor's FP8-Dynamic writes it (compressed-tensors, per-channel e4m3 weights
with bf16 `weight_scale`, dynamic per-token activations; the rest bf16: `demo.fp8_checkpoint`), and the reference
is transformers loading the same files with `CompressedTensorsConfig(dequantize=True)` in float32: issue 38's
live Qwen2.5-VL FP8 server. Through tritonclient too: greedy, beam 3, seeded sampling and a LoRA on the wire (PEFT
on the dequantized model) equal transformers; the scales-ignored control differs; `/v1/models` says the precision."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from qwen_vl_cases import SIZES, Reference, build, mp4, png

pytestmark = pytest.mark.server

KIND = "qwen2_5_vl"
NEW = 8
IMAGES = {name: png(size, seed=90 + i) for i, (name, size) in enumerate(SIZES.items())}


FMT = "ct-channel"
FP8_ENVS = ("TRITON_VLM_CPU_GEMV_FP8", "TRITON_VLM_CPU_GEMV_BF16")  # e4m3 and bf16 kept as stored wherever built


@pytest.fixture(scope="module")
def qwen_api(tmp_path_factory):
    """(the front end, the server) on one Qwen2.5-VL checkpoint in FP8, shared by this module's tests."""
    from test_openai import serve_api

    from triton_vlm.demo.fp8_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("qwen-openai")
    model = quantize_checkpoint(build(root, KIND), root / "fp8" / KIND, FMT)  # (its folder names the model)
    old = {env: os.environ.get(env) for env in FP8_ENVS}
    os.environ.update({env: "1" for env in old})  # (no race on a loaded machine decides what the test serves)
    try:
        serving = serve_api(tmp_path_factory, model, "qwen-openai-server")
        started = next(serving)
    finally:
        for env, value in old.items():
            os.environ.pop(env) if value is None else os.environ.__setitem__(env, value)
    yield started
    yield from serving


@pytest.fixture(scope="module")
def client(qwen_api):
    return qwen_api[0].client(timeout=180)


def _dequantized(path):
    from transformers import CompressedTensorsConfig

    return Reference(path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))


@pytest.fixture(scope="module")
def ref(qwen_api):
    return _dequantized(qwen_api[1].model_path)


def _url(data: bytes) -> str:
    from test_openai import data_url

    return data_url(data)


def _messages(names: list[str], question: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _url(IMAGES[n])}} for n in names]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def _prompt(ref: Reference, n_images: int, question: str) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return ref.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                             tokenize=False)


def _want(ref: Reference, names: list[str], question: str, beams: int = 1):
    prompt, images = _prompt(ref, len(names), question), [IMAGES[n] for n in names]
    seqs = ref.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams)
    texts = [ref.tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
    return texts, [len(s) for s in seqs], ref.inputs(prompt, images)["input_ids"].shape[1]


CASES = [(["small"], "What is this?"), (["wide"], "What is this?"), (["tall"], "Describe it."),
         (["tiny"], "What is this?"), (["large"], "What is this?"), (["large", "tiny", "tall"], "Compare them.")]


def test_greedy_answers_and_usage_equal_generate(client, ref, qwen_api):
    from triton_vlm.preprocess.checkpoint import ModelInfo

    info = ModelInfo.load(qwen_api[1].model_path)
    with ThreadPoolExecutor(len(CASES)) as pool:  # at once: batched together in vision and the engine
        answers = list(pool.map(lambda c: client.chat.completions.create(
            model=KIND, messages=_messages(*c), max_tokens=NEW, temperature=0), CASES))
    for (names, question), r in zip(CASES, answers):
        texts, lengths, prompt_tokens = _want(ref, names, question)
        assert r.choices[0].message.content == texts[0], names
        assert r.usage.completion_tokens == lengths[0]
        image_tokens = [info.image_tokens((SIZES[n][1], SIZES[n][0])) for n in names]
        assert r.usage.prompt_tokens == prompt_tokens > sum(image_tokens), names
    assert len({a.usage.prompt_tokens for a in answers[:5]}) > 3  # each image its own count
    assert len({a.choices[0].message.content for a in answers}) > 1, "the answers depend on the image"


def test_beam_search_equals_generate(client, ref):
    r = client.chat.completions.create(model=KIND, messages=_messages(["tall", "small"], "Describe it."), n=2,
                                       max_tokens=NEW, extra_body=dict(use_beam_search=True, best_of=3))
    texts, lengths, prompt_tokens = _want(ref, ["tall", "small"], "Describe it.", beams=3)
    assert [c.message.content for c in r.choices] == texts[:2]
    assert r.usage.completion_tokens == sum(lengths[:2]) and r.usage.prompt_tokens == prompt_tokens


def test_stream_equals_unstreamed(client, ref):
    messages = _messages(["wide", "tall"], "Compare them.")
    full = client.chat.completions.create(model=KIND, messages=messages, max_tokens=NEW)
    chunks = list(client.chat.completions.create(model=KIND, messages=messages, max_tokens=NEW, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == _want(ref, ["wide", "tall"], "Compare them.")[0][0]
    assert chunks[-1].usage == full.usage


def test_native_marker_in_message_text_is_refused(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=KIND, max_tokens=2, messages=[
            {"role": "user", "content": "look: <|vision_start|><|image_pad|><|vision_end|>"}])
    assert "image marker" in str(ei.value) and "messages[0].content" in str(ei.value)


def test_video_url_equals_generate(client, ref):
    """vLLM's `video_url` part with a data:video/mp4 URL, beside an image: the same tokens as transformers on the
    same frames."""
    video = mp4(10, (64, 48), seed=5)
    from test_openai import data_url

    url = data_url(video, "video/mp4")
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "image_url", "image_url": {"url": _url(IMAGES["small"])}},
                                             {"type": "text", "text": "What happens?"}]}]
    r = client.chat.completions.create(model=KIND, messages=messages, max_tokens=NEW, temperature=0)
    prompt = ref.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True, tokenize=False)
    want = ref.generate(prompt, [IMAGES["small"]], NEW, videos=[video])[0]
    assert r.choices[0].message.content == ref.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == ref.inputs(prompt, [IMAGES["small"]], [video])["input_ids"].shape[1]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=KIND, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]}])
    assert "video URLs over http(s) are not accepted" in str(ei.value)


# --- issue 38: the FP8 checkpoint through tritonclient, and the precision the card says ------------------------
def test_fp8_through_tritonclient_equals_transformers_dequantized(qwen_api, ref, tmp_path):
    """Greedy, beam 3 with 3 sequences, seeded sampling and a LoRA sent on the wire (adapters fp32 on the FP8
    base) equal transformers / PEFT on the dequantized model; the files with their scales ignored give other
    tokens."""
    from peft import PeftModel
    from test_fp8_qwen import PROMPT, _sampled
    from test_quant_fp8 import random_adapter, scales_ignored
    from triton_vlm_client import VLMClient

    server = qwen_api[1]
    path = server.model_path
    adapter = random_adapter(path, tmp_path / "adapter", fmt=FMT)
    small, tall = IMAGES["small"], IMAGES["tall"]
    with VLMClient(server.grpc_url, protocol="grpc", timeout=180) as c:
        greedy = c.generate(PROMPT, [small], max_tokens=NEW).output_ids
        beams = c.generate(PROMPT, [tall], max_tokens=NEW, beam_width=3, num_return_sequences=3).output_ids
        sampled = c.generate(PROMPT, [small], max_tokens=NEW, temperature=1.3, top_k=20, seed=4321).output_ids
        lora = c.generate(PROMPT, [small], max_tokens=NEW, lora_task_id=38, lora_dir=str(adapter)).output_ids
    assert greedy == ref.generate(PROMPT, [small], NEW)
    assert beams == ref.generate(PROMPT, [tall], NEW, beams=3, num_return_sequences=3)
    assert sampled == _sampled(ref, small, 4321)
    want = ref.generate(PROMPT, [small], NEW, model=PeftModel.from_pretrained(_dequantized(path).model,
                                                                             str(adapter)).eval())
    assert want != greedy and lora == want
    assert ref.generate(PROMPT, [small], NEW, model=scales_ignored(ref.model, path)) != greedy, \
        "the scales must matter"


def test_models_card_says_the_precision_served(client, qwen_api):
    """The card (official client, list and retrieve) says what the checkpoint holds and what it is computed as,
    and how the engine holds it: what the llm's metric says."""
    import urllib.request
    from pathlib import Path

    from test_quant_fp8 import expected_held

    from triton_vlm.openai.metrics import held_label

    server = qwen_api[1]
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    held = expected_held(Path(server.log_file).read_text(errors="replace"))
    assert held_label(metrics) == held, [line for line in metrics.splitlines() if "weights_info" in line]
    [card] = [m for m in client.models.list().data if m.model_extra["parent"] is None]
    assert card.model_extra["weights"] == ("fp8-e4m3 (compressed-tensors, per-channel weight_scale), computed as "
                                           "its float32 dequantization")
    assert card.model_extra["held"] == held == client.models.retrieve(card.id).model_extra["held"]
