"""Beam search for one request, a transcription of transformers 5.x `GenerationMixin._beam_search` (batch = 1).

Per step (HF's names in brackets):
  log_softmax(fp32 logits) -> processors -> + running beam scores -> top K = max(2, 1 + n_eos) * num_beams over
  num_beams * vocab [`_get_top_k_continuations`] -> stopping criteria on the K candidates -> best num_beams
  candidates that did not stop keep running [`_get_running_beams_for_next_iteration`] -> candidates that stopped
  and rank within the top num_beams join the finished pool if they beat its worst, score =
  sum_logprobs / new_len ** length_penalty [`_update_finished_beams`] -> early-stop heuristic
  [`_check_early_stop_heuristic`] and loop condition [`_beam_search_has_unfinished_sequences`].

The same torch ops run on tensors of the same shapes as HF's (leading batch dim 1), so tie-breaking in `topk`
is identical. The first step gets the prompt's logits as one row; it is tiled to num_beams rows with running
scores [0, -1e9, ...] exactly as HF does after `_expand_inputs_for_generation`.

When no candidate has a finite score (every token of every beam excluded, or NaN / inf logits), beam sampling
draws from uniform scores instead (`multinomial` would reject the distribution: a device-side assert on CUDA)
and the step raises `NoTokenLeft` once it has synced; HF would go on with -inf / NaN beams.

A request built with a `beam_batch.BatchSpec` may instead be stepped with other such requests by
`beam_batch.beam_step` (the same computation over [B, nb, V], one read-back for all). Its state then lives in a
`beam_batch.BeamGroup` (`group` = (group, index)); `_view()` reads it there, and `_own()` copies it back into this
object before any per-request operation that changes it (`step`, `finalize`, the cancel path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..params import Sequence_
from .logits import LogitsPipeline, StopCriteria
from .search import NoTokenLeft


def _split(values: list, n_head: int, n: int) -> tuple[list, list, list]:
    """A read-back [head..., parents (n), tokens (n)] into its three parts."""
    return values[:n_head], values[n_head:n_head + n], values[n_head + n:n_head + 2 * n]


@dataclass
class _Candidates:
    """The K continuations considered at one step."""

    scores: torch.Tensor  # [1, K] accumulated log-probs
    beam: torch.Tensor  # [K] the running row each continues
    token: torch.Tensor  # [K] the token each appends
    seqs: torch.Tensor  # [K, Lp + max_new] prompt + new tokens
    token_lp: torch.Tensor  # [K, max_new] processed log-prob of each new token


@dataclass
class BeamState:
    """One request's beam-search state (own tensors, or views into a `beam_batch.BeamGroup`)."""

    gen: torch.Tensor  # [nb, <= max_new] running beams' new tokens (columns >= t unused; a group's may be narrower)
    tok_lp: torch.Tensor  # [nb, <= max_new] their processed log-probs
    running: torch.Tensor  # [1, nb] running beam scores
    fin_gen: torch.Tensor  # [nb, <= max_new] finished pool (HF `sequences`), best first
    fin_lp: torch.Tensor  # [nb, <= max_new]
    fin_len: torch.Tensor  # [1, nb] long
    fin_score: torch.Tensor  # [1, nb] HF `beam_scores`
    is_fin: torch.Tensor  # [1, nb] bool HF `is_sent_finished`
    unsat: torch.Tensor  # [1, 1] bool HF `is_early_stop_heuristic_unsatisfied`


class BeamSearch:
    def __init__(self, *, prompt_ids: list[int], num_beams: int, max_new_tokens: int, length_penalty: float,
                 early_stopping: bool | str, n_eos: int, pipeline: LogitsPipeline, stop: StopCriteria,
                 generator_seed: int | None = None, do_sample: bool = False, batch_spec: Any = None):
        self.prompt = torch.tensor(prompt_ids, dtype=torch.long)  # [Lp]
        self.Lp = len(prompt_ids)
        self.nb = num_beams
        self.K = max(2, 1 + n_eos) * num_beams  # HF `beams_to_keep`
        self.max_new = max_new_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.pipeline = pipeline
        self.stop = stop
        self.do_sample = do_sample
        self.seed = generator_seed
        self.generator: torch.Generator | None = None
        self.t = 0  # new tokens in every running row
        self.done = False
        self._init = False
        self._stable: list[int] = []  # the stable prefix found so far (`stable_prefix`)
        self.spec = batch_spec  # a `beam_batch.BatchSpec`: may be stepped batched by `beam_batch.beam_step`
        self.guide_gens: list[tuple[int, ...]] = [()] * num_beams  # guided: each running row's tokens (host)
        self.group: Optional[tuple[Any, int]] = None  # (BeamGroup, index) while its state lives there
        self._norm_row: Optional[torch.Tensor] = None  # [max_new + 1] fp32 length ** length_penalty, on the host

    @property
    def key(self) -> tuple[int, int]:
        """Requests with the same key may step together (`beam_batch.beam_step`)."""
        return (self.nb, self.K)

    def _setup(self, device: torch.device) -> None:
        nb, K, Lmax = self.nb, self.K, self.Lp + self.max_new
        self.device = device
        self.pipeline.to(device)
        self.stop.to(device)
        self.seqs = torch.zeros((nb, Lmax), dtype=torch.long, device=device)  # [nb, Lp + max_new]
        self.seqs[:, :self.Lp] = self.prompt.to(device)
        self.tok_lp = torch.zeros((nb, self.max_new), dtype=torch.float, device=device)  # [nb, max_new]
        self.running_scores = torch.zeros((1, nb), dtype=torch.float, device=device)
        self.running_scores[:, 1:] = -1e9
        # finished pool (HF `sequences`, `beam_scores`, `is_sent_finished`), kept sorted best first
        self.fin_gen = torch.zeros((nb, self.max_new), dtype=torch.long, device=device)  # [nb, max_new]
        self.fin_lp = torch.zeros((nb, self.max_new), dtype=torch.float, device=device)  # [nb, max_new]
        self.fin_len = torch.zeros((1, nb), dtype=torch.long, device=device)
        self.beam_scores = torch.full((1, nb), -1e9, dtype=torch.float, device=device)
        self.is_fin = torch.zeros((1, nb), dtype=torch.bool, device=device)
        self.unsat = torch.ones((1, 1), dtype=torch.bool, device=device)  # `is_early_stop_heuristic_unsatisfied`
        self.top_mask = torch.cat((torch.ones(nb, dtype=torch.bool), torch.zeros(K - nb, dtype=torch.bool))).to(device)
        if self.do_sample:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        self._init = True

    @property
    def num_rows(self) -> int:
        return 0 if self.done else (1 if self.t == 0 else self.nb)

    def _view(self) -> BeamState:
        """The current state, read where it lives (no copy)."""
        if self.group is not None:
            g, i = self.group
            return g.member(i)
        return BeamState(self.seqs[:, self.Lp:], self.tok_lp, self.running_scores, self.fin_gen, self.fin_lp,
                         self.fin_len, self.beam_scores, self.is_fin, self.unsat)

    def _own(self) -> None:
        """Take the state back from its batch group (if any) into this object's own tensors."""
        if self.group is None:
            return
        st = self._view()
        self.group = None

        def full(x: torch.Tensor) -> torch.Tensor:  # [nb, w] -> [nb, max_new]
            return nn.functional.pad(x, (0, self.max_new - x.shape[1]))

        self.seqs = torch.cat((self.seqs[:, :self.Lp], full(st.gen)), dim=1)  # [nb, Lp + max_new]
        self.tok_lp, self.running_scores = full(st.tok_lp), st.running
        self.fin_gen, self.fin_lp, self.fin_len = full(st.fin_gen), full(st.fin_lp), st.fin_len
        self.beam_scores, self.is_fin, self.unsat = st.fin_score, st.is_fin, st.unsat

    def norm_row(self) -> torch.Tensor:
        """[max_new + 1] fp32 on the host: entry L = float32(`_len_norm(L)`), the divisor HF's Python float becomes
        (entry 0 unused)."""
        if self._norm_row is None:
            vals = [1.0] + [self._len_norm(n) for n in range(1, self.max_new + 1)]
            self._norm_row = torch.tensor(vals, dtype=torch.float64).to(torch.float32)
        return self._norm_row

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """logits [num_rows, V] -> (parents, tokens, done) for the next step's rows."""
        self._own()
        first = self.t == 0
        if not self._init:
            self._setup(logits.device)
        logits = logits.to(torch.float32)
        if first:
            logits = logits.expand(self.nb, -1)  # HF runs the prompt once per beam: identical rows
        log_probs, scores = self._scores(logits)
        stuck = ~torch.isfinite(scores.amax())  # [] no finite candidate: NaN, +inf, or every token excluded
        if self.do_sample:
            scores = torch.where(stuck, 0.0, scores)  # a valid distribution; the request fails below
        cand = self._candidates(log_probs, scores)
        stopped = self.stop(cand.seqs[:, :self.Lp + self.t + 1], self.t + 1).view(1, self.K)  # [1, K]
        parents, tokens = self._next_running(cand, stopped)
        self._update_finished(cand, stopped)
        self.t += 1
        flags = self._finished_flags(stopped)  # [3]
        # the step's one device read-back: the loop condition's flags, stuck, and the running rows
        packed = torch.cat((flags, stuck.view(1).long(), parents, tokens))  # [4 + 2 * nb]
        head, parents_l, tokens_l = _split(packed.tolist(), 4, self.nb)
        improvement_possible, all_finished, all_stopped, is_stuck = (bool(f) for f in head)
        open_beam = not (all_finished and self.early_stopping is True)
        self.done = not (improvement_possible and open_beam and not all_stopped) or self.t >= self.max_new
        if is_stuck:
            raise NoTokenLeft(self.t, nonfinite_logits=not bool(torch.isfinite(logits).all()))
        if self.done:
            return [], [], True
        parents_l = [0] * self.nb if first else parents_l
        self.track(parents_l, tokens_l)
        return parents_l, tokens_l, False

    def track(self, parents: list[int], tokens: list[int]) -> None:
        """Guided: the next running rows' generated tokens, from the step's parents and tokens (host lists)."""
        if self.pipeline.guide is not None:
            self.guide_gens = [self.guide_gens[p] + (t,) for p, t in zip(parents, tokens)]

    def _scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> processed log-probs [nb, V] and accumulated beam scores [1, nb * V]."""
        log_probs = nn.functional.log_softmax(logits, dim=-1)  # [nb, V]
        if self.pipeline.guide is not None:  # the rows' tokens from the host: no read-back for the grammar
            self.pipeline.guide.rows = list(self.guide_gens)
        log_probs = self.pipeline(self.seqs[:, :self.Lp + self.t], log_probs)  # [nb, V]
        V = log_probs.shape[-1]
        scores = (log_probs.view(1, self.nb, V) + self.running_scores[:, :, None]).reshape(1, self.nb * V)
        return log_probs, scores

    def _candidates(self, log_probs: torch.Tensor, scores: torch.Tensor) -> "_Candidates":
        """HF `_get_top_k_continuations`: the K best (or K sampled) continuations of the running beams."""
        V = log_probs.shape[-1]
        if self.do_sample:
            idx = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=self.K,
                                    generator=self.generator)  # [1, K]
            top_scores = torch.gather(scores, 1, idx)
        else:
            top_scores, idx = torch.topk(scores, k=self.K)  # [1, K]
        beam, token = (idx // V)[0], (idx % V)[0]  # [K] each: the row continued and the token appended
        seqs = self.seqs[beam]  # [K, Lp + max_new]
        seqs[:, self.Lp + self.t] = token
        token_lp = self.tok_lp[beam]  # [K, max_new]
        token_lp[:, self.t] = log_probs[beam, token]
        return _Candidates(top_scores, beam, token, seqs, token_lp)

    def _next_running(self, cand: "_Candidates", stopped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF `_get_running_beams_for_next_iteration`: the nb best candidates that did not stop keep running."""
        running = cand.scores + stopped.to(torch.float32) * -1.0e9  # [1, K]
        keep = torch.topk(running, k=self.nb)[1]  # [1, nb]
        self.running_scores = torch.gather(running, 1, keep)
        self.seqs = cand.seqs[keep[0]]
        self.tok_lp = cand.token_lp[keep[0]]
        return cand.beam[keep[0]], cand.token[keep[0]]

    def _update_finished(self, cand: "_Candidates", stopped: torch.Tensor) -> None:
        """HF `_update_finished_beams`: stopped candidates within the top nb join the pool if they beat its worst;
        score = sum of log-probs / new_len ** length_penalty."""
        t = self.t
        did_finish = stopped & self.top_mask[None, :]  # [1, K]
        penalised = cand.scores / self._len_norm(t + 1)
        pool_full = torch.all(self.is_fin, dim=-1, keepdim=True) & (self.early_stopping is True)
        penalised += pool_full.to(torch.float32) * -1.0e9
        penalised += (~self.unsat).to(torch.float32) * -1.0e9
        penalised += (~did_finish) * -1.0e9
        merged = torch.cat((self.beam_scores, penalised), dim=1)  # [1, nb + K]
        best = torch.topk(merged, k=self.nb)[1]  # [1, nb]
        rows = best[0]
        self.fin_gen = torch.cat((self.fin_gen, cand.seqs[:, self.Lp:]), dim=0)[rows]
        self.fin_lp = torch.cat((self.fin_lp, cand.token_lp), dim=0)[rows]
        lengths = torch.full_like(penalised, t + 1, dtype=torch.long)
        self.fin_len = torch.gather(torch.cat((self.fin_len, lengths), 1), 1, best)
        self.beam_scores = torch.gather(merged, 1, best)
        self.is_fin = torch.gather(torch.cat((self.is_fin, did_finish), dim=1), 1, best)

    def _finished_flags(self, stopped: torch.Tensor) -> torch.Tensor:
        """HF `_check_early_stop_heuristic` + `_beam_search_has_unfinished_sequences` (after t += 1), on the
        device: [improvement possible, every pool slot finished, every candidate stopped] as long [3]."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new
        else:
            best_len = self.t
        best_running = self.running_scores[:, :1] / self._len_norm(best_len)
        worst_finished = torch.where(self.is_fin, torch.min(self.beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        self.unsat = self.unsat & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        return torch.stack((torch.any(self.unsat), torch.all(self.is_fin), torch.all(stopped))).long()

    def _len_norm(self, length: int) -> float:
        """`length ** length_penalty`, the divisor of a hypothesis' score, as `transformers` computes it but with
        IEEE overflow: Python raises OverflowError where the float is out of range (e.g. 3 ** 1000.0); we return
        inf, so such scores are -0.0 (the limit `transformers` approaches) and nothing is raised."""
        try:
            return float(length) ** self.length_penalty
        except OverflowError:
            return math.inf

    def _force_finish(self) -> None:
        """Stopped before beam search ended (cancel): running beams join the pool as HF's old finalize did."""
        if self.t == 0:
            return
        self._own()
        t, nb = self.t, self.nb
        pen = self.running_scores / self._len_norm(t)
        merged = torch.cat((self.beam_scores, pen), dim=1)
        sel = torch.topk(merged, k=nb)[1]
        s = sel[0]
        self.fin_gen = torch.cat((self.fin_gen, self.seqs[:, self.Lp:]), dim=0)[s]
        self.fin_lp = torch.cat((self.fin_lp, self.tok_lp), dim=0)[s]
        self.fin_len = torch.gather(torch.cat((self.fin_len, torch.full_like(self.fin_len, t)), 1), 1, sel)
        self.beam_scores = torch.gather(merged, 1, sel)
        self.is_fin = torch.ones_like(self.is_fin)
        self.done = True

    def stable_prefix(self) -> list[int]:
        """New tokens every possible final hypothesis starts with, safe to stream: the final ranking picks among
        the kept finished hypotheses and extensions of the running beams, so their common prefix is final. It
        only grows (every later running beam or finished hypothesis extends one of this step's running beams),
        so a call compares only the columns after the prefix found so far, on the device, and reads them back
        for one row in one copy (no per-hypothesis read-backs, no Python loop over tokens)."""
        if self.t == 0:
            return []
        known, t = len(self._stable), self.t
        if known < t:
            st = self._view()
            gen, fin_gen = st.gen[:, known:t], st.fin_gen[:, known:t]  # [nb, t - known] each
            cols = torch.arange(known, t, device=gen.device)  # [t - known]
            ref = gen[0]  # [t - known]
            in_fin = (fin_gen == ref) & (cols < st.fin_len[0][:, None])  # a finished one agrees below its length
            agree = torch.all(gen == ref, dim=0) & torch.all(in_fin | ~st.is_fin[0][:, None], dim=0)  # [t - known]
            common = torch.cumprod(agree.long(), dim=0).sum()  # leading columns every candidate shares
            n, *row = torch.cat((common[None], ref)).tolist()  # one read-back
            self._stable.extend(row[:n])
        return list(self._stable)

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step (the running beams, in row order), the new tokens it holds."""
        return self._view().gen[:, :self.t].tolist() if self.t and not self.done else []

    def stream_prefixes(self) -> list[list[int]]:
        """One: the prefix every hypothesis still in the running shares (which ranked sequence ends up where is
        unknown until the end)."""
        return [self.stable_prefix()]

    def finalize(self, n: int) -> list[Sequence_]:
        """The n best hypotheses, best first; `cum_log_prob` is the length-penalised score (HF
        `sequences_scores`), `log_probs` the processed log-prob of each chosen token."""
        if not self.done:
            self._force_finish()
        self._own()
        if self.t == 0:
            return [Sequence_([], "", 0.0, []) for _ in range(n)]
        lens = self.fin_len[0].tolist()
        scores = self.beam_scores[0].tolist()
        gen = self.fin_gen.tolist()
        lps = self.fin_lp.tolist()
        return [Sequence_(gen[i][:lens[i]], "", scores[i], lps[i][:lens[i]]) for i in range(n)]
