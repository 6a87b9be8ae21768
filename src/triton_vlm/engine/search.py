"""The interface every per-request search implements (beam search in `beam.py`, greedy / sampling in
`sampling.py`); `decoder.Decoder` validates the parameters, builds one and delegates to it. Greedy
(`greedy.greedy_step`) and beam search (`beam_batch.beam_step`) may also step several requests' searches at once;
their per-request methods below then still work on each one."""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..params import Sequence_


class NoTokenLeft(Exception):
    """A row of the step had no finite score: every token excluded by the logits processors, or non-finite
    logits (NaN / inf). Raised by a search after its step (the row chose from uniform scores instead, so no
    sampling kernel ever saw an invalid distribution); `Decoder.step` turns it into the request's error."""

    def __init__(self, step: int, nonfinite_logits: bool):
        super().__init__(f"no finite score at generated token {step}")
        self.step = step  # 1 = the first new token
        self.nonfinite_logits = nonfinite_logits


class Search(Protocol):
    done: bool
    seed: Optional[int]  # the seed in use when sampling, else None

    @property
    def num_rows(self) -> int:
        """Rows of logits the next `step` takes: 1 before the first step (the prompt), 0 when done."""

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """logits [num_rows, vocab] (fp32) -> (parents, tokens, done) for the next step's rows; raises
        `NoTokenLeft` when a row had nothing to choose from."""

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step, the new tokens it holds, its last one the token it feeds ([] before the first
        step and when done): what a preempted request computes again (`preempt.py`)."""

    def stream_prefixes(self) -> list[list[int]]:
        """Per streamed sequence, the new tokens that are final already (never retracted). The lists may be the
        search's own (read them, never modify them)."""

    def finalize(self, n: int) -> list[Sequence_]:
        """The `n` returned sequences (text left empty), ranked (beam) or in sampling order."""
