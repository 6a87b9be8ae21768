"""Incremental detokenization for streaming, the way vLLM and TGI do it.

Each `push` decodes a short window of ids twice: the already-emitted part (`ids[prefix:read]`) and the same window
with the new ids (`ids[prefix:]`), and emits the difference. Decoding a window that starts a few tokens back keeps
what a token means in context (the leading space of a SentencePiece "▁word" or a byte-level "Ġword", which a lone
decode would strip), and text ending in U+FFFD (an incomplete UTF-8 sequence: byte-fallback or byte-level pieces
of one character) is held back until the character is complete. Text is also held back while the ids end in
a byte-fallback piece (`<0x29>`): a SentencePiece byte-fallback decoder turns a whole run of byte pieces that is
not valid UTF-8 into one U+FFFD per byte (`<0x29> <0xD2>` decodes to '\ufffd\ufffd', not ')\ufffd'), so the
text of a byte run is final only once a non-byte piece follows it. `flush()` emits what is left.

Property: with no prefix ids, "".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens=True)
for tokenizers whose decode is a concatenation of pieces (byte-level BPE; Metaspace with byte fallback, whose
first-space strip applies equally to both decodes of a window); `flush` computes its remainder from one full
decode. With prefix ids (the prompt), the text is what the ids mean after the prompt: decode(prompt + ids) minus
decode(prompt), leading space included. A decode that rewrites earlier text (clean_up_tokenization_spaces) can
make the streamed text differ from a full decode, as in vLLM.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

REPLACEMENT = "\ufffd"
PREFIX_WINDOW = 5  # tokens of context before the first unread token (vLLM uses 5)
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# id(tokenizer) -> (its byte-fallback piece ids, its special ids); tokenizers live as long as the process
_PIECES: dict[int, tuple[frozenset[int], frozenset[int]]] = {}


def byte_and_special_ids(tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    """Ids of the byte-fallback pieces `<0x00>`..`<0xFF>` (none for byte-level BPE) and of the special tokens
    (skipped by the decode, so a byte run goes on across them), computed once per tokenizer."""
    key = id(tokenizer)
    if key not in _PIECES:
        get_vocab = getattr(tokenizer, "get_vocab", None)
        vocab = get_vocab() if get_vocab is not None else {}
        if hasattr(tokenizer, "all_special_ids"):  # transformers
            special = set(tokenizer.all_special_ids)
        else:  # tokenizers.Tokenizer
            special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        _PIECES[key] = (frozenset(i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t)), frozenset(special))
    return _PIECES[key]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prefix_ids: Sequence[int] = ()):
        """tokenizer: anything with `decode(ids, skip_special_tokens=True)` (transformers or tokenizers)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in prefix_ids]
        self.n_prefix = len(self.ids)
        self.prefix_offset = max(self.n_prefix - PREFIX_WINDOW, 0)
        self.read_offset = self.n_prefix
        self.emitted: list[str] = []
        self.byte_ids, self.special_ids = byte_and_special_ids(tokenizer)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.emitted)

    def push(self, ids: Sequence[int]) -> str:
        """Add new token ids; return the newly completed text ("" while a character is incomplete)."""
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) == self.read_offset or self._in_byte_run():
            return ""  # nothing new, or a byte run that may still grow (its text is not final yet)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # nothing complete yet: wait for more ids
        out = new_text[len(prefix_text):]  # (a decode that rewrites earlier text, e.g. space clean-up, is fixed
        # up at flush when possible)
        # the next window starts at the first unread token: [read, end) holds one or more complete characters
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.emitted.append(out)
        return out

    def _in_byte_run(self) -> bool:
        """The last id that the decode does not skip is a byte piece."""
        if not self.byte_ids:
            return False
        for t in reversed(self.ids):
            if t not in self.special_ids:
                return t in self.byte_ids
        return False

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD here, as in a full decode)."""
        gen = self.ids[self.n_prefix:]
        if self.n_prefix == 0:
            full = self._decode(gen)
        else:
            prompt_text = self._decode(self.ids[:self.n_prefix])
            full = self._decode(self.ids)
            full = full[len(prompt_text):] if full.startswith(prompt_text) else self._decode(gen)
        done = self.text
        if full.startswith(done):
            out = full[len(done):]
        else:  # the tokenizer's decode is not a concatenation: best effort from the last window
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            out = self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        if out:
            self.emitted.append(out)
        return out
