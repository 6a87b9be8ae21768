"""Multinomial sampling (transformers 5.x `GenerationMixin._sample` with do_sample), batched over requests, with
its state on the host and one device read-back per step: the engine's one implementation of sampling (beam
sampling is `beam_batch.py`'s).

Every sampling request is stepped by `sample_step` with the other sampling requests of the decode step (a request
alone, e.g. its first step at the end of its prefill, is a batch of one). The processors run once over all their
rows [R, V] with per-row parameters, each transformers' expression made row-wise:
- repetition / presence / frequency penalties, no-repeat-ngram, bad words: `processors.process` (each row's
  seen tokens and counts on the device, updated from the chosen tokens after the step; n-grams and bad word
  prefixes matched on the host from its token lists);
- min_new_tokens: the end ids of the rows still held set to -inf (the same -inf as `torch.where`);
- temperature: `scores / t` per row, float32(t) in a [R, 1] column (on CUDA `tensor / python_float` is
  `a * (1.0f / float32(t))`, so there the column holds that fp32 reciprocal and multiplies); t = 1 is exact;
- top-k (`TopKLogitsWarper`): the k-th largest value of each row (k = min(max(top_k, 1), V)) is column k - 1 of
  ONE `topk(scores, max k)` (the k-th largest value does not depend on how many are asked for); rows without
  top-k compare with -inf (nothing removed);
- top-p (`TopPLogitsWarper`): the same ascending sort, softmax, cumsum and scatter over [R, V] (each row sorted
  and summed on its own), compared with float32(1 - top_p) per row (the Python float HF compares with is cast to
  fp32 likewise); rows without top-p compare with -1 (nothing removed); min_tokens_to_keep = 1
  (`processors.warp`).

The draw stays per request: HF draws `torch.multinomial(probs [n, V], 1, generator)` with the request's own
generator, and the random numbers it consumes depend on that call's shape, so rows of different requests cannot
share one call. For num_samples = 1 torch computes (`at::native::multinomial`, checked against `torch.multinomial`
in tests/engine/test_sampling_batch.py) `q = empty_like(probs).exponential_(1, generator)`, then
`argmax(probs / q, -1)`. Here each request fills its own [n, V] block of q from its own generator (exactly the
numbers its `multinomial` call would draw) and the division and argmax run once over every row. This also skips
`multinomial`'s two validity checks, each a host sync on an accelerator: every row here is a valid distribution
(a row with no finite score draws from uniform scores, and its request fails after the step: a row with nothing
to choose from has no distribution, and `multinomial` would reject it with a device-side assert on CUDA).
Finished rows of a request (num_return_sequences n > 1) get uniform probabilities so that its block stays [n, V].

Guided requests (`grammar`: one xgrammar matcher per row, fed the row's tokens on the host) get their grammar's
mask after min_new_tokens and before the warpers, as HF runs a `logits_processor`: one bitmask, one fill and one
apply for every constrained row of the step (`guided.mask_rows`); the other rows are not touched.

Log probs are log_softmax of the raw logits, the chosen token's and (top_log_probs = k) one `topk` per distinct k
(the order of exact ties in `topk` may depend on k). Everything comes back in ONE `.tolist()` of a
[R, 3 + 2 max k] float64 tensor (ids < 2**53 and fp32 values are exact in float64); stopping (end ids, max tokens,
stop words) is decided on the host (HF's `EosTokenCriteria | MaxLengthCriteria` plus token-level stop words).
Each request gets bit for bit what it gets stepped alone (on CPU, exact ties included; on CUDA the order of exact
ties in `topk` can depend on the number of rows, as noted in beam_batch.py), checked against transformers'
`generate()` in tests/engine/test_decoding.py and test_sampling_batch.py.
"""
from __future__ import annotations

import math
import random
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ...params import Sequence_
from . import guided, processors
from .processors import Context, RowContext
from .search import NoTokenLeft

StepOut = tuple[list[int], list[int], bool]  # (parents, tokens, done), as `search.Search.step`


def resolve_seed(seed: Optional[int]) -> int:
    """params.seed, or a fresh random seed when None."""
    return random.getrandbits(63) if seed is None else int(seed)


def readback(t: torch.Tensor) -> list:
    """The step's one device-to-host copy (a host-device synchronisation on an accelerator)."""
    return t.tolist()


class SampleSearch:
    """One sampling request of n rows; its tokens and log probs are host lists."""

    append_only = True  # a row's tokens only ever grow: what was streamed is always their prefix

    def __init__(self, *, num_rows: int, max_new_tokens: int, eos_ids: Sequence[int], min_new_tokens: int,
                 temperature: float, top_k: int, top_p: float, seed: Optional[int] = None, top_log_probs: int = 0,
                 stop_words_ids: Sequence[Sequence[int]] = (), grammar=None, context: Optional[Context] = None):
        self.n = num_rows
        # guided decoding: one xgrammar matcher per row (of n), fed that row's tokens on the host
        self.matchers = None if grammar is None else [guided.new_matcher(grammar, eos_ids) for _ in range(num_rows)]
        self.max_new = max_new_tokens
        self.eos = [int(e) for e in eos_ids]
        self.min_new = int(min_new_tokens) if self.eos else 0  # as HF: no end id, nothing to hold
        self.stop_words = sorted({tuple(int(t) for t in w) for w in stop_words_ids if len(w)}, key=len)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        assert self.temperature > 0 and self.top_k >= 0 and 0 < self.top_p <= 1.0, "unvalidated params"
        self.seed = resolve_seed(seed)
        self.k = int(top_log_probs)
        self.generator: Optional[torch.Generator] = None  # on the logits' device, made at the first step
        self.t = 0
        self.alive: list[int] = list(range(num_rows))  # rows (of n) still generating, in logits order
        self.tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self.log_probs: list[list[float]] = [[] for _ in range(num_rows)]
        self.top_lp: list[list[list[float]]] = [[] for _ in range(num_rows)]
        self.top_ids: list[list[list[int]]] = [[] for _ in range(num_rows)]
        # each row's context processors (penalties, no-repeat-ngram, bad words), or None
        self.rows = None if context is None else [RowContext(context, self.tokens[r]) for r in range(num_rows)]
        self.done = False

    @property
    def num_rows(self) -> int:
        return 0 if self.done else (1 if self.t == 0 else len(self.alive))

    def step(self, logits: torch.Tensor) -> StepOut:
        out = sample_step([self], logits, [0])[0]
        if isinstance(out, NoTokenLeft):
            raise out
        return out

    def _advance(self, rows: list[list]) -> StepOut:
        """rows: per alive row, its read-back [token, stuck, log prob, top lp (max k)..., top ids (max k)...]."""
        first = self.t == 0
        self.t += 1
        keep = []
        for i, (r, row) in enumerate(zip(self.alive, rows)):
            self.tokens[r].append(int(row[0]))
            self.log_probs[r].append(row[2])
            if self.matchers is not None:
                guided.accept(self.matchers[r], int(row[0]))
            if self.k:
                lp, ids = processors.split_top(row, self.k)
                self.top_lp[r].append(lp)
                self.top_ids[r].append(ids)
            if not self._stopped(self.tokens[r]):
                keep.append(i)
        tokens = [self.tokens[self.alive[i]][-1] for i in keep]
        self.alive = [self.alive[i] for i in keep]
        self.done = not self.alive
        if self.done:
            return [], [], True
        return ([0] * len(keep) if first else keep), tokens, False

    def _stopped(self, toks: list[int]) -> bool:
        """Stopping on the host: max new tokens, an end id, or a stop word just completed."""
        n = len(toks)
        if n >= self.max_new or toks[-1] in self.eos:
            return True
        return any(len(w) <= n and tuple(toks[n - len(w):]) == w for w in self.stop_words)

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step (the rows still generating), the new tokens it holds."""
        return [list(self.tokens[r]) for r in self.alive] if self.t and not self.done else []

    def stream_prefixes(self) -> list[list[int]]:
        """Every row's new tokens (rows in HF's order, finished rows included): all final already."""
        return self.tokens if self.t else []  # the live lists (append only): no O(tokens) copy per step

    def token_info(self, r: int, start: int, end: int) -> tuple[list[float], list, list]:
        lp = self.log_probs[r][start:end]
        if not self.k:
            return lp, [], []
        return lp, [list(x) for x in self.top_lp[r][start:end]], [list(x) for x in self.top_ids[r][start:end]]

    def finalize(self, n: int) -> list[Sequence_]:
        """The first n rows in sampling order (HF's row order, not re-ranked)."""
        if not self.t:
            return [Sequence_([], "", 0.0, []) for _ in range(n)]
        out = []
        for r in range(min(n, self.n)):
            lp, top_lp, top_ids = self.token_info(r, 0, len(self.tokens[r]))
            out.append(Sequence_(list(self.tokens[r]), "", float(sum(lp)), lp, top_lp, top_ids))
        return out


def _on(device: torch.device, values: Union[list, torch.Tensor], dtype=torch.long) -> torch.Tensor:
    """A small host-built tensor on `device`. On CUDA copied from pinned memory without blocking: a plain
    host-to-device copy synchronises the stream, and the step's only synchronisation is its read-back."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _process(searches: list[SampleSearch], row_of: list[int], raw: torch.Tensor,
             row_ids: Optional[list[int]] = None, contexts: Optional[list] = None) -> torch.Tensor:
    """The sampling processors (HF's order), row-wise: raw [R, V] fp32, row_of[j] = the search of row j, row_ids[j] its
    row among the search's n (its alive rows, in order, by default), contexts[j] its `RowContext` or None ->
    processed scores [R, V]."""
    V, dev = raw.shape[-1], raw.device
    scores = raw
    if contexts is not None and any(c is not None for c in contexts):  # penalties, no-repeat-ngram, bad words
        scores = processors.process(raw, contexts)
    held = [(j, e) for j, b in enumerate(row_of) if searches[b].t < searches[b].min_new for e in searches[b].eos]
    if held:  # MinNewTokensLengthLogitsProcessor
        rows, cols = zip(*held)
        scores = scores.index_put((_on(dev, list(rows)), _on(dev, list(cols))), scores.new_full((), -math.inf))
    constrained = [j for j, b in enumerate(row_of) if searches[b].matchers is not None]
    if constrained:  # the grammars (after min_new_tokens, before the warpers): one bitmask, one fill, one apply
        if row_ids is None:
            row_ids = [searches[b].alive[j - row_of.index(b)] for j, b in enumerate(row_of)]
        matchers = [searches[row_of[j]].matchers[row_ids[j]] for j in constrained]
        scores = guided.mask_rows(scores, constrained, matchers, V)
    return processors.warp(scores, [searches[b].temperature for b in row_of], [searches[b].top_k for b in row_of],
                           [searches[b].top_p for b in row_of])


def _draw(searches: list[SampleSearch], scores: torch.Tensor, pos: Optional[list[int]]) -> torch.Tensor:
    """scores [R, V] (no row without a finite score) -> each row's token [R]: per search, torch.multinomial's
    draw over its [n, V] block (its finished rows uniform) from its own generator; pos = each row's place among
    the sum(n) rows of the blocks (None: all rows, in order)."""
    if pos is None:
        full = scores
    else:
        full = scores.new_zeros((sum(s.n for s in searches), scores.shape[-1]))  # [N, V] finished rows: uniform
        full[_on(scores.device, pos)] = scores
    probs = nn.functional.softmax(full, dim=-1)  # [N, V]
    q = torch.empty_like(probs)  # [N, V]
    off = 0
    for s in searches:  # the numbers each request's own `multinomial(probs [n, V], 1)` would draw
        q[off:off + s.n].exponential_(1, generator=s.generator)
        off += s.n
    drawn = torch.argmax(probs / q, dim=-1)  # [N]
    return drawn if pos is None else drawn[_on(drawn.device, pos)]


def sample_step(searches: list[SampleSearch], logits: torch.Tensor,
                starts: list[int]) -> list[Union[StepOut, NoTokenLeft]]:
    """One step of sampling searches: logits [rows, V] of the decode step (any float dtype and device), search i's
    rows beginning at starts[i] (one row, the prompt's, at its first step) -> each search's (parents, tokens,
    done), or the `NoTokenLeft` that ends it (that search is left unchanged; the others are unaffected).
    One device read-back for all of them."""
    if any(s.done for s in searches):
        raise ValueError("sample_step() needs unfinished sampling searches")
    dev = logits.device
    idx, row_of, row_ids, pos, off, all_alive = [], [], [], [], 0, True
    for b, (s, st) in enumerate(zip(searches, starts)):
        if s.generator is None:
            s.generator = torch.Generator(device=dev)
            s.generator.manual_seed(s.seed)
        rows = [st] * s.n if s.t == 0 else [st + i for i in range(len(s.alive))]  # first step: HF's n copies
        idx += rows
        row_of += [b] * len(rows)
        row_ids += list(s.alive)  # at the first step every one of the n rows is alive
        pos += [off + r for r in s.alive]
        all_alive &= len(s.alive) == s.n
        off += s.n
    if idx == list(range(len(idx))) and len(idx) == logits.shape[0]:
        raw = logits.to(torch.float32)  # [R, V]
    else:
        raw = logits.index_select(0, _on(dev, idx)).to(torch.float32)  # [R, V]
    contexts = [None if searches[b].rows is None else searches[b].rows[r] for b, r in zip(row_of, row_ids)]
    scores = _process(searches, row_of, raw, row_ids, contexts)
    stuck = ~torch.isfinite(scores.amax(dim=-1))  # [R] no finite score: NaN, +inf or every token excluded
    scores = torch.where(stuck[:, None], 0.0, scores)  # a valid distribution; the request fails below
    tokens = _draw(searches, scores, None if all_alive else pos)  # [R]
    logp = nn.functional.log_softmax(raw, dim=-1)  # [R, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [R]
    cols = [tokens.to(torch.float64), stuck.to(torch.float64), chosen.to(torch.float64)]
    packed = torch.stack(cols, dim=1)  # [R, 3]
    top = processors.top_log_probs([searches[b].k for b in row_of], logp)
    if top is not None:
        packed = torch.cat((packed, top), dim=1)  # [R, 3 + 2 max k]
    if any(c is not None for c in contexts):
        processors.commit(contexts, tokens)  # before the read-back: the device state of the next step, no sync
    values = readback(packed)
    out: list[Union[StepOut, NoTokenLeft]] = []
    j = 0
    for s in searches:
        rows = values[j:j + len(s.alive)]  # at the first step every one of the n rows is alive
        if any(r[1] for r in rows):
            bad = torch.tensor([j + i for i, r in enumerate(rows) if r[1]], device=dev)
            out.append(NoTokenLeft(s.t + 1, nonfinite_logits=not bool(torch.isfinite(raw[bad]).all())))
        else:
            out.append(s._advance(rows))
        j += len(rows)
    return out
