"""IncrementalDetokenizer: streaming one token at a time reproduces the full decode, never a broken character."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from triton_vlm.engine.search.detok import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a test, isn't it?",
    "Streaming text  with  double spaces,\ttabs and\nnew lines.",
    "Emoji: 😀 🎉🚀 and a family 👨‍👩‍👧 in a row.",
    "中文测试：你好，世界！ 日本語のテキストも。 한국어도 있어요.",
    "Mixed: naïve café, Ünïcödé — “quotes” … done.",
]
TEXTS = CORPUS + [
    "Unseen words: zyzzyva quixotic 🦜 饕餮 résumé",
    " leading space and trailing space ",
    "🎉🎉🎉",
]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def llama_like() -> Tokenizer:
    """SentencePiece-style BPE: Metaspace '▁', byte fallback <0xNN>, decoder strips the first space (Llama)."""
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = meta
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  limit_alphabet=60)
    tok.train_from_iterator([t for t in CORPUS if t.isascii()] * 3, trainer=trainer)
    vocab = tok.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = tok.model.get_merges() if hasattr(tok.model, "get_merges") else None
    if merges is None:
        import json
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in json.loads(tok.to_str())["model"]["merges"]]
    llama = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    llama.pre_tokenizer = meta
    llama.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    llama.add_special_tokens(["<unk>", "<s>", "</s>"])
    return llama


def stream(tok, ids, prefix=()):
    d = IncrementalDetokenizer(tok, prefix)
    pieces = [d.push([i]) for i in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("name", ["byte_level", "llama_like"])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(request, name, text):
    tok = request.getfixturevalue(name)
    ids = tok.encode(text).ids
    assert len(ids) > 1
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_multibyte_characters_are_held_back(byte_level):
    ids = byte_level.encode("🦜饕").ids  # unseen characters: several byte-level tokens each
    assert len(ids) >= 4
    d = IncrementalDetokenizer(byte_level)
    out = [d.push([i]) for i in ids]
    assert out[0] == "" and [o for o in out if o][0] == "🦜"
    assert "".join(out) + d.flush() == "🦜饕"


def test_llama_byte_fallback_and_leading_space(llama_like):
    ids = llama_like.encode("hi 🦜 there").ids
    assert any(llama_like.id_to_token(i).startswith("<0x") for i in ids)
    pieces = stream(llama_like, ids)
    assert "".join(pieces) == "hi 🦜 there"
    # after a prompt, the first new token keeps its leading space (a lone decode would strip it)
    prompt = llama_like.encode("Hello").ids
    gen = llama_like.encode("Hello world").ids[len(prompt):]
    assert llama_like.decode(gen) == "world"
    assert "".join(stream(llama_like, gen, prompt)) == " world"


def test_prefix_window_with_byte_level(byte_level):
    prompt = byte_level.encode("Streaming text with").ids
    full = byte_level.encode("Streaming text with emoji 😀 and 中文 now").ids
    assert full[:len(prompt)] == prompt
    gen = full[len(prompt):]
    text = "".join(stream(byte_level, gen, prompt))
    assert text == " emoji 😀 and 中文 now"


def test_special_tokens_are_skipped_and_chunks_of_ids(byte_level):
    eot = byte_level.token_to_id("<|endoftext|>")
    ids = byte_level.encode("Emoji: 😀 🎉🚀 and 中文").ids + [eot]
    d = IncrementalDetokenizer(byte_level)
    out = [d.push(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [d.flush()]
    assert "".join(out) == "Emoji: 😀 🎉🚀 and 中文" and d.text == "Emoji: 😀 🎉🚀 and 中文"
    assert d.push([]) == "" and d.flush() == ""


def test_incomplete_character_at_the_end_matches_full_decode(byte_level):
    ids = byte_level.encode("ok 饕").ids[:-1]  # cut inside the last character
    pieces = stream(byte_level, ids)
    assert "".join(pieces) == byte_level.decode(ids, skip_special_tokens=True)
    assert pieces[-1].endswith("\ufffd")  # only flush may emit the broken tail, as decode() does


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A real SentencePiece-trained BPE with byte fallback, assembled as Llama's tokenizer.json."""
    from triton_vlm.demo.sp_tokenizer import build_sentencepiece_tokenizer

    return build_sentencepiece_tokenizer(CORPUS * 4, vocab_size=400)


def _check_random_sequences(tok, n: int, seed: int) -> None:
    import random

    vocab = sorted(tok.get_vocab().values())
    byte_ids = [i for t, i in tok.get_vocab().items() if t.startswith("<0x")]
    assert len(byte_ids) == 256
    rng = random.Random(seed)
    for _ in range(n):
        # half the draws from the byte pieces: runs of bytes that are and are not valid UTF-8
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.choice(vocab) for _ in range(rng.randint(2, 6))]
        full = tok.decode(ids, skip_special_tokens=True)
        d, sent = IncrementalDetokenizer(tok), ""
        for i in ids:
            sent += d.push([i])
            assert full.startswith(sent), (ids, sent, full)  # nothing streamed is ever taken back
        assert sent + d.flush() == full, ids


def test_byte_runs_stream_exactly_the_full_decode(llama_like):
    ids = [llama_like.token_to_id("<0x29>"), llama_like.token_to_id("<0xD2>")]
    assert llama_like.decode(ids) == "\ufffd\ufffd"  # the whole run is invalid UTF-8: one U+FFFD per byte
    assert "".join(stream(llama_like, ids)) == "\ufffd\ufffd"
    _check_random_sequences(llama_like, 3000, seed=0)


def test_sentencepiece_byte_fallback_tokenizer(sentencepiece_tok):
    _check_random_sequences(sentencepiece_tok, 3000, seed=1)
    for text in TEXTS:
        ids = sentencepiece_tok(text, add_special_tokens=False)["input_ids"]
        assert "".join(stream(sentencepiece_tok, ids)) == sentencepiece_tok.decode(ids), text
