"""The context logits processors batched across rows: repetition / presence / frequency penalties, no-repeat-ngram
and bad words, each with per-row parameters, for the batched searches (`greedy.greedy_step`,
`sampling_batch.sample_step`, `beam_batch.beam_step`). No host-device sync: what the host knows (each row's
tokens) is sent down pinned and non-blocking, what the device holds stays there.

Each processor is transformers' expression on the rows that use it, so every row's processed scores are bitwise
what transformers' processor computes on that row alone (tests/engine/test_batched_processors.py), in HF's
order:
- repetition penalty: HF gathers the context's scores, penalises them and scatters them back; a token present
  several times gets the same value each time, so this is `where(seen, where(s < 0, s * p, s / p), s)` with
  `seen` [rows, V] the tokens of the row's context (prompt + generated; ids past the lm head do not count).
  `p` is a [rows, 1] column; on CUDA `s / python_float` is `s * (1.0f / float32(p))`, so it multiplies by that;
- presence / frequency: `s - f * count - pr * (count > 0)`, count [rows, V] over the generated tokens;
- no-repeat-ngram: the tokens that would complete an n-gram already in the row's context, found on the host
  (the prompt's n-grams indexed once per request, the generated ones as they come), -inf by one `index_put_`
  (the same -inf as `masked_fill`);
- bad words: `s + bias`, bias [rows, V] = the single-token words' -inf row plus -inf at the last token of every
  multi-token word whose prefix ends the row's context (matched on the host). Whether a prefix as long as the
  whole context counts differs by transformers version (5.17 skips a word longer than the context, so such a
  prefix never matches; later ones match it): asked of the installed transformers once (`_prefix_may_fill`).

State. Greedy and sampling rows keep `seen` / `count` on the device, each row a view [V] into the step's
[rows, V] result (`RowContext`), updated after the step from the chosen tokens (a scatter, no sync). Beam rows
rebuild them every step from the group's token history (`beam_batch.BeamGroup.gen`), since beams fork.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import torch

from ...params import GenerationParams

Bans = list[tuple[int, int]]  # (row, token) pairs


def on_device(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """A small host-built tensor on `device`; on CUDA copied from pinned memory without blocking (a plain
    host-to-device copy synchronises the stream)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Context:
    """One request's context processors and their constants (host), with its device tensors made on first use."""

    @staticmethod
    def build(params: GenerationParams, prompt_ids: Sequence[int], eos_ids: Sequence[int],
              bad_words_ids: Sequence[Sequence[int]], vocab_size: int) -> Optional["Context"]:
        """None when the request uses none of them."""
        eos = {int(e) for e in eos_ids}
        words = {tuple(int(t) for t in w) for w in bad_words_ids if len(w)}
        # validated by `GenerationRequest.validate`; an id outside the vocabulary here is a bug
        assert all(0 <= t < vocab_size for w in words for t in w), "bad_words_ids outside the vocabulary"
        words = {w for w in words if not (len(w) == 1 and w[0] in eos)}  # NoBadWordsLogitsProcessor drops these
        c = Context(prompt_ids, params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
                    params.no_repeat_ngram_size or 0, sorted(words))
        return c if c.active else None

    def __init__(self, prompt_ids: Sequence[int], repetition: float, presence: float, frequency: float,
                 ngram: int, bad_words: Sequence[tuple[int, ...]]):
        self.prompt = [int(i) for i in prompt_ids]
        self.repetition, self.presence, self.frequency = float(repetition), float(presence), float(frequency)
        self.ngram = int(ngram)
        self.single = sorted({w[0] for w in bad_words if len(w) == 1})
        self.multi = [w for w in bad_words if len(w) > 1]
        self.rep = self.repetition != 1.0
        self.pf = self.presence != 0.0 or self.frequency != 0.0
        self.host = self.ngram > 0 or bool(self.multi)  # needs each row's tokens on the host
        self.active = self.rep or self.pf or self.host or bool(self.single)
        self._index: Optional[dict] = None
        self._dev: dict = {}

    def prompt_seen(self, V: int, device: torch.device) -> torch.Tensor:
        """[V] bool: the prompt's tokens (ids >= V, past the lm head, left out)."""
        key = ("seen", V, device)
        if key not in self._dev:
            ids = on_device([min(i, V) for i in self.prompt], device)
            self._dev[key] = torch.zeros(V + 1, dtype=torch.bool, device=device).index_fill_(0, ids, True)[:V]
        return self._dev[key]

    def single_bias(self, V: int, device: torch.device) -> torch.Tensor:
        """[V] fp32: -inf at the single-token bad words, 0 elsewhere."""
        key = ("bias", V, device)
        if key not in self._dev:
            bias = torch.zeros(V, dtype=torch.float32)
            if self.single:
                bias[self.single] = -math.inf
            self._dev[key] = on_device(bias, device)
        return self._dev[key]

    def _prompt_index(self) -> dict:
        """The prompt's n-grams: (n-1)-token prefix -> tokens that followed it."""
        if self._index is None:
            self._index = _ngrams(self.prompt, self.ngram, {}, 0)
        return self._index

    def ngram_bans(self, gen: Sequence[int], cache: Optional["RowContext"] = None) -> list[int]:
        """No-repeat-ngram: the tokens that would complete an n-gram of the context (prompt + `gen`, the row's
        generated tokens). cache: the row's own index of its generated n-grams, extended (greedy / sampling)."""
        n, Lp = self.ngram, len(self.prompt)
        if not n or Lp + len(gen) < n:
            return []
        prefix = tuple((self.prompt[-(n - 1):] + list(gen[-(n - 1):]))[-(n - 1):]) if n > 1 else ()
        tail = self.prompt[max(0, Lp - n + 1):]  # the prompt's part of the windows that end in generated tokens
        if cache is None:
            grams = _ngrams(tail + list(gen), n, {}, 0)
        else:
            grams = cache.grams = _ngrams(tail + list(gen), n, cache.grams, cache.indexed)
            cache.indexed = max(0, len(tail) + len(gen) - n + 1)
        return list(self._prompt_index().get(prefix, ())) + list(grams.get(prefix, ()))

    def bad_word_hits(self, gen: Sequence[int]) -> list[int]:
        """The last tokens of the multi-token bad words whose prefix ends the context (prompt + `gen`)."""
        n = len(self.prompt) + len(gen)
        short = 1 if _prefix_may_fill() else 0  # the shortest context a word of length L is matched in: L - short
        return [w[-1] for w in self.multi if n >= len(w) - short and _ends_with(self.prompt, gen, w[:-1])]


@functools.cache
def _prefix_may_fill() -> bool:
    """Does the installed transformers' NoBadWordsLogitsProcessor ban a word whose prefix is the whole context
    (context [1], word [1, 2])? transformers 5.17 does not (it skips words longer than the context), 5.24 does."""
    from transformers import NoBadWordsLogitsProcessor  # noqa: PLC0415

    scores = NoBadWordsLogitsProcessor([[1, 2]], eos_token_id=0)(torch.tensor([[1]]), torch.zeros(1, 3))
    return bool(torch.isinf(scores[0, 2]))


def _ngrams(ids: Sequence[int], n: int, index: dict, start: int) -> dict:
    """index updated with the n-grams of ids starting at positions >= start: prefix -> set of next tokens."""
    for i in range(max(start, 0), len(ids) - n + 1):
        index.setdefault(tuple(ids[i:i + n - 1]), set()).add(ids[i + n - 1])
    return index


def _ends_with(prompt: list[int], gen: Sequence[int], suffix: tuple[int, ...]) -> bool:
    m = len(suffix)
    if len(gen) >= m:
        return tuple(gen[len(gen) - m:]) == suffix
    return tuple(prompt[len(prompt) - (m - len(gen)):]) + tuple(gen) == suffix


class RowContext:
    """One greedy / sampling row's processor state: its generated tokens (the search's host list), device views
    [V] of the tokens it has seen (repetition) and their counts (presence / frequency), its n-gram index."""

    def __init__(self, ctx: Context, gen: list[int]):
        self.ctx, self.gen = ctx, gen
        self.seen: Optional[torch.Tensor] = None
        self.count: Optional[torch.Tensor] = None
        self.grams: dict = {}
        self.indexed = 0


def _rows_where(rows: list, pred: Callable) -> list[int]:
    return [j for j, r in enumerate(rows) if r is not None and pred(r)]


def update_rows(scores: torch.Tensor, idx: list[int],
                fn: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """fn applied to the rows idx of scores [R, V] (all of them without an index when idx is every row)."""
    if len(idx) == scores.shape[0]:
        return fn(scores, idx)
    at = on_device(idx, scores.device)
    return scores.index_copy(0, at, fn(scores.index_select(0, at), idx))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return on_device(torch.tensor(values, dtype=torch.float32)[:, None], device)  # [r, 1]


def repetition(scores: torch.Tensor, seen: torch.Tensor, penalties: list[float]) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor with a penalty per row: scores [r, V], seen [r, V] bool."""
    dev = scores.device
    p = _column(penalties, dev)
    if dev.type == "cuda":  # CUDA's `a / python_float`: a * (1.0f / float32(p))
        div = scores * on_device(torch.ones(len(penalties), 1) / torch.tensor(penalties, dtype=torch.float32)[:, None],
                                 dev)
    else:
        div = scores / p
    return torch.where(seen, torch.where(scores < 0, scores * p, div), scores)


def presence_frequency(scores: torch.Tensor, count: torch.Tensor, presence: list[float],
                       frequency: list[float]) -> torch.Tensor:
    """`logits.presence_frequency_penalty` with per-row values: count [r, V] fp32."""
    dev = scores.device
    scores = scores - _column(frequency, dev) * count
    return scores - _column(presence, dev) * (count > 0).to(scores.dtype)


def ban(scores: torch.Tensor, bans: Bans) -> torch.Tensor:
    """-inf at the (row, token) pairs (no-repeat-ngram: HF's masked_fill)."""
    if not bans:
        return scores
    at = on_device(bans, scores.device)  # [n, 2]
    return scores.index_put((at[:, 0], at[:, 1]), scores.new_full((), -math.inf))  # a fill, no host copy


def bad_words(scores: torch.Tensor, ctxs: list[Context], hits: Bans) -> torch.Tensor:
    """HF's SequenceBias for bad words: scores + bias, bias = the rows' single-token -inf rows, -inf at the hits."""
    V, dev = scores.shape[-1], scores.device
    bias = torch.stack([c.single_bias(V, dev) for c in ctxs])  # [r, V]
    if hits:
        at = on_device(hits, dev)
        bias = bias.index_put((at[:, 0], at[:, 1]), bias.new_full((), -math.inf))
    return scores + bias


def host_bans(rows: list[Optional[RowContext]], gens: Optional[list] = None) -> tuple[Bans, Bans]:
    """(no-repeat-ngram bans, multi-token bad word hits) as (row, token) pairs over all rows."""
    grams: Bans = []
    hits: Bans = []
    for j, r in enumerate(rows):
        if r is None or not r.ctx.host:
            continue
        gen = r.gen if gens is None else gens[j]
        grams += [(j, t) for t in r.ctx.ngram_bans(gen, r if gens is None else None)]
        hits += [(j, t) for t in r.ctx.bad_word_hits(gen)]
    return grams, hits


def process(scores: torch.Tensor, rows: list[Optional[RowContext]], seen: Optional[torch.Tensor] = None,
            count: Optional[torch.Tensor] = None, gens: Optional[list] = None) -> torch.Tensor:
    """scores [R, V] fp32, rows[j] = row j's context (None: no processors) -> processed scores [R, V].
    seen / count: [R, V] for every row (beams), else read from each row's `RowContext` (built from the prompt at
    a row's first step). gens: each row's generated tokens when not the `RowContext`'s own list (beams)."""
    V, dev = scores.shape[-1], scores.device
    rep = _rows_where(rows, lambda r: r.ctx.rep)
    if rep:
        if seen is None:
            for j in rep:
                if rows[j].seen is None:
                    rows[j].seen = rows[j].ctx.prompt_seen(V, dev)
            s = torch.stack([rows[j].seen for j in rep])
        else:
            s = seen if len(rep) == len(rows) else seen.index_select(0, on_device(rep, dev))
        scores = update_rows(scores, rep, lambda x, idx: repetition(x, s, [rows[j].ctx.repetition for j in idx]))
    pf = _rows_where(rows, lambda r: r.ctx.pf)
    if pf:
        if count is None:
            for j in pf:
                if rows[j].count is None:
                    rows[j].count = torch.zeros(V, dtype=torch.float32, device=dev)
            c = torch.stack([rows[j].count for j in pf])
        else:
            c = count if len(pf) == len(rows) else count.index_select(0, on_device(pf, dev))
        scores = update_rows(scores, pf, lambda x, idx: presence_frequency(
            x, c, [rows[j].ctx.presence for j in idx], [rows[j].ctx.frequency for j in idx]))
    grams, hits = host_bans(rows, gens)
    scores = ban(scores, grams)
    bw = _rows_where(rows, lambda r: bool(r.ctx.single or r.ctx.multi))
    if bw:
        pos = {j: i for i, j in enumerate(bw)}
        local = [(pos[j], t) for j, t in hits]
        scores = update_rows(scores, bw, lambda x, idx: bad_words(x, [rows[j].ctx for j in idx], local))
    return scores


def commit(rows: list[Optional[RowContext]], tokens: torch.Tensor) -> None:
    """After a step: each row's device state with its chosen token (tokens [R] on the device), as new views."""
    dev = tokens.device
    rep = _rows_where(rows, lambda r: r.ctx.rep and r.seen is not None)
    if rep:
        at = tokens if len(rep) == len(rows) else tokens.index_select(0, on_device(rep, dev))
        new = torch.stack([rows[j].seen for j in rep]).scatter(1, at[:, None], True)
        for i, j in enumerate(rep):
            rows[j].seen = new[i]
    pf = _rows_where(rows, lambda r: r.ctx.pf and r.count is not None)
    if pf:
        at = tokens if len(pf) == len(rows) else tokens.index_select(0, on_device(pf, dev))
        counts = torch.stack([rows[j].count for j in pf])
        new = counts.scatter_add(1, at[:, None], torch.ones((len(pf), 1), dtype=counts.dtype, device=dev))
        for i, j in enumerate(pf):
            rows[j].count = new[i]


def top_log_probs(ks: list[int], logp: torch.Tensor) -> Optional[torch.Tensor]:
    """[R, 2 max k] float64: row j's k = ks[j] best log probs then their ids (one topk per distinct k: the order
    of exact ties in `topk` may depend on k), or None when no row asks."""
    kmax = max(ks) if ks else 0
    if not kmax:
        return None
    out = torch.zeros((len(ks), 2 * kmax), dtype=torch.float64, device=logp.device)
    for k in sorted(set(ks) - {0}):
        idx = on_device([j for j, kj in enumerate(ks) if kj == k], logp.device)
        top = torch.topk(logp.index_select(0, idx), k, dim=-1)  # [rows_k, k] each, best first
        out[idx, :k] = top.values.to(torch.float64)
        out[idx, kmax:kmax + k] = top.indices.to(torch.float64)
    return out


def split_top(row: list, k: int) -> tuple[list[float], list[int]]:
    """A read-back row's [..., 3 head columns, top lp (max k)..., top ids (max k)...] -> its k log probs and ids."""
    kmax = (len(row) - 3) // 2
    return row[3:3 + k], [int(x) for x in row[3 + kmax:3 + kmax + k]]


def warp(scores: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float],
         keeps: Optional[list[int]] = None) -> torch.Tensor:
    """HF's sampling warpers row-wise (TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper) with each
    row's temperature, top_k (0: off), top_p (1.0: off) and min_tokens_to_keep (keeps, 1 by default)."""
    V, dev = scores.shape[-1], scores.device
    keeps = keeps or [1] * len(temps)
    if any(t != 1.0 for t in temps):
        if dev.type == "cuda":  # CUDA's `a / python_float`: a * (1.0f / float32(t))
            scores = scores * on_device(torch.ones(len(temps), 1) / torch.tensor(temps, dtype=torch.float32)[:, None],
                                        dev)
        else:
            scores = scores / _column(temps, dev)
    ks = [min(max(k, m), V) if k else 0 for k, m in zip(top_ks, keeps)]
    if any(ks):  # remove below the k-th largest value
        k_col = on_device(ks, dev)[:, None]  # [R, 1]
        kth = torch.topk(scores, max(ks))[0].gather(1, (k_col - 1).clamp(min=0))  # [R, 1]
        kth = torch.where(k_col > 0, kth, -math.inf)
        scores = scores.masked_fill(scores < kth, -math.inf)
    if any(p < 1.0 for p in top_ps):
        limit = _column([1 - p if p < 1.0 else -1.0 for p in top_ps], dev)  # [R, 1] float32(1 - top_p)
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= limit
        if len(set(keeps)) == 1:
            remove_sorted[..., -keeps[0]:] = 0
        else:  # the last min_tokens_to_keep sorted positions of each row stay
            cols = torch.arange(V, device=dev)[None, :]
            remove_sorted &= cols < (V - on_device(keeps, dev))[:, None]
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores
