"""The OpenAI API on a LLaVA-NeXT checkpoint: one live tritonserver serving the tiny llava-v1.6-mistral-shaped
checkpoint (its processor's "[INST] ... [/INST]" chat template) and one front end, driven by the official
`openai` client with images of several sizes and aspect ratios as data: URLs. The answers equal transformers'
`generate()` on the prompt the same template renders through the processor: greedy, beam search (n sequences),
streamed text equal to the unstreamed, and usage counting each image's own number of tokens."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llava_next_cases import SIZES, Reference, png

pytestmark = pytest.mark.server

VARIANT = "mistral"  # Mistral text model, two CLIP feature layers concatenated, 16-pixel tiles
NEW = 8
IMAGES = {name: png(size, seed=70 + i) for i, (name, size) in enumerate(SIZES.items())}


@pytest.fixture(scope="module")
def next_api(llava_next_server):
    """(the front end, the server) on one NeXT checkpoint (the session's, shared with test_llava_next_server)."""
    from test_openai import Running
    from triton_vlm.openai import FrontendConfig

    assert VARIANT == "mistral"
    server = llava_next_server
    fe = Running(FrontendConfig(triton=server.grpc_url, model_dir=Path(server.model_path),
                                triton_metrics_url=f"http://localhost:{server.metrics_port}/metrics"))
    yield fe, server
    fe.stop()


@pytest.fixture(scope="module")
def client(next_api):
    return next_api[0].client(timeout=120)


@pytest.fixture(scope="module")
def ref(next_api):
    return Reference(next_api[1].model_path)


def _url(data: bytes) -> str:
    from test_openai import data_url

    return data_url(data)


def _messages(names: list[str], question: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _url(IMAGES[n])}} for n in names]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def _prompt(ref: Reference, n_images: int, question: str) -> str:
    """The prompt transformers' processor renders from the checkpoint's chat template for the same message."""
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return ref.processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)


def _want(ref: Reference, names: list[str], question: str, beams: int = 1) -> tuple[list[str], list[int], int]:
    """transformers' answers: (texts, token counts, prompt tokens)."""
    prompt, images = _prompt(ref, len(names), question), [IMAGES[n] for n in names]
    seqs = ref.generate(prompt, images, NEW, beams=beams, num_return_sequences=beams)
    texts = [ref.processor.tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
    return texts, [len(s) for s in seqs], ref.inputs(prompt, images)["input_ids"].shape[1]


CASES = [(["square"], "What is this?"), (["wide"], "What is this?"), (["tall"], "Describe it."),
         (["tiny"], "What is this?"), (["large"], "What is this?"), (["sliver"], "Describe it."),
         (["large", "tiny", "tall"], "Compare them.")]


def test_template_renders_the_mistral_prompt(ref):
    assert _prompt(ref, 2, "Compare them.") == "[INST] <image>\n<image>\nCompare them. [/INST]"


def test_greedy_answers_and_usage_equal_generate(client, ref, next_api):
    from triton_vlm.preprocess.checkpoint import ModelInfo

    info = ModelInfo.load(next_api[1].model_path)
    with ThreadPoolExecutor(len(CASES)) as pool:  # at once: batched together in vision and the engine
        answers = list(pool.map(lambda c: client.chat.completions.create(
            model=VARIANT, messages=_messages(*c), max_tokens=NEW, temperature=0), CASES))
    for (names, question), r in zip(CASES, answers):
        texts, lengths, prompt_tokens = _want(ref, names, question)
        assert r.choices[0].message.content == texts[0], names
        assert r.usage.completion_tokens == lengths[0]
        image_tokens = [info.image_tokens((SIZES[n][1], SIZES[n][0])) for n in names]
        assert r.usage.prompt_tokens == prompt_tokens > sum(image_tokens), names
    # the per-image counts differ with the size: the usage is not a fixed count per image
    assert len({a.usage.prompt_tokens for a in answers[:6]}) > 3
    assert len({a.choices[0].message.content for a in answers}) > 1, "the answers depend on the image"


@pytest.mark.parametrize("names,n,best_of", [(["wide"], 3, 3), (["tall", "square"], 2, 4)])
def test_beam_search_equals_generate(client, ref, names, n, best_of):
    r = client.chat.completions.create(model=VARIANT, messages=_messages(names, "Describe it."), n=n,
                                       max_tokens=NEW, extra_body=dict(use_beam_search=True, best_of=best_of))
    texts, lengths, prompt_tokens = _want(ref, names, "Describe it.", beams=best_of)
    assert [c.message.content for c in r.choices] == texts[:n] and [c.index for c in r.choices] == list(range(n))
    assert r.usage.completion_tokens == sum(lengths[:n]) and r.usage.prompt_tokens == prompt_tokens


def test_stream_equals_unstreamed(client, ref):
    messages = _messages(["wide", "tall", "square"], "Compare them.")
    full = client.chat.completions.create(model=VARIANT, messages=messages, max_tokens=NEW)
    chunks = list(client.chat.completions.create(model=VARIANT, messages=messages, max_tokens=NEW, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == _want(ref, ["wide", "tall", "square"], "Compare them.")[0][0]
    assert chunks[-1].usage == full.usage
