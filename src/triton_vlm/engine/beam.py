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
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import nn

from .logits import LogitsPipeline, StopCriteria


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # length-penalised (HF `sequences_scores`)
    log_probs: list[float]  # processed log-prob of each chosen token (HF `compute_transition_scores`)


class BeamSearch:
    def __init__(self, *, prompt_ids: list[int], num_beams: int, max_new_tokens: int, length_penalty: float,
                 early_stopping: bool | str, n_eos: int, pipeline: LogitsPipeline, stop: StopCriteria,
                 generator_seed: int | None = None, do_sample: bool = False):
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

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """logits [num_rows, V] -> (parents, tokens, done) for the next step's rows."""
        first = self.t == 0
        if not self._init:
            self._setup(logits.device)
        nb, K, t, Lp = self.nb, self.K, self.t, self.Lp
        logits = logits.to(torch.float32)
        if first:
            logits = logits.expand(nb, -1)  # HF runs the prompt once per beam: identical rows
        V = logits.shape[-1]
        L = Lp + t

        log_probs = nn.functional.log_softmax(logits, dim=-1)  # [nb, V]
        log_probs = self.pipeline(self.seqs[:, :L], log_probs)  # [nb, V]
        acc = (log_probs.view(1, nb, V) + self.running_scores[:, :, None]).reshape(1, nb * V)

        # c. top-K continuations
        if self.do_sample:
            topk_indices = torch.multinomial(nn.functional.softmax(acc, dim=-1), num_samples=K,
                                             generator=self.generator)  # [1, K]
            topk_log_probs = torch.gather(acc, 1, topk_indices)
        else:
            topk_log_probs, topk_indices = torch.topk(acc, k=K)  # [1, K]
        beam = (topk_indices // V)[0]  # [K] row of the current logits
        tok = (topk_indices % V)[0]  # [K]
        cand = self.seqs[beam]  # [K, Lp + max_new]
        cand[:, L] = tok
        cand_lp = self.tok_lp[beam]  # [K, max_new]
        cand_lp[:, t] = log_probs[beam, tok]

        # d. which candidates stop here
        hits = self.stop(cand[:, :L + 1], t + 1).view(1, K)

        # e. running beams for the next step
        topk_running = topk_log_probs + hits.to(torch.float32) * -1.0e9
        nxt = torch.topk(topk_running, k=nb)[1]  # [1, nb]
        self.running_scores = torch.gather(topk_running, 1, nxt)
        parents = beam[nxt[0]]
        tokens = tok[nxt[0]]
        self.seqs = cand[nxt[0]]
        self.tok_lp = cand_lp[nxt[0]]

        # f. finished pool
        did_finish = hits & self.top_mask[None, :]
        pen = topk_log_probs / self._len_norm(t + 1)
        full = torch.all(self.is_fin, dim=-1, keepdim=True) & (self.early_stopping is True)
        pen += full.to(torch.float32) * -1.0e9
        pen += (~self.unsat).to(torch.float32) * -1.0e9
        pen += (~did_finish) * -1.0e9
        merged_scores = torch.cat((self.beam_scores, pen), dim=1)  # [1, nb + K]
        sel = torch.topk(merged_scores, k=nb)[1]  # [1, nb]
        s = sel[0]
        self.fin_gen = torch.cat((self.fin_gen, cand[:, Lp:]), dim=0)[s]
        self.fin_lp = torch.cat((self.fin_lp, cand_lp), dim=0)[s]
        self.fin_len = torch.gather(torch.cat((self.fin_len, torch.full_like(pen, t + 1, dtype=torch.long)), 1), 1, sel)
        self.beam_scores = torch.gather(merged_scores, 1, sel)
        self.is_fin = torch.gather(torch.cat((self.is_fin, did_finish), dim=1), 1, sel)

        # g. stop conditions
        self.t = t = t + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new
        else:
            best_len = t
        best_running = self.running_scores[:, :1] / self._len_norm(best_len)
        worst_finished = torch.where(self.is_fin, torch.min(self.beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        self.unsat = self.unsat & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        improvement_possible = bool(torch.any(self.unsat))
        open_beam = not (bool(torch.all(self.is_fin)) and self.early_stopping is True)
        valid_continuations = not bool(torch.all(hits))
        self.done = not (improvement_possible and open_beam and valid_continuations) or t >= self.max_new
        if self.done:
            return [], [], True
        parents_l = [0] * nb if first else parents.tolist()
        return parents_l, tokens.tolist(), False

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

    def best_so_far(self) -> list[int]:
        if self.t == 0:
            return []
        run_score = float(self.running_scores[0, 0]) / self._len_norm(self.t)
        if bool(self.is_fin[0, 0]) and float(self.beam_scores[0, 0]) >= run_score:
            return self.fin_gen[0, :int(self.fin_len[0, 0])].tolist()
        return self.seqs[0, self.Lp:self.Lp + self.t].tolist()

    def stable_prefix(self) -> list[int]:
        """New tokens every possible final hypothesis starts with, safe to stream: the final ranking picks among
        the kept finished hypotheses and extensions of the running beams, so their common prefix is final."""
        if self.t == 0:
            return []
        cands = [row[self.Lp:self.Lp + self.t] for row in self.seqs.tolist()]
        fin, lens = self.is_fin[0].tolist(), self.fin_len[0].tolist()
        cands += [self.fin_gen[i, :lens[i]].tolist() for i in range(self.nb) if fin[i]]
        prefix = cands[0]
        for c in cands[1:]:
            n = 0
            while n < min(len(prefix), len(c)) and prefix[n] == c[n]:
                n += 1
            prefix = prefix[:n]
        return prefix

    def finalize(self, n: int) -> list[Hypothesis]:
        if not self.done:
            self._force_finish()
        if self.t == 0:
            return [Hypothesis([], 0.0, []) for _ in range(n)]
        lens = self.fin_len[0].tolist()
        scores = self.beam_scores[0].tolist()
        gen = self.fin_gen.tolist()
        lps = self.fin_lp.tolist()
        return [Hypothesis(gen[i][:lens[i]], scores[i], lps[i][:lens[i]]) for i in range(n)]
