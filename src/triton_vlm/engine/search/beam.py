"""One request's beam search state (transformers 5.x `GenerationMixin._beam_search`, HF's names in brackets); its
steps run in `beam_batch.beam_step` (HF's batched computation, a request alone being a group of one):

  log_softmax(fp32 logits) -> processors -> + running beam scores -> top K = max(2, 1 + n_eos) * num_beams over
  num_beams * vocab (or K drawn, beam sampling) [`_get_top_k_continuations`] -> stopping criteria on the K
  candidates -> best num_beams candidates that did not stop keep running [`_get_running_beams_for_next_iteration`]
  -> candidates that stopped and rank within the top num_beams join the finished pool if they beat its worst,
  score = sum_logprobs / new_len ** length_penalty [`_update_finished_beams`] -> early-stop heuristic
  [`_check_early_stop_heuristic`] and loop condition [`_beam_search_has_unfinished_sequences`].

The first step gets the prompt's logits as one row; it is tiled to num_beams rows with running scores
[0, -1e9, ...] exactly as HF does after `_expand_inputs_for_generation`. When no candidate has a finite score
(every token of every beam excluded, or NaN / inf logits), beam sampling draws from uniform scores instead and
the step ends the request with `NoTokenLeft` once it has synced; HF would go on with -inf / NaN beams.

The state lives here (own tensors, made at `_setup`) until the request's first group step, then in a
`beam_batch.BeamGroup` (`group` = (group, index)); `_view()` reads it there, and `_own()` copies it back into this
object before a per-request operation that changes it (`finalize`, the cancel path). This module also holds
what reads the state for one request: the stable prefix it streams, the rows a preemption recomputes, the
ranked final hypotheses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ...params import Sequence_
from .search import NoTokenLeft


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
                 early_stopping: bool | str, n_eos: int, batch_spec: Any, guide=None,
                 generator_seed: int | None = None, do_sample: bool = False):
        self.prompt = torch.tensor(prompt_ids, dtype=torch.long)  # [Lp]
        self.Lp = len(prompt_ids)
        self.nb = num_beams
        self.K = max(2, 1 + n_eos) * num_beams  # HF `beams_to_keep`
        self.max_new = max_new_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.guide = guide  # guided decoding: the request's `guided.GrammarGuide`, or None
        self.do_sample = do_sample
        self.seed = generator_seed
        self.generator: torch.Generator | None = None
        self.t = 0  # new tokens in every running row
        self.done = False
        self._init = False
        self._stable: list[int] = []  # the stable prefix found so far (`stable_prefix`)
        self.spec = batch_spec  # its `beam_batch.BatchSpec`: what `beam_batch.beam_step` needs besides this
        # guided, or context processors that match tokens on the host: each running row's new tokens (host)
        self.row_gens: list[tuple[int, ...]] = [()] * num_beams
        ctx = batch_spec.context
        self._host_rows = guide is not None or (ctx is not None and ctx.host)
        self.group: Optional[tuple[Any, int]] = None  # (BeamGroup, index) while its state lives there
        self._norm_row: Optional[torch.Tensor] = None  # [max_new + 1] fp32 length ** length_penalty, on the host

    @property
    def key(self) -> tuple[int, int]:
        """Requests with the same key may step together (`beam_batch.beam_step`)."""
        return (self.nb, self.K)

    def _setup(self, device: torch.device) -> None:
        nb, K, Lmax = self.nb, self.K, self.Lp + self.max_new
        self.device = device
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
        """logits [num_rows, V] -> (parents, tokens, done) for the next step's rows: `beam_batch.beam_step` with
        this one member."""
        from .beam_batch import beam_step  # beam_batch builds on this module
        out = beam_step([self], logits, [0])[0]
        if isinstance(out, NoTokenLeft):
            raise out
        return out

    def track(self, parents: list[int], tokens: list[int]) -> None:
        """Guided or host-matched processors: the next running rows' generated tokens, from the step's parents and
        tokens (host lists)."""
        if self._host_rows:
            self.row_gens = [self.row_gens[p] + (t,) for p, t in zip(parents, tokens)]

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
