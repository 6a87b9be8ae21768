"""Greedy search and multinomial sampling for one request, as transformers 5.x `GenerationMixin._sample`.

The engine uses this per-request path for greedy search with score processors and for sampling with processors
that need each row's context (repetition / presence / frequency penalties, no-repeat-ngram, bad words). Greedy
without them runs batched in `greedy.greedy_step`, sampling without them in `sampling_batch.sample_step`; both are
tested bit for bit against this class.

Sampling with `num_return_sequences` n runs n rows like HF (the prompt expanded n times). HF draws every step with
ONE `torch.multinomial(probs [n, V], 1)` over all n rows, finished rows included; the random stream consumed per
call depends only on the shape, so finished rows (the scheduler no longer computes them) are filled with uniform
probabilities and the surviving rows draw exactly the tokens HF draws from `torch.manual_seed(seed)`.
Processors run on raw fp32 logits (HF does not log-softmax before processing outside beam search).
Log probs (the chosen token's, and the `top_log_probs` k best when asked) are log_softmax of the raw logits: the
model's own distribution, as OpenAI's `logprobs` / `top_logprobs` and HF's `normalize_logits=True`.

A row with no finite processed score (every token excluded, e.g. by bad words and min_tokens; or NaN / inf
logits) has no distribution to draw from: `multinomial` would reject it (a device-side assert on CUDA, which
leaves the process's CUDA context unusable). Such a row draws from uniform scores instead (the same shape, so
the other rows' draws are unchanged), and the step raises `NoTokenLeft` after its one host sync.
"""
from __future__ import annotations

import random

import torch
from torch import nn

from ..params import Sequence_
from .logits import LogitsPipeline, StopCriteria
from .search import NoTokenLeft


def resolve_seed(seed: int | None) -> int:
    """params.seed, or a fresh random seed when None."""
    return random.getrandbits(63) if seed is None else int(seed)


class Sampler:
    append_only = True  # a row's tokens only ever grow: what was streamed is always their prefix

    def __init__(self, *, prompt_ids: list[int], num_rows: int, max_new_tokens: int, do_sample: bool,
                 pipeline: LogitsPipeline, stop: StopCriteria, seed: int | None = None, top_log_probs: int = 0):
        self.prompt = torch.tensor(prompt_ids, dtype=torch.long)  # [Lp]
        self.Lp = len(prompt_ids)
        self.n = num_rows
        self.max_new = max_new_tokens
        self.do_sample = do_sample
        self.pipeline = pipeline
        self.stop = stop
        self.seed = resolve_seed(seed)
        self.k = top_log_probs
        self.generator: torch.Generator | None = None
        self.t = 0
        self.alive: list[int] = list(range(num_rows))  # rows (of n) still generating, in logits order
        self.lengths = [0] * num_rows
        self.generated: list[list[int]] = [[] for _ in range(num_rows)]  # host copy of each row's new tokens
        self.done = False
        self._init = False

    def _setup(self, device: torch.device) -> None:
        self.pipeline.to(device)
        self.stop.to(device)
        self.seqs = torch.zeros((self.n, self.Lp + self.max_new), dtype=torch.long, device=device)  # [n, Lmax]
        self.seqs[:, :self.Lp] = self.prompt.to(device)
        self.tok_lp = torch.zeros((self.n, self.max_new), dtype=torch.float, device=device)  # [n, max_new]
        if self.k:
            self.top_lp = torch.zeros((self.n, self.max_new, self.k), dtype=torch.float, device=device)  # [n, T, k]
            self.top_ids = torch.zeros((self.n, self.max_new, self.k), dtype=torch.long, device=device)  # [n, T, k]
        if self.do_sample:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        self._init = True

    @property
    def num_rows(self) -> int:
        return 0 if self.done else (1 if self.t == 0 else len(self.alive))

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        first = self.t == 0
        if not self._init:
            self._setup(logits.device)
        t, L = self.t, self.Lp + self.t
        raw = logits.to(torch.float32)  # [rows, V]
        if first:
            raw = raw.expand(self.n, -1)
        alive = torch.tensor(self.alive, dtype=torch.long, device=raw.device)  # [rows]
        if self.pipeline.guide is not None:  # the rows' tokens from the host: no read-back for the grammar
            self.pipeline.guide.rows = [tuple(self.generated[r]) for r in self.alive]
        scores = self.pipeline(self.seqs[alive, :L], raw)  # [rows, V]
        stuck = ~torch.isfinite(scores.amax(dim=-1))  # [rows] no finite score: NaN, +inf or every token excluded
        if self.do_sample:
            scores = torch.where(stuck[:, None], 0.0, scores)  # a valid distribution; the request fails below
            if len(self.alive) < self.n:
                full = raw.new_zeros((self.n, raw.shape[-1]))  # finished rows: uniform, never read
                full[alive] = scores
            else:
                full = scores
            probs = nn.functional.softmax(full, dim=-1)  # [n, V]
            next_all = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)  # [n]
            tokens = next_all[alive]
        else:
            tokens = torch.argmax(scores, dim=-1)  # [rows]
        logp = nn.functional.log_softmax(raw, dim=-1)  # [rows, V]
        chosen_lp = logp.gather(1, tokens[:, None])[:, 0]
        self.seqs[alive, L] = tokens
        self.tok_lp[alive, t] = chosen_lp
        if self.k:
            top = torch.topk(logp, self.k, dim=-1)  # [rows, k] each, best first
            self.top_lp[alive, t] = top.values
            self.top_ids[alive, t] = top.indices
        # the step's one device read-back: each row's stop, stuck and token
        hits, stuck_rows, tok_list = torch.stack((self.stop(self.seqs[alive, :L + 1], t + 1).long(),
                                                  stuck.long(), tokens)).tolist()
        if any(stuck_rows):
            bad = torch.tensor(stuck_rows, dtype=torch.bool, device=raw.device)
            raise NoTokenLeft(t + 1, nonfinite_logits=not bool(torch.isfinite(raw[bad]).all()))
        self.t = t + 1
        for r, tok in zip(self.alive, tok_list):
            self.lengths[r] = self.t
            self.generated[r].append(tok)
        keep = [i for i, h in enumerate(hits) if not h]
        self.alive = [self.alive[i] for i in keep]
        self.done = not self.alive
        if self.done:
            return [], [], True
        parents = [0] * len(keep) if first else keep
        return parents, [tok_list[i] for i in keep], False

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step (the rows still generating), the new tokens it holds."""
        return [list(self.generated[r]) for r in self.alive] if self.t and not self.done else []

    def stream_prefixes(self) -> list[list[int]]:
        """Every row's new tokens (rows in HF's order, finished rows included): all final already."""
        if not self._init:
            return []
        return self.generated  # the live host lists (the step read the tokens back already): no device copy

    def token_info(self, r: int, start: int, end: int) -> tuple[list[float], list[list[float]], list[list[int]]]:
        """Row r's new tokens [start, end): their log probs, and the top-k log probs / ids ([] without k)."""
        lp = self.tok_lp[r, start:end].tolist()
        if not self.k:
            return lp, [], []
        return lp, self.top_lp[r, start:end].tolist(), self.top_ids[r, start:end].tolist()

    def finalize(self, n: int) -> list[Sequence_]:
        """The first n rows in sampling order (HF does not re-rank); `log_probs` = log_softmax of the raw
        logits at each chosen token, `cum_log_prob` their sum; the top-k of the same distribution when asked."""
        if not self._init:
            return [Sequence_([], "", 0.0, []) for _ in range(n)]
        gen = self.seqs[:, self.Lp:].tolist()
        out = []
        for r in range(min(n, self.n)):
            lp, top_lp, top_ids = self.token_info(r, 0, self.lengths[r])
            out.append(Sequence_(gen[r][:self.lengths[r]], "", float(sum(lp)), lp, top_lp, top_ids))
        return out
