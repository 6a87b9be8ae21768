"""Beam search batched across requests: transformers' `_beam_search` with batch size B, one read-back per step.

HF's `_beam_search` is batched: every state tensor has a leading batch dim and each step is the same ops over
[B, nb, V] (topk over each row of [B, nb * V], `_gather_beams` = `take_along_dim` over the beam dim). `beam_step`
runs that computation for the beam requests of one decode step that share `BeamSearch.key` = (num_beams,
K = beams_to_keep) and reads the results back with ONE `.tolist()` of a [B, 4 + 2 nb] tensor.

Every op is row-wise, so each request gets bit for bit what it gets alone (a group of one, checked against HF in
tests/engine/test_decoding.py): log_softmax, topk and the reductions see the same row on the same
algorithm (on CPU, exact ties included; on CUDA topk's kernel choice can depend on the number of rows, so exact
ties may be ordered differently: tests/engine/test_beam_batch.py's GPU test compares tie-free logits). What differs
per request is a tensor here:
- t, max_new (requests start at different steps). The token / log-prob histories [B, nb, W] hold the columns
  written so far: W grows in steps of `GROW` up to the longest max_new, so a long request does not make every
  step copy everyone's unused columns (HF pads to max_length);
- the length-penalty divisor: HF divides by the Python float `new_len ** length_penalty`. PyTorch turns it into
  float32(b); on CPU `a / b` is computed, on CUDA (`div_true_kernel_cuda`, CPU-scalar branch) `a * inv_b` with
  inv_b = 1.0f / float32(b) computed in fp32 on the host. `norm` holds float32(L ** lp) per request and length L
  (on CUDA its fp32 reciprocal, computed on the host as CUDA does) and divides (multiplies on CUDA) by it;
- `early_stopping is True` (pool full) and `early_stopping == "never" and length_penalty > 0` (best length);
- end ids (padded with -1), stop words (right-aligned in [B, words, M] with a mask) and min_new_tokens.

Every beam request steps here (a request alone, e.g. its first step at the end of its prefill, is a group of one),
whatever its processors, in HF's order on the log-softmaxed scores: the context processors (repetition /
presence / frequency penalties, no-repeat-ngram, bad words: `processors.process`, each row's seen tokens and
counts rebuilt from the group's token history, n-grams and bad word prefixes matched on the host from
`BeamSearch.row_gens`), min_new_tokens (a -inf mask of the end ids, applied with `masked_fill`), the guided
members' grammars (`BeamGroup._grammars`: one bitmask, one fill, one apply for all of them; each row's matcher
from its tokens on the host), then for beam sampling members the warpers (temperature, top-k, top-p with
min_tokens_to_keep = n_eos + 1: `processors.warp`) and K draws from the member's own generator
(`BeamGroup._continuations`: what `torch.multinomial(probs, K)` draws, without its validity checks).

State: a `BeamGroup` holds the stacked state of its members (`BeamSearch.group` points at it); while the members
of consecutive steps are the same, the group is reused (nothing restacked). A step with other members builds a new
group from each member's current state (`BeamSearch._view`: own tensors or views into its old group). Groups only
rebind their tensors (never write into them), so views read by finished or streaming requests stay valid. In the
engine a request's first step (the prompt's row) runs alone (`BeamSearch.step`, a group of one) at the end of its
prefill; later steps with the other beam requests of the decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from . import guided, processors
from .beam import BeamSearch, BeamState
from .processors import Context, RowContext
from .search import NoTokenLeft

StepOut = tuple[list[int], list[int], bool]  # (parents, tokens, done), as `search.Search.step`
GROW = 64  # history columns added at a time


@dataclass(frozen=True)
class BatchSpec:
    """What `beam_step` needs besides `BeamSearch`'s own fields: the stopping rules and min_new_tokens."""

    eos: tuple[int, ...]
    min_new: int  # 0 without end ids (as HF)
    stop_words: tuple[tuple[int, ...], ...]
    context: Optional[Context] = None  # penalties, no-repeat-ngram, bad words (`processors.process`)
    # beam sampling's warpers (HF keeps min_keep = n_eos + 1 tokens); unused without sampling
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_keep: int = 1



def readback(t: torch.Tensor) -> list:
    """The step's one device-to-host copy (a host-device synchronisation on an accelerator)."""
    return t.tolist()


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[n, w_i] each -> [B, n, width]: cut or zero-padded on the right."""
    rows = [r[:, :width] for r in rows]
    if all(r.shape[-1] == width for r in rows):
        return torch.stack(rows)
    out = rows[0].new_zeros((len(rows), rows[0].shape[0], width))
    for b, r in enumerate(rows):
        out[b, :, :r.shape[-1]] = r
    return out


def _width(t_max: int, T: int) -> int:
    """History columns for a step that writes column t_max: a multiple of GROW, at most T."""
    return min(T, (t_max // GROW + 1) * GROW)


class BeamGroup:
    """The stacked state of B beam searches with the same (nb, K), as HF's `_beam_search` keeps it."""

    def __init__(self, searches: list[BeamSearch], device: torch.device):
        for s in searches:
            if not s._init:
                s._setup(device)
        s0, B = searches[0], len(searches)
        self.members, self.nb, self.K, self.device = list(searches), s0.nb, s0.K, device
        self.T = T = max(s.max_new for s in searches)
        self.W = W = _width(max(s.t for s in searches), T)
        st: list[BeamState] = [s._view() for s in searches]
        self.gen = _padded([x.gen for x in st], W)  # [B, nb, W] running beams' new tokens
        self.lp = _padded([x.tok_lp for x in st], W)  # [B, nb, W] their log-probs
        self.fin_gen = _padded([x.fin_gen for x in st], W)  # [B, nb, W] finished pool
        self.fin_lp = _padded([x.fin_lp for x in st], W)  # [B, nb, W]
        self.run = torch.cat([x.running for x in st])  # [B, nb]
        self.fin_len = torch.cat([x.fin_len for x in st])  # [B, nb]
        self.fin_score = torch.cat([x.fin_score for x in st])  # [B, nb]
        self.is_fin = torch.cat([x.is_fin for x in st])  # [B, nb]
        self.unsat = torch.cat([x.unsat for x in st])  # [B, 1]
        host = [(s.t, s.max_new, s.spec.min_new, s.early_stopping is True,
                 s.early_stopping == "never" and s.length_penalty > 0.0) for s in searches]
        t, max_new, min_new, es_true, best_is_max = (torch.tensor(c, device=device) for c in zip(*host))
        self.t, self.max_new, self.min_new = t, max_new, min_new  # [B] long each
        self.es_true, self.best_is_max = es_true, best_is_max  # [B] bool each
        self.min_new_host = [h[2] for h in host]
        # float32(L ** lp) per request [B, T + 1]; on CUDA its fp32 reciprocal (what `a / python_float` computes)
        norm = torch.stack([nn.functional.pad(s.norm_row(), (0, T - s.max_new), value=1.0) for s in searches])
        self.recip = device.type == "cuda"
        self.norm = (torch.ones_like(norm) / norm if self.recip else norm).to(device)
        E = max(1, max(len(s.spec.eos) for s in searches))
        self.eos = torch.tensor([list(s.spec.eos) + [-1] * (E - len(s.spec.eos)) for s in searches],
                                device=device)  # [B, E] end ids, -1 = none
        self.eos_mask = None  # [B, V] bool, built on the first step that holds end ids back
        self._stop_words(searches)
        self.top_mask = s0.top_mask  # [K] the top nb candidates
        self._rows_key: tuple = ()
        self._rows_idx = None
        self.contexts = [s.spec.context for s in searches]  # each member's context processors, or None
        self.sampling = [b for b, s in enumerate(searches) if s.do_sample]  # the beam sampling members
        self._prompt_seen: Optional[torch.Tensor] = None  # [B, V] bool, with repetition penalties
        for i, s in enumerate(searches):
            s.group = (self, i)

    def _stop_words(self, searches: list[BeamSearch]) -> None:
        """words [B, n_words, M] right-aligned, care (the word's positions) alike, or None without stop words."""
        W = max(len(s.spec.stop_words) for s in searches)
        self.words = self.care = None
        if not W:
            return
        M = max(len(w) for s in searches for w in s.spec.stop_words)
        words = torch.zeros((len(searches), W, M), dtype=torch.long)
        care = torch.zeros((len(searches), W, M), dtype=torch.bool)
        for b, s in enumerate(searches):
            for j, w in enumerate(s.spec.stop_words):
                words[b, j, M - len(w):] = torch.tensor(w)
                care[b, j, M - len(w):] = True
        self.words, self.care = words.to(self.device), care.to(self.device)
        self.word_pos = torch.arange(1 - M, 1, device=self.device)  # [M] offsets of a window ending at t

    def member(self, i: int) -> BeamState:
        """Member i's state: views, min(W, its max_new) columns wide."""
        n = self.members[i].max_new
        return BeamState(self.gen[i, :, :n], self.lp[i, :, :n], self.run[i:i + 1], self.fin_gen[i, :, :n],
                         self.fin_lp[i, :, :n], self.fin_len[i:i + 1], self.fin_score[i:i + 1],
                         self.is_fin[i:i + 1], self.unsat[i:i + 1])

    def rows(self, logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """The decode step's logits [rows, V] -> [B, nb, V]: member i's rows begin at starts[i]; a member at its
        first step has one row (the prompt's), repeated nb times as HF's expanded input gives it."""
        nb = self.nb
        idx = [st + (r if s.t else 0) for s, st in zip(self.members, starts) for r in range(nb)]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return logits[idx[0]:idx[0] + len(idx)].view(len(self.members), nb, -1)
        if tuple(idx) != self._rows_key:
            self._rows_key, self._rows_idx = tuple(idx), torch.tensor(idx, device=logits.device)
        return logits.index_select(0, self._rows_idx).view(len(self.members), nb, -1)

    def _norm(self, x: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """x [B, j] / float32(length ** lp) per row (x * its fp32 reciprocal on CUDA), length [B] long."""
        v = self.norm.gather(1, length[:, None])  # [B, 1]
        return x * v if self.recip else x / v

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, nb, V] -> [B, 4 + 2 nb] long: per member (improvement possible, pool all finished, every
        candidate stopped, stuck), the next running rows' parents [nb] and tokens [nb]."""
        B, nb, K = len(self.members), self.nb, self.K
        self._grow(max(s.t for s in self.members))
        log_probs = nn.functional.log_softmax(logits.to(torch.float32), dim=-1)  # [B, nb, V]
        V = log_probs.shape[-1]
        if any(c is not None for c in self.contexts):  # penalties, no-repeat-ngram, bad words
            log_probs = self._context(log_probs)
        if any(s.t < m for s, m in zip(self.members, self.min_new_host)):  # MinNewTokensLengthLogitsProcessor
            held = (self.t < self.min_new)[:, None] & self._eos_mask(V)  # [B, V] end ids of members still held
            log_probs.masked_fill_(held[:, None, :], -math.inf)  # the same -inf as `torch.where` (a fresh tensor)
        log_probs = self._grammars(log_probs)
        if self.sampling:  # beam sampling's warpers on the sampling members' rows
            log_probs = self._warp(log_probs)
        flat = log_probs.view(B, nb * V)
        scores = (log_probs + self.run[:, :, None]).view(B, nb * V)  # [B, nb * V]
        stuck = ~torch.isfinite(scores.amax(dim=-1))  # [B]
        top, idx = self._continuations(scores, stuck)  # [B, K] each
        beam, token = idx // V, idx % V  # [B, K] each
        col = self.t[:, None, None].expand(B, K, 1)  # [B, K, 1] each member's new-token column
        cand_gen = torch.take_along_dim(self.gen, beam[:, :, None], dim=1)  # [B, K, W]
        cand_gen.scatter_(2, col, token[:, :, None])
        cand_lp = torch.take_along_dim(self.lp, beam[:, :, None], dim=1)  # [B, K, W]
        cand_lp.scatter_(2, col, flat.gather(1, idx)[:, :, None])
        stopped = self._stopped(cand_gen, token)  # [B, K]
        # HF `_get_running_beams_for_next_iteration`
        running = top + stopped.to(torch.float32) * -1.0e9  # [B, K]
        keep = torch.topk(running, k=nb)[1]  # [B, nb]
        parents, tokens = beam.gather(1, keep), token.gather(1, keep)  # [B, nb] each
        self.run = running.gather(1, keep)
        self.gen = torch.take_along_dim(cand_gen, keep[:, :, None], dim=1)  # [B, nb, W]
        self.lp = torch.take_along_dim(cand_lp, keep[:, :, None], dim=1)
        self._update_finished(top, cand_gen, cand_lp, stopped)
        self.t = self.t + 1
        flags = self._flags(stopped, stuck)  # [B, 4]
        return torch.cat((flags, parents, tokens), dim=1)

    def _context(self, log_probs: torch.Tensor) -> torch.Tensor:
        """The members' context processors on their rows of the log-probs [B, nb, V] (`processors.process`):
        each row's seen tokens and counts from its history columns < t (the spare column V takes the others)."""
        B, nb, V = log_probs.shape
        rows = [None if c is None else RowContext(c, []) for c in self.contexts for _ in range(nb)]
        gens = [s.row_gens[r] if c is not None and c.host else () for s, c in zip(self.members, self.contexts)
                for r in range(nb)]
        seen = count = None
        rep = any(c is not None and c.rep for c in self.contexts)
        pf = any(c is not None and c.pf for c in self.contexts)
        if rep or pf:
            cols = torch.arange(self.W, device=self.device)
            ids = torch.where(cols[None, None, :] < self.t[:, None, None], self.gen, V)  # [B, nb, W]
            if rep:
                if self._prompt_seen is None or self._prompt_seen.shape[1] != V:
                    self._prompt_seen = torch.stack([
                        torch.zeros(V, dtype=torch.bool, device=self.device) if c is None or not c.rep
                        else c.prompt_seen(V, self.device) for c in self.contexts])  # [B, V]
                seen = torch.zeros((B, nb, V + 1), dtype=torch.bool, device=self.device).scatter_(2, ids, True)
                seen = (seen[..., :V] | self._prompt_seen[:, None, :]).view(B * nb, V)
            if pf:
                count = torch.zeros((B, nb, V + 1), dtype=torch.float32, device=self.device)
                count = count.scatter_add_(2, ids, torch.ones_like(ids, dtype=torch.float32))[..., :V]
                count = count.reshape(B * nb, V)
        out = processors.process(log_probs.view(B * nb, V), rows, seen, count, gens)
        return out.view(B, nb, V)

    def _warp(self, log_probs: torch.Tensor) -> torch.Tensor:
        """HF's beam sampling warpers (temperature, top-k, top-p with min_tokens_to_keep) on the rows of the
        sampling members of log_probs [B, nb, V] (`processors.warp`)."""
        B, nb, V = log_probs.shape
        rows = [b * nb + r for b in self.sampling for r in range(nb)]
        specs = [self.members[j // nb].spec for j in rows]
        flat = log_probs.view(B * nb, V)

        def warp(x: torch.Tensor, idx) -> torch.Tensor:
            return processors.warp(x, [p.temperature for p in specs], [p.top_k for p in specs],
                                   [p.top_p for p in specs], [p.min_keep for p in specs])

        return processors.update_rows(flat, rows, warp).view(B, nb, V)

    def _continuations(self, scores: torch.Tensor, stuck: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF `_get_top_k_continuations` on scores [B, nb * V]: the K best, or for a sampling member K drawn by
        `torch.multinomial(softmax(scores), K)` from its own generator (which draws q ~ Exp(1) over the row and
        takes topk(probs / q, K): done so here, per member, without multinomial's validity checks, each a sync;
        a stuck member draws from uniform scores, and fails after the step) -> (scores [B, K], indices [B, K])."""
        B, K = scores.shape[0], self.K
        if not self.sampling:
            return torch.topk(scores, k=K)
        whole = len(self.sampling) == B
        at = None if whole else processors.on_device(self.sampling, scores.device)
        sc = scores if whole else scores.index_select(0, at)
        sc = torch.where((stuck if whole else stuck.index_select(0, at))[:, None], 0.0, sc)
        probs = nn.functional.softmax(sc, dim=-1)  # [S, nb * V]
        q = torch.empty_like(probs)
        for i, b in enumerate(self.sampling):
            q[i].exponential_(1, generator=self.members[b].generator)
        idx = torch.topk(probs / q, k=K)[1]  # [S, K]
        top = torch.gather(sc, 1, idx)
        if whole:
            return top, idx
        best, best_idx = torch.topk(scores, k=K)
        return best.index_copy(0, at, top), best_idx.index_copy(0, at, idx)

    def _grammars(self, log_probs: torch.Tensor) -> torch.Tensor:
        """Guided members' grammars on their rows of the processed log-probs [B, nb, V] (after min_new_tokens, as
        HF runs a generate() logits_processor on beam search's log-softmaxed scores): one bitmask, one fill, one
        apply for every constrained row; the matchers from each member's host rows (`BeamSearch.row_gens`)."""
        B, nb, V = log_probs.shape
        rows, matchers = [], []
        for i, s in enumerate(self.members):
            if s.guide is not None:
                rows += range(i * nb, (i + 1) * nb)
                matchers += s.guide.matchers(s.row_gens)
        if not rows:
            return log_probs
        return guided.mask_rows(log_probs.view(B * nb, V), rows, matchers, V).view(B, nb, V)

    def _grow(self, t_max: int) -> None:
        """Widen the histories (zeros on the right) when column t_max is not there yet."""
        W = _width(t_max, self.T)
        if W > self.W:
            pad = (0, W - self.W)
            self.gen, self.lp = nn.functional.pad(self.gen, pad), nn.functional.pad(self.lp, pad)
            self.fin_gen, self.fin_lp = nn.functional.pad(self.fin_gen, pad), nn.functional.pad(self.fin_lp, pad)
            self.W = W

    def _eos_mask(self, V: int) -> torch.Tensor:
        if self.eos_mask is None or self.eos_mask.shape[1] != V:
            mask = torch.zeros((len(self.members), V + 1), dtype=torch.bool, device=self.device)
            self.eos_mask = mask.scatter_(1, torch.where(self.eos < 0, V, self.eos), True)[:, :V]  # [B, V]
        return self.eos_mask

    def _stopped(self, cand_gen: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Stopping per member (HF's `EosTokenCriteria | MaxLengthCriteria` plus stop words): max new tokens, an
        end id, or a stop word ending at column t."""
        done = (self.t + 1 >= self.max_new)[:, None] | (token[:, :, None] == self.eos[:, None, :]).any(-1)  # [B, K]
        if self.words is not None:
            pos = self.t[:, None] + self.word_pos[None, :]  # [B, M] window columns; < 0: before the first token
            win = torch.take_along_dim(cand_gen, pos.clamp(min=0)[:, None, :], dim=2)  # [B, K, M]
            eq = (win[:, :, None, :] == self.words[:, None]) & (pos >= 0)[:, None, None, :]  # [B, K, words, M]
            hit = (eq | ~self.care[:, None]).all(-1) & self.care[:, None].any(-1)  # [B, K, words]
            done = done | hit.any(-1)
        return done

    def _update_finished(self, top: torch.Tensor, cand_gen: torch.Tensor, cand_lp: torch.Tensor,
                         stopped: torch.Tensor) -> None:
        """HF `_update_finished_beams` with per-member lengths, divisors and early_stopping."""
        nb = self.nb
        did_finish = stopped & self.top_mask[None, :]  # [B, K]
        new_len = self.t + 1  # [B]
        penalised = self._norm(top, new_len)  # [B, K]
        pool_full = torch.all(self.is_fin, dim=-1, keepdim=True) & self.es_true[:, None]  # [B, 1]
        penalised += pool_full.to(torch.float32) * -1.0e9
        penalised += (~self.unsat).to(torch.float32) * -1.0e9
        penalised += (~did_finish) * -1.0e9
        merged = torch.cat((self.fin_score, penalised), dim=1)  # [B, nb + K]
        best = torch.topk(merged, k=nb)[1]  # [B, nb]
        self.fin_gen = torch.take_along_dim(torch.cat((self.fin_gen, cand_gen), 1), best[:, :, None], dim=1)
        self.fin_lp = torch.take_along_dim(torch.cat((self.fin_lp, cand_lp), 1), best[:, :, None], dim=1)
        lengths = new_len[:, None].expand_as(penalised)  # [B, K]
        self.fin_len = torch.gather(torch.cat((self.fin_len, lengths), 1), 1, best)
        self.fin_score = torch.gather(merged, 1, best)
        self.is_fin = torch.gather(torch.cat((self.is_fin, did_finish), dim=1), 1, best)

    def _flags(self, stopped: torch.Tensor, stuck: torch.Tensor) -> torch.Tensor:
        """HF `_check_early_stop_heuristic` (after t += 1) and the loop condition's inputs, per member [B, 4]."""
        best_len = torch.where(self.best_is_max, self.max_new, self.t)  # [B]
        best_running = self._norm(self.run[:, :1], best_len)  # [B, 1]
        worst = torch.where(self.is_fin, torch.min(self.fin_score, dim=1, keepdim=True)[0], -1.0e9)  # [B, nb]
        self.unsat = self.unsat & torch.any(best_running > worst, dim=-1, keepdim=True)
        return torch.stack((self.unsat[:, 0], self.is_fin.all(-1), stopped.all(-1), stuck), dim=1).long()


def _group_for(searches: list[BeamSearch], device: torch.device) -> BeamGroup:
    """The group these searches stepped in last time, if it is exactly them in this order; else a new one."""
    g = searches[0].group[0] if searches[0].group is not None else None
    if (g is not None and g.device == device and len(g.members) == len(searches)
            and all(s.group is not None and s.group[0] is g and s.group[1] == i for i, s in enumerate(searches))):
        return g
    return BeamGroup(searches, device)


def beam_step(searches: list[BeamSearch], logits: torch.Tensor,
              starts: list[int]) -> list[Union[StepOut, NoTokenLeft]]:
    """One step of beam searches with the same `key` and a `spec`: logits [rows, V] of the decode step, search i's
    rows beginning at starts[i] -> each search's (parents, tokens, done), or the `NoTokenLeft` that ends it.
    One device read-back for all of them."""
    key = searches[0].key
    if any(s.done or s.key != key for s in searches):
        raise ValueError("beam_step() needs unfinished beam searches with the same key")
    g = _group_for(searches, logits.device)
    rows = g.rows(logits, starts)  # [B, nb, V]
    packed = readback(g.advance(rows))  # [B, 4 + 2 nb]
    out: list[Union[StepOut, NoTokenLeft]] = []
    nb = g.nb
    for i, (s, row) in enumerate(zip(searches, packed)):
        first = s.t == 0
        s.t += 1
        improvement_possible, all_finished, all_stopped, stuck = (bool(f) for f in row[:4])
        open_beam = not (all_finished and s.early_stopping is True)
        s.done = not (improvement_possible and open_beam and not all_stopped) or s.t >= s.max_new
        if stuck:
            out.append(NoTokenLeft(s.t, nonfinite_logits=not bool(torch.isfinite(rows[i]).all())))
        elif s.done:
            out.append(([], [], True))
        else:
            parents, tokens = [0] * nb if first else row[4:4 + nb], row[4 + nb:4 + 2 * nb]
            s.track(parents, tokens)
            out.append((parents, tokens, False))
    return out
