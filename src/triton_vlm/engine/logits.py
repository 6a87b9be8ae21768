"""Logits processors and stopping criteria, matching transformers 5.x `generate()` bit for bit.

`LogitsPipeline` applies, in Hugging Face's order (`GenerationMixin._get_logits_processor`):
repetition penalty -> presence / frequency penalties -> no-repeat-ngram -> bad words -> min new tokens -> the
request's grammar (`guided.GrammarGuide`, where HF runs a `logits_processor` given to `generate()`), then,
only when sampling, temperature -> top-k -> top-p. Each step is the same torch expression HF uses, so processed
scores are bitwise equal given equal inputs. Processors see the full context of each row (prompt ids, image
placeholder ids included, followed by the generated ids), as HF's processors see `input_ids`.

Presence / frequency penalties are OpenAI's (`logits[t] -= presence * (count[t] > 0) + frequency * count[t]`,
count over the GENERATED tokens only), applied as vLLM applies them: after the repetition penalty, frequency
first, before temperature. HF has no such processor; `hf_generate.PresenceFrequencyPenalty` is the same
expression for the baseline (added after HF's own processors: the -inf masks of no-repeat-ngram, bad words and
min new tokens commute with a finite subtraction, so the result is the same).

`StopCriteria` is HF's `EosTokenCriteria | MaxLengthCriteria` plus token-level stop words: a row stops when its
last token is an EOS id, when it holds `max_tokens` new tokens, or when its generated tokens end with a stop
word's ids (the stop word stays in the output).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch



def _assert_ids(what: str, ids: Sequence[int], vocab_size: int) -> None:
    """Validated by `GenerationRequest.validate`; an id outside the vocabulary here is a bug."""
    assert all(0 <= int(i) < vocab_size for i in ids), f"{what} outside [0, {vocab_size}): unvalidated request"


class LogitsPipeline:
    """Stateless per-step processing of a request's scores; built once per request."""

    def __init__(self, *, prompt_len: int, eos_ids: Sequence[int], vocab_size: int,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 no_repeat_ngram_size: int = 0, min_new_tokens: int = 0,
                 bad_words_ids: Sequence[Sequence[int]] = (), sampling: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, min_tokens_to_keep: int = 1, guide=None):
        self.prompt_len = prompt_len
        self.guide = guide  # guided.GrammarGuide or None
        self.vocab_size = vocab_size
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)  # [n_eos]
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.ngram = int(no_repeat_ngram_size)
        self.min_new_tokens = int(min_new_tokens) if len(eos_ids) else 0
        self.sampling = sampling
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_keep = int(min_tokens_to_keep)
        # validated by `GenerationParams.validate`
        assert self.repetition_penalty > 0 and (not sampling or (self.temperature > 0 and self.top_k >= 0
                                                                  and 0 < self.top_p <= 1.0)), "unvalidated params"
        # NoBadWordsLogitsProcessor: drop single-token bad words that are an EOS id, then a -inf
        # SequenceBias (dict keyed by the tuple of ids, so duplicates collapse).
        eos_set = {int(e) for e in eos_ids}
        words: dict[tuple[int, ...], None] = {}
        for w in bad_words_ids:
            w = tuple(int(t) for t in w)
            if not w:
                continue
            _assert_ids("bad_words_ids", w, vocab_size)
            if len(w) == 1 and w[0] in eos_set:
                continue
            words[w] = None
        self.has_bad_words = bool(words)
        self.length_1_bias = torch.zeros((vocab_size,), dtype=torch.float)  # [V]
        single = [w[0] for w in words if len(w) == 1]
        if single:
            self.length_1_bias[single] = torch.tensor([float("-inf")] * len(single))
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for w in words:
            if len(w) > 1:
                by_len.setdefault(len(w) - 1, []).append(w)
        self.multi_token_biases = [  # (prefixes [g, m], last tokens [g], biases [g])
            (torch.tensor([w[:-1] for w in g]), torch.tensor([w[-1] for w in g]),
             torch.tensor([float("-inf")] * len(g), dtype=torch.float))
            for g in by_len.values()
        ]
        self._device = torch.device("cpu")
        self._eos_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> "LogitsPipeline":
        if device != self._device:
            self.eos = self.eos.to(device)
            self.length_1_bias = self.length_1_bias.to(device)
            self.multi_token_biases = [tuple(t.to(device) for t in g) for g in self.multi_token_biases]
            self._device = device
        return self

    # --- processors (HF LogitsProcessor.__call__ bodies, batch = rows) -------------------------------------
    def _repetition_penalty(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab_size = scores.shape[-1]
        input_ids = input_ids.clamp(max=vocab_size)  # ids past the lm head (never generated) hit a spare column
        scores = torch.nn.functional.pad(scores, (0, 1))
        score = torch.gather(scores, 1, input_ids)
        score = torch.where(score < 0, score * self.repetition_penalty, score / self.repetition_penalty)
        return scores.scatter(1, input_ids, score)[..., :vocab_size]

    def _presence_frequency(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return presence_frequency_penalty(input_ids[:, self.prompt_len:], scores, self.presence_penalty,
                                          self.frequency_penalty)

    def _no_repeat_ngram(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = self.ngram
        cur_len = input_ids.shape[-1]
        if cur_len < n:
            return scores
        prefix = input_ids[:, cur_len + 1 - n:]  # [rows, n-1]
        windows = input_ids.unfold(dimension=1, size=n, step=1)  # [rows, cur_len-n+1, n]
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1)  # [rows, cur_len-n+1]
        vocab_size = scores.shape[-1]
        banned = scores.new_zeros((scores.shape[0], vocab_size + 1), dtype=torch.bool)
        banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab_size), vocab_size), True)
        return scores.masked_fill(banned[:, :vocab_size], -float("inf"))

    def _bad_words(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(scores)
        bias += self.length_1_bias
        for prefixes, last_tokens, biases in self.multi_token_biases:
            m = prefixes.shape[1]
            if m > input_ids.shape[1]:
                continue
            matching = (input_ids[:, None, -m:] == prefixes).all(dim=-1)  # [rows, g]
            bias.index_add_(1, last_tokens, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias

    def _min_new_tokens(self, new_len: int, scores: torch.Tensor) -> torch.Tensor:
        if new_len < self.min_new_tokens:
            mask = self._eos_mask  # [V] the end ids, built on the first step that needs it
            if mask is None or mask.device != scores.device or mask.shape[0] != scores.shape[-1]:
                vocab = torch.arange(scores.shape[-1], device=scores.device)
                mask = self._eos_mask = torch.isin(vocab, self.eos)
            return torch.where(mask, -math.inf, scores)
        return scores

    def _top_k(self, scores: torch.Tensor) -> torch.Tensor:
        top_k = min(max(self.top_k, self.min_keep), scores.size(-1))
        remove = scores < torch.topk(scores, top_k)[0][..., -1, None]
        return scores.masked_fill(remove, -float("inf"))

    def _top_p(self, scores: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - self.top_p)
        remove_sorted[..., -self.min_keep:] = 0
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        return scores.masked_fill(remove, -float("inf"))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids [rows, L] (prompt + generated), scores [rows, V] fp32 -> processed scores [rows, V]."""
        new_len = input_ids.shape[-1] - self.prompt_len
        if self.repetition_penalty != 1.0:
            scores = self._repetition_penalty(input_ids, scores)
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            scores = self._presence_frequency(input_ids, scores)
        if self.ngram > 0:
            scores = self._no_repeat_ngram(input_ids, scores)
        if self.has_bad_words:
            scores = self._bad_words(input_ids, scores)
        if self.min_new_tokens > 0:
            scores = self._min_new_tokens(new_len, scores)
        if self.guide is not None:
            scores = self.guide(input_ids, scores)
        if self.sampling:
            if self.temperature != 1.0:
                scores = scores / self.temperature
            if self.top_k != 0:
                scores = self._top_k(scores)
            if self.top_p < 1.0:
                scores = self._top_p(scores)
        return scores


def presence_frequency_penalty(generated: torch.Tensor, scores: torch.Tensor, presence: float,
                               frequency: float) -> torch.Tensor:
    """OpenAI's penalties as vLLM computes them: generated [rows, n] ids (< V), scores [rows, V] ->
    scores - frequency * count - presence * (count > 0), count[t] = occurrences of t among the generated ids."""
    counts = torch.zeros_like(scores)  # [rows, V]
    if generated.shape[1]:
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
    scores = scores - frequency * counts
    return scores - presence * (counts > 0).to(scores.dtype)


class StopCriteria:
    """Which rows are finished after appending a token: EOS, max new tokens, or a stop word just completed."""

    def __init__(self, *, eos_ids: Sequence[int], max_new_tokens: int, stop_words_ids: Sequence[Sequence[int]],
                 vocab_size: int):
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)  # [n_eos]
        self.max_new_tokens = max_new_tokens
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for w in stop_words_ids:
            w = tuple(int(t) for t in w)
            if w:
                _assert_ids("stop_words_ids", w, vocab_size)
                by_len.setdefault(len(w), []).append(w)
        self.stop_words = [torch.tensor(sorted(set(g))) for _, g in sorted(by_len.items())]  # each [g, m]
        self._device = torch.device("cpu")

    def to(self, device: torch.device) -> "StopCriteria":
        if device != self._device:
            self.eos = self.eos.to(device)
            self.stop_words = [w.to(device) for w in self.stop_words]
            self._device = device
        return self

    def __call__(self, input_ids: torch.Tensor, new_len: int) -> torch.Tensor:
        """input_ids [rows, L] including the token just appended; new_len = generated tokens in each row."""
        rows = input_ids.shape[0]
        done = torch.full((rows,), new_len >= self.max_new_tokens, dtype=torch.bool, device=input_ids.device)
        if self.eos.numel():
            done |= torch.isin(input_ids[:, -1], self.eos)
        for words in self.stop_words:
            m = words.shape[1]
            if m > new_len:  # only generated tokens may complete a stop word
                break
            done |= (input_ids[:, None, -m:] == words).all(dim=-1).any(dim=-1)
        return done
