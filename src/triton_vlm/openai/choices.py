"""One choice of a response as it is generated: its text (stop strings applied), token ids, log probs and finish
reason. The same code serves streamed and unstreamed requests, so both give the same text.

Stop strings (OpenAI's semantics, as vLLM applies them): the text ends just before the first stop string to
complete, i.e. the occurrence that ends earliest (of two ending together, the longer); the stop string is not
part of the text. Streaming holds back a tail that could still become a stop string, so no text is ever sent
and then taken back.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Optional


class StopMatcher:
    """Every stop string's KMP failure table, built once per request; `scan` advances a choice's match state over
    new text only, so matching costs O(new characters x stop strings) per token, whatever the text's and the stop
    strings' lengths (a re-search of the text's tail for every stop prefix cost O(len(stop) x len(text)))."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self._fail = [_failure(s) for s in self.stops]

    def start(self) -> list[int]:
        """A fresh match state: per stop string, how many of its first characters end the text so far."""
        return [0] * len(self.stops)

    def scan(self, state: list[int], text: str, start: int) -> tuple[Optional[int], int]:
        """Advance `state` over `text[start:]`. Returns (cut, hold): where the text is cut (the start of the
        earliest-ending stop string; of two ending together, the longer), or None, and the characters at the end
        that begin some stop string (held back: they may still complete it)."""
        for pos in range(start, len(text)):
            ch, done = text[pos], 0
            for k, s in enumerate(self.stops):
                j, fail = state[k], self._fail[k]
                while j and s[j] != ch:
                    j = fail[j - 1]
                if s[j] == ch:
                    j += 1
                if j == len(s):
                    done = max(done, j)
                    j = fail[j - 1]
                state[k] = j
            if done:
                return pos + 1 - done, 0
        return None, max(state, default=0)


def _failure(s: str) -> list[int]:
    """KMP: fail[i] = the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, j = [0] * len(s), 0
    for i in range(1, len(s)):
        while j and s[i] != s[j]:
            j = fail[j - 1]
        if s[i] == s[j]:
            j += 1
        fail[i] = j
    return fail


@dataclass
class Choice:
    index: int
    matcher: StopMatcher
    text: str = ""
    sent: int = 0  # characters of `text` already released
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, log prob), best first
    stopped: bool = False  # a stop string ended the text
    done: bool = False
    _tokens: "_TokenTexts" = field(default_factory=lambda: _TokenTexts())  # shared by this choice's copies
    _taken: int = 0  # tokens handed out by take_tokens
    _taken_chars: int = 0
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _stop_state: Optional[list[int]] = None  # StopMatcher.scan's state over `text`

    def feed(self, piece: bytes, ids: list[int], log_probs: list[float],
             top: Optional[list[list[tuple[int, float]]]] = None) -> str:
        """Add a piece of generated text (UTF-8 bytes, decoded incrementally) and its tokens; returns the text that
        can be released now."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self.log_probs.extend(log_probs)
        self.top.extend(top or [])
        before = len(self.text)
        self.text += self._utf8.decode(piece)
        if self.matcher.stops:
            if self._stop_state is None:
                self._stop_state = self.matcher.start()
            cut, hold = self.matcher.scan(self._stop_state, self.text, before)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return self._release(len(self.text))
            return self._release(len(self.text) - hold)
        return self._release(len(self.text))

    def finish(self) -> str:
        """The rest of the text, once the sequence is complete."""
        if not self.stopped:
            tail = self._utf8.decode(b"", final=True)
            if tail:
                self.feed(tail.encode(), [], [])
        self.done = True
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish_reason(self, max_tokens: Optional[int], eos_ids: frozenset) -> str:
        if self.stopped or (self.ids and self.ids[-1] in eos_ids):
            return "stop"
        if max_tokens is not None and len(self.ids) >= max_tokens:
            return "length"
        return "stop"  # the engine matched a stop word at the token level

    def token_texts(self, tokenizer, eos_ids: frozenset) -> list[tuple[int, str, float, list]]:
        """Every token's (id, text, log prob, top alternatives) once the choice is done (see `take_tokens`)."""
        return self.take_tokens(tokenizer, eos_ids, start=0)

    def take_tokens(self, tokenizer, eos_ids: frozenset, start: Optional[int] = None) -> list:
        """The tokens whose text has been released and not yet taken: (id, text, log prob, top alternatives), the
        texts joining to this choice's text exactly. A token's text is what decoding the ids so far adds (a token
        that ends inside a character adds nothing until the character completes); end tokens are left out; after
        a stop string, nothing. Alternatives are (text, log prob), each token decoded on its own."""
        raw = self._tokens.extend(self, tokenizer, eos_ids)
        i, pos = (self._taken, self._taken_chars) if start is None else (0, 0)
        out = []
        while i < len(raw):
            t, piece, k = raw[i]
            if pos + len(piece) > self.sent and not self.done:
                break  # its text is not released yet
            piece = piece[:max(0, len(self.text) - pos)]
            if self.done and pos >= len(self.text) and self.stopped:
                i = len(raw)
                break  # after a stop string
            top = [(tokenizer.decode([a]), v) for a, v in self.top[k]] if k < len(self.top) else []
            out.append((t, piece, self.log_probs[k] if k < len(self.log_probs) else 0.0, top))
            pos += len(piece)
            i += 1
        if self.done and pos < len(self.text) and out:  # characters completed only by the end of the sequence
            t, piece, lp, top = out[-1]
            out[-1] = (t, piece + self.text[pos:], lp, top)
            pos = len(self.text)
        if start is None:
            self._taken, self._taken_chars = i, pos
        return out


class _TokenTexts:
    """Each generated token's text, computed once per sequence (shared by its greedy copies), incrementally: each
    token decodes a short window (`engine.detok.IncrementalDetokenizer`), not every id so far (which made a
    sequence's log probs quadratic in its length)."""

    def __init__(self):
        self.raw: list[tuple[int, str, int]] = []  # (id, text, index into the sequence's ids)
        self.k = 0
        self.detok = None

    def extend(self, choice: "Choice", tokenizer, eos_ids: frozenset) -> list[tuple[int, str, int]]:
        if self.detok is None:
            from ..engine.search.detok import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer)
        while self.k < len(choice.ids):
            k, t = self.k, choice.ids[self.k]
            self.k += 1
            if t in eos_ids:
                continue
            self.raw.append((t, self.detok.push([t]), k))
        return self.raw
