"""Streaming through the live server on a checkpoint with a Llama SentencePiece tokenizer (byte fallback).

The demo's byte-level BPE never splits text into byte-fallback runs; llava-1.5's tokenizer does. A random-weight
LLaVA with a SentencePiece-trained tokenizer (256 of its 400 pieces are `<0xXX>` bytes) generates byte runs
that are and are not valid UTF-8; for every request, the streamed pieces of each sequence must concatenate to
exactly the non-streamed text, and the final response must add only what was not streamed.
"""
from __future__ import annotations

import pytest

from triton_vlm_client import VLMClient

pytestmark = pytest.mark.server

PROMPTS = ["USER: Say hello. ASSISTANT:", "USER: héllo wörld ASSISTANT:", "USER: 日本語のテキスト ASSISTANT:",
           "USER: The quick brown fox ASSISTANT:", "USER: 😀 🎉 ASSISTANT:", "USER: naïve café ASSISTANT:"]


@pytest.fixture(scope="module")
def sp_server(tmp_path_factory):
    from conftest import _start_server, _stop_server
    from triton_vlm.demo.checkpoint import DEFAULT_TEXTS, build_random_llava
    from triton_vlm.demo.sp_tokenizer import build_sentencepiece_tokenizer

    texts = DEFAULT_TEXTS * 4 + PROMPTS * 4
    model = build_random_llava(tmp_path_factory.mktemp("sp-llava"), seed=3,
                               tokenizer=build_sentencepiece_tokenizer(texts, vocab_size=400))
    server = _start_server(tmp_path_factory, model, {}, "sp-server")
    yield server
    _stop_server(server)


def test_tokenizer_is_byte_fallback_sentencepiece(sp_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sp_server.model_path)
    assert "ByteFallback" in str(tok.backend_tokenizer.decoder)
    assert sum(t.startswith("<0x") for t in tok.get_vocab()) == 256


@pytest.mark.parametrize("beam_width", [1, 3])
def test_streamed_text_equals_the_full_decode(sp_server, beam_width):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sp_server.model_path)
    byte_ids = {i for t, i in tok.get_vocab().items() if t.startswith("<0x")}
    runs_seen = 0
    with VLMClient(sp_server.grpc_url, protocol="grpc", timeout=120) as client:
        for prompt in PROMPTS:
            params = dict(max_tokens=40, min_tokens=40, beam_width=beam_width)
            full = client.generate(prompt, **params)
            pieces = list(client.stream(prompt, **params))
            streamed = "".join(p.text for p in pieces if p.sequence_index == 0)
            assert streamed == full.texts[0], (prompt, streamed, full.texts[0])
            ids = list(full.output_ids[0][:full.sequence_lengths[0]])
            assert tok.decode(ids, skip_special_tokens=True) == full.texts[0]
            runs_seen += sum(1 for a, b in zip(ids, ids[1:]) if a in byte_ids and b in byte_ids)
    assert runs_seen > 10, "the random model must generate byte runs for this test to mean anything"
