"""Per-request decoding state: beam search, greedy or sampling. Knows nothing of KV caches or batching.

The scheduler calls `step(logits)` with one row of logits per row it computed (`num_rows` of them: 1 for the first
step, the prompt's last position). The answer says, for every row of the next step, which of those rows' KV cache
it continues (`parents`) and which token it appends (`tokens`). Rows may repeat (beam search forks a beam) and
disappear (a sampled sequence finished). `finalize()` returns the sequences once `done`.

Scores follow Hugging Face:
- beam search: `cum_log_prob` = HF `sequences_scores` (sum of processed log-probs / new_len ** length_penalty);
  `log_probs` = the processed log-prob of each chosen token, i.e. `compute_transition_scores(sequences, scores,
  beam_indices)`, whose sum is the unpenalised score.
- greedy / sampling: `log_probs` = log_softmax of the RAW logits at each chosen token, i.e.
  `compute_transition_scores(sequences, logits, normalize_logits=True)` with `output_logits=True`
  (the model's own distribution, independent of temperature / top-k / top-p / penalties); `cum_log_prob` = sum.
Sampled sequences are returned in HF's row order (sampling order), not re-ranked.

One implementation per search algorithm, each batched across requests with one device read-back per step for all
of them, whatever the request's processors (a request stepped alone, e.g. its first step at the end of its
prefill, is a batch of one):
- greedy (`greedy.GreedySearch`, state on the host): `step_greedy`;
- sampling (`sampling_batch.SampleSearch`, each request's draw from its own seeded `torch.Generator` as
  transformers draws from `torch.manual_seed(seed)`): `step_samples`;
- beam search and beam sampling (`beam.BeamSearch` state, stepped by `beam_batch.beam_step`: HF's batched
  `_beam_search` over [B, nb, V]): `step_beams`, per (num_beams, beams_to_keep).
The context processors (repetition / presence / frequency penalties, no-repeat-ngram, bad words) run batched over
the rows that use them with per-row parameters (`processors.py`); min_new_tokens, the sampling warpers and
guided decoding's grammar masks (`guided.py`) likewise; log probs and top log probs come back in the same
read-back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ... import names as N
from ...errors import Internal, InvalidArgument, VLMError
from ...params import GenerationParams, Sequence_
from . import beam_batch, processors, sampling_batch
from .beam import BeamSearch
from .greedy import GreedySearch, greedy_step
from .guided import GrammarGuide, new_matcher
from .processors import Context
from .sampling_batch import SampleSearch, resolve_seed, sample_step
from .search import NoTokenLeft, Search


@dataclass
class StepResult:
    parents: list[int]  # for each row of the NEXT step: the row (of the logits just given) whose KV cache it continues
    tokens: list[int]  # the token appended to each next-step row (same length as parents)
    done: bool  # request finished: no rows for the next step (parents == [])


class Decoder:
    """Per-request decoding state (beam search, greedy or sampling). Knows nothing of KV caches or batching."""

    def __init__(self, params: GenerationParams, prompt_ids: list[int], *, eos_ids: Sequence[int], vocab_size: int,
                 bad_words_ids: Sequence[Sequence[int]] = (), stop_words_ids: Sequence[Sequence[int]] = (),
                 grammar=None):
        prompt_ids = [int(i) for i in prompt_ids]
        eos_ids = [int(e) for e in eos_ids]
        # the request was validated at the boundary (`GenerationRequest.validate`); these are invariants
        assert prompt_ids and params.max_tokens >= 1 and params.beam_width >= 1, "unvalidated request"
        self.params = params
        self.vocab_size = vocab_size
        self._bad_words = len(bad_words_ids)
        # grammar: an xgrammar CompiledGrammar (guided decoding): greedy / sampling rows' matchers, or beam search's
        # `GrammarGuide` (a matcher per running beam, from its tokens)
        self._guided = grammar is not None
        # penalties, no-repeat-ngram and bad words, for any search (`processors.process`, batched across rows)
        context = Context.build(params, prompt_ids, eos_ids, bad_words_ids, vocab_size)
        self._search: Search
        if params.beam_width > 1:  # batched across requests by `step_beams` (guided, sampling, penalties too)
            sampling = bool(params.do_sample)
            spec = beam_batch.BatchSpec(
                eos=tuple(eos_ids), min_new=int(params.min_tokens) if eos_ids else 0,
                stop_words=tuple(tuple(int(t) for t in w) for w in stop_words_ids if len(w)), context=context,
                temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p),
                min_keep=len(eos_ids) + 1 if eos_ids else 2)  # HF keeps n_eos + 1 tokens in beam sampling warpers
            guide = None if grammar is None else GrammarGuide(grammar, prompt_len=len(prompt_ids), end_ids=eos_ids,
                                                              vocab_size=vocab_size)
            self._search = BeamSearch(
                prompt_ids=prompt_ids, num_beams=params.beam_width, max_new_tokens=params.max_tokens,
                length_penalty=params.length_penalty, early_stopping=params.early_stopping, n_eos=len(eos_ids),
                batch_spec=spec, guide=guide, generator_seed=resolve_seed(params.seed) if sampling else None,
                do_sample=sampling)
        elif params.do_sample:  # batched by `step_samples` (guided, penalties too)
            self._search = SampleSearch(
                num_rows=params.num_return_sequences, max_new_tokens=params.max_tokens, eos_ids=eos_ids,
                min_new_tokens=params.min_tokens, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, seed=params.seed, top_log_probs=params.top_log_probs,
                stop_words_ids=stop_words_ids, grammar=grammar, context=context)
        else:  # batched across requests by `step_greedy` (guided, penalties too)
            self._search = GreedySearch(max_new_tokens=params.max_tokens, eos_ids=eos_ids,
                                        min_new_tokens=params.min_tokens, stop_words_ids=stop_words_ids,
                                        matcher=None if grammar is None else new_matcher(grammar, eos_ids),
                                        context=context, top_log_probs=params.top_log_probs)

    @property
    def seed(self) -> int | None:
        """The seed actually used when sampling (a random one when params.seed is None), else None."""
        return self._search.seed if self.params.do_sample else None

    @property
    def num_rows(self) -> int:
        """Rows the scheduler must compute logits for at the next step (1 before the first step, 0 when done)."""
        return self._search.num_rows

    @property
    def done(self) -> bool:
        return self._search.done

    def step(self, logits: torch.Tensor) -> StepResult:
        """logits [num_rows, vocab] at each row's last position, any float dtype, any device."""
        search = self._search
        if search.done:
            raise Internal("step() called on a finished request")
        if logits.dim() != 2 or logits.shape[0] != search.num_rows:
            raise Internal(f"expected logits [{search.num_rows}, vocab], got {tuple(logits.shape)}")
        if logits.shape[1] != self.vocab_size:
            raise Internal(f"logits have {logits.shape[1]} columns, vocab_size is {self.vocab_size}")
        try:
            parents, tokens, done = search.step(logits)
        except NoTokenLeft as e:
            raise self._no_token_error(e) from None
        return StepResult(parents, tokens, done)

    @property
    def batched_greedy(self) -> bool:
        """Its steps may run in `step_greedy` with other such requests' rows (one row, host state)."""
        return isinstance(self._search, GreedySearch)

    @property
    def batched_sampling(self) -> bool:
        """Its steps may run in `step_samples` with other such requests' rows (host state, own generator)."""
        return isinstance(self._search, SampleSearch)

    @property
    def overlap_kind(self) -> str | None:
        """'greedy' or 'sample' when its next token can be chosen on the device before this step's token is on the
        host (async scheduling, `engine/overlap.py`): one row, past its first step and min_tokens, no grammar, no
        context processors (their state is the host's token lists); else None (the step runs synchronously)."""
        s = self._search
        if not isinstance(s, (GreedySearch, SampleSearch)) or s.done or s.t < 1 or s.t < s.min_new:
            return None
        if isinstance(s, GreedySearch):
            return "greedy" if s.matcher is None and s.row is None else None
        return "sample" if s.n == 1 and s.matchers is None and s.rows is None else None

    @property
    def steps_left(self) -> int:
        """Steps until max_tokens ends it (an end id or a stop word may end it sooner)."""
        s = self._search
        return s.max_new - s.t if isinstance(s, (GreedySearch, SampleSearch)) else self.params.max_tokens

    def advance_picked(self, row: list, nonfinite: Callable[[], bool]) -> StepResult | VLMError:
        """The host half of an `overlap_kind` step chosen on the device: its read-back row [token, stuck, log prob,
        top lp..., top ids...] -> its `StepResult` (stopping decided here), or the error that ends it (a row with
        no finite score; `nonfinite()` says whether the logits themselves were)."""
        s = self._search
        if row[1]:
            return self._no_token_error(NoTokenLeft(s.t + 1, nonfinite_logits=nonfinite()))
        return StepResult(*(s._advance(row) if isinstance(s, GreedySearch) else s._advance([row])))

    @property
    def beam_key(self):
        """None, or the key of the requests it may step with in `step_beams` (same num_beams and K)."""
        s = self._search
        return s.key if isinstance(s, BeamSearch) else None

    def _no_token_error(self, e: NoTokenLeft) -> VLMError:
        """What left a row nothing to choose from: the model's logits, or the request's exclusions."""
        if e.nonfinite_logits:
            return Internal(f"the model produced non-finite logits (NaN or inf) at generated token {e.step}; "
                            "in float16 this is usually an overflow: serve the model in bfloat16 or float32")
        p, causes = self.params, []
        if self._guided:
            causes.append(f"{N.GUIDED_DECODING_GUIDE} (the grammar allows no token after what was generated)")
        if self._bad_words:
            causes.append(f"{N.BAD_WORDS} ({self._bad_words} words)")
        if e.step <= p.min_tokens:
            causes.append(f"{N.MIN_TOKENS} ({p.min_tokens}: the end ids are excluded before it)")
        if p.no_repeat_ngram_size:
            causes.append(f"{N.NO_REPEAT_NGRAM_SIZE} ({p.no_repeat_ngram_size})")
        return InvalidArgument(
            f"every token is excluded at generated token {e.step} by {' and '.join(causes) or 'the request'}: "
            "there is nothing left to generate; exclude fewer tokens")

    @property
    def append_only(self) -> bool:
        """Whether every streamed sequence only ever grows (greedy, batched sampling): the streamer then need not
        check, every step, that what it sent is still the sequence's prefix."""
        return bool(getattr(self._search, "append_only", False))

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step (the KV rows, in order), the new tokens it holds; its last one is the token it
        feeds next."""
        return self._search.row_tokens()

    def stream_prefixes(self) -> list[list[int]]:
        """Per returned sequence, the new tokens that can be streamed now and never retracted. Beam search:
        one, the common prefix of every hypothesis still in the running; greedy / sampling: every sequence's
        tokens so far."""
        return self._search.stream_prefixes()

    def token_info(self, j: int, start: int, end: int):
        """Sequence j's new tokens [start, end): (log probs, top-k log probs, top-k ids), or None where the search
        does not know them before it finishes (beam search)."""
        info = getattr(self._search, "token_info", None)
        return None if info is None else info(j, start, end)

    def finalize(self) -> list[Sequence_]:
        """Ranked best first (beam search) or in sampling order; params.num_return_sequences of them."""
        return self._search.finalize(self.params.num_return_sequences)


def step_greedy(decoders: list[Decoder], logits: torch.Tensor) -> list[StepResult | VLMError]:
    """One step of several `batched_greedy` decoders at once: logits [rows, vocab], row i = decoders[i]'s one
    row. Each decoder's `StepResult`, or the error that ends its request (the others are unaffected)."""
    for d in decoders:
        if not d.batched_greedy or d.done:
            raise Internal("step_greedy() needs unfinished greedy decoders")
    if logits.dim() != 2 or logits.shape[0] != len(decoders) or logits.shape[1] != decoders[0].vocab_size:
        raise Internal(f"expected logits [{len(decoders)}, {decoders[0].vocab_size}], got {tuple(logits.shape)}")
    outs = greedy_step([d._search for d in decoders], logits)
    return [d._no_token_error(o) if isinstance(o, NoTokenLeft) else StepResult(*o) for d, o in zip(decoders, outs)]


def step_beams(decoders: list[Decoder], logits: torch.Tensor, starts: list[int]) -> list[StepResult | VLMError]:
    """One step of beam decoders with the same `beam_key` at once (`beam_batch.beam_step`): logits [rows, vocab]
    of the decode step, decoders[i]'s `num_rows` rows beginning at starts[i]. Each decoder's `StepResult`, or the
    error that ends its request (the others are unaffected)."""
    key = decoders[0].beam_key
    for d in decoders:
        if key is None or d.beam_key != key or d.done:
            raise Internal("step_beams() needs unfinished batchable beam decoders with the same key")
    if logits.dim() != 2 or logits.shape[1] != decoders[0].vocab_size:
        raise Internal(f"expected logits [rows, {decoders[0].vocab_size}], got {tuple(logits.shape)}")
    if any(st < 0 or st + d.num_rows > logits.shape[0] for d, st in zip(decoders, starts)):
        raise Internal(f"decoder rows outside the {logits.shape[0]} rows of logits")
    outs = beam_batch.beam_step([d._search for d in decoders], logits, starts)
    return [d._no_token_error(o) if isinstance(o, NoTokenLeft) else StepResult(*o) for d, o in zip(decoders, outs)]


def step_samples(decoders: list[Decoder], logits: torch.Tensor, starts: list[int]) -> list[StepResult | VLMError]:
    """One step of `batched_sampling` decoders at once (`sampling_batch.sample_step`): logits [rows, vocab] of the
    decode step, decoders[i]'s `num_rows` rows beginning at starts[i]. Each decoder's `StepResult`, or the error
    that ends its request (the others are unaffected)."""
    for d in decoders:
        if not d.batched_sampling or d.done:
            raise Internal("step_samples() needs unfinished batchable sampling decoders")
    if logits.dim() != 2 or logits.shape[1] != decoders[0].vocab_size:
        raise Internal(f"expected logits [rows, {decoders[0].vocab_size}], got {tuple(logits.shape)}")
    if any(st < 0 or st + d.num_rows > logits.shape[0] for d, st in zip(decoders, starts)):
        raise Internal(f"decoder rows outside the {logits.shape[0]} rows of logits")
    outs = sample_step([d._search for d in decoders], logits, starts)
    return [d._no_token_error(o) if isinstance(o, NoTokenLeft) else StepResult(*o) for d, o in zip(decoders, outs)]


def pick(decoders: list[Decoder], kinds: list[str], logits: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The device half of an overlapped decode step (async scheduling, `engine/overlap.py`): logits [rows, vocab],
    row i = decoders[i]'s one row, kinds[i] its `overlap_kind` (read on the host at launch) -> (the chosen tokens
    [rows] on the logits' device, [(row indices, packed [n, 3 + 2 max k] float64)] per kind). The same ops as
    `greedy_step` / `sample_step` make for those rows, so each row chooses bit for bit what they would; the host
    half is `Decoder.advance_picked`. Reads only what a step never changes (parameters, the generators), so it may
    run while the host advances the previous step of the same decoders."""
    raw = logits.to(torch.float32)  # [rows, V]
    tokens = torch.empty(raw.shape[0], dtype=torch.long, device=raw.device)
    groups = []
    for kind in ("greedy", "sample"):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if not rows:
            continue
        idx = processors.on_device(rows, raw.device)  # [n] (on CUDA from pinned memory: no sync)
        sub = raw if len(rows) == raw.shape[0] else raw.index_select(0, idx)  # [n, V]
        searches = [decoders[i]._search for i in rows]
        if kind == "greedy":
            chosen_ids = torch.argmax(sub, dim=-1)  # [n]
            stuck = ~torch.isfinite(sub.amax(dim=-1))
        else:
            scores = processors.warp(sub, [s.temperature for s in searches], [s.top_k for s in searches],
                                     [s.top_p for s in searches])
            stuck = ~torch.isfinite(scores.amax(dim=-1))
            scores = torch.where(stuck[:, None], 0.0, scores)
            chosen_ids = sampling_batch._draw(searches, scores, None)  # [n] each from its own generator
        logp = torch.nn.functional.log_softmax(sub, dim=-1)  # [n, V]
        chosen = logp.gather(1, chosen_ids[:, None])[:, 0]
        packed = torch.stack((chosen_ids.to(torch.float64), stuck.to(torch.float64), chosen.to(torch.float64)), dim=1)
        top = processors.top_log_probs([s.k for s in searches], logp)
        if top is not None:
            packed = torch.cat((packed, top), dim=1)  # [n, 3 + 2 max k]
        tokens.index_copy_(0, idx, chosen_ids)
        groups.append((rows, packed))
    return tokens, groups
