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
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> Optional[int]:
        """Where `text` is cut: the start of the earliest-ending stop string that ends after `start`, or None."""
        best = None
        for s in self.stops:
            i = text.find(s, max(0, start - len(s) + 1))
            if i >= 0:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
        return None if best is None else best[1]

    def holdback(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string (they may still complete it)."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold


@dataclass
class Choice:
    index: int
    matcher: StopMatcher
    text: str = ""
    sent: int = 0  # characters of `text` already released
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stopped: bool = False  # a stop string ended the text
    done: bool = False
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def feed(self, piece: bytes, ids: list[int], log_probs: list[float]) -> str:
        """Add a piece of generated text (UTF-8 bytes, decoded incrementally) and its tokens; returns the text that
        can be released now."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self.log_probs.extend(log_probs)
        before = len(self.text)
        self.text += self._utf8.decode(piece)
        if self.matcher.stops:
            cut = self.matcher.find(self.text, before)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return self._release(len(self.text))
            return self._release(len(self.text) - self.matcher.holdback(self.text))
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

    def token_texts(self, tokenizer, eos_ids: frozenset) -> list[tuple[int, str, float]]:
        """(id, text, log prob) per generated token, the texts joining to this choice's text exactly: each
        token's text is what decoding the ids so far adds (a token that ends inside a character adds nothing
        until the character completes); the end token is left out; after a stop string, nothing."""
        out: list[tuple[int, str, float]] = []
        prev, ids, joined = "", [], 0
        for k, t in enumerate(self.ids):
            if t in eos_ids and k == len(self.ids) - 1:
                break
            ids.append(t)
            cur = tokenizer.decode(ids, skip_special_tokens=True)
            if cur.endswith("\ufffd") or not cur.startswith(prev):
                piece = ""
            else:
                piece, prev = cur[len(prev):], cur
            lp = self.log_probs[k] if k < len(self.log_probs) else 0.0
            room = len(self.text) - joined
            if room <= 0 and piece:
                break
            piece = piece[:room]
            joined += len(piece)
            out.append((t, piece, lp))
        if joined < len(self.text) and out:  # characters completed only by the end of the sequence
            t, piece, lp = out[-1]
            out[-1] = (t, piece + self.text[joined:], lp)
        return out
