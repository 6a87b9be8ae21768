"""A Llama-family SentencePiece tokenizer built offline: BPE with byte fallback, what llava-1.5-7b-hf ships.

The `sentencepiece` trainer learns the pieces (BPE, `byte_fallback=True`: the 256 `<0xXX>` byte pieces cover
any character it did not learn); they are then assembled into the same `tokenizers` pipeline as Llama's
`tokenizer.json`: normalizer "prepend ▁, spaces -> ▁", BPE model with `byte_fallback`, decoder
"▁ -> space, ByteFallback, Fuse, strip one leading space". The byte-fallback decoder turns a run of byte
pieces that is not valid UTF-8 into one U+FFFD per byte, so a run's text is final only once the run ends:
the tokenizer family on which incremental detokenization is easiest to get wrong.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

from .checkpoint import BOS, EOS, IMAGE, PAD, UNK

SPIECE_UNDERLINE = "\u2581"


def _train_pieces(texts: list[str], vocab_size: int) -> list[tuple[str, float]]:
    import sentencepiece as spm  # noqa: PLC0415 - a test-time dependency only

    with tempfile.TemporaryDirectory() as d:
        prefix = str(Path(d) / "sp")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD, user_defined_symbols=[IMAGE],
            num_threads=1, minloglevel=2, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity")
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges from a SentencePiece BPE vocabulary: every split of a piece into two pieces, ranked by the
    merged piece's id (SentencePiece numbers BPE pieces in merge order)."""
    merges = []
    for piece, rank in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def build_sentencepiece_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train and assemble the tokenizer; encoding adds `<s>`; `<image>` is a special token (id 4)."""
    pieces = _train_pieces(list(texts), vocab_size)
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    bpe = models.BPE(vocab=vocab, merges=_merges(vocab), unk_token=UNK, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE),
                                           normalizers.Replace(" ", SPIECE_UNDERLINE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, extra_special_tokens={"image_token": IMAGE},
                                   padding_side="left", clean_up_tokenization_spaces=False)
