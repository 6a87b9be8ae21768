"""Greedy search (transformers 5.x `GenerationMixin._sample` without sampling) batched over requests, with its
state on the host and one device read-back per step: the engine's one implementation of greedy search.

Every greedy request is stepped by `greedy_step` with the other greedy requests of the decode step (a request
alone, e.g. its first step at the end of its prefill, is a batch of one). Per step it needs from the device only
each row's argmax, that token's log prob (and its top_log_probs k best), and whether the row had any finite score.
`greedy_step` computes these for every row at once over the [rows, vocab] logits block: the context processors of
the rows that use them (repetition / presence / frequency penalties, no-repeat-ngram, bad words:
`processors.process`, each with the row's own parameters), one masked fill for the rows still inside
min_new_tokens, one argmax, one amax, one log_softmax, one gather, one `topk` per distinct k, and reads them back
with ONE `.tolist()` of a [rows, 3 + 2 max k] float64 tensor (token ids < 2**53 and fp32 log probs are exact in
float64). Stopping (end ids, max tokens, stop words) is decided on the host from the token lists. Guided rows (a
grammar's `matcher`) get their grammar's mask after min_new_tokens: one bitmask for all of them, one masked fill
(`guided.mask_rows`); the other rows are not touched.

Each row gets what it gets alone, bit for bit (the same ops on the same fp32 values, row-wise; argmax and
log_softmax of a row do not depend on the other rows; ties go to the first index), and that matches transformers'
`_sample` with `do_sample=False` and `compute_transition_scores(normalize_logits=True)` (tests/engine/
test_decoding.py): log probs are those of the raw logits, the model's own distribution.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from ...params import Sequence_
from . import guided, processors
from .processors import Context, RowContext
from .search import NoTokenLeft

StepOut = tuple[list[int], list[int], bool]  # (parents, tokens, done), as `search.Search.step`


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on `device` without a host-device sync: on CUDA copied from pinned memory,
    non-blocking (the caching host allocator keeps the pinned buffer until the copy has run). The GPU check found
    two pageable copies here, each a sync, in every greedy step inside min_new_tokens."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def readback(t: torch.Tensor) -> list:
    """The step's one device-to-host copy (a host-device synchronisation on an accelerator)."""
    return t.tolist()


class GreedySearch:
    """One greedy row; its tokens and log probs are host lists."""

    seed: Optional[int] = None
    append_only = True  # a row's tokens only ever grow: what was streamed is always their prefix

    def __init__(self, *, max_new_tokens: int, eos_ids: Sequence[int], min_new_tokens: int,
                 stop_words_ids: Sequence[Sequence[int]] = (), matcher=None, context: Optional[Context] = None,
                 top_log_probs: int = 0):
        self.matcher = matcher  # guided decoding: the row's xgrammar GrammarMatcher (`guided.mask_rows`)
        self.k = int(top_log_probs)
        self.top_lp: list[list[float]] = []
        self.top_ids: list[list[int]] = []
        self.max_new = max_new_tokens
        self.eos = [int(e) for e in eos_ids]
        self.min_new = int(min_new_tokens) if self.eos else 0  # as HF: no end id, nothing to hold
        self.stop_words = sorted({tuple(int(t) for t in w) for w in stop_words_ids if len(w)}, key=len)
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.row = None if context is None else RowContext(context, self.tokens)  # its context processors
        self.done = False

    @property
    def t(self) -> int:
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        return 0 if self.done else 1

    def step(self, logits: torch.Tensor) -> StepOut:
        out = greedy_step([self], logits)[0]
        if isinstance(out, NoTokenLeft):
            raise out
        return out

    def _advance(self, row: list) -> StepOut:
        """row: its read-back [token, stuck, log prob, top lp (max k)..., top ids (max k)...]."""
        token = int(row[0])
        if self.matcher is not None:
            guided.accept(self.matcher, token)
        self.tokens.append(token)
        self.log_probs.append(row[2])
        if self.k:
            lp, ids = processors.split_top(row, self.k)
            self.top_lp.append(lp)
            self.top_ids.append(ids)
        self.done = self._stopped()
        return ([], [], True) if self.done else ([0], [token], False)

    def _stopped(self) -> bool:
        """Stopping on the host: max new tokens, an end id, or a stop word just completed."""
        toks, n = self.tokens, self.t
        if n >= self.max_new or toks[-1] in self.eos:
            return True
        return any(len(w) <= n and tuple(toks[n - len(w):]) == w for w in self.stop_words)

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step, the new tokens it holds (its last one is the one it feeds)."""
        return [list(self.tokens)] if self.t and not self.done else []

    def stream_prefixes(self) -> list[list[int]]:
        return [self.tokens] if self.t else []  # the live list: no O(tokens) copy per step

    def token_info(self, r: int, start: int, end: int) -> tuple[list[float], list, list]:
        if not self.k:
            return self.log_probs[start:end], [], []
        return (self.log_probs[start:end], [list(x) for x in self.top_lp[start:end]],
                [list(x) for x in self.top_ids[start:end]])

    def finalize(self, n: int) -> list[Sequence_]:
        if not self.t:
            return [Sequence_([], "", 0.0, []) for _ in range(n)]
        lp, top_lp, top_ids = self.token_info(0, 0, self.t)
        return [Sequence_(list(self.tokens), "", float(sum(lp)), lp, top_lp, top_ids)][:n]


def greedy_step(searches: list[GreedySearch], logits: torch.Tensor) -> list[Union[StepOut, NoTokenLeft]]:
    """logits [rows, V] (row i = searches[i], any float dtype and device) -> each search's step, or the
    `NoTokenLeft` of a row with no finite score (that search is left unchanged). One device read-back."""
    raw = logits.to(torch.float32)  # [rows, V]
    scores = raw
    rows = [s.row for s in searches]
    if any(r is not None for r in rows):  # penalties, no-repeat-ngram, bad words: every such row at once
        scores = processors.process(raw, rows)
    held = [(i, e) for i, s in enumerate(searches) if s.t < s.min_new for e in s.eos]
    if held:  # MinNewTokensLengthLogitsProcessor: end ids -inf for the rows not yet min_new_tokens long
        at = to_device(held, raw.device)  # [held, 2] (row, end id)
        scores = scores.index_put((at[:, 0], at[:, 1]), scores.new_full((), -math.inf))  # no host copy
    guided_rows = [i for i, s in enumerate(searches) if s.matcher is not None]
    if guided_rows:  # the grammars (after min_new_tokens, as HF runs a generate() logits_processor): one bitmask
        scores = guided.mask_rows(scores, guided_rows, [searches[i].matcher for i in guided_rows], raw.shape[-1])
    tokens = torch.argmax(scores, dim=-1)  # [rows]
    stuck = ~torch.isfinite(scores.amax(dim=-1))  # [rows] no finite score: NaN, +inf or every token excluded
    logp = torch.nn.functional.log_softmax(raw, dim=-1)  # [rows, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [rows]
    packed = torch.stack((tokens.to(torch.float64), stuck.to(torch.float64), chosen.to(torch.float64)), dim=1)
    top = processors.top_log_probs([s.k for s in searches], logp)
    if top is not None:
        packed = torch.cat((packed, top), dim=1)  # [rows, 3 + 2 max k]
    if any(r is not None for r in rows):
        processors.commit(rows, tokens)  # before the read-back: the device state of the next step, no sync
    out: list[Union[StepOut, NoTokenLeft]] = []
    for i, (s, row) in enumerate(zip(searches, readback(packed))):  # [rows, 3 + 2 max k]
        if row[1]:
            out.append(NoTokenLeft(s.t + 1, nonfinite_logits=not bool(torch.isfinite(raw[i]).all())))
        else:
            out.append(s._advance(row))
    return out
