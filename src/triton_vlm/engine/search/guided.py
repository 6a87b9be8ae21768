"""Grammar-constrained decoding with xgrammar (the library vLLM, SGLang and TensorRT-LLM use).

`GuideCompiler` (`guide_compiler.py`) turns a request's `GuidedDecoding` into an xgrammar `CompiledGrammar` for
the checkpoint's tokenizer (its `TokenizerInfo` built once, with the model's vocabulary size, which may exceed the
tokenizer's). Compilation runs on a small pool of its own, never on the engine's step nor on the caller's thread:
a request waits for its grammar outside the engine's queue (vLLM v1's WAITING_FOR_FSM) within a time limit;
compiled grammars are kept in a byte-bounded LRU cache keyed by the canonical guide, single-flight. A json_schema (and each json_schema content of a structural tag)
goes through `guided_schema.enforceable` first: keywords xgrammar 0.2.8 would not enforce are refused with
`InvalidArgument` naming the keyword and where it is, and bounded strings are compiled as control-character-free
patterns, for every entry point alike. JSON (`json`: any object, `json_schema`) is compact: no
whitespace beyond the separators ", " and ": " (vLLM's `disable-any-whitespace`), so that a model cannot stall
in free whitespace between tokens (a model that knows no JSON otherwise fills max_tokens with newlines). A guide
the library cannot compile is refused with `InvalidArgument` carrying the library's own message.

The grammar's mask comes where transformers runs a `logits_processor` passed to `generate()`:
`_merge_criteria_processor_list` appends custom processors after the built-in ones (penalties, no-repeat-ngram, bad
words, min new tokens, batched in `processors.py`) and before the sampling warpers (temperature, top-k, top-p); in
beam search on the log-softmaxed scores, as HF's `_beam_search` processes them. xgrammar's own
`contrib.hf.LogitsProcessor` is the reference the tests compare with. `GrammarGuide` keeps one request's matcher
states (a beam request's, whose rows fork); called as a processor it masks its rows of a scores tensor.

Matcher state per row: a row's state is a function of the tokens it generated, so the guide keeps one
`GrammarMatcher` per distinct generated sequence of the live rows; at each step a row's matcher is its parent's
(the sequence minus its last token) forked and fed the last token. Beams that are reordered, forked or dropped,
and sampled rows that finish, need no bookkeeping from the search: the states follow the tokens. The matcher's
stop tokens are the request's end ids, so a grammar that is complete allows only them (a finished grammar forces
the end token). A row the grammar leaves no token for is an ordinary `NoTokenLeft` of the search (the request
ends with an error naming the grammar), never a device assert.

Batching: each batched step masks all of its constrained rows at once with `mask_rows` (ONE bitmask
[rows, ceil(V / 32)], ONE fill for every row's matcher with xgrammar's `BatchGrammarMatcher`, ONE apply over
their indices; unconstrained rows untouched, the matchers fed from tokens held on the host): guided greedy rows
in `greedy.greedy_step`, guided sampling rows in `sampling_batch.sample_step` (after min_new_tokens, before the
warpers), guided beam rows in `beam_batch.beam_step` (on the log-softmaxed scores after min_new_tokens). These are
three calls per decode step at most (one per batched step; beam groups one per (num_beams, K)), not one: the mask
must come where HF applies it in each path (beams: after log_softmax, whose normalisation the mask would change
if applied to the raw logits), so no single pre-split apply serves all three. Every request takes these batched
steps, penalties, no-repeat-ngram, bad words and beam sampling included (the per-request paths were removed).
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
import xgrammar as xgr

from .guide_compiler import (ANY_OBJECT, CACHE_SIZE, GuideCompiler, choice_grammar,  # noqa: F401 - re-exported
                             library_message)


_local = threading.local()


def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """One per thread (an engine steps on its own thread)."""
    b = getattr(_local, "batch", None)
    if b is None:
        b = _local.batch = xgr.BatchGrammarMatcher(max_threads="auto")
    return b


def mask_rows(scores: torch.Tensor, rows: Sequence[int], matchers: Sequence[xgr.GrammarMatcher],
              vocab_size: int) -> torch.Tensor:
    """What matchers[j] forbids set to -inf in row rows[j] of scores [R, V], the other rows untouched: one bitmask
    [R, ceil(V / 32)] filled for every constrained row in one call, applied in one masked fill. Returns a new
    tensor (the caller's scores, e.g. the raw logits the log probs come from, stay as they were).

    A matcher that has accepted a stop token (a beam that ended but is still carried as a running row with a
    score of -1e9, as transformers' beam search does when fewer live candidates than beams remain) allows only
    its stop tokens: the library refuses to fill a terminated matcher's mask."""
    live = [(r, m) for r, m in zip(rows, matchers) if not m.is_terminated()]
    ended = [(r, m) for r, m in zip(rows, matchers) if m.is_terminated()]
    scores = scores.contiguous().clone()
    if live:
        bitmask = xgr.allocate_token_bitmask(scores.shape[0], vocab_size)
        _batch_matcher().batch_fill_next_token_bitmask([m for _, m in live], bitmask, [r for r, _ in live])
        indices = [r for r, _ in live]
        if scores.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=vocab_size, indices=indices, backend="cpu")
        else:  # plain torch ops: no kernel compiled at run time, no device assert
            xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True),
                                            vocab_size=vocab_size, indices=indices, backend="torch_native")
    for r, m in ended:
        stops = [t for t in m.stop_token_ids if 0 <= t < scores.shape[-1]]
        keep = scores[r, stops].clone()
        scores[r].fill_(float("-inf"))
        scores[r, stops] = keep
    return scores


def new_matcher(compiled: xgr.CompiledGrammar, end_ids: Sequence[int]) -> xgr.GrammarMatcher:
    """A matcher whose stop tokens are the request's end ids: a complete grammar allows only them."""
    return xgr.GrammarMatcher(compiled, override_stop_tokens=[int(e) for e in end_ids] or None)


def accept(matcher: xgr.GrammarMatcher, token: int) -> None:
    if not matcher.accept_token(int(token)):  # the masked scores chose it: a bug, not a request's fault
        raise AssertionError(f"the grammar refused token {token} it allowed")


class GrammarGuide:
    """One request's grammar states (`matchers`: the matcher of each row from its own generated tokens, used by the
    batched beam step); called as a logits processor, it masks the scores of the request's rows."""

    def __init__(self, compiled: xgr.CompiledGrammar, *, prompt_len: int, end_ids: Sequence[int],
                 vocab_size: int):
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.root = new_matcher(compiled, end_ids)
        self._states: dict[tuple[int, ...], xgr.GrammarMatcher] = {(): self.root}
        # the next call's rows' generated tokens, set by a search that holds them on the host (no read-back)
        self.rows: Optional[list[tuple[int, ...]]] = None

    def _matcher(self, gen: tuple[int, ...], previous: dict) -> xgr.GrammarMatcher:
        m = previous.get(gen)
        if m is not None:
            return m
        parent = previous.get(gen[:-1]) if gen else None
        if parent is None:  # not a one-token extension of a live row: replay its tokens from the start
            m, todo = self.root.fork(), gen
        else:
            m, todo = parent.fork(), gen[-1:]
        for t in todo:
            if m.is_terminated():  # an ended beam's row: what follows its stop token is not the grammar's
                break
            accept(m, t)
        return m

    def matchers(self, gens: Sequence[tuple[int, ...]]) -> list[xgr.GrammarMatcher]:
        """The matcher of each row of this step, given each row's generated tokens (the live states become
        these rows')."""
        previous = self._states
        matchers = [self._matcher(g, previous) for g in gens]
        self._states = dict(zip(gens, matchers))
        return matchers

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids [rows, L] (prompt + generated), scores [rows, V] -> a new tensor of scores with what the
        grammar forbids at -inf. The rows' generated tokens are `rows` when the search set them (host lists),
        else read back from input_ids."""
        gens = self.rows if self.rows is not None else [tuple(r) for r in input_ids[:, self.prompt_len:].tolist()]
        self.rows = None
        assert len(gens) == scores.shape[0], "a guide's rows and its scores disagree"
        matchers = self.matchers(gens)
        return mask_rows(scores, range(len(matchers)), matchers, self.vocab_size)
